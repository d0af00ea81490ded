// chunk.cu -- the flagship: the chunked form, fused, on tensor cores (mma.sync m16n8k16).
//
// One CTA of 8 warps per (batch*head, tile of BV value columns) walks the sequence in chunks of
// C = 64 tokens. With S the KMAX x BV state slice entering a chunk of len <= C tokens (local
// index t):
//
//   o_t = scale * ( gamma^(t+1) q_t S  +  sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s )
//   S   = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s
//
// The warps specialise. Output warps 0..3 each own 16 rows t of the chunk; state warps 4..7 each
// own KMAX/4 rows of S, in fp32 registers, and publish a 16-bit copy of S in shared memory as
// the operand of q_t S. Both groups work on the same chunk at the same time; two barriers per
// chunk order the state copy and the double-buffered cp.async tiles.
//
// Only non-negative powers of gamma are formed (no overflow for any gamma in (0, 1], any N).
// For an output warp whose rows start at r0 the decay is factored as
//   gamma^(t-s) = gamma^(t-r0) * gamma^(r0-s)         (s < r0: every key left of the warp's rows)
// and the 16 x 16 diagonal block uses gamma^(t-s) directly, with the causal mask as a select.
// For fp16 the state copy is scaled by a power of two chosen from max|S| so it cannot overflow.
//
// NaN semantics: a dense P V product would multiply the zeros above the diagonal of P with a
// NaN in a later row of v. So when a chunk's v holds a non-finite value, the operand of P V has
// it zeroed and the outputs the causal sum reaches (rows t >= s, same column) are set to NaN.
// The state update uses v as it is, so later chunks see the NaN through S.
#include "rtk_common.cuh"

// wgmma descriptors of MN-major operands (v and the state copy, [k][n] with n contiguous): the
// leading byte offset is the step between 64-column regions, the stride byte offset the step
// between 8-row groups (checked on an H200; the swapped reading faults).
#define RTK_MN_LBO(region) (region)
#define RTK_MN_SBO(region) 1024

#ifndef RTK_KUNROLL  // unrolling of the output warps' k loop (experiment knob)
#define RTK_KUNROLL 1
#endif

// Shared-memory layout. SW = false: rows padded by 16 bytes (conflict-free ldmatrix). SW = true
// (the wgmma kernel): 128-byte-swizzled regions of 64 columns (rtk_swz_off), 1024-byte aligned,
// the layout wgmma descriptors read. The *_off functions give the element offset of 16-byte
// piece p of row r; KS and VS are the element step from one row to the next in the same piece.
template <int KMAX, int BV, bool SW>
struct rtk_chunk_smem {
  static constexpr int C = 64;
  static constexpr int KS = SW ? 64 : KMAX + 8;
  static constexpr int VS = SW ? 64 : BV + 8;
  static constexpr int Q = 0, K = Q + C * (SW ? KMAX : KS), V = K + C * (SW ? KMAX : KS);
  static constexpr int STAGE = V + C * (SW ? BV : VS);
  static constexpr int S = 2 * STAGE;  // 16-bit copy of the state, KMAX x BV
  static constexpr int ELEMS = S + KMAX * (SW ? BV : VS);
  static constexpr int ALIGN = SW ? 1024 : 0;            // slack for aligning the base
  static constexpr int BYTES = ELEMS * 2 + 32 + ALIGN;  // + fp16 scaling: max|S| of the 4 state warps, 2 slots
  static __device__ __forceinline__ int qk_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * KS + p * 8; }
  static __device__ __forceinline__ int v_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * VS + p * 8; }
  static __device__ __forceinline__ int s_off(int r, int p) { return SW ? rtk_swz_off(KMAX, r, p) : r * VS + p * 8; }
};

