// params.cuh -- the parameters every forward kernel takes first.
#pragma once
#include "types.cuh"

// The leading parameters of every forward kernel, in the order rtkernels/methods/_launch.py
// passes them: pointers; sizes as 64-bit integers and the scale as a double (so the launcher can
// pass plain Python numbers); element strides (batch, head, token) of the [B, H, N, D] views of
// q, k, v and o, whose last stride is 1. RTK_FWD_SIZES declares the int/float forms.
#define RTK_FWD_PARAMS(ELEM)                                                                \
  const ELEM* __restrict__ q, const ELEM* __restrict__ k, const ELEM* __restrict__ v,       \
  ELEM* __restrict__ o, const float* __restrict__ log_decay,                                \
  const float* __restrict__ init_state, float* __restrict__ final_state,                    \
  rtk_i64 H_, rtk_i64 N_, rtk_i64 Dk_, rtk_i64 Dv_, double scale_,                          \
  rtk_i64 q_sb, rtk_i64 q_sh, rtk_i64 q_sn, rtk_i64 k_sb, rtk_i64 k_sh, rtk_i64 k_sn,       \
  rtk_i64 v_sb, rtk_i64 v_sh, rtk_i64 v_sn, rtk_i64 o_sb, rtk_i64 o_sh, rtk_i64 o_sn
#define RTK_FWD_SIZES                                                                       \
  const int H = (int)H_, N = (int)N_, Dk = (int)Dk_, Dv = (int)Dv_;                         \
  const float scale = (float)scale_
