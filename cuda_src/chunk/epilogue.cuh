// chunk/epilogue.cuh -- output fragments: zeroing, copying, NaN marking, stores (plain and bulk).
#pragma once
#include "../include/copy.cuh"

// Zero the accumulators of fragments.
template <int A, int B> __device__ __forceinline__ void rtk_zero(float (&x)[A][B]) {
  #pragma unroll
  for (int i = 0; i < A; ++i)
    #pragma unroll
    for (int j = 0; j < B; ++j) x[i][j] = 0.f;
}
// Copy fragments (dst = src).
template <int A, int B> __device__ __forceinline__ void rtk_frag_copy(float (&dst)[A][B], const float (&src)[A][B]) {
  #pragma unroll
  for (int i = 0; i < A; ++i)
    #pragma unroll
    for (int j = 0; j < B; ++j) dst[i][j] = src[i][j];
}

// NaN semantics of rtk_chunk_fwd: a dense P V product would multiply the zeros above the diagonal
// of P with a NaN in a later row of v. So when a chunk's v holds a non-finite value, the operand of
// P V has it zeroed and the outputs the causal sum reaches are set to NaN here. The state update
// uses v as it is, so later chunks see the NaN through S.
// Rare (a chunk's v holds Inf/NaN): set to NaN the outputs of warp rows r0 .. r0+15 that a
// non-finite v_s reaches (rows t >= s of the same column); bad(s, c) is true (nonzero) where
// v_s[c] is one.
template <int NT, class Bad>
__device__ __forceinline__ void rtk_chunk_mark_nonfinite(float (&o_acc)[NT][4], int r0, int g, int t4, Bad bad) {
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = r0 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
      bool hit = false;
      for (int s2 = 0; s2 <= t; ++s2) hit |= bad(s2, c);
      if (hit) o_acc[nt][e] = __int_as_float(0x7fc00000);
    }
}

// The same in one pass over the keys s <= r0 + 15, each column's first non-finite key (C: none) then
// compared with the rows: compact code, for kernels that compile it once per output warp.
template <int NT, int C, class Bad>
__device__ __forceinline__ void rtk_chunk_mark_from_first(float (&o_acc)[NT][4], int r0, int g, int t4, Bad bad) {
  int first[NT][2];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) first[nt][0] = first[nt][1] = C;
  #pragma unroll 1
  for (int s2 = r0 + 15; s2 >= 0; --s2)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int b = 0; b < 2; ++b)
        if (bad(s2, nt * 8 + 2 * t4 + b)) first[nt][b] = s2;
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    #pragma unroll
    for (int e = 0; e < 4; ++e)
      if (r0 + g + (e >> 1) * 8 >= first[nt][e & 1]) o_acc[nt][e] = __int_as_float(0x7fc00000);
}

// Two adjacent outputs as one store (4 bytes for 16-bit types, 8 for fp32).
template <int DT> __device__ __forceinline__ void rtk_store_pair(typename rtk_io<DT>::T* p, float lo, float hi) {
  if constexpr (DT == RTK_F32) {
    float2 pair;
    pair.x = lo;
    pair.y = hi;
    *reinterpret_cast<float2*>(p) = pair;
  } else {
    *reinterpret_cast<rtk_u32*>(p) = rtk_pack2<DT>(lo, hi);
  }
}

// Store an output warp's rows t = r0 + g (+8) < len of the chunk at token n0 (the scale is already
// in the row and diagonal factors); paired stores where ovec_full, else column by column.
template <int DT, int NT>
__device__ __forceinline__ void rtk_chunk_store_rows(typename rtk_io<DT>::T* ob, const float (&o_acc)[NT][4],
                                                     int n0, int r0, int g, int t4, int len, rtk_i64 o_sn,
                                                     int v0, int dv_here, bool ovec_full) {
  #pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = r0 + g + hh * 8;
    if (t < len) {
      typename rtk_io<DT>::T* orow = ob + ((rtk_i64)n0 + t) * o_sn + v0 + 2 * t4;
      if (ovec_full) {  // the usual case: whole tile, aligned pairs
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) rtk_store_pair<DT>(orow + nt * 8, o_acc[nt][2 * hh], o_acc[nt][2 * hh + 1]);
      } else {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = nt * 8 + 2 * t4;
          if (c < dv_here) rtk_io<DT>::store(orow + nt * 8, o_acc[nt][2 * hh]);
          if (c + 1 < dv_here) rtk_io<DT>::store(orow + nt * 8 + 1, o_acc[nt][2 * hh + 1]);
        }
      }
    }
  }
}

