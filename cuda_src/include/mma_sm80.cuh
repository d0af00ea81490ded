// mma_sm80.cuh -- 16-bit tensor-core products, mma.sync m16n8k16 (sm_80+).
#pragma once
#include "types.cuh"

// D += A (16x16, row) * B (16x8, col), fp32 accumulators; DT selects f16 or bf16 operands.
template <int DT> __device__ __forceinline__ void rtk_mma16816(float (&d)[4], const rtk_u32 (&a)[4],
                                                               rtk_u32 b0, rtk_u32 b1);
template <> __device__ __forceinline__ void rtk_mma16816<RTK_BF16>(float (&d)[4], const rtk_u32 (&a)[4],
                                                                    rtk_u32 b0, rtk_u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void rtk_mma16816<RTK_F16>(float (&d)[4], const rtk_u32 (&a)[4],
                                                                   rtk_u32 b0, rtk_u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 -> one register of two 16-bit values (lo in the low half), round to nearest even.
