// params.cuh -- the parameters of the forward kernels: one struct passed by value.
#pragma once
#include "types.cuh"

// Every field is 8 bytes (pointers, 64-bit integers, the scale as a double), in the order
// rtkernels/methods/_launch.py (FWD_FIELDS) builds them, so the launcher packs plain Python ints and
// floats into the struct's bytes. Element strides (batch, head, token) describe the [B, H, N, D]
// views of q, k, v and o, whose last stride is 1: both public layouts, no transposed copies.
struct rtk_fwd_params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  const float* log_decay;
  const float* init_state;
  float* final_state;
  rtk_i64 H, N, Dk, Dv;
  double scale;
  rtk_i64 q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
};
static_assert(sizeof(rtk_fwd_params) == 24 * 8, "rtk_fwd_params: 24 fields of 8 bytes");

// The struct's fields as the locals the kernels use (q, k, v, o typed as ELEM; H_ .. scale_ and
// the strides), and RTK_FWD_SIZES their int/float forms.
#define RTK_FWD_UNPACK(P, ELEM)                                                             \
  const ELEM* __restrict__ q = static_cast<const ELEM*>((P).q);                             \
  const ELEM* __restrict__ k = static_cast<const ELEM*>((P).k);                             \
  const ELEM* __restrict__ v = static_cast<const ELEM*>((P).v);                             \
  ELEM* __restrict__ o = static_cast<ELEM*>((P).o);                                         \
  const float* __restrict__ log_decay = (P).log_decay;                                      \
  const float* __restrict__ init_state = (P).init_state;                                    \
  float* __restrict__ final_state = (P).final_state;                                        \
  const rtk_i64 H_ = (P).H, N_ = (P).N, Dk_ = (P).Dk, Dv_ = (P).Dv;                         \
  const double scale_ = (P).scale;                                                          \
  const rtk_i64 q_sb = (P).q_sb, q_sh = (P).q_sh, q_sn = (P).q_sn;                          \
  const rtk_i64 k_sb = (P).k_sb, k_sh = (P).k_sh, k_sn = (P).k_sn;                          \
  const rtk_i64 v_sb = (P).v_sb, v_sh = (P).v_sh, v_sn = (P).v_sn;                          \
  const rtk_i64 o_sb = (P).o_sb, o_sh = (P).o_sh, o_sn = (P).o_sn
#define RTK_FWD_SIZES                                                                       \
  const int H = (int)H_, N = (int)N_, Dk = (int)Dk_, Dv = (int)Dv_;                         \
  const float scale = (float)scale_
