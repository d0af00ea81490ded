// chunk/cta.cuh -- a chunk kernel CTA's place: roles, (batch, head), value tile, segment, pointers.
#pragma once
#include "../include/types.cuh"

// The CTA's place, as locals of a kernel whose q, k, v, o hold elements of type T and whose tile
// has BV value columns: thread and warp roles, (batch, head), the value tile, and the
// split-sequence strategy: CTA z handles tokens [z * seg_len, z * seg_len + NS) and its state
// enters from / leaves to slot z of the state buffers (one segment, z = 0, otherwise).
// kt_used: the k-steps of 2^KSHIFT columns that hold real q/k columns; ovec_full: the output rows
// of the tile take paired stores (whole tile, pairs aligned).
#define RTK_CHUNK_CTA(T, KSHIFT)                                                                  \
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;                                  \
  const int g = lane >> 2, t4 = lane & 3;                                                         \
  const bool out_warp = warp < 4;                                                                 \
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;                                          \
  const int v0 = blockIdx.y * BV;                                                                 \
  const float lg2 = rtk_head_log_decay(decay, decay_mode, h) * 1.4426950408889634f; /* log2(gamma) */ \
  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};                             \
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};                             \
  const rtk_i64 n_begin = (rtk_i64)blockIdx.z * seg_len;                                          \
  const int NS = (int)min((rtk_i64)N - n_begin, seg_len);                                         \
  const rtk_i64 state_slot = (rtk_i64)blockIdx.z * gridDim.x * Dk * Dv;                           \
  const T* qb = q + rtk_offset(qs, b, h, n_begin);                                                \
  const T* kb = k + rtk_offset(ks, b, h, n_begin);                                                \
  const T* vb = v + rtk_offset(vs, b, h, n_begin) + v0;                                           \
  T* ob = o + rtk_offset(os, b, h, n_begin);                                                      \
  const int dv_here = min(BV, Dv - v0); /* value columns of this tile */                          \
  const int kt_used = (Dk + (1 << KSHIFT) - 1) >> KSHIFT;                                         \
  const bool ovec_full = dv_here == BV && ((o_sn & 1) == 0) &&                                    \
                         ((reinterpret_cast<size_t>(ob + v0) & (2 * (int)sizeof(T) - 1)) == 0)
