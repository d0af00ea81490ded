// chunk/states.cu -- rtk_chunk_states.
//
// The first pass of the split-sequence strategy for 16-bit inputs, as a kernel of its own. Its
// launch splits the tokens before the last segment into slots of p.seg_len tokens (a whole
// segment, or a part of one: more CTAs where few segments would leave multiprocessors idle); CTA
// z forms local[z] = sum_s gamma^(NS-1-s) k_s^T v_s over its slot's NS tokens (slot 0 from the
// initial state, the others from zero), chunk by chunk as S = gamma^len S + sum_s
// gamma^(len-1-s) k_s^T v_s exactly as the state warps of rtk_chunk_fwd do (the same operands,
// weights and mma), into slot z + 1 of final_state; CTAs z = 0 also copy the initial state (zeros
// without one) to slot 0. The fused pass then starts each segment from these slots
// (RTK_MODE_FOLD): no scan kernel, and the last segment, whose state nobody needs before the
// fused pass, is not read twice. Same parameters as rtk_chunk_fwd (q and o are not read).
//
// Why not rtk_chunk_fwd with states_only: there half the warps idle, the registers and shared
// memory are sized for the fused pass, and a value tile narrower than Dv reads k once per tile.
// Here every warp computes and all threads load, the tile is as wide as the registers allow (BV
// 128 for KMAX <= 128), and the eight warps tile the KMAX x BV state 4 x 2: warp w owns the 16 MT
// rows (w % 4) * 16 MT .. and the BV / 2 columns (w / 4) * BV / 2 .., for every key of each chunk
// (large warp tiles: fewer shared-memory fragment loads per mma). STAGES chunks of k and v in
// flight (cp.async), one barrier per chunk.
//
// TMA (Hopper, sm_90a, aligned rows): one thread loads each chunk as tensor copies (64-row boxes
// of 64 columns through the k and v tensor maps, 128-byte swizzle) completing on the stage's
// mbarrier, so the copies stay in flight while every warp computes, where cp.async would take the
// computing threads' issue slots. The two warpgroups then update S with wgmma: A the weighted k^T
// fragments from registers, B v straight from its boxes (the layout wgmma reads), one group per
// chunk. Why: with mma.sync the pass issued an instruction in about half the cycles with two warps
// a scheduler and ran at a fifth of the tensor rate; one wgmma does 64 mma.sync's work. The
// 64 x 64 blocks of S go to the warpgroups by rows (KMAX / 64 even) or by value columns.
//
// DLOG (the split dq pass of a trainable decay, rtk_chunk_fwd's DLOG): each segment also carries
// W = dS/dlog(gamma), W = gamma^len (W + len S) + sum_s (len-1-s) gamma^(len-1-s) k_s^T v_s from
// 0, into the W slots that follow the S slots (W slot z + 1 at slot gridDim.z + 1 + z + 1); BV 64
// (S and W in registers). fp16 carries and stores W times rtk_dlog_norm (chunk/decay.cuh).
#include "../include/copy.cuh"
#include "../include/mma_sm80.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/wgmma_sm90.cuh"
#include "cta.cuh"
#include "decay.cuh"
#include "epilogue.cuh"
#include "loader.cuh"
#include "modes.cuh"

// Stage layout: k rows then v rows, padded by 16 bytes (cp.async), or for TMA unpadded boxes of
// 64 columns, each 64 rows x 128 bytes, behind 1024 bytes of slack to align them and the stages'
// mbarriers.
template <int KMAX, int BV, int STAGES, bool TMA = false>
struct rtk_chunk_states_smem {
  static constexpr int C = 64, KS = TMA ? KMAX : KMAX + 8, VS = TMA ? BV : BV + 8;
  static constexpr int K = 0, V = C * KS, STAGE = V + C * VS;
  static constexpr int BYTES = STAGES * STAGE * 2 + (TMA ? 1024 + 8 * STAGES : 0);
};

// The tensor maps of k and v for the TMA instances (zeros for the others): rank 4, element
// coordinates (column, token, head, batch) over the tensors as stored, boxes of 64 x 64.
struct rtk_kv_maps {
  rtk_tmap k, v;
};

