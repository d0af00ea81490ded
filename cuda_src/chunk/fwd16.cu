// chunk/fwd16.cu -- rtk_chunk_fwd: the chunked form for fp16/bf16, fused, on tensor cores (mma.sync; WG: wgmma)
//
// One CTA of 8 warps per (batch*head, tile of BV value columns) walks the sequence in chunks of
// C = 64 tokens. With S the KMAX x BV state slice entering a chunk of len <= C tokens (index t):
//   o_t = scale * ( gamma^(t+1) q_t S  +  sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s )
//   S   = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s
// Output warps 0..3 each own 16 rows t of the chunk; state warps 4..7 own KMAX/4 rows of S each,
// in fp32 registers, and publish a 16-bit copy of S in shared memory as the operand of q_t S. The
// groups meet at one barrier per chunk: tiles and state copy are double-buffered, so the state
// warps load chunk c + 1 and write the copy of S entering it while the output warps compute c.
//
// Only non-negative powers of gamma are formed (no overflow for any gamma in (0, 1], any N): an
// output warp whose rows start at r0 factors gamma^(t-s) = gamma^(t-r0) * gamma^(r0-s) for s < r0,
// and its 16 x 16 diagonal block uses gamma^(t-s) with the causal mask as a select. fp16's state
// copy is scaled by a power of two chosen from max|S|. NaN in, NaN out: rtk_chunk_mark_nonfinite.
//
// DUAL (the backward's dk and dv passes fused: q = k of the forward, k = its q, v = dL/do, x = its v,
// read with v's strides; wgmma, one value tile holding all of Dv): after the chunk's rows of o (dv)
// the output warps compute a second output o2 (dk, KMAX wide, written with k's strides) from the same
// tiles and state copy, the operator with queries x, keys v and values k, whose state is S^T:
//   o2_t = scale * ( gamma^(t+1) x_t S^T  +  sum_{s<=t} gamma^(t-s) (x_t . v_s) k_s )
// so one walk reads q, k, v and dL/do once for both gradients. A chunk whose k holds Inf/NaN takes
// the cleaned P k product, as v's does for o.
//
// DLOG (the backward's dq pass of a trainable decay: q = dL/do, k = v, v = k of the forward, x = its
// q, read with v's strides; wgmma, BV 64): the pass also sums its share of dL/dlog(gamma) with a
// second state: 1, W = dS/dlog(gamma); 2, Z of the split, on chunks that end at the last token; 3,
// Z only as its 16-bit copy (bf16, BV 128). With DUAL, 2 adds the split's dk/dv-pass terms.
// chunk/dlog_rows.cuh has the math, the per-CTA sums and the segments.

#include "../include/copy.cuh"
#include "../include/mma_sm80.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/wgmma_sm90.cuh"
#include "cta.cuh"
#include "decay.cuh"
#include "dlog_rows.cuh"
#include "epilogue.cuh"
#include "layout16.cuh"
#include "loader.cuh"
#include "modes.cuh"
#include "products.cuh"

// MINB: CTAs per SM the registers are sized for (2: 128 a thread; 1: no spills, one CTA per SM).
// WG (sm_90a, KMAX <= 128, BV a multiple of 64): the output warps form a warpgroup on wgmma (q k^T,
// q S from shared memory, P v with P from registers); else each output warp uses mma.sync.
// STAGES: chunks of tiles in shared memory: 2, or (wgmma, no DLOG) 3, twice the bytes in flight.
// DLOG, DUAL: see the header (aligned rows, wgmma; DLOG not RTK_MODE_STATES; DUAL two stages, Dv <= BV).
// TMA (wgmma, aligned rows, a forward walk, unpacked, no DUAL): one state thread loads each chunk by
// tensor copies on the stage's mbarrier, each output warp sends its rows by tensor stores. Why: on an
// H200 these took a quarter of each group's issue slots as cp.async and row copies. Zeros elsewhere.
struct rtk_fwd_maps {
  rtk_tmap q, k, v, o, x;  // rank 4 over the tensors as stored: (column, token, head, batch); x: DLOG 1, 2
};

template <int DT, int KMAX, int BV, bool VEC, int MINB, bool WG, int DLOG = 0, int STAGES = 2, bool DUAL = false,
          bool TMA = false>