// MINB: CTAs per SM the register budget is sized for (2: 128 registers a thread, for grids of
// more than one wave; 1: no spills, for grids that give each SM at most one CTA anyway).
// WG (sm_90a only, KMAX <= 128, BV a multiple of 64): the output warps form one warpgroup that
// computes the chunk with wgmma (q k^T and q S from shared memory, P v with P from registers);
// otherwise each output warp uses mma.sync on its 16 rows.
template <int DT, int KMAX, int BV, bool VEC, int MINB, bool WG>
__global__ void __launch_bounds__(256, MINB)
rtk_chunk_fwd(RTK_FWD_PARAMS(rtk_u16), rtk_i64 seg_len, int states_only) {
  RTK_FWD_SIZES;
  typedef rtk_chunk_smem<KMAX, BV, WG> L;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  constexpr int NT = BV / 8;          // n-tiles of the value columns
  constexpr int MT = KMAX / 64;       // m-tiles of state rows per state warp
  constexpr rtk_u32 EXP = rtk_expmask<DT>::v;
  static_assert(BV % 16 == 0 && KMAX % 64 == 0, "bad tile");
  static_assert(!WG || (KMAX <= 128 && BV % 64 == 0), "bad wgmma tile");

  extern __shared__ __align__(16) unsigned char smem_base[];
  constexpr rtk_u32 AL = L::ALIGN > 0 ? L::ALIGN : 1;
  unsigned char* smem_raw = smem_base + ((AL - (rtk_smem_addr(smem_base) & (AL - 1))) & (AL - 1));
  rtk_u16* sm = reinterpret_cast<rtk_u16*>(smem_raw);
  // fp16 only: each state warp publishes max|S| of its rows (or -1 when not finite) in slot
  // (chunk & 1) before barrier (B); the state warps read the 4 values after (B), the output warps
  // after the next (A), and both derive the same power of two 2^e, max|S| * 2^e <= 2^14.
  float* s_red = reinterpret_cast<float*>(smem_raw + L::ELEMS * 2);
  auto copy_exponent = [&](int slot) -> int {
    float m = 0.f;
    bool fin = true;
    for (int i = 0; i < 4; ++i) {
      const float x = s_red[slot * 4 + i];
      fin = fin && x >= 0.f;
      m = fmaxf(m, x);
    }
    return (fin && m > 0.f) ? min(60, max(-60, 14 - (int)ceilf(log2f(m)))) : 0;
  };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const bool out_warp = warp < 4;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int v0 = blockIdx.y * BV;
  const float lg2 = log_decay[h] * 1.4426950408889634f;  // log2(gamma)

  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};
  // Split-sequence strategy: CTA z handles tokens [z * seg_len, z * seg_len + NS) and its state
  // enters from / leaves to slot z of the state buffers (one segment, z = 0, otherwise).
  const rtk_i64 n_begin = (rtk_i64)blockIdx.z * seg_len;
  const int NS = (int)min((rtk_i64)N - n_begin, seg_len);
  const rtk_i64 state_slot = (rtk_i64)blockIdx.z * gridDim.x * Dk * Dv;
  const rtk_u16* qb = q + rtk_offset(qs, b, h, n_begin);
  const rtk_u16* kb = k + rtk_offset(ks, b, h, n_begin);
  const rtk_u16* vb = v + rtk_offset(vs, b, h, n_begin) + v0;
  rtk_u16* ob = o + rtk_offset(os, b, h, n_begin);
  const int dv_here = min(BV, Dv - v0);  // value columns of this tile
  const int kt_used = (Dk + 15) >> 4;     // 16-wide k-steps that hold real q/k columns
  const bool ovec_full = dv_here == BV && ((o_sn & 1) == 0) && ((reinterpret_cast<size_t>(ob + v0) & 3) == 0);

  // ---- loading one chunk into a stage: the state warps' job (they have slack) -----------------
  // Thread st = tid - 128 copies 16-byte pieces at a fixed column of rows st / PIECES + pass * ROWS,
  // so every address is a base pointer plus a multiple of the row stride.
  constexpr int QV = KMAX / 8, VV = BV / 8;         // 16-byte pieces per q/k row and per v row
  constexpr int QROWS = 128 / QV, VROWS = 128 / VV;  // rows one pass of the 128 loader threads covers
  const int st = tid - 128;
  const int qcol = (st % QV) * 8, qrow = st / QV;
  const int vcol = (st % VV) * 8, vrow = st / VV;
  const int qbytes = max(0, min(16, (Dk - qcol) * 2));
  const int vbytes = max(0, min(16, (dv_here - vcol) * 2));
  // The pointers of pass 0 (column kept inside the row when it lies past Dk or Dv: nothing is
  // read there, the zero-fill does the work) and the byte step between passes.
  const rtk_u16* q_first = qb + (rtk_i64)qrow * q_sn + (qbytes ? qcol : 0);
  const rtk_u16* k_first = kb + (rtk_i64)qrow * k_sn + (qbytes ? qcol : 0);
  const rtk_u16* v_first = vb + (rtk_i64)vrow * v_sn + (vbytes ? vcol : 0);
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sQ = sm + stage * L::STAGE + L::Q;
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if (VEC) {
      const rtk_u32 dq = rtk_smem_addr(sQ + L::qk_off(qrow, qcol >> 3)), dk = rtk_smem_addr(sK + L::qk_off(qrow, qcol >> 3));
      const rtk_u32 dv = rtk_smem_addr(sV + L::v_off(vrow, vcol >> 3));
      const char* qp = reinterpret_cast<const char*>(q_first + (rtk_i64)n0 * q_sn);
      const char* kp = reinterpret_cast<const char*>(k_first + (rtk_i64)n0 * k_sn);
      const char* vp = reinterpret_cast<const char*>(v_first + (rtk_i64)n0 * v_sn);
      const rtk_i64 qstep = 2 * QROWS * q_sn, kstep = 2 * QROWS * k_sn, vstep = 2 * VROWS * v_sn;
      if (n0 + C <= NS) {  // a whole chunk: no row checks
        #pragma unroll
        for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
          if (!states_only) rtk_cp_async16(dq + 2 * u * QROWS * KS, qp, qbytes);
          rtk_cp_async16(dk + 2 * u * QROWS * KS, kp, qbytes);
        }
        #pragma unroll
        for (int u = 0; u < C / VROWS; ++u, vp += vstep) rtk_cp_async16(dv + 2 * u * VROWS * VS, vp, vbytes);
      } else {
        #pragma unroll
        for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
          const bool in = n0 + qrow + u * QROWS < NS;
          if (!states_only) rtk_cp_async16(dq + 2 * u * QROWS * KS, in ? (const void*)qp : (const void*)qb, in ? qbytes : 0);
          rtk_cp_async16(dk + 2 * u * QROWS * KS, in ? (const void*)kp : (const void*)kb, in ? qbytes : 0);
        }
        #pragma unroll
        for (int u = 0; u < C / VROWS; ++u, vp += vstep) {
          const bool in = n0 + vrow + u * VROWS < NS;
          rtk_cp_async16(dv + 2 * u * VROWS * VS, in ? (const void*)vp : (const void*)vb, in ? vbytes : 0);
        }
      }
    } else {
      for (int e = st; e < C * KMAX; e += 128) {
        const int r = e / KMAX, col = e - r * KMAX;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const bool ok = n < NS && col < Dk;
        const int at = L::qk_off(r, col >> 3) + (col & 7);
        if (!states_only) sQ[at] = ok ? qb[n * q_sn + col] : (rtk_u16)0;
        sK[at] = ok ? kb[n * k_sn + col] : (rtk_u16)0;
      }
      for (int e = st; e < C * BV; e += 128) {
        const int r = e / BV, col = e - r * BV;
        const rtk_i64 n = (rtk_i64)n0 + r;
        sV[L::v_off(r, col >> 3) + (col & 7)] = (n < NS && col < dv_here) ? vb[n * v_sn + col] : (rtk_u16)0;
      }
    }
  };

  const int nchunks = (NS + C - 1) / C;
  if (!out_warp) {
    load_chunk(0, 0);
    rtk_cp_async_commit();
  }
  if (!VEC) __syncthreads();  // chunk 0 was stored by other threads; the v check below reads it

  const rtk_u32 sS_addr = rtk_smem_addr(sm + L::S);

  // Chunk prologue shared by both warp groups: prefetch the next chunk, wait for this one, look
  // for non-finite v, barrier (A). Returns whether this chunk's v holds Inf/NaN.
  auto begin_chunk = [&](int chunk) -> bool {
    bool my_bad = false;
    if (!out_warp) {
      const int stage = chunk & 1;
#ifndef RTK_PROBE_NO_LOAD
      if (chunk + 1 < nchunks) load_chunk(chunk + 1, stage ^ 1);
#endif
      rtk_cp_async_commit();
      rtk_cp_async_wait<1>();
      // The v pieces of this thread's loader set (with VEC the pieces it copied itself; without,
      // pieces written before an earlier barrier): any Inf/NaN? The barrier ORs the answers.
      const rtk_u16* sV = sm + stage * L::STAGE + L::V;
      #pragma unroll
      for (int u = 0; u < C / VROWS; ++u) {
        const uint4 x = *reinterpret_cast<const uint4*>(sV + L::v_off(vrow + u * VROWS, vcol >> 3));
        my_bad |= rtk_nonfinite2<DT>(x.x) | rtk_nonfinite2<DT>(x.y) | rtk_nonfinite2<DT>(x.z) |
                  rtk_nonfinite2<DT>(x.w);
      }
    }
#ifdef RTK_PROBE_NO_LOAD
    my_bad = false;
#endif
    // the tiles (cp.async) and the state copy (st.shared) are read by wgmma next: async proxy
    if (WG && !out_warp) rtk_fence_proxy_async();
    return __syncthreads_or(my_bad) != 0;  // (A) tiles and state copy visible
  };

  // The two groups run separate loops (so neither holds the other's registers); both execute the
  // same barriers in the same order.
  if (out_warp) {
    // ---- output warps: per-thread decay factors, fixed for the whole sequence -----------------
    const int w = warp, r0 = 16 * warp;  // this warp's rows r0 .. r0+15 of each chunk
    // gamma^(8 - 2 t4 - e) for the thread's two key columns in an 8-wide tile (exponents 1..8),
    // gamma^8 to step one tile to the left, gamma^(t - r0) * scale for its two rows (t = r0 + g,
    // + 8), gamma^(r0 + 1), and gamma^(t - s) * scale inside the 16 x 16 diagonal block (-1 where
    // s > t: the mask is a select).
    const float col_f0 = rtk_exp2(lg2 * (float)(8 - 2 * t4)), col_f1 = rtk_exp2(lg2 * (float)(7 - 2 * t4));
    const float g8 = rtk_exp2(lg2 * 8.f);
    const float row_lo = rtk_exp2(lg2 * (float)g) * scale, row_hi = rtk_exp2(lg2 * (float)(g + 8)) * scale;
    const float inter0 = rtk_exp2(lg2 * (float)(r0 + 1));
    float diag[2][4];
    #pragma unroll
    for (int jd = 0; jd < 2; ++jd)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dt = g + (e >> 1) * 8 - (jd * 8 + 2 * t4 + (e & 1));
        diag[jd][e] = dt >= 0 ? rtk_exp2(lg2 * (float)dt) * scale : -1.f;
      }
    float s_inv = 1.f;  // the state copy holds S * 2^e (fp16); s_inv = 2^-e
    __syncthreads();    // (matches the state warps' start barrier: the first state copy)

    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const bool v_bad = begin_chunk(chunk);
      if (DT == RTK_F16) s_inv = exp2f((float)-copy_exponent((chunk + 1) & 1));
      const int stage = chunk & 1;
      const int n0 = chunk * C;
      const int len = min(C, NS - n0);
      const rtk_u32 sQ_addr = rtk_smem_addr(sm + stage * L::STAGE + L::Q);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
