// params.cuh -- the parameters of the forward kernels: the per-call pointers, then one struct.
#pragma once
#include "head_decay.cuh"

// A forward kernel takes the seven pointers of a call as __restrict__ kernel parameters (the
// no-alias promise that lets the compiler read inputs through the read-only path; the same fields
// inside a struct cost the fp32 kernel registers and 9 % of its time), then one struct passed by
// value with everything the launch plan fixes. rtkernels/methods/_launch.py (FWD_FIELDS) builds
// both in this order; every field is 8 bytes, so the launcher packs plain Python ints and floats.
#define RTK_FWD_POINTERS(ELEM)                                                              \
  const ELEM* __restrict__ q, const ELEM* __restrict__ k, const ELEM* __restrict__ v,       \
  ELEM* __restrict__ o, const void* __restrict__ decay,                                   \
  const float* __restrict__ init_state, float* __restrict__ final_state

// Sizes, the scale, and the element strides (batch, head, token) of the [B, H, N, D] views of q,
// k, v and o, whose last stride is 1: both public layouts, no transposed copies.
struct rtk_fwd_shape {
  rtk_i64 H, N, Dk, Dv;
  double scale;
  rtk_i64 q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
  rtk_i64 decay_mode;  // how to read the decay argument (head_decay.cuh)
};
static_assert(sizeof(rtk_fwd_shape) == 18 * 8, "rtk_fwd_shape: 18 fields of 8 bytes");

// The struct's fields as the locals the kernels use; RTK_FWD_SIZES gives their int/float forms.
#define RTK_FWD_SHAPE(P)                                                                    \
  const rtk_i64 H_ = (P).H, N_ = (P).N, Dk_ = (P).Dk, Dv_ = (P).Dv;                         \
  const double scale_ = (P).scale;                                                          \
  const rtk_i64 q_sb = (P).q_sb, q_sh = (P).q_sh, q_sn = (P).q_sn;                          \
  const rtk_i64 k_sb = (P).k_sb, k_sh = (P).k_sh, k_sn = (P).k_sn;                          \
  const rtk_i64 v_sb = (P).v_sb, v_sh = (P).v_sh, v_sn = (P).v_sn;                          \
  const rtk_i64 o_sb = (P).o_sb, o_sh = (P).o_sh, o_sn = (P).o_sn;                          \
  const rtk_i64 decay_mode = (P).decay_mode
#define RTK_FWD_SIZES                                                                       \
  const int H = (int)H_, N = (int)N_, Dk = (int)Dk_, Dv = (int)Dv_;                         \
  const float scale = (float)scale_