// As rtk_chunk_store_rows for whole tiles whose rows start on 16 bytes (sm_90+): the warp puts
// its 16 rows into buffer `stage` (shared address, rows of OS elements; the warp's own rows, so
// no barrier beyond the warp) with stmatrix, and lanes 0..15 each send one row with a bulk copy,
// committed as one group per lane and chunk. The kernel cycles through NBUF buffers, so before
// refilling one, the copies that read it NBUF chunks before must be done (wait_read<NBUF - 1>);
// it waits for all before it ends.
template <int DT, int NT, int OS, int NBUF = 2>
__device__ __forceinline__ void rtk_chunk_send_rows(typename rtk_io<DT>::T* ob, const float (&o_acc)[NT][4],
                                                    rtk_u32 stage, int n0, int r0, int lane, int len,
                                                    rtk_i64 o_sn, int v0) {
  rtk_bulk_wait_read<NBUF - 1>();
  __syncwarp();
  const int m = lane >> 3;  // matrix m of each stmatrix: rows 8 (m & 1) .., n-tile 2 np + (m >> 1)
  const rtk_u32 at = stage + 2 * ((r0 + (m & 1) * 8 + (lane & 7)) * OS + (m >> 1) * 8);
  #pragma unroll
  for (int np = 0; np < NT / 2; ++np)
    rtk_stsm_x4(at + 32 * np, rtk_pack2<DT>(o_acc[2 * np][0], o_acc[2 * np][1]),
                rtk_pack2<DT>(o_acc[2 * np][2], o_acc[2 * np][3]),
                rtk_pack2<DT>(o_acc[2 * np + 1][0], o_acc[2 * np + 1][1]),
                rtk_pack2<DT>(o_acc[2 * np + 1][2], o_acc[2 * np + 1][3]));
  rtk_fence_proxy_async();  // these writes before the async proxy's reads
  __syncwarp();
  const int t = r0 + lane;
  if (lane < 16 && t < len)
    rtk_bulk_store(ob + ((rtk_i64)n0 + t) * o_sn + v0, stage + 2 * t * OS, NT * 8 * (int)sizeof(typename rtk_io<DT>::T));
  rtk_bulk_commit();
}

// Whether any of COUNT 16-byte pieces of a tile in shared memory, piece `piece` of rows row,
// row + STEP, .. (element offsets off(row, piece)), holds an Inf/NaN.
template <int DT, int COUNT, int STEP, typename Off>
__device__ __forceinline__ bool rtk_pieces_nonfinite(const rtk_u16* tile, int row, int piece, Off off) {
  bool bad = false;
  #pragma unroll
  for (int u = 0; u < COUNT; ++u) {
    const uint4 x = *reinterpret_cast<const uint4*>(tile + off(row + u * STEP, piece));
    bad |= rtk_nonfinite2<DT>(x.x) | rtk_nonfinite2<DT>(x.y) | rtk_nonfinite2<DT>(x.z) | rtk_nonfinite2<DT>(x.w);
  }
  return bad;
}

// As rtk_chunk_send_rows through a tensor map (sm_90+, the TMA instances): the warp puts its 16
// rows into its region of buffer `stage` as boxes of 16 rows x 64 columns in the 128-byte swizzle
// (stmatrix rows then fall on distinct banks, and the region is what the map's box reads), and
// lane 0 stores each box at element coordinates (c0 + 64 i, row, c2, c3). The copy engine drops
// what lies outside the tensor (rows past N, columns past Dv), so partial chunks and tiles need no
// test. Buffers and groups as in rtk_chunk_send_rows (the groups are lane 0's).
template <int DT, int NT, int NBUF = 2>
__device__ __forceinline__ void rtk_chunk_send_box(const rtk_tmap* map, const float (&o_acc)[NT][4], rtk_u32 stage,
                                                   int lane, int c0, int row, int c2, int c3) {
  static_assert(NT % 8 == 0, "whole 64-column boxes");
  rtk_bulk_wait_read<NBUF - 1>();
  __syncwarp();
  const int m = lane >> 3, rr = (m & 1) * 8 + (lane & 7);  // matrix m: rows 8 (m & 1) .., n-tile 2 np + (m >> 1)
  #pragma unroll
  for (int np = 0; np < NT / 2; ++np)
    rtk_stsm_x4(stage + (np >> 2) * 2048 + rtk_swizzle128(rr, 2 * (np & 3) + (m >> 1)),
                rtk_pack2<DT>(o_acc[2 * np][0], o_acc[2 * np][1]), rtk_pack2<DT>(o_acc[2 * np][2], o_acc[2 * np][3]),
                rtk_pack2<DT>(o_acc[2 * np + 1][0], o_acc[2 * np + 1][1]),
                rtk_pack2<DT>(o_acc[2 * np + 1][2], o_acc[2 * np + 1][3]));
  rtk_fence_proxy_async();  // these writes before the async proxy's reads
  __syncwarp();
  if (lane == 0) {
    #pragma unroll
    for (int i = 0; i < NT / 8; ++i) rtk_tensor_store4(map, c0 + 64 * i, row, c2, c3, stage + i * 2048);
  }
  rtk_bulk_commit();
}