template <int DT, int KMAX, int BV, bool VEC, int STAGES, bool DLOG = false, bool TMA = false>
__global__ void __launch_bounds__(256, 2)
rtk_chunk_states(RTK_FWD_POINTERS(rtk_u16), const __grid_constant__ rtk_chunk_shape p,
                 const __grid_constant__ rtk_kv_maps maps) {  // grid.z: slots - 1
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  const rtk_i64 seg_len = p.seg_len;  // p.mode: unused
  typedef rtk_chunk_states_smem<KMAX, BV, STAGES, TMA> L;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  // a warp's m-tiles (16 rows, MSTEP apart) and n-tiles (8 columns). mma.sync: the 4 x 2 warp
  // tiling. TMA (wgmma): warpgroup wg holds the 64-row blocks wg, wg + 2, .. whole (ROWS) or, with
  // one block, value columns wg * BV / 2 .., its warp w rows 16 w of each block
  constexpr bool ROWS = (KMAX / 64) % 2 == 0;
  constexpr int MT = TMA ? (ROWS ? KMAX / 128 : 1) : KMAX / 64;
  constexpr int NT = TMA ? (ROWS ? BV / 8 : BV / 16) : BV / 16;
  constexpr int MSTEP = TMA ? 128 : 16;
  static_assert(BV % 32 == 0 && KMAX % 64 == 0 && STAGES >= 2, "bad tile");
  static_assert(!TMA || (VEC && BV % 64 == 0 && (ROWS || BV % 128 == 0)),
                "tensor copies take aligned rows and 64-column boxes; the warpgroups need two blocks of S");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem_base = smem_raw;
  if constexpr (TMA) smem_base += (1024 - (rtk_smem_addr(smem_raw) & 1023)) & 1023;
  rtk_u16* sm = reinterpret_cast<rtk_u16*>(smem_base);
  const rtk_u32 bars = rtk_smem_addr(smem_base) + STAGES * L::STAGE * 2;  // TMA: a barrier per stage

  RTK_CHUNK_CTA(rtk_u16, 4);
  (void)out_warp; (void)kt_used; (void)ovec_full; (void)seq_bad; (void)out_scale;  // never packed
  const int wg = warp >> 2;  // the warp's rows and columns
  const int sr0 = TMA ? (ROWS ? wg * 64 : 0) + (warp & 3) * 16 : (warp & 3) * MT * 16;
  const int c0 = TMA && ROWS ? 0 : wg * (BV / 2);

  typedef rtk_chunk_loader<rtk_u16, KMAX, BV, 256> LD;
  const LD ld(tid, Dk, dv_here, kb, kb, vb, k_sn, k_sn, v_sn);
  // TMA: a reversed pass (negative token strides) reads kernel row n from stored row N - 1 - n, so
  // the box of a chunk starts at the stored row of its last token and its rows run backwards
  const bool rev = k_sn < 0;
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if constexpr (TMA) {  // one thread
      const int first = (int)n_begin + n0, y = rev ? N - first - C : first;
      const rtk_u32 bar = bars + 8 * stage;
      rtk_mbar_expect(bar, (KMAX + BV) * C * 2);
      rtk_tensor_load_boxes<KMAX / 64>(rtk_smem_addr(sK), &maps.k, 0, y, h, b, bar);
      rtk_tensor_load_boxes<BV / 64>(rtk_smem_addr(sV), &maps.v, v0, y, h, b, bar);
    } else if (VEC) {
      ld.template copy<C, KS, VS>(0u, rtk_smem_addr(sK + ld.qrow * KS + ld.qcol),
                                  rtk_smem_addr(sV + ld.vrow * VS + ld.vcol), n0, NS, false);
    } else {
      for (int e = tid; e < C * KMAX; e += 256) {
        const int r = e / KMAX, col = e - r * KMAX;
        const rtk_i64 n = (rtk_i64)n0 + r;
        sK[r * KS + col] = (n < NS && col < Dk) ? kb[n * k_sn + col] : (rtk_u16)0;
      }
      for (int e = tid; e < C * BV; e += 256) {
        const int r = e / BV, col = e - r * BV;
        const rtk_i64 n = (rtk_i64)n0 + r;
        sV[r * VS + col] = (n < NS && col < dv_here) ? vb[n * v_sn + col] : (rtk_u16)0;
      }
    }
  };

  // slots of final_state (each [B*H, Dk, Dv]): 0 the initial state (or zeros), 1 + z the state
  // CTA z's tokens end with: for z = 0 from the initial state, else from zero; rtk_chunk_fwd in
  // RTK_MODE_FOLD combines them (rtk_chunk_state::fold)
  const rtk_i64 slot = (rtk_i64)gridDim.x * Dk * Dv;
  const rtk_chunk_state<MT, NT, MSTEP> sf = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, state_slot + slot};
  float s_acc[MT][NT][4], w_acc[DLOG ? MT : 1][NT][4];
  rtk_zero(reinterpret_cast<float (&)[MT * NT][4]>(s_acc));
  rtk_zero(reinterpret_cast<float (&)[(DLOG ? MT : 1) * NT][4]>(w_acc));
  if (blockIdx.z == 0) {
    const rtk_chunk_state<MT, NT, MSTEP> s0 = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, 0};
    s0.load(s_acc, init_state);
    s0.store(s_acc, final_state);
  }
  const int nchunks = (NS + C - 1) / C;
  if constexpr (TMA) {
    if (tid == 0) {
      for (int i = 0; i < STAGES; ++i) rtk_mbar_init(bars + 8 * i);
      rtk_mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0)
      for (int c = 0; c < STAGES - 1 && c < nchunks; ++c) load_chunk(c, c);
  } else {
    #pragma unroll
    for (int c = 0; c < STAGES - 1; ++c) {
      if (c < nchunks) load_chunk(c, c);
      rtk_cp_async_commit();
    }
  }
  // the key weights of a whole chunk (every chunk of a slot: slots are whole chunks), computed once
  // instead of per chunk: the pass issues instructions about half the cycles with two warps per
  // scheduler, so per-chunk work that repeats is time
  const float dn = DLOG ? rtk_dlog_norm<DT>(lg2) : 1.f;  // fp16 carries W dn (decay.cuh)
  const rtk_key_weights<DT, DLOG> kw_whole[4] = {{lg2, C, 0, t4, TMA && rev, dn}, {lg2, C, 1, t4, TMA && rev, dn},
                                                 {lg2, C, 2, t4, TMA && rev, dn}, {lg2, C, 3, t4, TMA && rev, dn}};
  #pragma unroll 1
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    if constexpr (TMA) {
      __syncthreads();  // everyone is done with the stage loaded next
      if (tid == 0 && chunk + STAGES - 1 < nchunks) load_chunk(chunk + STAGES - 1, (chunk + STAGES - 1) % STAGES);
      rtk_mbar_wait(bars + 8 * (chunk % STAGES), (chunk / STAGES) & 1);
    } else {
      rtk_cp_async_wait<STAGES - 2>();
      __syncthreads();  // chunk visible to all; everyone is done with the stage loaded next
      if (chunk + STAGES - 1 < nchunks) load_chunk(chunk + STAGES - 1, (chunk + STAGES - 1) % STAGES);
      rtk_cp_async_commit();
    }
    const int stage = chunk % STAGES;
    const int len = min(C, NS - chunk * C);
    const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
    const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
    const float carry = rtk_exp2(lg2 * (float)len);
    if constexpr (DLOG) rtk_frag_dlog_step<DT == RTK_F16>(w_acc, s_acc, carry, len, dn);  // before S moves on
    rtk_frag_scale(s_acc, carry);
    if constexpr (TMA) {
      // every k-step's weighted k^T fragments, then S (+ W) += A V as one wgmma group. A k-step's
      // rows in a box run in the order the copy wrote them (a reversed pass: backwards, and its
      // weights with them), and k-step kk of the chunk is box rows 16 j .., j = 3 - kk reversed:
      // the k-steps are summed in the chunk's order either way (the bits of the pass on flipped copies)
      const unsigned long long dv = rtk_wg_desc(sV_addr, RTK_MN_LBO(C * 128), RTK_MN_SBO(C * 128));
      rtk_u32 a[4][MT][4], a2[4][DLOG ? MT : 1][4];  // a2: DLOG only
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int j = rev ? 3 - kk : kk;
        const rtk_key_weights<DT, DLOG> kw = len != C ? rtk_key_weights<DT, DLOG>(lg2, len, j, t4, rev, dn)
                                             : rev ? kw_whole[3 - kk] : kw_whole[kk];  // no indexed local array
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int col = sr0 + mt * MSTEP + ((lane >> 3) & 1) * 8;
          rtk_ldsm_x4_trans(a[kk][mt], sK_addr + (col >> 6) * C * 128 +
                                           rtk_swizzle128(j * 16 + (lane & 7) + (lane >> 4) * 8, (col & 63) >> 3));
          kw.apply(a[kk][mt], a2[kk][DLOG ? mt : 0]);
        }
      }
      rtk_wg_fence();
      // every k-step, with no branch between the wgmmas (one would make ptxas fence each): slots
      // are whole chunks (plan.split, fold_parts), so each k-step holds keys of the slot
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int nb = 0; nb < NT / 8; ++nb) {
            const rtk_u32 off = (c0 / 64 + nb) * (C * 128) + (rev ? 3 - kk : kk) * 2048;
            const unsigned long long db = rtk_desc_at(dv, off >> 4);
            rtk_wgmma_rs<DT, 1>(reinterpret_cast<float (&)[32]>(s_acc[mt][8 * nb]), a[kk][mt], db, 1);
            if constexpr (DLOG)
              rtk_wgmma_rs<DT, 1>(reinterpret_cast<float (&)[32]>(w_acc[mt][8 * nb]), a2[kk][mt], db, 1);
          }
      rtk_wg_commit();
      rtk_wg_wait<0>();  // before the next chunk's barrier hands this stage to the copies
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nb = 0; nb < NT / 8; ++nb) {
          rtk_wg_pin(reinterpret_cast<float (&)[32]>(s_acc[mt][8 * nb]));
          if constexpr (DLOG) rtk_wg_pin(reinterpret_cast<float (&)[32]>(w_acc[mt][8 * nb]));
        }
    } else {
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk * 16 < len) {
          const rtk_key_weights<DT, DLOG> kw = len == C ? kw_whole[kk] : rtk_key_weights<DT, DLOG>(lg2, len, kk, t4, false, dn);
          // every fragment of the k-step first, then the mma: the ldmatrix and mma asm statements
          // are volatile (kept in order), so interleaving them would expose each load's latency
          rtk_u32 a[MT][4], a2[MT][4], bb[NT / 2][4];  // a2: DLOG only
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            rtk_ldsm_x4_trans(a[mt], sK_addr + 2 * ((kk * 16 + (lane & 7) + (lane >> 4) * 8) * KS + sr0 + mt * 16 +
                                                    ((lane >> 3) & 1) * 8));
          #pragma unroll
          for (int np = 0; np < NT / 2; ++np)
            rtk_ldsm_x4_trans(bb[np], sV_addr + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + c0 +
                                                     np * 16 + (lane >> 4) * 8));
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) kw.apply(a[mt], a2[mt]);
          #pragma unroll
          for (int np = 0; np < NT / 2; ++np)
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              rtk_mma16816<DT>(s_acc[mt][2 * np], a[mt], bb[np][0], bb[np][1]);
              rtk_mma16816<DT>(s_acc[mt][2 * np + 1], a[mt], bb[np][2], bb[np][3]);
              if constexpr (DLOG) {
                rtk_mma16816<DT>(w_acc[mt][2 * np], a2[mt], bb[np][0], bb[np][1]);
                rtk_mma16816<DT>(w_acc[mt][2 * np + 1], a2[mt], bb[np][2], bb[np][3]);
              }
            }
        }
      }
    }
  }
  sf.store(s_acc, final_state);
  if constexpr (DLOG) {  // W slot z + 1, after the gridDim.z + 1 S slots
    auto wf = sf;
    wf.state_slot += (rtk_i64)(gridDim.z + 1) * slot;
    wf.store(w_acc, final_state);
  }
}

