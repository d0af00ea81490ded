// chunk/layout16.cuh -- rtk_chunk_fwd's shared memory: tile stages, state copies, output rows.
#pragma once
#include "../include/wgmma_sm90.cuh"

// Shared-memory layout. SW = false: rows padded by 16 bytes (conflict-free ldmatrix). SW = true
// (the wgmma kernel): 128-byte-swizzled regions of 64 columns (rtk_swz_off), 1024-byte aligned,
// the layout wgmma descriptors read. The *_off functions give the element offset of 16-byte
// piece p of row r; KS and VS are the element step from one row to the next in the same piece.
// ZSMEM (the 128-wide Z dq pass): two S copies, one Z copy updated in place (no W copies), and one
// x tile (XB) outside the stages, which the output warps load themselves each period. TMA (tiles
// by tensor copies, output rows by tensor stores): each output warp's 16 rows of a buffer are two
// (BV 128) or one box of 16 x 64 in the 128-byte swizzle, at 4 KB (2 KB) steps.
template <int KMAX, int BV, bool SW, bool DLOG = false, int STAGES = 2, bool DUAL = false,
          bool ZSMEM = false, bool TMA = false>  // STAGES: of q/k/v tiles
struct rtk_chunk_smem {
  static constexpr int C = 64;
  static constexpr int KS = SW ? 64 : KMAX + 8;
  static constexpr int VS = SW ? 64 : BV + 8;
  static constexpr int Q = 0, K = Q + C * (SW ? KMAX : KS), V = K + C * (SW ? KMAX : KS);
  static constexpr int X = V + C * (SW ? BV : VS);  // DLOG, DUAL: the chunk's rows of x, laid out as v
  static constexpr int STAGE = X + ((DLOG && !ZSMEM) || DUAL ? C * (SW ? BV : VS) : 0);
  // two 16-bit copies of the state, KMAX x BV each: the state entering chunk c in copy c % 2;
  // KMAX 256 keeps one (its tiles fill the 163 KB of an A100), written after an extra barrier
  static constexpr int S = STAGES * STAGE, SCOPY = KMAX * (SW ? BV : VS), NCOPY = KMAX == 256 ? 1 : 2;
  // SW only: OBUF buffers of the chunk's 64 output rows on their way to global memory (rows of BV + 8,
  // DUAL: of the wider output + 8: conflict-free stmatrix, aligned bulk copies); one where three tile
  // stages leave no room for two, and for DUAL, whose two outputs a chunk take turns in it
  static constexpr int W = S + NCOPY * SCOPY;  // DLOG: the copies of W, as those of S
  static constexpr int OS = (DUAL && KMAX > BV ? KMAX : BV) + 8, XB = W + (DLOG ? (ZSMEM ? 1 : NCOPY) * SCOPY : 0);
  static constexpr int O = XB + (ZSMEM ? C * BV : 0);
  static constexpr int ALIGN = SW ? 1024 : 0;            // slack for aligning the base
  // + fp16 scaling: max|S| of the 4 state warps, 2 slots (DLOG: and max|W|), RED bytes; + rtk_cta_sync_or's
  // ring (2 words); + TMA: an mbarrier per tile stage (BARS bytes)
  static constexpr int RED = DLOG ? 64 : 32, BARS = TMA ? 8 * STAGES : 0, TAIL = RED + 8 + BARS + ALIGN;
  static constexpr int OBUF = !DUAL && (O + 2 * C * OS) * 2 + TAIL <= 227 * 1024 ? 2 : 1;
  static constexpr int ELEMS = O + (SW ? OBUF * C * OS : 0);
  static constexpr int BYTES = ELEMS * 2 + TAIL;
  static __device__ __forceinline__ int qk_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * KS + p * 8; }
  static __device__ __forceinline__ int v_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * VS + p * 8; }
  static __device__ __forceinline__ int s_off(int r, int p) { return SW ? rtk_swz_off(KMAX, r, p) : r * VS + p * 8; }
};
