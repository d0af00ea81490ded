// wgmma_sm90.cuh -- Hopper warpgroup MMA: swizzled shared-memory layout, descriptors, wgmma (sm_90a).
#pragma once
#include "tf32.cuh"
#include "types.cuh"

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

// The same layout in bytes for 32-bit elements (TF32 operands): float column c of row r, regions of
// 32 columns.
__device__ __forceinline__ int rtk_swz_off32(int rows, int r, int c) {
  return (c >> 5) * (rows * 128) + r * 128 + ((((c >> 2) & 7) ^ (r & 7)) << 4) + ((c & 3) << 2);
}

// Where key s of a chunk sits in a K-major TF32 operand whose A side comes from an accumulator: a
// TF32 A fragment has columns t4, t4 + 4 where an m64nNk8 accumulator holds columns 2 t4, 2 t4 + 1,
// so key s is stored at column (s & ~7) | 4 (s & 1) | ((s & 7) >> 1) of each 8.
__device__ __forceinline__ int rtk_tf32_key_col(int s) { return (s & ~7) | ((s & 1) << 2) | ((s & 7) >> 1); }

// Copy u of thread t (NW warps) into a transposed tile (BV rows = value columns, 64 keys stored at
// rtk_tf32_key_col, rtk_swz_off32's layout), element by element: key s and value column d. A warp's
// copy covers 8 consecutive columns and 4 keys, which land in 32 different banks, and reads 4
// 32-byte sectors of the row-major source. BV * 64 / (32 NW) copies a thread.
template <int BV, int NW>
__device__ __forceinline__ void rtk_tf32_vt_elem(int t, int u, int& s, int& d) {
  const int tg = (16 / NW) * (t >> 5) + u / (BV / 8);  // 4 keys: 8 (tg / 2) + 2 i + tg % 2, i = lane / 8
  s = 8 * (tg >> 1) + 2 * ((t & 31) >> 3) + (tg & 1);
  d = 8 * (u % (BV / 8)) + (t & 7);
}

// Shared-memory matrix descriptor, 128-byte swizzle. lbo/sbo in bytes.
__device__ __forceinline__ unsigned long long rtk_wg_desc(rtk_u32 saddr, rtk_u32 lbo, rtk_u32 sbo) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// wgmma descriptors of MN-major operands (e.g. v, [k][n] with n contiguous): the
// leading byte offset is the step between 64-column regions, the stride byte offset the step
// between 8-row groups (checked on an H200; the swapped reading faults).
#define RTK_MN_LBO(region) (region)
#define RTK_MN_SBO(region) 1024

// base + off, formed right where it is used (volatile: the compiler neither hoists nor keeps a
// table of descriptors alive in registers).
__device__ __forceinline__ unsigned long long rtk_desc_at(unsigned long long base, rtk_u32 off16) {
  unsigned long long d;
  asm volatile("add.s64 %0, %1, %2;" : "=l"(d) : "l"(base), "l"((unsigned long long)off16));
  return d;
}
// The descriptor offset (16-byte units) of k-step ks of a K-major tile of `rows` rows: each step
// is 32 bytes along the 128-byte rows (16 16-bit or 8 TF32 columns), a new region every 4 steps.
__device__ __forceinline__ rtk_u32 rtk_kmajor_step(int rows, int ks) {
  return (rtk_u32)(((ks >> 2) * (rows * 128) + (ks & 3) * 32) >> 4);
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
// A warpgroup's registers per thread, lowered (giving them to the CTA's pool) or raised (taking
// them from it) to N, a multiple of 8; every warp of the warpgroup runs it.
template <int N> __device__ __forceinline__ void rtk_reg_dealloc() {
#ifdef RTK_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
#endif
}
template <int N> __device__ __forceinline__ void rtk_reg_alloc() {
#ifdef RTK_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
#endif
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

#define RTK_WGMMA_TF32_SS                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " RTK_D32 ", %32, %33, p, 1, 1;\n}\n" \
               : RTK_D32_OPS(d) : "l"(da), "l"(db), "r"(acc))
#define RTK_WGMMA_TF32_RS                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " RTK_D32                      \
               ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"                                        \
               : RTK_D32_OPS(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc))
// D (64 x 64) (+)= A (64 x 8) B (8 x 64), TF32 operands, both K-major in shared memory (TF32 wgmma
// takes no transposed operand).
__device__ __forceinline__ void rtk_wgmma_tf32_ss(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
#ifdef RTK_HAS_WGMMA
  RTK_WGMMA_TF32_SS;
#else
  __trap();
#endif
}
// The same with A from registers: warp w's rows 16 w.. as an mma.sync m16n8k8 TF32 A fragment.
__device__ __forceinline__ void rtk_wgmma_tf32_rs(float (&d)[32], const rtk_u32 (&a)[4], unsigned long long db, int acc) {
#ifdef RTK_HAS_WGMMA
  RTK_WGMMA_TF32_RS;
#else
  __trap();
#endif
}

// D (+)= P V over a chunk's 64 keys, P an m64n64 accumulator used as the A operand: its keys 2 t4,
// 2 t4 + 1 of n-tile j are A columns t4, t4 + 4, the order rtk_tf32_key_col stores v^T in. P was just
// multiplied, so rtk_tf32_operand rounds it. vt: v^T's descriptor (K-major, `rows` rows). ACC
// false: D = P V. Waits for the products and pins D.
template <bool ACC>
__device__ __forceinline__ void rtk_tf32_pv(float (&d)[32], const float (&p)[8][4], unsigned long long vt, int rows) {
  rtk_u32 a[8][4];
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    a[j][0] = rtk_tf32_operand(p[j][0]);
    a[j][1] = rtk_tf32_operand(p[j][2]);
    a[j][2] = rtk_tf32_operand(p[j][1]);
    a[j][3] = rtk_tf32_operand(p[j][3]);
  }
  rtk_wg_fence();
  #pragma unroll
  for (int j = 0; j < 8; ++j) rtk_wgmma_tf32_rs(d, a[j], rtk_desc_at(vt, rtk_kmajor_step(rows, j)), ACC || j > 0);
  rtk_wg_commit();
  rtk_wg_wait<0>();
  rtk_wg_pin(d);
}
