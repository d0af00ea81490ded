// tf32.cuh -- fp32 on tensor cores: TF32 mma.sync m16n8k8 and the 3xTF32 operand split (sm_80+).
#pragma once
#include "types.cuh"

// fp32 on tensor cores: TF32 mma.sync m16n8k8 and the 3xTF32 split (sm_80+).
//
// Fragments of mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, g = lane >> 2, t4 = lane & 3:
//   A 16x8 (row, col): a0 (g, t4)   a1 (g+8, t4)   a2 (g, t4+4)   a3 (g+8, t4+4)
//   B 8x8  (k, n):     b0 (t4, g)   b1 (t4+4, g)
//   C/D 16x8 (row, col): c0 (g, 2t4)  c1 (g, 2t4+1)  c2 (g+8, 2t4)  c3 (g+8, 2t4+1)

// fp32 -> tf32 (10 mantissa bits), round to nearest, ties away; the low 13 bits become zero.
__device__ __forceinline__ rtk_u32 rtk_tf32(float x) {
  rtk_u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// x rounded to TF32 for a tensor-core operand: the bits plus half a TF32 ulp, whose 13 low bits the
// tensor cores do not read, so they see x rounded to nearest, ties away, as cvt.rna gives it (three
// instructions on sm_90; this is one VIADDMNMX). The max with the bits keeps the canonical NaN
// 0x7FFFFFFF, which the add would carry into the sign bit: that is the NaN an fp32 multiply and the
// tensor cores make (the tests put NaN 0xFFFFFFFF into every input), so use it on values just
// multiplied or accumulated; raw inputs, whose NaN may carry any sign and payload (0xFFFFFFFF
// would become +0), take rtk_tf32. An Inf becomes a NaN. (An asm like cvt: the compiler keeps the
// fragment registers apart from accumulators wgmma may still read.)
__device__ __forceinline__ rtk_u32 rtk_tf32_operand(float x) {
  rtk_u32 r;
  asm("{\n.reg .s32 t;\nadd.s32 t, %1, 4096;\nmax.s32 %0, t, %1;\n}" : "=r"(r) : "r"(__float_as_uint(x)));
  return r;
}
// The same as a float (for an operand stored back to shared memory).
__device__ __forceinline__ float rtk_round_tf32(float x) { return __uint_as_float(rtk_tf32(x)); }
// x = hi + lo for the 3xTF32 products, in 2 instructions: hi = x truncated to tf32 (clear the 13
// low mantissa bits: one logic op), lo = x - hi, exact in fp32 (0 <= lo / x < 2^-10), handed to
// the mma as its raw fp32 bits: a .tf32 operand's 13 low mantissa bits are not read by the tensor
// cores (ptxas itself feeds cvt.rna.tf32 results to HMMA.TF32 without clearing them), so the mma
// sees lo truncated to 11 significant bits (error < 2^-20 |x|). hi * hi' + hi * lo' + lo * hi'
// then carries about 20 bits of every product (the lo * lo' term, < 2^-20 relative, is dropped).
// The truncation errors lean towards zero, but in proportion to each product, so they do not grow
// where a sum cancels: measured 1.9e-6 relative at (4,32,4096,128), gamma 0.99, on an H200
// (1.3e-6 with hi rounded to nearest, which takes an integer add more: at 3 instructions a split
// the splits were the fp32 kernel's bottleneck, 1.37 against 1.11 ms).
// Non-finite x: Inf gives hi = Inf and lo = NaN; NaN gives lo = NaN (hi is NaN or Inf); either way
// every product with x is NaN, as with cvt.rna. Without EXACT only hi is formed, with cvt.rna (lo =
// 0 and nothing is computed for it).
template <bool EXACT> __device__ __forceinline__ void rtk_split_tf32(float x, rtk_u32& hi, rtk_u32& lo) {
  if (EXACT) {
    hi = __float_as_uint(x) & 0xFFFFE000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
  } else {
    hi = rtk_tf32(x);
    lo = 0u;
  }
}
// D += A (16x8, row) * B (8x8, col), tf32 operands, fp32 accumulators.
__device__ __forceinline__ void rtk_mma1688_tf32(float (&d)[4], const rtk_u32 (&a)[4], rtk_u32 b0, rtk_u32 b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// D += A * B from split operands: EXACT (3xTF32) adds the two small cross terms first, then
// hi * hi; otherwise the one TF32 product hi * hi.
template <bool EXACT>
__device__ __forceinline__ void rtk_mma1688_x3(float (&d)[4], const rtk_u32 (&ah)[4], const rtk_u32 (&al)[4],
                                               rtk_u32 bh0, rtk_u32 bh1, rtk_u32 bl0, rtk_u32 bl1) {
  if (EXACT) {
    rtk_mma1688_tf32(d, al, bh0, bh1);
    rtk_mma1688_tf32(d, ah, bl0, bl1);
  }
  rtk_mma1688_tf32(d, ah, bh0, bh1);
}
// D[m][n] += A[m] B[n] over an M x N grid of fragments from split operands (B as rtk_mma1688_x3
// takes it: [n][0], [n][1] the two registers), in three sweeps over the grid -- every lo * hi',
// then every hi * lo', then every hi * hi' -- so that an mma never waits for the one just before
// it; each accumulator still adds the terms in rtk_mma1688_x3's order (bit-identical results).
// use(m, n): whether the pair is computed (a compile-time true in the usual case).
template <bool EXACT, int M, int N, class Use>
__device__ __forceinline__ void rtk_mma1688_x3_grid(float (&d)[M][N][4], const rtk_u32 (&ah)[M][4],
                                                    const rtk_u32 (&al)[M][4], const rtk_u32 (&bh)[N][2],
                                                    const rtk_u32 (&bl)[N][2], Use use) {
  if (EXACT) {
    #pragma unroll
    for (int n = 0; n < N; ++n)
      #pragma unroll
      for (int m = 0; m < M; ++m)
        if (use(m, n)) rtk_mma1688_tf32(d[m][n], al[m], bh[n][0], bh[n][1]);
    #pragma unroll
    for (int n = 0; n < N; ++n)
      #pragma unroll
      for (int m = 0; m < M; ++m)
        if (use(m, n)) rtk_mma1688_tf32(d[m][n], ah[m], bl[n][0], bl[n][1]);
  }
  #pragma unroll
  for (int n = 0; n < N; ++n)
    #pragma unroll
    for (int m = 0; m < M; ++m)
      if (use(m, n)) rtk_mma1688_tf32(d[m][n], ah[m], bh[n][0], bh[n][1]);
}
