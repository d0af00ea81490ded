// chunk/cta.cuh -- a chunk kernel CTA's place: roles, (batch, head), value tile, segment, pointers.
#pragma once
#include "../include/types.cuh"
#include "modes.cuh"

// A CTA's chunks of its ns tokens: C each from token 0, or with ZWALK (the Z split's dq pass)
// ending at the last token, chunk 0 then holding the first ((ns - 1) mod C) + 1.
template <int C, bool ZWALK>
struct rtk_chunk_grid {
  int ns, first;
  __device__ explicit rtk_chunk_grid(int ns_) : ns(ns_), first(ZWALK && ns_ > 0 ? (ns_ - 1) % C + 1 : C) {}
  __device__ __forceinline__ int start(int k) const { return ZWALK ? (k == 0 ? 0 : first + (k - 1) * C) : k * C; }
  __device__ __forceinline__ int len(int k, int n0) const { return min(ZWALK && k == 0 ? first : C, ns - n0); }  // n0 = start(k)
};

// The tokens of the CTAs of row `row` = blockIdx.x / H: segment blockIdx.z of the split-sequence
// strategy, or with packed sequences (p.cu_seqlens) sequence `row`, tokens [cu[row], cu[row+1]),
// which a reversed launch reads as kernel rows [N - cu[row+1], N - cu[row]). The offsets are
// clamped into [0, N] and made non-decreasing, so no device value leads a CTA outside the batch.
// Invalid offsets (p.cu_valid false, decided on the device) give sequence 0 every row and the
// others none, and set `bad`: the kernel then makes every output and state NaN.
struct rtk_chunk_rows {
  rtk_i64 begin;
  int count;
  bool bad;
};
__device__ __forceinline__ rtk_chunk_rows rtk_chunk_rows_of(const rtk_chunk_shape& p, int N, int row) {
  if (p.cu_seqlens == 0) {
    const rtk_i64 begin = (rtk_i64)blockIdx.z * p.seg_len;
    return {begin, (int)min((rtk_i64)N - begin, p.seg_len), false};
  }
  const rtk_i64* cu = reinterpret_cast<const rtk_i64*>(p.cu_seqlens);
  const bool bad = *reinterpret_cast<const bool*>(p.cu_valid) == false;
  rtk_i64 lo = min(max(cu[row], (rtk_i64)0), (rtk_i64)N);
  rtk_i64 hi = min(max(cu[row + 1], lo), (rtk_i64)N);
  if (bad) {
    lo = 0;
    hi = row == 0 ? N : 0;
  }
  // an empty sequence reads and writes nothing; its pointers stay on row 0 all the same
  return {hi == lo ? 0 : p.cu_reverse ? (rtk_i64)N - hi : lo, (int)(hi - lo), bad};
}

// The CTA's place, as locals of a kernel whose q, k, v, o hold elements of type T, whose tile
// has BV value columns and whose struct parameter is p (rtk_chunk_shape): thread and warp roles,
// (batch, head) and the value tile (rtk_head_tile's order), and the split-sequence strategy: CTA z handles tokens
// [z * seg_len, z * seg_len + NS) and its state enters from / leaves to slot z of the state
// buffers (one segment, z = 0, otherwise). With packed sequences (one segment) the CTA row is the
// sequence, b = 0, tokens [n_begin, n_begin + NS) (rtk_chunk_rows_of), and the state slot of row
// s, head h is s * H + h: the [S, H, Dk, Dv] states. seq_bad: invalid offsets; out_scale (NaN then)
// is the scale the output factors take, the state warps make their state NaN.
// kt_used: the k-steps of 2^KSHIFT columns that hold real q/k columns; ovec_full: the output rows
// of the tile take paired stores (whole tile, pairs aligned).
#define RTK_CHUNK_CTA(T, KSHIFT)                                                                  \
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;                                  \
  const int g = lane >> 2, t4 = lane & 3;                                                         \
  const bool out_warp = warp < 4;                                                                 \
  int bh, tile;                                                                                     \
  rtk_head_tile(bh, tile);                                                                         \
  const int b_row = bh / H, h = bh - b_row * H;                                                    \
  const rtk_chunk_rows rows_here = rtk_chunk_rows_of(p, N, b_row);                                \
  const int b = p.cu_seqlens != 0 ? 0 : b_row;                                                    \
  const bool seq_bad = rows_here.bad;                                                             \
  const float out_scale = seq_bad ? __int_as_float(0x7fc00000) : scale;                           \
  const int v0 = tile * BV;                                                                       \
  const float lg2 = rtk_head_log_decay(decay, decay_mode, h) * 1.4426950408889634f; /* log2(gamma) */ \
  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};                             \
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};                             \
  const rtk_i64 n_begin = rows_here.begin;                                                        \
  const int NS = rows_here.count;                                                                 \
  const rtk_i64 state_slot = (rtk_i64)blockIdx.z * gridDim.x * Dk * Dv;                           \
  const T* qb = q + rtk_offset(qs, b, h, n_begin);                                                \
  const T* kb = k + rtk_offset(ks, b, h, n_begin);                                                \
  const T* vb = v + rtk_offset(vs, b, h, n_begin) + v0;                                           \
  T* ob = o + rtk_offset(os, b, h, n_begin);                                                      \
  const int dv_here = min(BV, Dv - v0); /* value columns of this tile */                          \
  const int kt_used = (Dk + (1 << KSHIFT) - 1) >> KSHIFT;                                         \
  const bool ovec_full = dv_here == BV && ((o_sn & 1) == 0) &&                                    \
                         ((reinterpret_cast<size_t>(ob + v0) & (2 * (int)sizeof(T) - 1)) == 0)
