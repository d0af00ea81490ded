// chunk/decay_grad_sum.cu -- rtk_chunk_decay_grad_sum: the last step of the decay gradient.
//
// rtk_chunk_decay_grad leaves one fp32 partial sum of dL/dlog(gamma) per (batch, value tile, head).
// This sums them per head in a fixed order in fp64 (deterministic, no atomics) and, for a decay
// the caller gave as a tensor of factors or rates, applies the chain rule to the caller's values,
// so the backward hands autograd the gradient of the caller's tensor in one launch:
//   factors: dL/dgamma = dL/dlog(gamma) / gamma;   rates: dL/dr = -dL/dlog(gamma),
// 0 where the forward clamped log(gamma) at RTK_LOG_DECAY_MIN (a constant there), NaN where the
// value is outside the domain (the forward's outputs are NaN there too).
#include "../include/head_decay.cuh"

struct rtk_decay_grad_sum_shape {
  rtk_i64 rows, H, decay_mode;
};

__global__ void rtk_chunk_decay_grad_sum(const float* __restrict__ partial, float* __restrict__ out,
                                         const void* __restrict__ decay,
                                         const __grid_constant__ rtk_decay_grad_sum_shape p) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= p.H) return;
  double s = 0.0;
  for (rtk_i64 r = 0; r < p.rows; ++r) s += partial[r * p.H + h];
  const int kind = (int)((p.decay_mode >> 2) & 3);
  if (kind != RTK_DECAY_LOG) {
    const double x = rtk_head_decay_value(decay, p.decay_mode, h);
    const double nan = __longlong_as_double(0x7ff8000000000000LL);
    if (kind == RTK_DECAY_FACTOR) s = (x > 0.0 && x <= 1.0) ? s / x : nan;
    else s = (x >= 0.0 && x <= 1.7976931348623157e308) ? (-x >= RTK_LOG_DECAY_MIN ? -s : 0.0) : nan;
  }
  out[h] = (float)s;
}
