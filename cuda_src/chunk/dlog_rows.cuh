// chunk/dlog_rows.cuh -- the DLOG dq pass's per-chunk sums of dlog(gamma) in its output warps
// (rtk_chunk_fwd, fwd16.cu's header has the math): rows of a product dotted with x, and the
// intra-chunk scores weighted by their distance.
#pragma once
#include "../include/types.cuh"

// sum over this thread's elements of x_t . (f_t acc_t), for the warp's rows t = r0 + g (factor
// f_lo) and r0 + g + 8 (f_hi) of a chunk: acc in the mma accumulator layout (NT n-tiles of 8
// columns), x the chunk's 16-bit x tile in shared memory, piece p of row r at element off(r, p).
template <int DT, int NT, class Off>
__device__ __forceinline__ float rtk_dlog_rows(const float (&acc)[NT][4], const rtk_u16* sX, int r0, int g, int t4,
                                               float f_lo, float f_hi, Off off) {
  float sum = 0.f;
  #pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = r0 + g + 8 * hh;
    float row = 0.f;
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float x0, x1;
      rtk_unpack2<DT>(*reinterpret_cast<const rtk_u32*>(sX + off(t, nt) + 2 * t4), x0, x1);
      row = fmaf(x0, acc[nt][2 * hh], fmaf(x1, acc[nt][2 * hh + 1], row));
    }
    sum = fmaf(hh ? f_hi : f_lo, row, sum);
  }
  return sum;
}

// sum over s < t of (t - s) P_ts (x_t . v_s) over this thread's score fragments (the warp's rows
// from r0; xv in wgmma's accumulator order): a select above and on the diagonal, where x . v may
// be Inf and P is 0.
__device__ __forceinline__ float rtk_dlog_intra(const float (&p)[8][4], const float (&xv)[32], int r0, int g, int t4) {
  float sum = 0.f;
  #pragma unroll
  for (int j = 0; j < 8; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = r0 + g + (e >> 1) * 8 - (8 * j + 2 * t4 + (e & 1));
      sum += d > 0 ? (float)d * p[j][e] * xv[4 * j + e] : 0.f;
    }
  return sum;
}