__global__ void __launch_bounds__(256, MINB)
rtk_chunk_fwd(RTK_FWD_POINTERS(rtk_u16), const __grid_constant__ rtk_chunk_shape p,
              const __grid_constant__ rtk_fwd_maps maps) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  const rtk_i64 seg_len = p.seg_len;
  const int mode = (int)p.mode;
  const bool states_only = mode == RTK_MODE_STATES;
  // DLOG 1 (W) or 2 (Z): the dq pass carries a second state (DQ_DLOG; with DUAL, 2: the split's terms).
  // ZWALK: chunks that end at the last token. DLOG 3 (ZSMEM): Z only as its 16-bit copy, stepped by
  // the state warps, so that the value tile can be 128 wide (ZREG: W or Z in registers)
  constexpr bool DQ_DLOG = DLOG != 0 && !DUAL, WFORM = DLOG == 1, ZWALK = (DLOG == 2 || DLOG == 3) && !DUAL;
  constexpr bool DUAL_DLOG = DUAL && DLOG == 2, ZSMEM = DLOG == 3 && !DUAL, ZREG = DQ_DLOG && !ZSMEM;
  typedef rtk_chunk_smem<KMAX, BV, WG, DQ_DLOG, STAGES, DUAL, ZSMEM, TMA> L;
  // A second CTA barrier a chunk before the state warps write the next copy: with one copy (KMAX 256),
  // and for fp16 on mma.sync, whose copy is scaled by the 4 state warps' common maximum (racecheck saw
  // hazards with their own barrier). The wgmma kernel's fp16 state warps meet alone (STATE_BAR).
  constexpr bool SERIAL = L::NCOPY == 1 || (DT == RTK_F16 && !WG);
  constexpr bool STATE_BAR = DT == RTK_F16 && !SERIAL;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  constexpr int NT = BV / 8;          // n-tiles of the value columns
  constexpr int MT = KMAX / 64;       // m-tiles of state rows per state warp
  constexpr rtk_u32 EXP = rtk_expmask<DT>::v;
  static_assert(BV % 16 == 0 && KMAX % 64 == 0, "bad tile");
  static_assert(!WG || (KMAX <= 128 && BV % 64 == 0), "bad wgmma tile");
  static_assert(!DQ_DLOG || (WG && VEC && (BV == 64 || (ZSMEM && BV == 128))), "bad dlog tile");
  static_assert(!ZSMEM || DT == RTK_BF16, "the Z copy is not scaled: bf16 only");
  static_assert(STAGES == 2 || (STAGES == 3 && WG && VEC && !DLOG), "bad stages");
  static_assert(!DUAL || (WG && VEC && !WFORM && STAGES == 2), "bad dual tile");
  static_assert(!TMA || (WG && VEC && !DUAL), "bad tma instance");
  static_assert(L::BYTES <= 227 * 1024, "shared memory");

  extern __shared__ __align__(16) unsigned char smem_base[];
  constexpr rtk_u32 AL = L::ALIGN > 0 ? L::ALIGN : 1;
  unsigned char* smem_raw = smem_base + ((AL - (rtk_smem_addr(smem_base) & (AL - 1))) & (AL - 1));
  rtk_u16* sm = reinterpret_cast<rtk_u16*>(smem_raw);
  // fp16: each state warp publishes max|S| of its rows (-1: not finite) for the copy entering chunk c
  // in slot c % 2, read by the state warps after their barrier and the output warps after the CTA
  // barrier before chunk c; both derive 2^e, max|S| * 2^e <= 2^14. DLOG: W's at s_red[8 ..].
  float* s_red = reinterpret_cast<float*>(smem_raw + L::ELEMS * 2);
  rtk_u32* or_ring = reinterpret_cast<rtk_u32*>(smem_raw + L::ELEMS * 2 + L::RED);  // rtk_cta_sync_or
  const rtk_u32 bars = rtk_smem_addr(smem_raw) + L::ELEMS * 2 + L::RED + 8;  // TMA: stage s's at bars + 8 s
  auto copy_exponent = [&](int slot, int base = 0) -> int {
    float m = 0.f;
    bool fin = true;
    for (int i = 0; i < 4; ++i) {
      const float x = s_red[base + slot * 4 + i];
      fin = fin && x >= 0.f;
      m = fmaxf(m, x);
    }
    return (fin && m > 0.f) ? min(60, max(-60, 14 - (int)ceilf(log2f(m)))) : 0;
  };

  RTK_CHUNK_CTA(rtk_u16, 4);  // k-steps of 16 columns

  typedef rtk_chunk_loader<rtk_u16, KMAX, BV> LD;
  const LD ld(tid - 128, Dk, dv_here, qb, kb, vb, q_sn, k_sn, v_sn);
  constexpr int VROWS = LD::VROWS;
  const int st = ld.st, vcol = ld.vcol, vrow = ld.vrow;
  const rtk_u16* xb = DQ_DLOG || DUAL ? reinterpret_cast<const rtk_u16*>(p.x) + rtk_offset(vs, b, h, n_begin) + v0 : nullptr;
  const rtk_u16* x_first = DQ_DLOG || DUAL ? ld.tile_first(xb) : nullptr;
  const rtk_chunk_grid<C, ZWALK> grid(NS);
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sQ = sm + stage * L::STAGE + L::Q;
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = grid.start(chunk), lim = ZWALK ? n0 + grid.len(chunk, n0) : NS;  // rows from lim load as 0
    // TMA: tensor copies (zeros past N); a Z walk's short chunk 0 by cp.async (a box brings chunk 1's rows)
    if (TMA && !(ZWALK && chunk == 0 && grid.first < C)) {
      if (st == 0)
        rtk_chunk_tma_load<KMAX, BV, DQ_DLOG && !ZSMEM>(
            rtk_smem_addr(sQ), rtk_smem_addr(sK), rtk_smem_addr(sV), rtk_smem_addr(sm + stage * L::STAGE + L::X), &maps.q,
            &maps.k, &maps.v, &maps.x, !states_only, (int)n_begin + n0, v0, h, b, bars + 8 * stage);
      if (ZSMEM) rtk_dlog_x_prefetch(xb, v_sn, n0, lim, st);
    } else if (VEC) {
      if (TMA && st == 0) rtk_mbar_expect(bars + 8 * stage, 0u);  // (the stage's barrier passes, no bytes)
      ld.template copy<C, KS, VS>(rtk_smem_addr(sQ + L::qk_off(ld.qrow, ld.qcol >> 3)),
                                  rtk_smem_addr(sK + L::qk_off(ld.qrow, ld.qcol >> 3)),
                                  rtk_smem_addr(sV + L::v_off(vrow, vcol >> 3)), n0, lim, !states_only);
      if ((DQ_DLOG && !ZSMEM) || DUAL)
        ld.template copy_tile<C, VS>(rtk_smem_addr(sm + stage * L::STAGE + L::X + L::v_off(vrow, vcol >> 3)), x_first,
                                     xb, n0, lim);
      else if (ZSMEM) rtk_dlog_x_prefetch(xb, v_sn, n0, lim, st);
    } else {
      for (int e = st; e < C * KMAX; e += 128) {
        const int r = e / KMAX, col = e - r * KMAX;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const bool ok = n < lim && col < Dk;
        const int at = L::qk_off(r, col >> 3) + (col & 7);
        if (!states_only) sQ[at] = ok ? qb[n * q_sn + col] : (rtk_u16)0;
        sK[at] = ok ? kb[n * k_sn + col] : (rtk_u16)0;
      }
      for (int e = st; e < C * BV; e += 128) {
        const int r = e / BV, col = e - r * BV;
        const rtk_i64 n = (rtk_i64)n0 + r;
        sV[L::v_off(r, col >> 3) + (col & 7)] = (n < lim && col < dv_here) ? vb[n * v_sn + col] : (rtk_u16)0;
      }
    }
  };

  const int nchunks = (NS + C - 1) / C;

  // The end of a chunk period: the state warps wait for chunk `next` and look for Inf/NaN in its v (DUAL:
  // and k), then the CTA barrier ORs the answers. Returns whether chunk `next`'s v (or k) holds one.
  auto end_period = [&](int next) -> bool {
    bool my_bad = false;
    if (!out_warp) {
      // chunk `next` is in; the one after it may still be loading
      if (!TMA) rtk_cp_async_wait<STAGES - 2>();
      else if (next < nchunks) rtk_mbar_wait(bars + 8 * (next % STAGES), (rtk_u32)(next / STAGES) & 1u);
      if (TMA && ZWALK && next == 0 && grid.first < C) rtk_cp_async_wait<0>();  // its cp.async chunk 0
      if (!VEC) rtk_named_sync(1, 128);  // the chunk was stored by other state warps
      if (next < nchunks) {  // the v pieces of this thread's loader set (DUAL: and k's): any Inf/NaN?
        const rtk_u16* tiles = sm + (next % STAGES) * L::STAGE;
        my_bad = rtk_pieces_nonfinite<DT, C / VROWS, VROWS>(tiles + L::V, vrow, vcol >> 3, L::v_off);
        if (DUAL) my_bad |= rtk_pieces_nonfinite<DT, C / LD::QROWS, LD::QROWS>(tiles + L::K, ld.qrow, ld.qcol >> 3, L::qk_off);
      }
      // the tiles (cp.async) and the state copy (st.shared) are read by wgmma next: async proxy
      if (WG) rtk_fence_proxy_async();
    }
    return rtk_cta_sync_or(my_bad, or_ring, (rtk_u32)next);
  };

  if (tid == 0) {
    or_ring[0] = or_ring[1] = 0u;
    for (int i = 0; i < (TMA ? STAGES : 0); ++i) rtk_mbar_init(bars + 8 * i);
    if (TMA) rtk_mbar_init_fence();
  }
  rtk_cta_sync();  // the ring zeroed (and the barriers set up) before either group's first end_period

  // The two groups run separate loops (neither holds the other's registers) and meet once a chunk
  // (end_period). In period c the output warps use stage c % STAGES and state copy c % 2; the state warps
  // load chunk c + STAGES - 1 into chunk c - 1's stage, update S and write the copy entering c + 1.
  if (out_warp) {
    // ---- output warps: per-thread decay factors, fixed for the whole sequence -----------------
    const int w = warp, r0 = 16 * warp;  // this warp's rows r0 .. r0+15 of each chunk
    const rtk_chunk_decay dec(lg2, out_scale, g, t4, r0);
    // the wgmma kernel sends whole, 16-byte aligned output rows with bulk copies
    const bool orows = WG && ovec_full && o_sn % 8 == 0 && (reinterpret_cast<size_t>(ob + v0) & 15) == 0, osend = TMA || orows;
    // DUAL: o2's rows, of k's strides, KMAX (= Dk, else paired stores column by column) wide
    rtk_u16* ob2 = DUAL ? reinterpret_cast<rtk_u16*>(p.out2) + rtk_offset(ks, b, h, n_begin) : nullptr;
    const bool ovec2 = DUAL && Dk == KMAX && (k_sn & 1) == 0 && (reinterpret_cast<size_t>(ob2) & 3) == 0;
    const bool osend2 = ovec2 && k_sn % 8 == 0 && (reinterpret_cast<size_t>(ob2) & 15) == 0;
    // scores P: gamma^(t-s) * scale for s <= t, 0 above the diagonal (code per warp: no branches)
    auto scale_scores = [&](float (&pp)[8][4]) { dec.scale_scores_of(w, pp); };
    float s_inv = 1.f;  // the state copy holds S * 2^e (fp16); s_inv = 2^-e
    float dlog_sum = 0.f;  // DLOG: this thread's share of the CTA's sum
    const float w_unnorm = WFORM ? 1.f / rtk_dlog_norm<DT>(lg2) : 1.f;  // fp16's W copy holds W dn 2^e'
    // ZSMEM: Z_0 = 0 over the Z step's pieces; G's block, for <G, Z_end> in the last step
    [[maybe_unused]] const float* const gz = ZSMEM && p.dlog_g != 0 ? reinterpret_cast<const float*>(p.dlog_g) + (rtk_i64)bh * Dk * Dv : nullptr;
    if constexpr (ZSMEM) rtk_zcopy_zero<KMAX, BV>(sm + L::W, tid);
    if (SERIAL) rtk_cta_sync();  // (the state warps' next_copy)
    bool v_bad = end_period(0);   // chunk 0 and the first state copy are in place
    auto out_end = [&](int chunk) -> bool {
      if (SERIAL) rtk_cta_sync();  // done with the state copy (the state warps' next_copy)
      return end_period(chunk + 1);
    };

    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk % STAGES, slot = chunk & 1;  // tiles; state copy
      if (DT == RTK_F16) s_inv = exp2f((float)-copy_exponent(slot));
      // wgmma: the factors of the rows against the state copy, gamma^(t+1) * scale (and fp16's 2^-e)
      const float f_lo = dec.inter0 * s_inv * dec.row_lo, f_hi = dec.inter0 * s_inv * dec.row_hi;
      // DLOG: the same for the rows against the W copy (fp16: its own 2^-e', and 1 / dn)
      const float w_inv = DT == RTK_F16 && DQ_DLOG ? exp2f((float)-copy_exponent(slot, 8)) * w_unnorm : s_inv;
      const float fw_lo = dec.inter0 * w_inv * dec.row_lo, fw_hi = dec.inter0 * w_inv * dec.row_hi;
      const rtk_u32 sS_addr = rtk_smem_addr(sm + L::S + (L::NCOPY == 2 ? slot : 0) * L::SCOPY);
      const int n0 = grid.start(chunk), len = grid.len(chunk, n0);
      const rtk_u32 sQ_addr = rtk_smem_addr(sm + stage * L::STAGE + L::Q);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
      // TMA: the stage's copies are seen complete here too (the state warps waited before the barrier)
      if constexpr (TMA) rtk_mbar_wait(bars + 8 * stage, (rtk_u32)(chunk / STAGES) & 1u);
      if (states_only) {  // first pass of the split-sequence strategy: no outputs
        v_bad = out_end(chunk);
        continue;
      }
      float o_acc[NT][4];
      float p[8][4];  // scores of the 16 rows against key tiles 0 .. 2w+1
      float pk[DUAL_DLOG ? 8 : 1][4];  // DUAL_DLOG: P (o's scaled scores) kept for the split's intra term
      bool saw_bad = false;
      auto voff = [](int r, int pc) { return L::v_off(r, pc); };  // a v-like tile's piece pc of row r
      // o_acc += P[:, 16 kk ..] V[16 kk .., :] by mma.sync (kk a compile-time value)
      auto pv = [&](int kk) { saw_bad |= rtk_chunk_pv_step<DT>(o_acc, p, kk, sV_addr, lane, v_bad, voff); };
      // wgmma descriptors: a base per operand plus the byte offset of each k step / 16-row group (>> 4:
      // the address field counts 16-byte units); kmaj: k-step ks of a 64-row tile stored K-major
      auto kmaj = [](int ks) { return rtk_kmajor_step(C, ks); };
      if constexpr (WG) {
        // q k^T for all 64 x 64 pairs and q S, both from shared memory, as two wgmma groups
        float (&pa)[32] = reinterpret_cast<float (&)[32]>(p);
        const unsigned long long dq = rtk_wg_desc(sQ_addr, 16, 1024), dk = rtk_wg_desc(sK_addr, 16, 1024);
        auto scores = [&]() {
          #pragma unroll
          for (int ks = 0; ks < KMAX / 16; ++ks) rtk_wgmma_ss<DT, 0>(pa, rtk_desc_at(dq, kmaj(ks)), rtk_desc_at(dk, kmaj(ks)), ks);
        };
        auto times_copy = [&](float (&acc)[NT][4], rtk_u32 copy_addr) {  // acc = q (copy), one group
          const unsigned long long ds = rtk_wg_desc(copy_addr, RTK_MN_LBO(KMAX * 128), RTK_MN_SBO(KMAX * 128));
          #pragma unroll
          for (int nb = 0; nb < BV / 64; ++nb)
            #pragma unroll
            for (int ks = 0; ks < KMAX / 16; ++ks)
              rtk_wgmma_ss<DT, 1>(reinterpret_cast<float (&)[32]>(acc[8 * nb]), rtk_desc_at(dq, kmaj(ks)),
                                  rtk_desc_at(ds, (nb * (KMAX * 128) + ks * 2048) >> 4), ks);
          rtk_wg_commit();
        };
        rtk_wg_fence();
        if constexpr (DQ_DLOG) {  // q W, then q k^T (W: and x v^T), then q S: W's term is summed (registers freed) first
          const rtk_u16* sX = sm + (ZSMEM ? L::XB : stage * L::STAGE + L::X);  // ZSMEM: one x tile, loaded here
          if constexpr (ZSMEM) rtk_dlog_x_copy<C, BV, VS>(rtk_smem_addr(sX), xb, v_sn, n0, n0 + len, dv_here, tid, voff);
          const unsigned long long dx = rtk_wg_desc(rtk_smem_addr(sX), 16, 1024), dvk = rtk_wg_desc(sV_addr, 16, 1024);
          float xv[32];  // x v^T (W only: Z's intra-chunk term is the dk/dv pass's)
          {
            float wacc[NT][4];  // W or Z
            times_copy(wacc, rtk_smem_addr(sm + L::W + (ZSMEM ? 0 : slot) * L::SCOPY));
            scores();
            #pragma unroll
            for (int ks = 0; ks < (WFORM ? BV / 16 : 0); ++ks) rtk_wgmma_ss<DT, 0>(xv, rtk_desc_at(dx, kmaj(ks)), rtk_desc_at(dvk, kmaj(ks)), ks);
            rtk_wg_commit();
            if constexpr (ZSMEM) rtk_dlog_x_ready();
            rtk_wg_wait<1>();
            if constexpr (ZSMEM) rtk_named_arrive(3, 256);  // q Z has read the Z copy: the state warps may step it
            rtk_wg_pin(reinterpret_cast<float (&)[NT * 4]>(wacc));
            dlog_sum += rtk_dlog_rows<DT>(wacc, sX, r0, g, t4, fw_lo, fw_hi, voff);  // x_t . gamma^(t+1) scale q_t W
          }
          rtk_wg_fence();  // o_acc may take wacc's registers
          times_copy(o_acc, sS_addr);
          rtk_chunk_land<1>(p, o_acc, f_lo, f_hi, [&](float (&pp)[8][4]) {
            scale_scores(pp);
            if constexpr (WFORM) {
              rtk_wg_pin(xv);
              dlog_sum += rtk_dlog_intra(pp, xv, r0, g, t4);  // sum_{s<t} (t-s) P_ts (x_t . v_s)
            }
          });
          // x_t . (t+1) gamma^(t+1) scale q_t S (Z: weight t), before P v joins o_acc
          constexpr int e = WFORM ? 1 : 0;
          dlog_sum += rtk_dlog_rows<DT>(o_acc, sX, r0, g, t4, (float)(r0 + g + e), (float)(r0 + g + 8 + e), voff);
        } else {
          scores();
          rtk_wg_commit();
          times_copy(o_acc, sS_addr);
          rtk_chunk_land<1>(p, o_acc, f_lo, f_hi, scale_scores);
          if constexpr (DUAL_DLOG) rtk_frag_copy(pk, p);
        }
        if (!v_bad) {  // P v: P from registers, v from shared memory
          rtk_chunk_pv_wgmma<DT>(o_acc, p, sV_addr);
        } else {  // rare: a non-finite v in this chunk; mma.sync with the operand cleaned
          #pragma unroll
          for (int kk = 0; kk < 4; ++kk) pv(kk);
        }
      } else {
        rtk_zero(o_acc);
        rtk_zero(p);

        // q_t S and q_t . k_s, sharing the q fragments
        #pragma unroll 1  // unrolling measured no faster and costs registers
        for (int kstep = 0; kstep < KMAX / 16; ++kstep) {
          if (kstep >= kt_used) break;
          rtk_u32 a[4];
          rtk_ldsm_x4(a, sQ_addr + 2 * ((r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + kstep * 16 + (lane >> 4) * 8));
          #pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            rtk_u32 bb[4];
            rtk_ldsm_x4_trans(bb, sS_addr + 2 * ((kstep * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + np * 16 + (lane >> 4) * 8));
            rtk_mma16816<DT>(o_acc[2 * np], a, bb[0], bb[1]);
            rtk_mma16816<DT>(o_acc[2 * np + 1], a, bb[2], bb[3]);
          }
          #pragma unroll
          for (int jp = 0; jp < 4; ++jp) {
            if (jp <= w) {
              rtk_u32 bb[4];
              rtk_ldsm_x4(bb, sK_addr + 2 * ((jp * 16 + (lane & 7) + (lane >> 4) * 8) * KS + kstep * 16 + ((lane >> 3) & 1) * 8));
              rtk_mma16816<DT>(p[2 * jp], a, bb[0], bb[1]);
              rtk_mma16816<DT>(p[2 * jp + 1], a, bb[2], bb[3]);
            }
          }
        }

        // gamma^(r0+1) q_t S (undoing the copy's 2^e); the keys left of the diagonal block get
        // gamma^(r0-s): tile j lies 8(2w-1-j) + (8 - 2 t4 - e) to the left of r0
        const float fi = dec.inter0 * s_inv;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) o_acc[nt][e] *= fi;
        dec.scale_left(p, w);
        #pragma unroll
        for (int kk = 0; kk < 3; ++kk)
          if (kk < w) pv(kk);
        dec.scale_rows(o_acc);
        // the diagonal block; tiles are picked with compile-time indices so p stays in registers
        #pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          if (kk == w) {
            #pragma unroll
            for (int jd = 0; jd < 2; ++jd) dec.mask_diag(p[2 * kk + jd], jd);
            pv(kk);
          }
        }
      }
      if (v_bad && __any_sync(0xffffffffu, saw_bad)) {
        const rtk_u16* sV = sm + stage * L::STAGE + L::V;
        rtk_chunk_mark_nonfinite(o_acc, r0, g, t4,
                                 [&](int s2, int c) -> int { return (sV[L::v_off(s2, c >> 3) + (c & 7)] & EXP) == EXP; });
      }
      // TMA, ZWALK: a short chunk 0 by stores from registers (a box would write chunk 1's rows)
      if (TMA && !(ZWALK && len < C)) {
        if constexpr (TMA)
          rtk_chunk_send_box<DT, NT, L::OBUF>(&maps.o, o_acc, rtk_smem_addr(sm + L::O + (chunk % L::OBUF) * C * L::OS + w * 16 * BV),
                                              lane, v0, (int)n_begin + n0 + r0, h, b);
      } else if (orows && !TMA)
        rtk_chunk_send_rows<DT, NT, L::OS, L::OBUF>(ob, o_acc, rtk_smem_addr(sm + L::O + (chunk % L::OBUF) * C * L::OS),
                                                     n0, r0, lane, len, o_sn, v0);
      else
        rtk_chunk_store_rows<DT>(ob, o_acc, n0, r0, g, t4, len, o_sn, v0, dv_here, ovec_full);
      if constexpr (DUAL) {
        // o2 = scale (gamma^(t+1) x S^T + P2 k), P2_ts = gamma^(t-s) x_t . v_s: x v^T and x S^T from
        // shared memory (the state copy read K-major is S^T), then P2 k with k read MN-major
        float o2[KMAX / 8][4];
        float p2[8][4];
        float (&p2a)[32] = reinterpret_cast<float (&)[32]>(p2);
        const rtk_u32 sX_addr = rtk_smem_addr(sm + stage * L::STAGE + L::X);
        const unsigned long long dx = rtk_wg_desc(sX_addr, 16, 1024), dvk = rtk_wg_desc(sV_addr, 16, 1024);
        const unsigned long long dst = rtk_wg_desc(sS_addr, 16, 1024);
        rtk_wg_fence();
        #pragma unroll
        for (int ks = 0; ks < BV / 16; ++ks) rtk_wgmma_ss<DT, 0>(p2a, rtk_desc_at(dx, kmaj(ks)), rtk_desc_at(dvk, kmaj(ks)), ks);
        rtk_wg_commit();
        #pragma unroll
        for (int nb = 0; nb < KMAX / 64; ++nb)
          #pragma unroll
          for (int ks = 0; ks < BV / 16; ++ks)
            rtk_wgmma_ss<DT, 0>(reinterpret_cast<float (&)[32]>(o2[8 * nb]), rtk_desc_at(dx, kmaj(ks)),
                                rtk_desc_at(dst, ((ks >> 2) * (KMAX * 128) + (ks & 3) * 32 + nb * (64 * 128)) >> 4), ks);
        rtk_wg_commit();
        rtk_chunk_land<1>(p2, o2, f_lo, f_hi, [&](float (&pp)[8][4]) {
          // DUAL_DLOG, the split's intra-chunk term: sum_{s<t} (t-s) P_ts (x_t . v_s), x v^T unscaled
          if constexpr (DUAL_DLOG) dlog_sum += rtk_dlog_intra(pk, reinterpret_cast<const float (&)[32]>(pp), r0, g, t4);
          scale_scores(pp);
        });
        if constexpr (DUAL_DLOG) {  // the split's edge term: q_t . o2_t' (o2' = x S^T, before P2 k joins)
          const int e = chunk == 0 && blockIdx.z == 0 ? 0 : 1;  // weight t + 1, t where the sequence ends
          dlog_sum += rtk_dlog_rows<DT>(o2, sm + stage * L::STAGE + L::Q, r0, g, t4, (float)(r0 + g + e),
                                        (float)(r0 + g + 8 + e), [](int r, int pc) { return L::qk_off(r, pc); });
        }
        bool saw2 = false;
        if (!v_bad) {
          rtk_chunk_pv_wgmma<DT>(o2, p2, sK_addr);
        } else {  // rare: a non-finite v or k in this chunk
          #pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            saw2 |= rtk_chunk_pv_step<DT>(o2, p2, kk, sK_addr, lane, true, [](int r, int pc) { return L::qk_off(r, pc); });
        }
        if (v_bad && __any_sync(0xffffffffu, saw2)) {
          const rtk_u16* sK = sm + stage * L::STAGE + L::K;
          rtk_chunk_mark_nonfinite(o2, r0, g, t4,
                                   [&](int s2, int c) -> int { return (sK[L::qk_off(s2, c >> 3) + (c & 7)] & EXP) == EXP; });
        }
        if (osend2)
          rtk_chunk_send_rows<DT, KMAX / 8, L::OS, 1>(ob2, o2, rtk_smem_addr(sm + L::O), n0, r0, lane, len, k_sn, 0);
        else
          rtk_chunk_store_rows<DT>(ob2, o2, n0, r0, g, t4, len, k_sn, 0, Dk, ovec2);
      }
      v_bad = out_end(chunk);  // done with this stage and this state copy
    }
    if (WG && (osend || (DUAL && osend2))) rtk_bulk_wait_all<0>();
    if (ZSMEM && gz != nullptr) dlog_sum += rtk_zcopy_dot<DT, KMAX, BV>(sm + L::W, tid, gz, Dk, dv_here, v0);
    if constexpr (DLOG) {  // this warp's share of the CTA's sum (s_red[0 .. 7]: fp16's S maxima, no longer read)
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) dlog_sum += __shfl_xor_sync(0xffffffffu, dlog_sum, off);
      if (lane == 0) s_red[w] = dlog_sum;
    }
  } else {
    // ---- state warps: fp32 state in registers, 16-bit copy in shared memory --------------------
    // m-tile mt of a state warp: rows sr0 + MSTEP mt .. + 15. WG: a warpgroup on wgmma, warp w holding rows
    // 16 (w - 4) of each 64 (its accumulator layout); else each warp owns MT * 16 rows (mma.sync).
    constexpr int MSTEP = WG ? 64 : 16;
    const int sr0 = (warp - 4) * (WG ? 16 : MT * 16);
    float s_acc[MT][NT][4];
    float w_acc[ZREG ? MT : 1][NT][4];  // W = dS/dlog(gamma) or Z, from 0 (or the folded slots)
    const float dn = WFORM ? rtk_dlog_norm<DT>(lg2) : 1.f;  // fp16: w_acc holds W dn (decay.cuh)
    #pragma unroll
    for (int mt = 0; mt < (ZREG ? MT : 1); ++mt) rtk_zero(w_acc[mt]);
    const rtk_chunk_state<MT, NT, MSTEP> sf = {sr0, g, t4, bh, Dk, Dv, v0, dv_here,
                                               mode == RTK_MODE_FOLD ? 0 : state_slot};
    if (mode == RTK_MODE_FOLD) {
      const float lgd = rtk_head_log_decay(decay, decay_mode, h);
      const int per_seg = (int)(seg_len / p.fold_len);
      if constexpr (ZREG)  // (Z is not split: rtkernels/methods/chunk/plan.py)
        sf.template fold_with<true, DT == RTK_F16>(s_acc, w_acc, init_state, lgd, p.fold_len, per_seg, gridDim.x, dn);
      else sf.fold(s_acc, init_state, lgd, p.fold_len, per_seg, gridDim.x);
    } else {
      sf.load(s_acc, init_state);
    }
    if (seq_bad) rtk_frag_scale(s_acc, __int_as_float(0x7fc00000));  // invalid packed offsets: NaN states
    auto publish_max = [&](int slot) {  // fp16 (DQ_DLOG: W's or Z's too, at base 8)
      if (DT != RTK_F16) return;
      auto warp_max = [&](const float (&x)[MT][NT][4], int base) {
        const float m = rtk_frag_warp_absmax(x);
        if (lane == 0) s_red[base + slot * 4 + warp - 4] = m;
      };
      warp_max(s_acc, 0);
      if constexpr (ZREG) warp_max(w_acc, 8);
    };
    // the copy of S entering chunk c: copy c % 2, with fp16 scaling slot c % 2 (after publish_max
    // and next_copy's barrier)
    auto store_state_copy = [&](int slot) {
      const float mul = DT == RTK_F16 ? exp2f((float)copy_exponent(slot)) : 1.f;
      rtk_u16* sS = sm + L::S + (L::NCOPY == 2 ? slot : 0) * L::SCOPY;
      sf.pairs(s_acc, [&](int r, int c, float lo, float hi) {
        rtk_store_pair<DT>(sS + L::s_off(r, c >> 3) + (c & 7), lo * mul, hi * mul);
      });
      if constexpr (ZREG) {
        const float wmul = DT == RTK_F16 ? exp2f((float)copy_exponent(slot, 8)) : 1.f;
        rtk_u16* sW = sm + L::W + slot * L::SCOPY;
        sf.pairs(w_acc, [&](int r, int c, float lo, float hi) {
          rtk_store_pair<DT>(sW + L::s_off(r, c >> 3) + (c & 7), lo * wmul, hi * wmul);
        });
      }
    };
    // once per period (and before the first): SERIAL, a CTA barrier between publishing fp16's maximum
    // and writing the copy (and, with one copy, after the output warps' reads); STATE_BAR, the state warps'
    auto next_copy = [&](int slot, bool store) {
      publish_max(slot);
      if (SERIAL) rtk_cta_sync();
      else if (STATE_BAR) rtk_named_sync(2, 128);
      if (store) store_state_copy(slot);
    };
    #pragma unroll
    for (int c = 0; c < STAGES - 1; ++c) {  // one commit group per chunk, loaded or not
      if (c < nchunks) load_chunk(c, c);  // none: an empty packed sequence
      rtk_cp_async_commit();
    }
    next_copy(0, true);
    end_period(0);
    const rtk_key_weights<DT, WFORM> kw_whole[4] = {{lg2, C, 0, t4, false, dn}, {lg2, C, 1, t4, false, dn},
                                                    {lg2, C, 2, t4, false, dn}, {lg2, C, 3, t4, false, dn}};
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk % STAGES, slot = chunk & 1;  // tiles; state copy
      const int ahead = chunk + STAGES - 1;
      if (ahead < nchunks) load_chunk(ahead, ahead % STAGES);  // its stage was read in period c - 1
      rtk_cp_async_commit();
      const int n0 = grid.start(chunk), len = grid.len(chunk, n0);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
      // ---- state warps: S = gamma^len S + (K * w)^T V, w_s = gamma^(len-1-s) ----------------
      const float carry = rtk_exp2(lg2 * (float)len);
      // before S moves on; Z's last step weighs S by len - 1: Z then holds what <G, .> needs
      const int zm = WFORM || chunk + 1 < nchunks ? len : len - 1;
      if constexpr (ZREG) rtk_frag_dlog_step<WFORM && DT == RTK_F16>(w_acc, s_acc, carry, zm, dn);
      rtk_frag_scale(s_acc, carry);
      // k-step kk (tokens 16 kk ..): a[mt] the A fragment of (k_s w_s)^T for m-tile mt, W's a2[mt] of (k_s (len-1-s) w_s)^T
      auto weighted_k = [&](int kk, const rtk_key_weights<DT, WFORM>& kw, rtk_u32 (&a)[MT][4], rtk_u32 (&a2)[MT][4]) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rtk_ldsm_x4_trans(a[mt], sK_addr + 2 * L::qk_off(kk * 16 + (lane & 7) + (lane >> 4) * 8,
                                                           (sr0 + mt * MSTEP) / 8 + ((lane >> 3) & 1)));
          kw.apply(a[mt], a2[mt]);
        }
      };
      if constexpr (WG) {
        // S (+ W) += A V (v from shared memory), KB k-steps' fragments then one wgmma group: the plain
        // pass takes all four at once (keys past len weigh 0); DLOG and DUAL, short of registers, one
        constexpr int KB = DLOG || DUAL ? 1 : 4;
        const unsigned long long dv = rtk_wg_desc(sV_addr, RTK_MN_LBO(C * 128), RTK_MN_SBO(C * 128));
        #pragma unroll 1
        for (int k0 = 0; k0 * 16 < len; k0 += KB) {
          rtk_u32 a[KB][MT][4], a2[KB][MT][4];  // a2: W only
          #pragma unroll
          for (int j = 0; j < KB; ++j)
            weighted_k(k0 + j, KB == 4 && len == C ? kw_whole[j] : rtk_key_weights<DT, WFORM>(lg2, len, k0 + j, t4, false, dn),
                       a[j], a2[j]);
          rtk_wg_fence();
          #pragma unroll
          for (int j = 0; j < KB; ++j)
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
              #pragma unroll
              for (int nb = 0; nb < BV / 64; ++nb) {
                const unsigned long long db = rtk_desc_at(dv, (nb * (C * 128) + (k0 + j) * 2048) >> 4);
                rtk_wgmma_rs<DT, 1>(reinterpret_cast<float (&)[32]>(s_acc[mt][8 * nb]), a[j][mt], db, 1);
                if constexpr (WFORM)
                  rtk_wgmma_rs<DT, 1>(reinterpret_cast<float (&)[32]>(w_acc[mt][8 * nb]), a2[j][mt], db, 1);
              }
          rtk_wg_commit();
          rtk_wg_wait<0>();
        }
        rtk_wg_wait<0>();
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int nb = 0; nb < BV / 64; ++nb) {
            rtk_wg_pin(reinterpret_cast<float (&)[32]>(s_acc[mt][8 * nb]));
            if constexpr (WFORM) rtk_wg_pin(reinterpret_cast<float (&)[32]>(w_acc[mt][8 * nb]));
          }
      } else {
        #pragma unroll 1
        for (int kk = 0; kk * 16 < len; ++kk) {
          rtk_u32 a[MT][4], a2[MT][4];  // a2: W only
          weighted_k(kk, rtk_key_weights<DT, WFORM>(lg2, len, kk, t4, false, dn), a, a2);
          #pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            rtk_u32 bb[4];
            rtk_ldsm_x4_trans(bb, sV_addr + 2 * L::v_off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 2 + (lane >> 4)));
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              rtk_mma16816<DT>(s_acc[mt][2 * np], a[mt], bb[0], bb[1]);
              rtk_mma16816<DT>(s_acc[mt][2 * np + 1], a[mt], bb[2], bb[3]);
              if constexpr (WFORM) {
                rtk_mma16816<DT>(w_acc[mt][2 * np], a2[mt], bb[0], bb[1]);
                rtk_mma16816<DT>(w_acc[mt][2 * np + 1], a2[mt], bb[2], bb[3]);
              }
            }
          }
        }
      }
      // the copy of S entering chunk c + 1 (its buffer was read in period c - 1, or with one copy in c)
      if constexpr (ZSMEM) rtk_zcopy_state_sync();  // (for racecheck: dlog_rows.cuh)
      next_copy(slot ^ 1, chunk + 1 < nchunks);
      if constexpr (ZSMEM) rtk_zcopy_step<DT, KMAX, BV>(sm + L::S + slot * L::SCOPY, sm + L::W, carry, zm, tid - 128);
      end_period(chunk + 1);
    }
    const bool ends = mode != RTK_MODE_FOLD || blockIdx.z + 1 == gridDim.z;
    if (ends) sf.store(s_acc, final_state);
    if constexpr (DLOG) {  // <G, W_end> (Z_end) over this tile, by the CTA that ends the sequence; DUAL, ZSMEM: 0
      float gw = 0.f;
      if constexpr (ZREG)
        if (ends && p.dlog_g != 0)
          gw = sf.dot_transposed(w_acc, reinterpret_cast<const float*>(p.dlog_g) + (rtk_i64)bh * Dk * Dv);
      if (DT == RTK_F16) gw *= 1.f / dn;
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) gw += __shfl_xor_sync(0xffffffffu, gw, off);
      if (lane == 0) s_red[warp] = gw;
    }
  }
  if constexpr (DLOG) {  // the CTA's sum in a fixed order: the output warps' terms, then G's
    __syncthreads();
    if (tid == 0)
      reinterpret_cast<float*>(p.dlog_out)[((rtk_i64)(blockIdx.z * (gridDim.x / H) + b_row) * gridDim.y +
                                            tile) * H + h] =
          ((s_red[0] + s_red[1]) + (s_red[2] + s_red[3])) + ((s_red[4] + s_red[5]) + (s_red[6] + s_red[7]));
  }
}