#ifdef RTK_PROBE_NO_OUT
      if (chunk >= 0) { __syncthreads(); continue; }
#endif
      if (states_only) {  // first pass of the split-sequence strategy: no outputs
        __syncthreads();
        continue;
      }
      float o_acc[NT][4];
      float p[8][4];  // scores of the 16 rows against key tiles 0 .. 2w+1
      bool saw_bad = false;
      auto pv = [&](int kk) {  // o_acc += P[:, 16 kk ..] V[16 kk .., :]  (kk a compile-time value)
        rtk_u32 a[4];
        a[0] = rtk_pack2<DT>(p[2 * kk][0], p[2 * kk][1]);
        a[1] = rtk_pack2<DT>(p[2 * kk][2], p[2 * kk][3]);
        a[2] = rtk_pack2<DT>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = rtk_pack2<DT>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          rtk_u32 bb[4];
          rtk_ldsm_x4_trans(bb, sV_addr + 2 * L::v_off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 2 + (lane >> 4)));
          if (v_bad) {  // rare: zero Inf/NaN in the operand, remember that this warp saw one
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              const rtk_u32 lo_bad = ((bb[i] & EXP) == EXP) ? 0x0000FFFFu : 0u;
              const rtk_u32 hi_bad = (((bb[i] >> 16) & EXP) == EXP) ? 0xFFFF0000u : 0u;
              saw_bad |= (lo_bad | hi_bad) != 0u;
              bb[i] &= ~(lo_bad | hi_bad);
            }
          }
          rtk_mma16816<DT>(o_acc[2 * np], a, bb[0], bb[1]);
          rtk_mma16816<DT>(o_acc[2 * np + 1], a, bb[2], bb[3]);
        }
      };
      if constexpr (WG) {
        // q k^T for all 64 x 64 pairs and q S, both from shared memory, as two wgmma groups
        // descriptors: a base per operand, plus the byte offset of each 16-wide k step / 16-row
        // group (>> 4: the start-address field counts 16-byte units, and never overflows here)
        float (&pa)[32] = reinterpret_cast<float (&)[32]>(p);
        const unsigned long long dq = rtk_wg_desc(sQ_addr, 16, 1024), dk = rtk_wg_desc(sK_addr, 16, 1024);
        const unsigned long long ds = rtk_wg_desc(sS_addr, RTK_MN_LBO(KMAX * 128), RTK_MN_SBO(KMAX * 128));
        auto kmaj = [](int ks) { return (rtk_u32)(((ks >> 2) * (C * 128) + (ks & 3) * 32) >> 4); };
        rtk_wg_fence();
        #pragma unroll
        for (int ks = 0; ks < KMAX / 16; ++ks) rtk_wgmma_ss<DT, 0>(pa, rtk_desc_at(dq, kmaj(ks)), rtk_desc_at(dk, kmaj(ks)), ks);
        rtk_wg_commit();
        #pragma unroll
        for (int nb = 0; nb < BV / 64; ++nb) {
          float (&oa)[32] = reinterpret_cast<float (&)[32]>(o_acc[8 * nb]);
          #pragma unroll
          for (int ks = 0; ks < KMAX / 16; ++ks)
            rtk_wgmma_ss<DT, 1>(oa, rtk_desc_at(dq, kmaj(ks)), rtk_desc_at(ds, (nb * (KMAX * 128) + ks * 2048) >> 4), ks);
        }
        rtk_wg_commit();
        rtk_wg_wait<1>();
        rtk_wg_pin(pa);
        // P: gamma^(t-s) * scale for s <= t (left of the diagonal block as row factor x column
        // factor, inside it directly), 0 above the diagonal (a select: q.k may be Inf there)
        // (left of the diagonal block, right to left: gamma^(r0-s) = col_f * gamma^(8 tiles))
        float step_lo = row_lo, step_hi = row_hi;
        #pragma unroll
        for (int j = 7; j >= 0; --j)
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int dj = j - 2 * w;
            float& x = p[j][e];
            if (dj < 0) {
              x *= ((e & 1) ? col_f1 : col_f0) * ((e >> 1) ? step_hi : step_lo);
              if (e == 3) { step_lo *= g8; step_hi *= g8; }
            } else if (dj < 2) {
              const float d = dj == 0 ? diag[0][e] : diag[1][e];
              x = d >= 0.f ? x * d : 0.f;
            } else {
              x = 0.f;
            }
          }
        rtk_wg_wait<0>();
        #pragma unroll
        for (int nb = 0; nb < BV / 64; ++nb) rtk_wg_pin(reinterpret_cast<float (&)[32]>(o_acc[8 * nb]));
        // q S rows: gamma^(t+1) * scale (and the fp16 copy's 2^-e)
        const float f_lo = inter0 * s_inv * row_lo, f_hi = inter0 * s_inv * row_hi;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          o_acc[nt][0] *= f_lo; o_acc[nt][1] *= f_lo;
          o_acc[nt][2] *= f_hi; o_acc[nt][3] *= f_hi;
        }
        if (!v_bad) {  // P v: P from registers, v from shared memory
          rtk_u32 a[4][4];
          #pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            a[kk][0] = rtk_pack2<DT>(p[2 * kk][0], p[2 * kk][1]);
            a[kk][1] = rtk_pack2<DT>(p[2 * kk][2], p[2 * kk][3]);
            a[kk][2] = rtk_pack2<DT>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
            a[kk][3] = rtk_pack2<DT>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
          }
          const unsigned long long dv = rtk_wg_desc(sV_addr, RTK_MN_LBO(C * 128), RTK_MN_SBO(C * 128));
          rtk_wg_fence();
          #pragma unroll
          for (int nb = 0; nb < BV / 64; ++nb) {
            float (&oa)[32] = reinterpret_cast<float (&)[32]>(o_acc[8 * nb]);
            #pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              rtk_wgmma_rs<DT, 1>(oa, a[kk], rtk_desc_at(dv, (nb * (C * 128) + kk * 2048) >> 4), 1);
          }
          rtk_wg_commit();
          rtk_wg_wait<0>();
          #pragma unroll
          for (int nb = 0; nb < BV / 64; ++nb) rtk_wg_pin(reinterpret_cast<float (&)[32]>(o_acc[8 * nb]));
        } else {  // rare: a non-finite v in this chunk; mma.sync with the operand cleaned
          #pragma unroll
          for (int kk = 0; kk < 4; ++kk) pv(kk);
        }
      } else {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) o_acc[nt][e] = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          #pragma unroll
          for (int e = 0; e < 4; ++e) p[j][e] = 0.f;

        // q_t S and q_t . k_s, sharing the q fragments
        #pragma unroll RTK_KUNROLL
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
        const float fi = inter0 * s_inv;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) o_acc[nt][e] *= fi;
        {
          float step = 1.f;
          #pragma unroll
          for (int j = 7; j >= 0; --j) {
            if (j < 2 * w) {
              const float f0 = col_f0 * step, f1 = col_f1 * step;
              p[j][0] *= f0; p[j][1] *= f1; p[j][2] *= f0; p[j][3] *= f1;
              step *= g8;
            }
          }
        }
        #pragma unroll
        for (int kk = 0; kk < 3; ++kk)
          if (kk < w) pv(kk);
        // rows: gamma^(t - r0) * scale
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          o_acc[nt][0] *= row_lo; o_acc[nt][1] *= row_lo;
          o_acc[nt][2] *= row_hi; o_acc[nt][3] *= row_hi;
        }
        // the diagonal block: gamma^(t-s) * scale for s <= t, a select (not a product) above it;
        // tiles are picked with compile-time indices so p stays in registers
        #pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          if (kk == w) {
            #pragma unroll
            for (int jd = 0; jd < 2; ++jd)
              #pragma unroll
              for (int e = 0; e < 4; ++e) {
                float& x = p[2 * kk + jd][e];
                x = diag[jd][e] >= 0.f ? x * diag[jd][e] : 0.f;
              }
            pv(kk);
          }
        }

      }
      if (v_bad && __any_sync(0xffffffffu, saw_bad)) {
        // rare: mark the outputs a non-finite v_s reaches (rows t >= s of the same column)
        const rtk_u16* sV = sm + stage * L::STAGE + L::V;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = r0 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
            bool hit = false;
            for (int s2 = 0; s2 <= t; ++s2) hit |= (sV[L::v_off(s2, c >> 3) + (c & 7)] & EXP) == EXP;
            if (hit) o_acc[nt][e] = __int_as_float(0x7fc00000);
          }
      }

      // store this warp's output rows (the scale is already in the row and diagonal factors)
      #pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = r0 + g + hh * 8;
        if (t < len) {
          rtk_u16* orow = ob + ((rtk_i64)n0 + t) * o_sn + v0 + 2 * t4;
          if (ovec_full) {  // the usual case: whole tile, 4-byte aligned pairs
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              *reinterpret_cast<rtk_u32*>(orow + nt * 8) = rtk_pack2<DT>(o_acc[nt][2 * hh], o_acc[nt][2 * hh + 1]);
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
      __syncthreads();  // (B) done with the state copy and with this stage
    }
  } else {
    // ---- state warps: fp32 state in registers, 16-bit copy in shared memory --------------------
    const int sr0 = (warp - 4) * MT * 16;  // first state row of a state warp
    float s_acc[MT][NT][4];
    // Where fragment element (mt, nt, e) of the state lives in a [slots, B*H, Dk, Dv] buffer, and
    // whether it is a real (row < Dk, column < Dv) element.
    auto state_elem = [&](int mt, int nt, int e, rtk_i64& off) -> bool {
      const int r = sr0 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
      off = state_slot + ((rtk_i64)bh * Dk + r) * Dv + v0 + c;
      return r < Dk && c < dv_here;
    };
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          rtk_i64 off;
          const bool real = state_elem(mt, nt, e, off);
          s_acc[mt][nt][e] = (init_state != nullptr && real) ? init_state[off] : 0.f;
        }
    auto publish_max = [&](int slot) {  // fp16: before a barrier the output warps also pass
      if (DT != RTK_F16) return;
      float m = 0.f;
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(s_acc[mt][nt][e]));
      const bool fin = __all_sync(0xffffffffu, m < 3.0e38f);  // false for Inf and NaN anywhere
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      if (lane == 0) s_red[slot * 4 + warp - 4] = fin ? m : -1.f;
    };
    auto store_state_copy = [&](int slot) {  // after that barrier
      const float mul = DT == RTK_F16 ? exp2f((float)copy_exponent(slot)) : 1.f;
      rtk_u16* sS = sm + L::S;
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = sr0 + mt * 16 + g + hh * 8, c = nt * 8 + 2 * t4;
            *reinterpret_cast<rtk_u32*>(sS + L::s_off(r, c >> 3) + (c & 7)) =
                rtk_pack2<DT>(s_acc[mt][nt][2 * hh] * mul, s_acc[mt][nt][2 * hh + 1] * mul);
          }
    };
    publish_max(1);
    __syncthreads();  // (matches the output warps' start barrier)
    store_state_copy(1);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      begin_chunk(chunk);
      const int stage = chunk & 1;
      const int n0 = chunk * C;
      const int len = min(C, NS - n0);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
      // ---- state warps: S = gamma^len S + (K * w)^T V, w_s = gamma^(len-1-s) ----------------
