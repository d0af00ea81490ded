// head_decay.cuh -- a head's log(gamma) from the decay argument as the caller gave it.
//
// The kernels read the per-head decay tensor itself (factors gamma, rates r, or the library's own
// float32 log(gamma) for a decay known on the host), so a decay that lives on the GPU costs the
// host no sync and no extra launch. A value outside the domain (gamma not in (0, 1], r not in
// [0, inf), NaN) gives NaN: that head's outputs and state become NaN, never a plausible number.
#pragma once
#include "types.cuh"

// mode = element type | what the values are << 2 | element stride << 8 (rtkernels/decay.py builds it)
#define RTK_DECAY_F32 0
#define RTK_DECAY_F64 1
#define RTK_DECAY_F16 2
#define RTK_DECAY_BF16 3
#define RTK_DECAY_LOG 0
#define RTK_DECAY_FACTOR 1
#define RTK_DECAY_RATE 2
// log(gamma) is clamped to at least this: gamma^d (d >= 1) has underflowed to 0 in every float type
// long before, and log(gamma) * 0 stays 0 instead of -inf * 0 = NaN.
#define RTK_LOG_DECAY_MIN (-1.0e4)

// The caller's value for head h, as stored (any of the four float types, any element stride).
__device__ __forceinline__ double rtk_head_decay_value(const void* decay, rtk_i64 mode, int h) {
  const rtk_i64 i = (mode >> 8) * h;
  switch (mode & 3) {
    case RTK_DECAY_F32: return static_cast<const float*>(decay)[i];
    case RTK_DECAY_F64: return static_cast<const double*>(decay)[i];
    case RTK_DECAY_F16: return rtk_io<RTK_F16>::load(static_cast<const rtk_u16*>(decay) + i);
    default: return rtk_io<RTK_BF16>::load(static_cast<const rtk_u16*>(decay) + i);
  }
}

// Not inlined: a call in the prologue costs nothing measurable, while the inlined fp64 log and
// type switch shifted the register allocation of the main loops (spills in several instances).
__device__ __noinline__ float rtk_head_log_decay(const void* decay, rtk_i64 mode, int h) {
  const double x = rtk_head_decay_value(decay, mode, h);
  const double nan = __longlong_as_double(0x7ff8000000000000LL);
  double lg = x;  // RTK_DECAY_LOG: checked on the host
  const int kind = (int)((mode >> 2) & 3);
  if (kind == RTK_DECAY_FACTOR) lg = (x > 0.0 && x <= 1.0) ? log(x) : nan;
  else if (kind == RTK_DECAY_RATE) lg = (x >= 0.0 && x <= 1.7976931348623157e308) ? -x : nan;
  return lg < RTK_LOG_DECAY_MIN ? (float)RTK_LOG_DECAY_MIN : (float)lg;  // NaN stays NaN
}
