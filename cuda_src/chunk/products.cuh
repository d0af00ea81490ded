// chunk/products.cuh -- a chunk's scores times a tile (mma.sync, cleaned of Inf/NaN, or wgmma) and
// the landing of the wgmma score and state products; rtk_chunk_fwd's outputs share them.
#pragma once
#include "../include/copy.cuh"
#include "../include/mma_sm80.cuh"
#include "../include/types.cuh"
#include "../include/wgmma_sm90.cuh"

// One k-step (keys 16 kk ..) of acc += P T by mma.sync: P is this warp's 16 rows of the chunk's
// fp32 scores, T a 64-row tile at shared address t_addr whose 16-byte piece pc of row r sits at
// element off(r, pc). With `clean` the Inf/NaN entries of T are zeroed in the operand (a dense
// product would multiply them by the zeros above P's diagonal); returns whether any were.
template <int DT, int NTX, class Off>
__device__ __forceinline__ bool rtk_chunk_pv_step(float (&acc)[NTX][4], const float (&p)[8][4], int kk, rtk_u32 t_addr,
                                                  int lane, bool clean, Off off) {
  constexpr rtk_u32 EXP = rtk_expmask<DT>::v;
  rtk_u32 a[4];
  a[0] = rtk_pack2<DT>(p[2 * kk][0], p[2 * kk][1]);
  a[1] = rtk_pack2<DT>(p[2 * kk][2], p[2 * kk][3]);
  a[2] = rtk_pack2<DT>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
  a[3] = rtk_pack2<DT>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  bool saw = false;
  #pragma unroll
  for (int np = 0; np < NTX / 2; ++np) {
    rtk_u32 bb[4];
    rtk_ldsm_x4_trans(bb, t_addr + 2 * off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 2 + (lane >> 4)));
    if (clean) {  // rare: zero Inf/NaN in the operand, remember that this thread saw one
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const rtk_u32 lo_bad = ((bb[i] & EXP) == EXP) ? 0x0000FFFFu : 0u;
        const rtk_u32 hi_bad = (((bb[i] >> 16) & EXP) == EXP) ? 0xFFFF0000u : 0u;
        saw |= (lo_bad | hi_bad) != 0u;
        bb[i] &= ~(lo_bad | hi_bad);
      }
    }
    rtk_mma16816<DT>(acc[2 * np], a, bb[0], bb[1]);
    rtk_mma16816<DT>(acc[2 * np + 1], a, bb[2], bb[3]);
  }
  return saw;
}

// acc (NTX = 8 per 64 columns) += P T on wgmma: P from registers (this warp's 16 rows of the
// chunk's fp32 scores, rounded to 16 bits), T a 64-row tile stored MN-major in 128-byte-swizzled
// regions of 64 columns at shared address t_addr.
template <int DT, int NTX>
__device__ __forceinline__ void rtk_chunk_pv_wgmma(float (&acc)[NTX][4], const float (&p)[8][4], rtk_u32 t_addr) {
  constexpr int REGION = 64 * 128;  // bytes of one 64-column region of a 64-row tile
  rtk_u32 a[4][4];
  #pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    a[kk][0] = rtk_pack2<DT>(p[2 * kk][0], p[2 * kk][1]);
    a[kk][1] = rtk_pack2<DT>(p[2 * kk][2], p[2 * kk][3]);
    a[kk][2] = rtk_pack2<DT>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[kk][3] = rtk_pack2<DT>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
  const unsigned long long dt = rtk_wg_desc(t_addr, RTK_MN_LBO(REGION), RTK_MN_SBO(REGION));
  rtk_wg_fence();
  #pragma unroll
  for (int nb = 0; nb < NTX / 8; ++nb) {
    float (&oa)[32] = reinterpret_cast<float (&)[32]>(acc[8 * nb]);
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) rtk_wgmma_rs<DT, 1>(oa, a[kk], rtk_desc_at(dt, (nb * REGION + kk * 2048) >> 4), 1);
  }
  rtk_wg_commit();
  rtk_wg_wait<0>();
  #pragma unroll
  for (int nb = 0; nb < NTX / 8; ++nb) rtk_wg_pin(reinterpret_cast<float (&)[32]>(acc[8 * nb]));
}

// wgmma, a chunk's scores p in flight as a group followed by LATER more (the first of them the rows
// against the state copy, acc): pin p as it lands and scale it (scale_scores), then wait for all,
// pin acc and scale its rows, the low and high row of each fragment by lo and hi.
template <int LATER, int NX, class Scale>
__device__ __forceinline__ void rtk_chunk_land(float (&p)[8][4], float (&acc)[NX][4], float lo, float hi,
                                               Scale scale_scores) {
  rtk_wg_wait<LATER>();
  rtk_wg_pin(reinterpret_cast<float (&)[32]>(p));
  scale_scores(p);
  rtk_wg_wait<0>();
  #pragma unroll
  for (int nb = 0; nb < NX / 8; ++nb) rtk_wg_pin(reinterpret_cast<float (&)[32]>(acc[8 * nb]));
  #pragma unroll
  for (int nt = 0; nt < NX; ++nt) {
    acc[nt][0] *= lo; acc[nt][1] *= lo;
    acc[nt][2] *= hi; acc[nt][3] *= hi;
  }
}
