// rtk_common.cuh -- the one shared header of the rtkernels CUDA sources.
//
// Header-free on purpose: NVRTC ships without the CUDA toolkit headers, so nothing here includes
// <cuda_fp16.h> or <cuda_bf16.h>. 16-bit values are raw 16-bit storage converted with inline PTX.
// The runtime inlines this file into every .cu source before compiling (see rtkernels/runtime).
#pragma once

typedef unsigned short rtk_u16;
typedef long long rtk_i64;

// Element type codes; rtkernels/runtime/dtypes.py holds the same numbers.
#define RTK_F32 0
#define RTK_F16 1
#define RTK_BF16 2

// rtk_io<DT>: storage type and fp32 load/store for one element type.
template <int DT> struct rtk_io;

template <> struct rtk_io<RTK_F32> {
  typedef float T;
  static __device__ __forceinline__ float load(const T* p) { return *p; }
  static __device__ __forceinline__ void store(T* p, float x) { *p = x; }
};

template <> struct rtk_io<RTK_F16> {
  typedef rtk_u16 T;
  static __device__ __forceinline__ float load(const T* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
  }
  static __device__ __forceinline__ void store(T* p, float x) {
    rtk_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    *p = h;
  }
};

template <> struct rtk_io<RTK_BF16> {
  typedef rtk_u16 T;
  // bf16 -> f32 is exact: the bf16 bits are the high half of the f32 bits (works on every arch).
  static __device__ __forceinline__ float load(const T* p) {
    return __uint_as_float(((unsigned int)(*p)) << 16);
  }
  static __device__ __forceinline__ void store(T* p, float x) {
    rtk_u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    *p = h;
  }
};

// Strides (in elements) of a [B, H, N, D] view with unit stride along D. Both public layouts
// ("bhnd" and "bnhd") are expressed this way, so kernels never need a transposed copy.
struct rtk_strides {
  rtk_i64 b, h, n;
};

__device__ __forceinline__ rtk_i64 rtk_offset(const rtk_strides& s, int b, int h, rtk_i64 n) {
  return (rtk_i64)b * s.b + (rtk_i64)h * s.h + n * s.n;
}
