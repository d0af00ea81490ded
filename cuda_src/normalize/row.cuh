// row.cuh -- what the two kernels of linear_attention's normalization share: the launch struct,
// row addressing, and loads/stores of a few consecutive elements of a row as fp32.
//
// Both kernels give each (batch, head, token) row a team of TEAM lanes (a power of two <= 32, a
// runtime value, so teams never straddle a warp): lane t of the team takes the chunks t, t + TEAM,
// ... of E consecutive elements, then the team sums its dot product with xor shuffles. With
// V16 a chunk is one 16-byte vector (8 16-bit values or 4 floats; the launcher picks it only when
// every row start is 16-byte aligned and both widths are multiples of E), else one element.
#pragma once
#include "../include/types.cuh"

// Sizes, scalars and the element strides (batch, head, token) of the [B, H, N, D] views of the
// row operands (unit stride along D: both public layouts, no copies). rtkernels/normalize_op.py
// builds it in this order (8 bytes per field). Unused operands have zero strides.
struct rtk_norm_shape {
  rtk_i64 B, H, N, Dk, Dv;
  double scale, eps;
  rtk_i64 q_sb, q_sh, q_sn;   // q
  rtk_i64 z_sb, z_sh, z_sn;   // z
  rtk_i64 n_sb, n_sh, n_sn;   // num
  rtk_i64 u_sb, u_sh, u_sn;   // u ("1+qk")
  rtk_i64 g_sb, g_sh, g_sn;   // G ("1+qk", fp32; batch stride 0 when the batch shares it)
  rtk_i64 o_sb, o_sh, o_sn;   // o; in the backward d_num
  rtk_i64 d_sb, d_sh, d_sn;   // the backward: the incoming gradient of o
  rtk_i64 x_sb, x_sh, x_sn;   // the backward: dq and dz (allocated alike)
  rtk_i64 team;               // lanes per row
};
static_assert(sizeof(rtk_norm_shape) == 32 * 8, "rtk_norm_shape: 32 fields of 8 bytes");

constexpr int RTK_NORM_THREADS = 256;

// E consecutive elements of one row as fp32: a 16-byte vector (V16) or one element.
template <int DT, bool V16> struct rtk_chunk;

template <int DT> struct rtk_chunk<DT, false> {
  typedef typename rtk_io<DT>::T T;
  static constexpr int E = 1;
  static __device__ __forceinline__ void load(const T* p, float (&x)[E]) { x[0] = rtk_io<DT>::load(p); }
  static __device__ __forceinline__ void store(T* p, const float (&x)[E]) { rtk_io<DT>::store(p, x[0]); }
};

template <> struct rtk_chunk<RTK_F32, true> {
  typedef float T;
  static constexpr int E = 4;
  static __device__ __forceinline__ void load(const T* p, float (&x)[E]) {
    const float4 w = *reinterpret_cast<const float4*>(p);
    x[0] = w.x; x[1] = w.y; x[2] = w.z; x[3] = w.w;
  }
  static __device__ __forceinline__ void store(T* p, const float (&x)[E]) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  }
};

template <int DT> struct rtk_chunk<DT, true> {  // DT: RTK_F16 or RTK_BF16
  typedef rtk_u16 T;
  static constexpr int E = 8;
  static __device__ __forceinline__ void load(const T* p, float (&x)[E]) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    rtk_unpack2<DT>(w.x, x[0], x[1]);
    rtk_unpack2<DT>(w.y, x[2], x[3]);
    rtk_unpack2<DT>(w.z, x[4], x[5]);
    rtk_unpack2<DT>(w.w, x[6], x[7]);
  }
  static __device__ __forceinline__ void store(T* p, const float (&x)[E]) {  // each value rounded once
    uint4 w;
    w.x = rtk_pack2<DT>(x[0], x[1]);
    w.y = rtk_pack2<DT>(x[2], x[3]);
    w.z = rtk_pack2<DT>(x[4], x[5]);
    w.w = rtk_pack2<DT>(x[6], x[7]);
    *reinterpret_cast<uint4*>(p) = w;
  }
};

// The sum of x over the team (every lane of the warp calls it; the team size divides 32).
__device__ __forceinline__ float rtk_team_sum(float x, int team) {
  for (int off = team >> 1; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// This thread's row (a flat index over B * H * N, token fastest) and its (b, h, n), its lane lt in
// the row's team, and the row's chunk counts: kq of q and z (Dk / E), kv of num, u and o (Dv / E).
struct rtk_norm_row {
  rtk_i64 r, b, h, n;
  bool valid;
  int team, lt, kq, kv;
};

template <int E>
__device__ __forceinline__ rtk_norm_row rtk_norm_locate(const rtk_norm_shape& p) {
  rtk_norm_row w;
  w.team = (int)p.team;
  w.lt = threadIdx.x % w.team;
  w.kq = (int)(p.Dk / E);
  w.kv = (int)(p.Dv / E);
  const rtk_i64 row = (rtk_i64)blockIdx.x * (RTK_NORM_THREADS / w.team) + threadIdx.x / w.team;
  w.valid = row < p.B * p.H * p.N;
  w.r = w.valid ? row : 0;
  const rtk_i64 bh = w.r / p.N;
  w.n = w.r - bh * p.N;
  w.b = bh / p.H;
  w.h = bh - w.b * p.H;
  return w;
}

__device__ __forceinline__ rtk_i64 rtk_norm_at(const rtk_norm_row& w, rtk_i64 sb, rtk_i64 sh, rtk_i64 sn) {
  return w.b * sb + w.h * sh + w.n * sn;
}
