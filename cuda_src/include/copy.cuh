// copy.cuh -- shared-memory addresses, cp.async, bulk and tensor copies, mbarriers, ldmatrix/stmatrix,
// named barriers (inline PTX, sm_80+; the bulk and tensor copies, mbarriers and stmatrix sm_90+).
#pragma once
#include "types.cuh"

__device__ __forceinline__ rtk_u32 rtk_smem_addr(const void* p) {
  rtk_u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte global -> shared copy; bytes beyond src_bytes (0..16) are filled with zeros.
__device__ __forceinline__ void rtk_cp_async16(rtk_u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4-byte global -> shared copy (src_bytes 0: zero), e.g. one element of a transposed tile.
__device__ __forceinline__ void rtk_cp_async4(rtk_u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
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
// Tensor copies global -> shared (sm_90+), completing on an mbarrier. A barrier (8 bytes of shared
// memory) counts one arrival a phase: the issuing thread announces the phase's bytes (expect), the
// copies name the barrier, and rtk_mbar_wait returns once the phase of that parity has completed
// (its bytes visible to the threads that waited).
__device__ __forceinline__ void rtk_mbar_init(rtk_u32 bar) {
  RTK_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void rtk_mbar_init_fence() {  // the inits seen by the copy engine
  RTK_SM90_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void rtk_mbar_expect(rtk_u32 bar, rtk_u32 bytes) {
  RTK_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void rtk_mbar_wait(rtk_u32 bar, rtk_u32 parity) {
  rtk_u32 done = 0;
  do {
    RTK_SM90_ASM("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// A tensor map (CUtensorMap, built on the host by cuTensorMapEncodeTiled): opaque, 128 bytes,
// 64-byte aligned; kernels take it as a __grid_constant__ parameter and name it by address.
struct __align__(64) rtk_tmap {
  unsigned long long words[16];
};
// The box of a rank-4 map at element coordinates (c0 innermost .. c3) to shared address `dst`
// (1024-byte aligned for the 128-byte swizzle); elements outside the tensor arrive as zeros.
__device__ __forceinline__ void rtk_tensor_load4(rtk_u32 dst, const rtk_tmap* map, int c0, int c1, int c2, int c3,
                                                 rtk_u32 bar) {
  RTK_SM90_ASM("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
               :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                  "r"(bar) : "memory");
}
// NB boxes of 64 columns x 64 rows side by side: columns c0 + 64 i to dst + 8192 i (the 128-byte
// swizzled regions of a 64-row tile), all completing on `bar`.
template <int NB>
__device__ __forceinline__ void rtk_tensor_load_boxes(rtk_u32 dst, const rtk_tmap* map, int c0, int c1, int c2, int c3,
                                                      rtk_u32 bar) {
  #pragma unroll
  for (int i = 0; i < NB; ++i) rtk_tensor_load4(dst + i * 8192, map, c0 + i * 64, c1, c2, c3, bar);
}
// The box of a rank-4 map at element coordinates (c0 innermost .. c3) from shared address `src`
// (1024-byte aligned for the 128-byte swizzle) to global memory, in the issuing thread's bulk group
// (rtk_bulk_commit / rtk_bulk_wait_*); elements outside the tensor are not written.
__device__ __forceinline__ void rtk_tensor_store4(const rtk_tmap* map, int c0, int c1, int c2, int c3, rtk_u32 src) {
  RTK_SM90_ASM("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
               :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
// The byte offset of 16-byte piece `piece` (0..7) of row `row` in a box of 128-byte rows written
// with the 128-byte swizzle: the piece index XORed with the row's place in its 8-row group.
__device__ __forceinline__ rtk_u32 rtk_swizzle128(int row, int piece) {
  return (rtk_u32)(row * 128 + ((piece ^ (row & 7)) << 4));
}
// Four 8x8 b16 matrices to shared memory (sm_90+); lane i gives the address of row (i % 8) of
// matrix (i / 8), register j holds matrix j as an mma.sync accumulator pair (row lane / 4).
__device__ __forceinline__ void rtk_stsm_x4(rtk_u32 addr, rtk_u32 r0, rtk_u32 r1, rtk_u32 r2, rtk_u32 r3) {
  RTK_SM90_ASM("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3) : "memory");
}

// Barriers for warp-specialized kernels, whose warp groups meet at a barrier from different
// places in the code. __syncthreads and bar.* are the .aligned forms, which require every thread
// to execute the same instruction (undefined otherwise; compute-sanitizer synccheck flags it);
// the non-aligned barrier.* forms count arrivals from any instruction.
// Barrier `id` (1..15) of `count` threads (a multiple of 32): a subset of the CTA's warps.
__device__ __forceinline__ void rtk_named_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// Arrive at named barrier id without waiting (the producers' side of a barrier.sync by the others).
__device__ __forceinline__ void rtk_named_arrive(int id, int count) {
  asm volatile("barrier.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// The whole CTA (barrier 0).
__device__ __forceinline__ void rtk_cta_sync() { asm volatile("barrier.sync 0;" ::: "memory"); }
// The whole CTA (barrier 0); returns whether `p` holds in any thread. Call number `phase` (0, 1,
// ... in every thread) uses ring[phase % 2] of a two-word shared ring zeroed before the first call:
// a thread whose `p` holds stores phase + 1 there before the barrier, and every thread compares after
// it (the word was last read in call phase - 2, before call phase - 1's barrier). Not barrier.red:
// compute-sanitizer's synccheck reports it as divergent when warp groups reach it from different
// places in the code (a probe on an H200: barrier.sync 0 from two places passes, barrier.red fails).
__device__ __forceinline__ bool rtk_cta_sync_or(bool p, rtk_u32* ring, rtk_u32 phase) {
  if (p) ring[phase & 1] = phase + 1;
  rtk_cta_sync();
  return ring[phase & 1] == phase + 1;
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
