// chunk/decay.cuh -- powers of gamma: the output warps' decay factors, the state update's weights.
#pragma once
#include "../include/types.cuh"

// An output warp's decay factors, fixed for the whole sequence; the warp owns rows r0 .. r0+15 of
// each chunk, (g, t4) are the thread's fragment coordinates. gamma^(8 - 2 t4 - e) for the thread's
// two key columns in an 8-wide tile (exponents 1..8), gamma^8 to step one tile to the left,
// gamma^(t - r0) * scale for its two rows (t = r0 + g, + 8), gamma^(r0 + 1), and gamma^(t - s) *
// scale inside the 16 x 16 diagonal block (-1 where s > t: the mask is a select).
struct rtk_chunk_decay {
  float col_f0, col_f1, g8, row_lo, row_hi, inter0, diag[2][4];

  __device__ __forceinline__ rtk_chunk_decay(float lg2, float scale, int g, int t4, int r0) {
    col_f0 = rtk_exp2(lg2 * (float)(8 - 2 * t4));
    col_f1 = rtk_exp2(lg2 * (float)(7 - 2 * t4));
    g8 = rtk_exp2(lg2 * 8.f);
    row_lo = rtk_exp2(lg2 * (float)g) * scale;
    row_hi = rtk_exp2(lg2 * (float)(g + 8)) * scale;
    inter0 = rtk_exp2(lg2 * (float)(r0 + 1));
    #pragma unroll
    for (int jd = 0; jd < 2; ++jd)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dt = g + (e >> 1) * 8 - (jd * 8 + 2 * t4 + (e & 1));
        diag[jd][e] = dt >= 0 ? rtk_exp2(lg2 * (float)dt) * scale : -1.f;
      }
  }
  // The scores p[j] of key tiles j left of warp w's diagonal block times gamma^(r0-s): tile j
  // lies 8(2w-1-j) + (8 - 2 t4 - e) to the left of r0 (the rows' gamma^(t-r0) comes later).
  __device__ __forceinline__ void scale_left(float (&p)[8][4], int w) const {
    float step = 1.f;
    #pragma unroll
    for (int j = 7; j >= 0; --j) {
      if (j < 2 * w) {
        const float f0 = col_f0 * step, f1 = col_f1 * step;
        p[j][0] *= f0; p[j][1] *= f1; p[j][2] *= f0; p[j][3] *= f1;
        step *= g8;
      }
    }
  }
  // All 64 keys of warp W's scores (the wgmma kernel): gamma^(t-s) * scale for s <= t (left of
  // the diagonal block, right to left, as row factor x column factor, gamma^(r0-s) = col_f *
  // gamma^(8 per tile); inside it directly), 0 above the diagonal (a select: q.k may be Inf there).
  template <int W> __device__ __forceinline__ void scale_scores(float (&p)[8][4]) const {
    float step_lo = row_lo, step_hi = row_hi;
    #pragma unroll
    for (int j = 2 * W - 1; j >= 0; --j) {
      const float f0l = col_f0 * step_lo, f1l = col_f1 * step_lo, f0h = col_f0 * step_hi, f1h = col_f1 * step_hi;
      p[j][0] *= f0l; p[j][1] *= f1l; p[j][2] *= f0h; p[j][3] *= f1h;
      step_lo *= g8;
      step_hi *= g8;
    }
    mask_diag(p[2 * W], 0);
    mask_diag(p[2 * W + 1], 1);
    #pragma unroll
    for (int j = 2 * W + 2; j < 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) p[j][e] = 0.f;
  }
  // scale_scores of output warp w (0..3), each warp running code compiled for its own rows.
  __device__ __forceinline__ void scale_scores_of(int w, float (&p)[8][4]) const {
    switch (w) {
      case 0: scale_scores<0>(p); break;
      case 1: scale_scores<1>(p); break;
      case 2: scale_scores<2>(p); break;
      default: scale_scores<3>(p); break;
    }
  }
  // Output rows times gamma^(t - r0) * scale.
  template <int NT> __device__ __forceinline__ void scale_rows(float (&o_acc)[NT][4]) const {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      o_acc[nt][0] *= row_lo; o_acc[nt][1] *= row_lo;
      o_acc[nt][2] *= row_hi; o_acc[nt][3] *= row_hi;
    }
  }
  // Tile jd of the diagonal block: gamma^(t-s) * scale for s <= t, a select (not a product) above
  // it (q.k may be Inf there).
  __device__ __forceinline__ void mask_diag(float (&x)[4], int jd) const {
    #pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = diag[jd][e] >= 0.f ? x[e] * diag[jd][e] : 0.f;
  }
};