#ifdef RTK_PROBE_NO_STATE
      if (chunk >= 0) { publish_max(chunk & 1); __syncthreads(); store_state_copy(chunk & 1); continue; }
#endif
      const float carry = rtk_exp2(lg2 * (float)len);
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) s_acc[mt][nt][e] *= carry;
      #pragma unroll 1
      for (int kk = 0; kk * 16 < len; ++kk) {
        {
          const int s_a = kk * 16 + 2 * t4, s_b = s_a + 8;
          const rtk_u32 wa = rtk_pack2<DT>(s_a < len ? rtk_exp2(lg2 * (float)(len - 1 - s_a)) : 0.f,
                                           s_a + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_a)) : 0.f);
          const rtk_u32 wb = rtk_pack2<DT>(s_b < len ? rtk_exp2(lg2 * (float)(len - 1 - s_b)) : 0.f,
                                           s_b + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_b)) : 0.f);
          rtk_u32 a[MT][4];
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            rtk_ldsm_x4_trans(a[mt], sK_addr + 2 * L::qk_off(kk * 16 + (lane & 7) + (lane >> 4) * 8, (sr0 + mt * 16) / 8 + ((lane >> 3) & 1)));
            a[mt][0] = rtk_mul2<DT>(a[mt][0], wa);  // k_s * gamma^(len-1-s), s = kk*16 + 2*t4 + {0, 1}
            a[mt][1] = rtk_mul2<DT>(a[mt][1], wa);
            a[mt][2] = rtk_mul2<DT>(a[mt][2], wb);  // s + 8
            a[mt][3] = rtk_mul2<DT>(a[mt][3], wb);
          }
          #pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            rtk_u32 bb[4];
            rtk_ldsm_x4_trans(bb, sV_addr + 2 * L::v_off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 2 + (lane >> 4)));
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              rtk_mma16816<DT>(s_acc[mt][2 * np], a[mt], bb[0], bb[1]);
              rtk_mma16816<DT>(s_acc[mt][2 * np + 1], a[mt], bb[2], bb[3]);
            }
          }
        }
      }
      publish_max(chunk & 1);
      __syncthreads();  // (B) the output warps are done with the state copy, everyone with this stage
      store_state_copy(chunk & 1);
    }
    if (final_state != nullptr) {
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            rtk_i64 off;
            if (state_elem(mt, nt, e, off)) final_state[off] = s_acc[mt][nt][e];
          }
    }
  }

}

