// fleet.cu -- the deterministic rank reduction of the fleet method.
//
// FleetAttention writes (Q K^T ⊙ M) V = sum_r diag(q_r) L_gamma diag(k_r) V: one discounted
// prefix sum per rank r. The fleet method runs the ranks in tiles on separate CTAs (scan.cu's
// kernel with gridDim.z = number of rank tiles), each leaving its tile's partial output in an
// fp32 workspace; this kernel adds the tiles in a fixed order (no atomics, so every run gives
// the same bits), scales and stores the output in the input dtype and layout.
#include "include/params.cuh"

// Everything but the two pointers: tiles, sizes, the scale, the output's strides.
struct rtk_fleet_shape {
  rtk_i64 tiles, BH, H, N, Dv;
  double scale;
  rtk_i64 o_sb, o_sh, o_sn;
};

template <int DT>
__global__ void rtk_fleet_reduce(const float* __restrict__ partial,  // [tiles, B*H, N, Dv]
                                 typename rtk_io<DT>::T* __restrict__ o, const __grid_constant__ rtk_fleet_shape p) {
  const rtk_i64 tiles = p.tiles, BH = p.BH, H = p.H, N = p.N, Dv = p.Dv;
  const rtk_i64 o_sb = p.o_sb, o_sh = p.o_sh, o_sn = p.o_sn;
  const float scale = (float)p.scale;
  const rtk_i64 total = BH * N * Dv;
  const rtk_i64 tile_stride = total;
  for (rtk_i64 e = (rtk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (rtk_i64)gridDim.x * blockDim.x) {
    const int c = (int)(e % Dv);
    const rtk_i64 row = e / Dv;  // bh * N + n
    const rtk_i64 n = row % N;
    const int bh = (int)(row / N);
    float acc = 0.f;
    for (int t = 0; t < tiles; ++t) acc += partial[t * tile_stride + e];
    const int b = bh / (int)H, h = bh - b * (int)H;
    const rtk_strides os = {o_sb, o_sh, o_sn};
    rtk_io<DT>::store(o + rtk_offset(os, b, h, n) + c, acc * scale);
  }
}