// The weights of the state update's A operand, k^T, for the thread's key rows of k-step kk in a
// chunk of len tokens: s = 16 kk + 2 t4 + {0, 1} (lo: registers 0, 1 of an A fragment) and s + 8
// (hi: registers 2, 3). S takes gamma^(len-1-s); with DERIV, W = dS/dlog(gamma) also takes
// (len-1-s) gamma^(len-1-s). Rows s >= len weigh 0 (the tile's rows past a short last chunk).
// rev: the fragment's rows are a tile's rows backwards (row r holds key C-1-r of the chunk: a
// reversed pass's tensor-copy boxes, read in the order the copy wrote them). dn: W's weights times
// rtk_dlog_norm (fp16's W is carried as W dn; 1 otherwise).
template <int DT, bool DERIV>
struct rtk_key_weights {
  rtk_u32 lo, hi, dlo, dhi;

  __device__ __forceinline__ rtk_key_weights(float lg2, int len, int kk, int t4, bool rev = false, float dn = 1.f) {
    float e[4], d[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = kk * 16 + 2 * t4 + (i >> 1) * 8 + (i & 1), s = rev ? 63 - r : r;
      e[i] = s < len ? rtk_exp2(lg2 * (float)(len - 1 - s)) : 0.f;
      d[i] = (float)(len - 1 - s) * (dn * e[i]);  // dn e first: 63 dn overflows fp32 for dn >= 2^123
    }
    lo = rtk_pack2<DT>(e[0], e[1]);
    hi = rtk_pack2<DT>(e[2], e[3]);
    dlo = DERIV ? rtk_pack2<DT>(d[0], d[1]) : 0u;
    dhi = DERIV ? rtk_pack2<DT>(d[2], d[3]) : 0u;
  }
  // a: an A fragment of k^T, weighted in place for S; da (DERIV): the same fragment weighted for W
  // (taken from a before a is weighted).
  __device__ __forceinline__ void apply(rtk_u32 (&a)[4], rtk_u32 (&da)[4]) const {
    if (DERIV) {
      da[0] = rtk_mul2<DT>(a[0], dlo);
      da[1] = rtk_mul2<DT>(a[1], dlo);
      da[2] = rtk_mul2<DT>(a[2], dhi);
      da[3] = rtk_mul2<DT>(a[3], dhi);
    }
    a[0] = rtk_mul2<DT>(a[0], lo);
    a[1] = rtk_mul2<DT>(a[1], lo);
    a[2] = rtk_mul2<DT>(a[2], hi);
    a[3] = rtk_mul2<DT>(a[3], hi);
  }
};

// The power of two dn that fp16 carries W = dS/dlog(gamma) scaled by (W dn in the state warps'
// registers, in the slots of the states pass and in the 16-bit weights (len-1-s) gamma^(len-1-s) dn
// of its chunk sums): the largest weight, n1 = max over m = 1..63 of m gamma^m, times dn lies in
// (1/2, 1]. Unscaled, fp16 would overflow near gamma = 1 (weights up to 63, times k) and lose W's
// leading term to a subnormal for small gamma (its weight is gamma: 1e-6 has 4 bits in fp16). At
// most 2^126, so that dn and 1/dn stay normal floats; 1 for bf16 (its range needs none) and for a
// gamma that is not a number.
template <int DT> __device__ __forceinline__ float rtk_dlog_norm(float lg2) {
  if (DT != RTK_F16) return 1.f;
  float n1 = 0.f;
  #pragma unroll 1
  for (int m = 1; m < 64; ++m) n1 = fmaxf(n1, (float)m * exp2f(lg2 * (float)m));
  if (!(n1 > 0.f) || n1 > 1e30f) return 1.f;
  int e;
  frexpf(n1, &e);  // n1 = f 2^e, f in [1/2, 1)
  return ldexpf(1.f, -max(-126, min(126, e)));
}
