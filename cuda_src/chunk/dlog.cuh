// chunk/dlog.cuh -- what the two dlog(gamma) kernels share (decay_grad.cu on 16-bit inputs,
// decay_grad_f32.cu on fp32): how 8 warps tile the state, the per-token weights, the causal block's
// tiles, fragment sums, the per-CTA constants and the CTA's fixed-order sum. decay_grad.cu's header
// has the math.
#pragma once
#include "../include/state_frag.cuh"

// How the 8 warps tile the KMAX x BV state: RW warps along the rows (16 rows at least each), CW
// along the columns; each warp holds MT x NT fragments of 16 x 8.
template <int KMAX, int BV>
struct rtk_dg_split {
  static constexpr int RW = KMAX >= 128 ? 8 : KMAX / 16, CW = 8 / RW;
  static constexpr int ROWS = KMAX / RW, COLS = BV / CW;
  static constexpr int MT = ROWS / 16, NT = COLS / 8;
  static_assert(RW * CW == 8 && ROWS % 16 == 0 && COLS % 16 == 0, "bad tile");
};

// The fp32 weight of token t (0..63) in a chunk of len tokens, per table row: normalised to at
// most 1 (n1 = max_{1<=m<=64} m gamma^m, as log2n1).
__device__ __forceinline__ float rtk_dg_weight(int row, int t, int len, float lg2, float log2n1) {
  switch (row) {
    case 0: return t < len ? (float)(t + 1) * rtk_exp2(lg2 * (float)(t + 1) - log2n1) : 0.f;  // A1'
    case 1: return t < len ? rtk_exp2(lg2 * (float)t) : 0.f;  // A2'
    // D2': s = L-1 (weight 0) by a select, gamma^0 / n1 may overflow
    case 2: return t < len - 1 ? (float)(len - 1 - t) * rtk_exp2(lg2 * (float)(len - 1 - t) - log2n1) : 0.f;
    default: return t < len ? rtk_exp2(lg2 * (float)(len - 1 - t)) : 0.f;  // D1
  }
}

// The CTA's constants in shared memory (read there, they keep no register through the chunk
// loop): wconst = {gamma^C, gamma^(last chunk's length), n1, gamma} and dtab[d] = d gamma^d (the
// intra weights). The carries in fp64 (their rounding compounds over the chunks; lg2's rounding
// moves them by at most |L log gamma| * 6e-8, relative). Returns log2(n1). The caller's first
// barrier publishes them.
__device__ __forceinline__ float rtk_dg_constants(int tid, float lg2, int N, int nchunks, float* wconst, float* dtab) {
  constexpr int C = 64;
  float log2n1 = lg2;
  #pragma unroll 1
  for (int m = 2; m <= C; ++m) log2n1 = fmaxf(log2n1, log2f((float)m) + lg2 * (float)m);
  if (tid < 2) wconst[tid] = (float)exp2((double)lg2 * (double)(tid == 0 ? C : N - (nchunks - 1) * C));
  if (tid == 2) wconst[2] = rtk_exp2(log2n1);
  if (tid == 3) wconst[3] = rtk_exp2(lg2);
  if (tid < C) dtab[tid] = (float)tid * rtk_exp2(lg2 * (float)tid);
  return log2n1;
}

template <int MT, int NT> __device__ __forceinline__ void rtk_dg_zero(float (&x)[MT][NT][4]) {
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) x[mt][nt][e] = 0.f;
}

// <x[:, n0 .. n0 + NG - 1], y> over fragments (fp32): y holds the NG n-tiles of x from n0 on (n0
// a constant after unrolling, so x stays in registers).
template <int MT, int NT, int NG>
__device__ __forceinline__ float rtk_dg_dot(const float (&x)[MT][NT][4], const float (&y)[MT][NG][4], int n0) {
  float s = 0.f;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NG; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s = fmaf(x[mt][n0 + nt][e], y[mt][nt][e], s);
  return s;
}

// Tile i (0..9) of the causal block: rows 16 r.., columns 16 c.., c <= r.
__device__ __forceinline__ void rtk_dg_tile(int i, int& r, int& c) {
  r = i < 1 ? 0 : i < 3 ? 1 : i < 6 ? 2 : 3;
  c = i - r * (r + 1) / 2;
}

// The end of the walk: <G, W_end> over the warp's real state elements, the scale and the
// normalisers (acc1 = sum <S, A1'>, acc2 = sum <W, A2'>, acci the intra term), then the CTA's sum
// in a fixed order (warp shuffles, then warps 0..7 through shared memory, no atomics), written by
// thread 0 to *out.
template <int MT, int NT>
__device__ __forceinline__ void rtk_dg_finish(const rtk_chunk_state<MT, NT>& frag, const float (&w_acc)[MT][NT][4],
                                              const float* grad_state, float scale, const float* wconst, float acc1,
                                              float acc2, float acci, float* red, float* out) {
  float accg = 0.f;
  if (grad_state != nullptr) {
    frag.elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      if (real) accg = fmaf(grad_state[off], w_acc[mt][nt][e], accg);
    });
  }
  float val = fmaf(scale, fmaf(wconst[2], acc1, fmaf(wconst[3], acc2, acci)), accg);
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) val += __shfl_xor_sync(0xffffffffu, val, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = val;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    #pragma unroll
    for (int w = 0; w < 8; ++w) s += red[w];
    *out = s;
  }
}