// The middle pass of the split-sequence strategy. local[z] holds segment z's own final state (its
// pass over the segment started from zero); this turns them into the state entering each
// segment, s_in[z] = gamma^seg_len s_in[z-1] + local[z-1] with s_in[0] the initial state (or 0),
// and the final state gamma^last_len s_in[last] + local[last]. One thread per state element,
// segments in order: deterministic.
__global__ void rtk_chunk_seg_scan(const float* __restrict__ local, float* __restrict__ s_in,
                                   const float* __restrict__ init_state, float* __restrict__ final_state,
                                   const float* __restrict__ log_decay, rtk_i64 nseg, rtk_i64 BH,
                                   rtk_i64 H, rtk_i64 DkDv, rtk_i64 seg_len, rtk_i64 last_len) {
  const rtk_i64 total = BH * DkDv;
  for (rtk_i64 e = (rtk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (rtk_i64)gridDim.x * blockDim.x) {
    const int h = (int)((e / DkDv) % H);
    const float lg = log_decay[h];
    const float carry = expf(lg * (float)seg_len);
    float st = init_state != nullptr ? init_state[e] : 0.f;
    for (rtk_i64 z = 0; z < nseg; ++z) {
      s_in[z * total + e] = st;
      if (z + 1 < nseg) st = fmaf(carry, st, local[z * total + e]);
    }
    if (final_state != nullptr) final_state[e] = fmaf(expf(lg * (float)last_len), st, local[(nseg - 1) * total + e]);
  }
}
