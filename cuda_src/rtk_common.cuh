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

// Strides (in elements) of a [B, H, N, D] view with unit stride along D. Both public layouts
// ("bhnd" and "bnhd") are expressed this way, so kernels never need a transposed copy.
struct rtk_strides {
  rtk_i64 b, h, n;
};

__device__ __forceinline__ rtk_i64 rtk_offset(const rtk_strides& s, int b, int h, rtk_i64 n) {
  return (rtk_i64)b * s.b + (rtk_i64)h * s.h + n * s.n;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core and async-copy building blocks (inline PTX, sm_80+).

typedef unsigned int rtk_u32;

__device__ __forceinline__ rtk_u32 rtk_smem_addr(const void* p) {
  rtk_u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte global -> shared copy; bytes beyond src_bytes (0..16) are filled with zeros.
__device__ __forceinline__ void rtk_cp_async16(rtk_u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void rtk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void rtk_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Bulk shared -> global copies (sm_90+; elsewhere they trap, and no caller reaches them): `bytes` (a
// multiple of 16) from a 16-byte aligned shared address to a 16-byte aligned global one, through
// the async proxy. The issuing thread commits its copies as a group and waits on its own groups:
// wait_read<N> until the shared source of all but the N newest groups was read, wait_all<N> until
// they were written.
#if __CUDA_ARCH__ >= 900
#define RTK_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define RTK_SM90_ASM(...) __trap()
#endif
__device__ __forceinline__ void rtk_bulk_store(void* gdst, rtk_u32 ssrc, rtk_u32 bytes) {
  RTK_SM90_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(gdst), "r"(ssrc), "r"(bytes) : "memory");
}
__device__ __forceinline__ void rtk_bulk_commit() { RTK_SM90_ASM("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void rtk_bulk_wait_read() {
  RTK_SM90_ASM("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void rtk_bulk_wait_all() {
  RTK_SM90_ASM("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// Four 8x8 b16 matrices to shared memory (sm_90+); lane i gives the address of row (i % 8) of
// matrix (i / 8), register j holds matrix j as an mma.sync accumulator pair (row lane / 4).
__device__ __forceinline__ void rtk_stsm_x4(rtk_u32 addr, rtk_u32 r0, rtk_u32 r1, rtk_u32 r2, rtk_u32 r3) {
  RTK_SM90_ASM("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3) : "memory");
}

// Barrier `id` (1..15) of `count` threads (a multiple of 32): a subset of the CTA's warps.
__device__ __forceinline__ void rtk_named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// Four 8x8 b16 matrices; lane i gives the address of row (i % 8) of matrix (i / 8).
__device__ __forceinline__ void rtk_ldsm_x4(rtk_u32 (&r)[4], rtk_u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void rtk_ldsm_x4_trans(rtk_u32 (&r)[4], rtk_u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

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
// Mask of the exponent bits of a 16-bit type (all ones: Inf or NaN).
template <int DT> struct rtk_expmask;
template <> struct rtk_expmask<RTK_BF16> { static constexpr rtk_u32 v = 0x7F80u; };
template <> struct rtk_expmask<RTK_F16> { static constexpr rtk_u32 v = 0x7C00u; };
// True when either 16-bit half of x is Inf or NaN (exponent bits all ones).
template <int DT> __device__ __forceinline__ bool rtk_nonfinite2(rtk_u32 x) {
  constexpr rtk_u32 m = rtk_expmask<DT>::v;
  return ((x & m) == m) || ((x & (m << 16)) == (m << 16));
}
// Elementwise product of two packed 16-bit pairs, rounded to nearest (fma with -0 keeps a*b exact-rounded).
template <int DT> __device__ __forceinline__ rtk_u32 rtk_mul2(rtk_u32 a, rtk_u32 b);
template <> __device__ __forceinline__ rtk_u32 rtk_mul2<RTK_BF16>(rtk_u32 a, rtk_u32 b) {
  rtk_u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
template <> __device__ __forceinline__ rtk_u32 rtk_mul2<RTK_F16>(rtk_u32 a, rtk_u32 b) {
  rtk_u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// 2^x with one MUFU instruction (relative error below 2^-22; 0 for x very negative).
__device__ __forceinline__ float rtk_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
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
// Every element of MT x NT accumulator fragments times f.
template <int MT, int NT> __device__ __forceinline__ void rtk_frag_scale(float (&x)[MT][NT][4], float f) {
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) x[mt][nt][e] *= f;
}

// A warp's fp32 fragment of a state (rows sr0 .. sr0 + 16 MT - 1, NT n-tiles of value columns
// from v0; chunk.cu's state warps, chunk_decay_grad.cu's accumulators): where
// element (mt, nt, e) lives in a [slots, B*H, Dk, Dv] buffer, and whether it is a real (row < Dk,
// column < Dv) element; loading the initial state and storing the final one.
template <int MT, int NT>
struct rtk_chunk_state {
  int sr0, g, t4, bh, Dk, Dv, v0, dv_here;
  rtk_i64 state_slot;

  __device__ __forceinline__ bool at(int mt, int nt, int e, rtk_i64& off) const {
    const int r = sr0 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
    off = state_slot + ((rtk_i64)bh * Dk + r) * Dv + v0 + c;
    return r < Dk && c < dv_here;
  }
  // f(mt, nt, e, off, real) for each element of the fragment (off and real as in at()).
  template <class F> __device__ __forceinline__ void elems(F f) const {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          rtk_i64 off;
          const bool real = at(mt, nt, e, off);
          f(mt, nt, e, off, real);
        }
  }
  __device__ __forceinline__ void load(float (&s_acc)[MT][NT][4], const float* init_state) const {
    elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      s_acc[mt][nt][e] = (init_state != nullptr && real) ? init_state[off] : 0.f;
    });
  }
  // The state entering segment z = blockIdx.z of the split-sequence strategy from the slots the
  // states pass (rtk_chunk_states) wrote: slot 0 the initial state, slot 1 the state entering
  // segment 1, slot j > 1 segment j-1's own state (from zero): s = slot[min(z, 1)], then
  // s = gamma^seg_len s + slot[j] for j = 2 .. z (as rtk_chunk_seg_scan, in the same order).
  __device__ __forceinline__ void fold(float (&s_acc)[MT][NT][4], const float* slots, float lgd, rtk_i64 seg_len,
                                       int bh_count) const {
    const int z = blockIdx.z;
    const rtk_i64 slot = (rtk_i64)bh_count * Dk * Dv;
    load(s_acc, slots + (z < 1 ? 0 : slot));
    const float carry = expf(lgd * (float)seg_len);
    #pragma unroll 1
    for (int j = 2; j <= z; ++j) {
      const float* sj = slots + j * slot;
      elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
        s_acc[mt][nt][e] = fmaf(carry, s_acc[mt][nt][e], real ? sj[off] : 0.f);
      });
    }
  }
  __device__ __forceinline__ void store(const float (&s_acc)[MT][NT][4], float* final_state) const {
    if (final_state == nullptr) return;
    elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      if (real) final_state[off] = s_acc[mt][nt][e];
    });
  }
  // f(r, c, lo, hi) for each pair of adjacent elements (row r, columns c and c + 1) of the fragment.
  template <class F> __device__ __forceinline__ void pairs(const float (&s_acc)[MT][NT][4], F f) const {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          f(sr0 + mt * 16 + g + hh * 8, nt * 8 + 2 * t4, s_acc[mt][nt][2 * hh], s_acc[mt][nt][2 * hh + 1]);
  }
};

// True for fp32 Inf and NaN (exponent bits all ones).
__device__ __forceinline__ bool rtk_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

// ---------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (wgmma, sm_90a only: callers guard with RTK_HAS_WGMMA).
// Shared-memory operands use the 128-byte swizzle: a tile is stored in regions of 64 columns of
// 16-bit values (128-byte rows), each region 1024-byte aligned; the 16-byte piece p of row r
// sits at piece p ^ (r % 8) of that row (rtk_swz_off).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RTK_HAS_WGMMA 1
#endif

// Element offset of 16-byte piece `piece` (8 elements) of row `row` in a tile of `rows` rows
// stored as 128-byte-swizzled regions of 64 columns.
__device__ __forceinline__ int rtk_swz_off(int rows, int row, int piece) {
  return (piece >> 3) * (rows * 64) + row * 64 + (((piece & 7) ^ (row & 7)) << 3);
}

// Shared-memory matrix descriptor, 128-byte swizzle. lbo/sbo in bytes.
__device__ __forceinline__ unsigned long long rtk_wg_desc(rtk_u32 saddr, rtk_u32 lbo, rtk_u32 sbo) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// base + off, formed right where it is used (volatile: the compiler neither hoists nor keeps a
// table of descriptors alive in registers).
__device__ __forceinline__ unsigned long long rtk_desc_at(unsigned long long base, rtk_u32 off16) {
  unsigned long long d;
  asm volatile("add.s64 %0, %1, %2;" : "=l"(d) : "l"(base), "l"((unsigned long long)off16));
  return d;
}
#ifdef RTK_HAS_WGMMA
__device__ __forceinline__ void rtk_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void rtk_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void rtk_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
#else  // never reached: the wgmma instances only run where RTK_HAS_WGMMA is defined
__device__ __forceinline__ void rtk_wg_fence() {}
__device__ __forceinline__ void rtk_wg_commit() {}
template <int N> __device__ __forceinline__ void rtk_wg_wait() {}
#endif
// Keeps the compiler from moving reads or writes of accumulator registers across a wait.
template <int R> __device__ __forceinline__ void rtk_wg_pin(float (&d)[R]) {
  #pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy (wgmma) reads.
__device__ __forceinline__ void rtk_fence_proxy_async() {
#ifdef RTK_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#define RTK_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define RTK_D32_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),   \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),         \
  "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),     \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]),     \
  "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D (64 x 64, fp32; warp w of the warpgroup holds rows 16w.., n-tile j in d[4j..4j+3] laid out as
// an mma.sync m16n8 accumulator) (+)= A (64 x 16) B (16 x 64). A and B from shared memory
// (descriptors); TB = 1: B stored MN-major ([k][n], n contiguous), 0: K-major ([n][k]).
#define RTK_WGMMA_SS(TY)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " RTK_D32                 \
               ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                                 \
               : RTK_D32_OPS(d) : "l"(da), "l"(db), "r"(acc), "n"(TB))
#define RTK_WGMMA_RS(TY)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " RTK_D32                 \
               ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                   \
               : RTK_D32_OPS(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB))

template <int DT, int TB>
__device__ __forceinline__ void rtk_wgmma_ss(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
#ifdef RTK_HAS_WGMMA
  if (DT == RTK_BF16) RTK_WGMMA_SS("bf16"); else RTK_WGMMA_SS("f16");
#else
  __trap();
#endif
}
// As rtk_wgmma_ss with A (64 x 16) from registers: warp w gives rows 16w.. as an mma.sync
// m16n8k16 A fragment.
template <int DT, int TB>
__device__ __forceinline__ void rtk_wgmma_rs(float (&d)[32], const rtk_u32 (&a)[4], unsigned long long db, int acc) {
#ifdef RTK_HAS_WGMMA
  if (DT == RTK_BF16) RTK_WGMMA_RS("bf16"); else RTK_WGMMA_RS("f16");
#else
  __trap();
#endif
}
