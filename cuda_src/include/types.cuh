// types.cuh -- element types and codes, fp32 load/store of 16-bit storage, strides, conversions.
//
// Header-free on purpose: NVRTC ships without the CUDA toolkit headers, so nothing here includes
// <cuda_fp16.h> or <cuda_bf16.h>; 16-bit values are raw storage converted with inline PTX.
#pragma once

typedef unsigned short rtk_u16;
typedef long long rtk_i64;
typedef unsigned int rtk_u32;

// Element type codes; rtkernels/jit/dtypes.py holds the same numbers.
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


template <int DT> __device__ __forceinline__ rtk_u32 rtk_pack2(float lo, float hi);
template <> __device__ __forceinline__ rtk_u32 rtk_pack2<RTK_BF16>(float lo, float hi) {
  rtk_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ rtk_u32 rtk_pack2<RTK_F16>(float lo, float hi) {
  rtk_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Two 16-bit values of one 32-bit word (the lower address in the low half) as fp32, exactly.
template <int DT> __device__ __forceinline__ void rtk_unpack2(rtk_u32 w, float& lo, float& hi);
template <> __device__ __forceinline__ void rtk_unpack2<RTK_BF16>(rtk_u32 w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xFFFF0000u);
}
template <> __device__ __forceinline__ void rtk_unpack2<RTK_F16>(rtk_u32 w, float& lo, float& hi) {
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi) : "r"(w));
}

// Mask of the exponent bits of a 16-bit type (all ones: Inf or NaN).
template <int DT> struct rtk_expmask;
template <> struct rtk_expmask<RTK_BF16> { static constexpr rtk_u32 v = 0x7F80u; };
template <> struct rtk_expmask<RTK_F16> { static constexpr rtk_u32 v = 0x7C00u; };
// True when either 16-bit half of x is Inf or NaN (exponent bits all ones).
template <int DT> __device__ __forceinline__ bool rtk_nonfinite2(rtk_u32 x) {
  constexpr rtk_u32 m = rtk_expmask<DT>::v;
  return ((x & m) == m) || ((x & (m << 16)) == (m << 16));
}
// Elementwise a * b + c of packed 16-bit pairs, rounded once to nearest.
template <int DT> __device__ __forceinline__ rtk_u32 rtk_fma2(rtk_u32 a, rtk_u32 b, rtk_u32 c);
template <> __device__ __forceinline__ rtk_u32 rtk_fma2<RTK_BF16>(rtk_u32 a, rtk_u32 b, rtk_u32 c) {
  rtk_u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
template <> __device__ __forceinline__ rtk_u32 rtk_fma2<RTK_F16>(rtk_u32 a, rtk_u32 b, rtk_u32 c) {
  rtk_u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// Elementwise product of two packed 16-bit pairs, rounded to nearest (fma with -0 keeps a*b exact-rounded).
template <int DT> __device__ __forceinline__ rtk_u32 rtk_mul2(rtk_u32 a, rtk_u32 b) {
  return rtk_fma2<DT>(a, b, 0x80008000u);
}
// 2^x with one MUFU instruction (relative error below 2^-22; 0 for x very negative).
__device__ __forceinline__ float rtk_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}


// True for fp32 Inf and NaN (exponent bits all ones).
__device__ __forceinline__ bool rtk_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

// This CTA's (batch * head, value tile) in a (B*H, tiles[, z]) grid, numbered so that the tiles of
// one head are next to each other in launch order: they read the same q and k rows, and running
// together they share them through L2 (x-major order would read q and k once per wave and tile).
__device__ __forceinline__ void rtk_head_tile(int& bh, int& tile) {
  const rtk_i64 at = blockIdx.x + (rtk_i64)gridDim.x * blockIdx.y;
  bh = (int)(at / gridDim.y);
  tile = (int)(at - (rtk_i64)bh * gridDim.y);
}
