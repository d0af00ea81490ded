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
// the operand of q_t S. Both groups work on the same chunk at the same time and meet at one
// barrier per chunk: the q/k/v tiles (cp.async) and the state copy are double-buffered, so the
// state warps load chunk c + 1 and write the copy of S entering it while the output warps
// compute chunk c.
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

// The last parameter of rtk_chunk_fwd: the whole fused pass (init_state: the state entering the
// CTA's segment, slot z), the states-only pass of the split-sequence strategy, or the fused pass
// after rtk_chunk_states (init_state: its slots, see rtk_chunk_state::fold; the final state is
// stored by the last segment, unslotted).
#define RTK_MODE_FUSED 0
#define RTK_MODE_STATES 1
#define RTK_MODE_FOLD 2

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
  // two 16-bit copies of the state, KMAX x BV each: the state entering chunk c in copy c % 2;
  // KMAX 256 keeps one (its tiles fill the 163 KB of an A100), written after an extra barrier
  static constexpr int S = 2 * STAGE, SCOPY = KMAX * (SW ? BV : VS), NCOPY = KMAX == 256 ? 1 : 2;
  // SW only: two buffers of the chunk's 64 output rows on their way to global memory (rows of
  // BV + 8 elements: conflict-free stmatrix, 16-byte aligned rows for the bulk copies)
  static constexpr int OS = BV + 8, O = S + NCOPY * SCOPY;
  static constexpr int ELEMS = O + (SW ? 2 * C * OS : 0);
  static constexpr int ALIGN = SW ? 1024 : 0;            // slack for aligning the base
  static constexpr int BYTES = ELEMS * 2 + 32 + ALIGN;  // + fp16 scaling: max|S| of the 4 state warps, 2 slots
  static __device__ __forceinline__ int qk_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * KS + p * 8; }
  static __device__ __forceinline__ int v_off(int r, int p) { return SW ? rtk_swz_off(C, r, p) : r * VS + p * 8; }
  static __device__ __forceinline__ int s_off(int r, int p) { return SW ? rtk_swz_off(KMAX, r, p) : r * VS + p * 8; }
};

// ---- pieces both forward kernels share (rtk_chunk_fwd below, rtk_chunk_fwd_f32 at the end) ------

// The CTA's place, as locals of a kernel whose q, k, v, o hold elements of type T and whose tile
// has BV value columns: thread and warp roles, (batch, head), the value tile, and the
// split-sequence strategy: CTA z handles tokens [z * seg_len, z * seg_len + NS) and its state
// enters from / leaves to slot z of the state buffers (one segment, z = 0, otherwise).
// kt_used: the k-steps of 2^KSHIFT columns that hold real q/k columns; ovec_full: the output rows
// of the tile take paired stores (whole tile, pairs aligned).
#define RTK_CHUNK_CTA(T, KSHIFT)                                                                  \
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;                                  \
  const int g = lane >> 2, t4 = lane & 3;                                                         \
  const bool out_warp = warp < 4;                                                                 \
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;                                          \
  const int v0 = blockIdx.y * BV;                                                                 \
  const float lg2 = log_decay[h] * 1.4426950408889634f; /* log2(gamma) */                         \
  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};                             \
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};                             \
  const rtk_i64 n_begin = (rtk_i64)blockIdx.z * seg_len;                                          \
  const int NS = (int)min((rtk_i64)N - n_begin, seg_len);                                         \
  const rtk_i64 state_slot = (rtk_i64)blockIdx.z * gridDim.x * Dk * Dv;                           \
  const T* qb = q + rtk_offset(qs, b, h, n_begin);                                                \
  const T* kb = k + rtk_offset(ks, b, h, n_begin);                                                \
  const T* vb = v + rtk_offset(vs, b, h, n_begin) + v0;                                           \
  T* ob = o + rtk_offset(os, b, h, n_begin);                                                      \
  const int dv_here = min(BV, Dv - v0); /* value columns of this tile */                          \
  const int kt_used = (Dk + (1 << KSHIFT) - 1) >> KSHIFT;                                         \
  const bool ovec_full = dv_here == BV && ((o_sn & 1) == 0) &&                                    \
                         ((reinterpret_cast<size_t>(ob + v0) & (2 * (int)sizeof(T) - 1)) == 0)

// Loading one chunk into a stage, the state warps' job (they have slack; all THREADS threads of
// rtk_chunk_states). Thread st = tid - 128 (st = tid there) copies 16-byte pieces (E elements) at a fixed column of rows st / PIECES + pass * ROWS, so every
// address is a base pointer plus a multiple of the row stride. The pointers of pass 0 keep the
// column inside the row when it lies past Dk or Dv: nothing is read there, the zero-fill does the
// work.
template <typename T, int KMAX, int BV, int THREADS = 128>
struct rtk_chunk_loader {
  static constexpr int SZ = (int)sizeof(T), E = 16 / SZ;
  static constexpr int QV = KMAX / E, VV = BV / E;                  // 16-byte pieces per q/k row and per v row
  static constexpr int QROWS = THREADS / QV, VROWS = THREADS / VV;  // rows one pass of the loader threads covers
  int st, qcol, qrow, vcol, vrow, qbytes, vbytes;
  const T *qb, *kb, *vb, *q_first, *k_first, *v_first;
  rtk_i64 q_sn, k_sn, v_sn;

  __device__ __forceinline__ rtk_chunk_loader(int st_, int Dk, int dv_here, const T* qb_, const T* kb_,
                                              const T* vb_, rtk_i64 q_sn_, rtk_i64 k_sn_, rtk_i64 v_sn_)
      : st(st_), qcol((st_ % QV) * E), qrow(st_ / QV), vcol((st_ % VV) * E), vrow(st_ / VV),
        qbytes(max(0, min(16, (Dk - qcol) * SZ))), vbytes(max(0, min(16, (dv_here - vcol) * SZ))),
        qb(qb_), kb(kb_), vb(vb_),
        q_first(qb_ + (rtk_i64)qrow * q_sn_ + (qbytes ? qcol : 0)),
        k_first(kb_ + (rtk_i64)qrow * k_sn_ + (qbytes ? qcol : 0)),
        v_first(vb_ + (rtk_i64)vrow * v_sn_ + (vbytes ? vcol : 0)), q_sn(q_sn_), k_sn(k_sn_), v_sn(v_sn_) {}

  // cp.async of chunk rows n0 .. n0 + C - 1 (those < NS; the rest zero-filled) to this thread's
  // pieces at shared addresses dq, dk, dv (row strides KS and VS elements); q only when with_q
  // (the states-only pass of the split-sequence strategy reads no q).
  template <int C, int KS, int VS>
  __device__ __forceinline__ void copy(rtk_u32 dq, rtk_u32 dk, rtk_u32 dv, int n0, int NS, bool with_q) const {
    const char* qp = reinterpret_cast<const char*>(q_first + (rtk_i64)n0 * q_sn);
    const char* kp = reinterpret_cast<const char*>(k_first + (rtk_i64)n0 * k_sn);
    const char* vp = reinterpret_cast<const char*>(v_first + (rtk_i64)n0 * v_sn);
    const rtk_i64 qstep = SZ * QROWS * q_sn, kstep = SZ * QROWS * k_sn, vstep = SZ * VROWS * v_sn;
    if (n0 + C <= NS) {  // a whole chunk: no row checks
      #pragma unroll
      for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
        if (with_q) rtk_cp_async16(dq + SZ * u * QROWS * KS, qp, qbytes);
        rtk_cp_async16(dk + SZ * u * QROWS * KS, kp, qbytes);
      }
      #pragma unroll
      for (int u = 0; u < C / VROWS; ++u, vp += vstep) rtk_cp_async16(dv + SZ * u * VROWS * VS, vp, vbytes);
    } else {
      #pragma unroll
      for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
        const bool in = n0 + qrow + u * QROWS < NS;
        if (with_q) rtk_cp_async16(dq + SZ * u * QROWS * KS, in ? (const void*)qp : (const void*)qb, in ? qbytes : 0);
        rtk_cp_async16(dk + SZ * u * QROWS * KS, in ? (const void*)kp : (const void*)kb, in ? qbytes : 0);
      }
      #pragma unroll
      for (int u = 0; u < C / VROWS; ++u, vp += vstep) {
        const bool in = n0 + vrow + u * VROWS < NS;
        rtk_cp_async16(dv + SZ * u * VROWS * VS, in ? (const void*)vp : (const void*)vb, in ? vbytes : 0);
      }
    }
  }
};

// An output warp's decay factors, fixed for the whole sequence; the warp owns rows r0 .. r0+15 of
// each chunk, (g, t4) are the thread's fragment coordinates. gamma^(8 - 2 t4 - e) for the thread's
// two key columns in an 8-wide tile (exponents 1..8), gamma^8 to step one tile to the left,
// gamma^(t - r0) * scale for its two rows (t = r0 + g, + 8), gamma^(r0 + 1), and gamma^(t - s) *
// scale inside the 16 x 16 diagonal block (-1 where s > t: the mask is a select).
struct rtk_chunk_decay {
  float col_f0, col_f1, g8, row_lo, row_hi, inter0, diag[2][4];

  __device__ __forceinline__ rtk_chunk_decay(float lg2, float scale, int g, int t4, int r0) {
    col_f0 = rtk_exp2(lg2 * (float)(8 - 2 * t4));
    col_f1 = rtk_exp2(lg2 * (float)(7 - 2 * t4));
    g8 = rtk_exp2(lg2 * 8.f);
    row_lo = rtk_exp2(lg2 * (float)g) * scale;
    row_hi = rtk_exp2(lg2 * (float)(g + 8)) * scale;
    inter0 = rtk_exp2(lg2 * (float)(r0 + 1));
    #pragma unroll
    for (int jd = 0; jd < 2; ++jd)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dt = g + (e >> 1) * 8 - (jd * 8 + 2 * t4 + (e & 1));
        diag[jd][e] = dt >= 0 ? rtk_exp2(lg2 * (float)dt) * scale : -1.f;
      }
  }
  // The scores p[j] of key tiles j left of warp w's diagonal block times gamma^(r0-s): tile j
  // lies 8(2w-1-j) + (8 - 2 t4 - e) to the left of r0 (the rows' gamma^(t-r0) comes later).
  __device__ __forceinline__ void scale_left(float (&p)[8][4], int w) const {
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
  // All 64 keys of warp W's scores (the wgmma kernel): gamma^(t-s) * scale for s <= t (left of
  // the diagonal block, right to left, as row factor x column factor, gamma^(r0-s) = col_f *
  // gamma^(8 per tile); inside it directly), 0 above the diagonal (a select: q.k may be Inf there).
  template <int W> __device__ __forceinline__ void scale_scores(float (&p)[8][4]) const {
    float step_lo = row_lo, step_hi = row_hi;
    #pragma unroll
    for (int j = 2 * W - 1; j >= 0; --j) {
      const float f0l = col_f0 * step_lo, f1l = col_f1 * step_lo, f0h = col_f0 * step_hi, f1h = col_f1 * step_hi;
      p[j][0] *= f0l; p[j][1] *= f1l; p[j][2] *= f0h; p[j][3] *= f1h;
      step_lo *= g8;
      step_hi *= g8;
    }
    mask_diag(p[2 * W], 0);
    mask_diag(p[2 * W + 1], 1);
    #pragma unroll
    for (int j = 2 * W + 2; j < 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) p[j][e] = 0.f;
  }
  // Output rows times gamma^(t - r0) * scale.
  template <int NT> __device__ __forceinline__ void scale_rows(float (&o_acc)[NT][4]) const {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      o_acc[nt][0] *= row_lo; o_acc[nt][1] *= row_lo;
      o_acc[nt][2] *= row_hi; o_acc[nt][3] *= row_hi;
    }
  }
  // Tile jd of the diagonal block: gamma^(t-s) * scale for s <= t, a select (not a product) above
  // it (q.k may be Inf there).
  __device__ __forceinline__ void mask_diag(float (&x)[4], int jd) const {
    #pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = diag[jd][e] >= 0.f ? x[e] * diag[jd][e] : 0.f;
  }
};

// Zero the accumulators of fragments.
template <int A, int B> __device__ __forceinline__ void rtk_zero(float (&x)[A][B]) {
  #pragma unroll
  for (int i = 0; i < A; ++i)
    #pragma unroll
    for (int j = 0; j < B; ++j) x[i][j] = 0.f;
}

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
// committed as one group per lane and chunk. Before refilling a buffer, the copies that read it
// two chunks before must be done (wait_read<1>); the kernel waits for all before it ends.
template <int DT, int NT, int OS>
__device__ __forceinline__ void rtk_chunk_send_rows(typename rtk_io<DT>::T* ob, const float (&o_acc)[NT][4],
                                                    rtk_u32 stage, int n0, int r0, int lane, int len,
                                                    rtk_i64 o_sn, int v0) {
  rtk_bulk_wait_read<1>();
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

// MINB: CTAs per SM the register budget is sized for (2: 128 registers a thread, for grids of
// more than one wave; 1: no spills, for grids that give each SM at most one CTA anyway).
// WG (sm_90a only, KMAX <= 128, BV a multiple of 64): the output warps form one warpgroup that
// computes the chunk with wgmma (q k^T and q S from shared memory, P v with P from registers);
// otherwise each output warp uses mma.sync on its 16 rows.
template <int DT, int KMAX, int BV, bool VEC, int MINB, bool WG>
__global__ void __launch_bounds__(256, MINB)
rtk_chunk_fwd(RTK_FWD_PARAMS(rtk_u16), rtk_i64 seg_len, int mode) {
  RTK_FWD_SIZES;
  const bool states_only = mode == RTK_MODE_STATES;
  typedef rtk_chunk_smem<KMAX, BV, WG> L;
  // A second CTA barrier per chunk, before the state warps write the next state copy: with one
  // copy (KMAX 256), and for fp16, whose copy is scaled by the 4 state warps' common maximum
  // (a barrier of the state warps alone would do, but compute-sanitizer's racecheck reported
  // hazards on the copy with it in the mma.sync kernel).
  constexpr bool SERIAL = L::NCOPY == 1 || DT == RTK_F16;
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
  // fp16 only: each state warp publishes max|S| of its rows (or -1 when not finite) for the copy of
  // S entering chunk c in slot c % 2; the state warps read the 4 values after a barrier of their
  // own, the output warps after the CTA barrier ending the period before chunk c, and both derive
  // the same power of two 2^e, max|S| * 2^e <= 2^14.
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

  RTK_CHUNK_CTA(rtk_u16, 4);  // k-steps of 16 columns

  typedef rtk_chunk_loader<rtk_u16, KMAX, BV> LD;
  const LD ld(tid - 128, Dk, dv_here, qb, kb, vb, q_sn, k_sn, v_sn);
  constexpr int VROWS = LD::VROWS;
  const int st = ld.st, vcol = ld.vcol, vrow = ld.vrow;
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sQ = sm + stage * L::STAGE + L::Q;
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if (VEC) {
      ld.template copy<C, KS, VS>(rtk_smem_addr(sQ + L::qk_off(ld.qrow, ld.qcol >> 3)),
                                  rtk_smem_addr(sK + L::qk_off(ld.qrow, ld.qcol >> 3)),
                                  rtk_smem_addr(sV + L::v_off(vrow, vcol >> 3)), n0, NS, !states_only);
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

  // The state warps' end of a chunk period: wait for their copies of chunk `next` (issued at the
  // start of the period), look for non-finite v in it, then the CTA barrier, which ORs the answers.
  // Returns whether chunk `next`'s v holds Inf/NaN.
  auto end_period = [&](int next) -> bool {
    bool my_bad = false;
    if (!out_warp) {
      rtk_cp_async_wait<0>();
      if (!VEC) rtk_named_sync(1, 128);  // the chunk was stored by other state warps
      if (next < nchunks) {
        // the v pieces of this thread's loader set: any Inf/NaN?
        const rtk_u16* sV = sm + (next & 1) * L::STAGE + L::V;
        #pragma unroll
        for (int u = 0; u < C / VROWS; ++u) {
          const uint4 x = *reinterpret_cast<const uint4*>(sV + L::v_off(vrow + u * VROWS, vcol >> 3));
          my_bad |= rtk_nonfinite2<DT>(x.x) | rtk_nonfinite2<DT>(x.y) | rtk_nonfinite2<DT>(x.z) |
                    rtk_nonfinite2<DT>(x.w);
        }
      }
      // the tiles (cp.async) and the state copy (st.shared) are read by wgmma next: async proxy
      if (WG) rtk_fence_proxy_async();
    }
#ifdef RTK_PROBE_NO_LOAD
    my_bad = false;
#endif
    return __syncthreads_or(my_bad) != 0;
  };

  // The two groups run separate loops (so neither holds the other's registers) and meet at one
  // barrier per chunk (end_period). In the period of chunk c the output warps compute its outputs
  // from stage c % 2 and state copy c % 2, while the state warps load chunk c + 1 into the other
  // stage, update S with chunk c and write the copy of S entering chunk c + 1 into the other copy.
  if (out_warp) {
    // ---- output warps: per-thread decay factors, fixed for the whole sequence -----------------
    const int w = warp, r0 = 16 * warp;  // this warp's rows r0 .. r0+15 of each chunk
    const rtk_chunk_decay dec(lg2, scale, g, t4, r0);
    // the wgmma kernel sends whole, 16-byte aligned output rows with bulk copies
    const bool osend = WG && ovec_full && o_sn % 8 == 0 && (reinterpret_cast<size_t>(ob + v0) & 15) == 0;
    float s_inv = 1.f;  // the state copy holds S * 2^e (fp16); s_inv = 2^-e
    if (SERIAL) __syncthreads();  // (the state warps' next_copy)
    bool v_bad = end_period(0);   // chunk 0 and the first state copy are in place
    auto out_end = [&](int chunk) -> bool {
      if (SERIAL) __syncthreads();  // done with the state copy (the state warps' next_copy)
      return end_period(chunk + 1);
    };

    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk & 1;
      if (DT == RTK_F16) s_inv = exp2f((float)-copy_exponent(stage));
      const rtk_u32 sS_addr = rtk_smem_addr(sm + L::S + (L::NCOPY == 2 ? stage : 0) * L::SCOPY);
      const int n0 = chunk * C;
      const int len = min(C, NS - n0);
      const rtk_u32 sQ_addr = rtk_smem_addr(sm + stage * L::STAGE + L::Q);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
#ifdef RTK_PROBE_NO_OUT
      if (chunk >= 0) { v_bad = out_end(chunk); continue; }
#endif
      if (states_only) {  // first pass of the split-sequence strategy: no outputs
        v_bad = out_end(chunk);
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
#ifdef RTK_PROBE_NO_QS
        rtk_zero(o_acc);
        if (chunk < 0)
#endif
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
        // P: gamma^(t-s) * scale for s <= t, 0 above the diagonal (code per warp: no branches)
        switch (w) {
          case 0: dec.scale_scores<0>(p); break;
          case 1: dec.scale_scores<1>(p); break;
          case 2: dec.scale_scores<2>(p); break;
          default: dec.scale_scores<3>(p); break;
        }
        rtk_wg_wait<0>();
        #pragma unroll
        for (int nb = 0; nb < BV / 64; ++nb) rtk_wg_pin(reinterpret_cast<float (&)[32]>(o_acc[8 * nb]));
        // q S rows: gamma^(t+1) * scale (and the fp16 copy's 2^-e)
        const float f_lo = dec.inter0 * s_inv * dec.row_lo, f_hi = dec.inter0 * s_inv * dec.row_hi;
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
        rtk_zero(o_acc);
        rtk_zero(p);

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
#ifdef RTK_PROBE_NO_STORE
      if (o_acc[0][0] == 1.2345e-30f)
#endif
      if (WG && osend)
        rtk_chunk_send_rows<DT, NT, L::OS>(ob, o_acc, rtk_smem_addr(sm + L::O + stage * C * L::OS), n0, r0, lane,
                                           len, o_sn, v0);
      else
        rtk_chunk_store_rows<DT>(ob, o_acc, n0, r0, g, t4, len, o_sn, v0, dv_here, ovec_full);
      v_bad = out_end(chunk);  // done with this stage and this state copy
    }
    if (WG && osend) rtk_bulk_wait_all<0>();
  } else {
    // ---- state warps: fp32 state in registers, 16-bit copy in shared memory --------------------
    const int sr0 = (warp - 4) * MT * 16;  // first state row of a state warp
    float s_acc[MT][NT][4];
    const rtk_chunk_state<MT, NT> sf = {sr0, g, t4, bh, Dk, Dv, v0, dv_here, mode == RTK_MODE_FOLD ? 0 : state_slot};
    if (mode == RTK_MODE_FOLD) sf.fold(s_acc, init_state, log_decay[h], seg_len, gridDim.x);
    else sf.load(s_acc, init_state);
    auto publish_max = [&](int slot) {  // fp16
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
    // the copy of S entering chunk c: copy c % 2, with fp16 scaling slot c % 2 (after publish_max
    // and a CTA barrier)
    auto store_state_copy = [&](int slot) {
      const float mul = DT == RTK_F16 ? exp2f((float)copy_exponent(slot)) : 1.f;
      rtk_u16* sS = sm + L::S + (L::NCOPY == 2 ? slot : 0) * L::SCOPY;
      sf.pairs(s_acc, [&](int r, int c, float lo, float hi) {
        rtk_store_pair<DT>(sS + L::s_off(r, c >> 3) + (c & 7), lo * mul, hi * mul);
      });
    };
    // once per period (and before the first): with SERIAL a CTA barrier between publishing the
    // fp16 maximum and writing the copy (and, with one copy, after the output warps' reads of it)
    auto next_copy = [&](int slot, bool store) {
      publish_max(slot);
      if (SERIAL) __syncthreads();
#ifdef RTK_PROBE_NO_COPY
      store = false;
#endif
      if (store) store_state_copy(slot);
    };
    load_chunk(0, 0);
    rtk_cp_async_commit();
    next_copy(0, true);
    end_period(0);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk & 1;
#ifndef RTK_PROBE_NO_LOAD
      if (chunk + 1 < nchunks) load_chunk(chunk + 1, stage ^ 1);  // its stage was read in period c - 1
#endif
      rtk_cp_async_commit();
      const int n0 = chunk * C;
      const int len = min(C, NS - n0);
      const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
      const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
      // ---- state warps: S = gamma^len S + (K * w)^T V, w_s = gamma^(len-1-s) ----------------
#ifdef RTK_PROBE_NO_STATE
      if (chunk >= 0) {
        next_copy(stage ^ 1, chunk + 1 < nchunks);
        end_period(chunk + 1);
        continue;
      }
#endif
      const float carry = rtk_exp2(lg2 * (float)len);
      rtk_frag_scale(s_acc, carry);
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
      // the copy of S entering chunk c + 1 (its buffer was read in period c - 1; with one copy,
      // after the output warps are done with it)
      next_copy(stage ^ 1, chunk + 1 < nchunks);
      end_period(chunk + 1);
    }
    if (mode != RTK_MODE_FOLD || blockIdx.z + 1 == gridDim.z) sf.store(s_acc, final_state);
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

// The first pass of the split-sequence strategy for 16-bit inputs, as a kernel of its own: the
// state each segment but the last ends with, local[z] = sum_s gamma^(NS-1-s) k_s^T v_s over the
// segment's NS tokens (segment 0 from the initial state, the others from zero), formed chunk by
// chunk as S = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s exactly as the state warps of
// rtk_chunk_fwd do (the same operands, weights and mma), into slot z + 1 of final_state; segment
// 0's CTAs also copy the initial state (zeros without one) to slot 0. The fused pass then starts
// each segment from these slots (RTK_MODE_FOLD): no scan kernel, and the last segment, whose
// state nobody needs before the fused pass, is not read twice. Same parameters as rtk_chunk_fwd
// (q and o are not read).
//
// Why not rtk_chunk_fwd with states_only: there half the warps idle, the registers and shared
// memory are sized for the fused pass, and a value tile narrower than Dv reads k once per tile.
// Here every warp computes and all threads load, the tile is as wide as the registers allow (BV
// 128 for KMAX <= 128), and the eight warps tile the KMAX x BV state 4 x 2: warp w owns the 16 MT
// rows (w % 4) * 16 MT .. and the BV / 2 columns (w / 4) * BV / 2 .., for every key of each chunk
// (large warp tiles: fewer shared-memory fragment loads per mma). STAGES chunks of k and v in
// flight (cp.async), one barrier per chunk.
template <int KMAX, int BV, int STAGES>
struct rtk_chunk_states_smem {
  static constexpr int C = 64, KS = KMAX + 8, VS = BV + 8;  // rows padded by 16 bytes
  static constexpr int K = 0, V = C * KS, STAGE = V + C * VS;
  static constexpr int BYTES = STAGES * STAGE * 2;
};

template <int DT, int KMAX, int BV, bool VEC, int STAGES>
__global__ void __launch_bounds__(256, 2)
rtk_chunk_states(RTK_FWD_PARAMS(rtk_u16), rtk_i64 seg_len, int unused) {  // grid.z: segments - 1
  RTK_FWD_SIZES;
  typedef rtk_chunk_states_smem<KMAX, BV, STAGES> L;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  constexpr int NT = BV / 16, MT = KMAX / 64;  // a warp's n-tiles (8 columns) and m-tiles (16 rows)
  static_assert(BV % 32 == 0 && KMAX % 64 == 0 && STAGES >= 2, "bad tile");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  rtk_u16* sm = reinterpret_cast<rtk_u16*>(smem_raw);

  RTK_CHUNK_CTA(rtk_u16, 4);
  (void)out_warp; (void)kt_used; (void)ovec_full;
  const int sr0 = (warp & 3) * MT * 16, c0 = (warp >> 2) * (BV / 2);  // the warp's rows and columns

  typedef rtk_chunk_loader<rtk_u16, KMAX, BV, 256> LD;
  const LD ld(tid, Dk, dv_here, kb, kb, vb, k_sn, k_sn, v_sn);
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if (VEC) {
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
  // segment z ends with: for z = 0 from the initial state (the state entering segment 1), else
  // from zero; rtk_chunk_fwd in RTK_MODE_FOLD combines them (rtk_chunk_state::fold)
  const rtk_i64 slot = (rtk_i64)gridDim.x * Dk * Dv;
  const rtk_chunk_state<MT, NT> sf = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, state_slot + slot};
  float s_acc[MT][NT][4];
  rtk_zero(reinterpret_cast<float (&)[MT * NT][4]>(s_acc));
  if (blockIdx.z == 0) {
    const rtk_chunk_state<MT, NT> s0 = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, 0};
    s0.load(s_acc, init_state);
    s0.store(s_acc, final_state);
  }
  const int nchunks = (NS + C - 1) / C;
  #pragma unroll
  for (int c = 0; c < STAGES - 1; ++c) {
    if (c < nchunks) load_chunk(c, c);
    rtk_cp_async_commit();
  }
  #pragma unroll 1
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    rtk_cp_async_wait<STAGES - 2>();
    __syncthreads();  // chunk visible to all; everyone is done with the stage loaded next
    if (chunk + STAGES - 1 < nchunks) load_chunk(chunk + STAGES - 1, (chunk + STAGES - 1) % STAGES);
    rtk_cp_async_commit();
    const int stage = chunk % STAGES;
    const int len = min(C, NS - chunk * C);
    const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
    const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);
    const float carry = rtk_exp2(lg2 * (float)len);
    rtk_frag_scale(s_acc, carry);
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk * 16 < len) {
        const int s_a = kk * 16 + 2 * t4, s_b = s_a + 8;
        const rtk_u32 wa = rtk_pack2<DT>(s_a < len ? rtk_exp2(lg2 * (float)(len - 1 - s_a)) : 0.f,
                                         s_a + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_a)) : 0.f);
        const rtk_u32 wb = rtk_pack2<DT>(s_b < len ? rtk_exp2(lg2 * (float)(len - 1 - s_b)) : 0.f,
                                         s_b + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_b)) : 0.f);
        // every fragment of the k-step first, then the mma: the ldmatrix and mma asm statements
        // are volatile (kept in order), so interleaving them would expose each load's latency
        rtk_u32 a[MT][4], bb[NT / 2][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          rtk_ldsm_x4_trans(a[mt], sK_addr + 2 * ((kk * 16 + (lane & 7) + (lane >> 4) * 8) * KS +
                                                  sr0 + mt * 16 + ((lane >> 3) & 1) * 8));
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          rtk_ldsm_x4_trans(bb[np], sV_addr + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + c0 +
                                                   np * 16 + (lane >> 4) * 8));
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = rtk_mul2<DT>(a[mt][0], wa);  // k_s * gamma^(len-1-s), s = kk*16 + 2*t4 + {0, 1}
          a[mt][1] = rtk_mul2<DT>(a[mt][1], wa);
          a[mt][2] = rtk_mul2<DT>(a[mt][2], wb);  // s + 8
          a[mt][3] = rtk_mul2<DT>(a[mt][3], wb);
        }
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            rtk_mma16816<DT>(s_acc[mt][2 * np], a[mt], bb[np][0], bb[np][1]);
            rtk_mma16816<DT>(s_acc[mt][2 * np + 1], a[mt], bb[np][2], bb[np][3]);
          }
      }
    }
  }
  sf.store(s_acc, final_state);
}

// =================================================================================================
// rtk_chunk_fwd_f32: fp32 inputs on TF32 tensor cores (mma.sync m16n8k8), same algorithm, same
// warp roles, same barriers (A) and (B) and the same parameters as rtk_chunk_fwd (so the launch
// code, the split-sequence strategy and rtk_chunk_seg_scan serve both). The parts that do not
// depend on the element type or the mma shape are shared with rtk_chunk_fwd (RTK_CHUNK_CTA, the
// loader, the decay factors, the output stores, the state's load and store; see above); like it,
// the states-only pass loads no q.
//
// EXACT (3xTF32): every mma operand x -- q, k, v, the decayed scores P, the state copy and
// k_s * gamma^(len-1-s) -- is split as x = hi + lo (rtk_split_tf32: hi is x truncated to tf32 with
// one logic instruction, lo = x - hi, exact, goes to the mma as raw fp32 bits) and each product
// is formed as lo*hi' + hi*lo' + hi*hi' with fp32 accumulation: about fp32 accuracy. Without
// EXACT: one TF32 mma per product (operands rounded to 10 mantissa bits by cvt.rna): about 1e-3
// relative error.
//
// Differences from the 16-bit kernel:
// - Tiles stay fp32 in shared memory (cp.async copies 4 floats per 16 bytes); fragments are read
//   with plain 32-bit loads (ldmatrix moves 16-bit elements) and split in registers. Row strides
//   are padded so that every fragment load is conflict-free: q/k and v rows by 4 floats (stride
//   = 4 mod 32 banks), the state copy by 8 (stride = 8 mod 32; its float2 stores are then
//   conflict-free too). The bank of each load is noted where it is made.
// - The state copy is fp32 (no scaling needed).
// - Each chunk's state contribution sum_s gamma^(len-1-s) k_s^T v_s is accumulated in fresh
//   registers and then added with one fp32 FMA, S = gamma^len S + delta: the long sum over chunks
//   is rounded to nearest once per chunk instead of going through the tensor cores' accumulation
//   for every token. gamma^len is computed in double precision: its rounding error compounds
//   over the chunks.
// - STAGES = 1 (KMAX = 256: two stages of fp32 q/k tiles do not fit in shared memory): the next
//   chunk is loaded after barrier (B) and waited for before (A), without overlap.
// - NaN in v: as in the 16-bit kernel, zeroed in the P V operand and put back as NaN in the
//   outputs the causal sum reaches (a one-pass version of rtk_chunk_mark_nonfinite, run by every
//   output warp whenever the chunk's v holds one). Without VEC the loader threads check the
//   values they store.
// - EXACT runs twelve warps (384 threads): the 4 output warps as in rtk_chunk_fwd and NSW = 8
//   state warps; state warp 4 + j (j = 0..7) holds rows 16 MT (j % 4) .. + 16 MT - 1 of the state
//   and value columns (j / 4) BV/2 .. + BV/2 - 1 (a quarter of the rows, half the columns). Its
//   warps mostly issue shared loads, operand splits and mma; a third warp per SM sub-partition
//   (output warp w, state warps 4 + w and 8 + w) keeps the tensor pipe busier than two. Without
//   EXACT (no splits) the extra warps cost more than they give: NSW = 4 state warps (all the
//   columns each), 256 threads. Measured at (4,32,4096,128) on an H200, kernel only: EXACT 1.11 ms
//   with 12 warps, 1.21 with 8; TF32 0.82 with 12, 0.74 with 8. Registers: at most 168 a thread
//   with 384 threads (65536 / 384), 255 with 256.
// - The state warps take part of q S (the "pieces", below), so that the output warps, whose work
//   grows with their rows, do not hold everyone up at (B). Each output warp runs its own compiled
//   copy of the output loop (out_loop inlined with W = its index as a constant), so its loops over
//   key tiles and n-tiles have fixed bounds and no branches.
//
// q S pieces. Per chunk, output warp w does q S for its 16 rows (KMAX/8 k-steps x NT n-tiles of
// m16n8k8 mma), then the scores of its rows against keys 0 .. 16w+15 and P V over those keys; for
// KMAX = 128, BV = 64 that is 128 + 48 (w + 1) mma (x3 with EXACT): 176, 224, 272, 320, against
// 128 (NSW = 4) or 64 (NSW = 8) for a state warp's update. So q S is cut into pieces of 16 rows x
// PT n-tiles, PT = 2 NT / NSW (half the tile with 4 state warps, a quarter with 8), and each state
// warp computes one of them (slot j = its index among the state warps; rtk_f32_pieces):
//
//   NSW = 4                                        NSW = 8
//   row block 0: all by output warp 0              all by output warp 0
//   row block 1: half 0 by output warp 1, half 1   quarters 0..2 by output warp 1, quarter 3 by
//                by slot 0                         slot 0
//   row block 2: half 0 by output warp 2, half 1   quarter 0 by output warp 2, quarters 1..3 by
//                by slot 1                         slots 1..3
//   row block 3: halves 0, 1 by slots 2, 3         quarters 0..3 by slots 4..7
//
// Each piece is computed exactly once, for every tile (BV 32 or 64, KMAX 64, 128 or 256); with
// KMAX = 128, BV = 64 the output warps do 176, 160, 208, 192 mma per chunk and each state warp 192
// (NSW = 4), or 176, 192, 176, 192 and 96 (NSW = 8: 368 to 384 per sub-partition).
// Protocol: a state warp computes its piece right after barrier (A), from the chunk's q tile and
// the state copy -- still the state entering the chunk, as the state warps rewrite the copy only
// after (B) --, stores the raw fp32 sums (no decay factor) in its slot of the piece buffer, in
// accumulator-fragment order ([slot][n-tile][lane], 4 floats: every lane reads back exactly the
// elements it needs, conflict-free), arrives at named barrier 1 (bar.arrive: it does not wait) and
// goes on with the state update. Output warps 1..3 wait at barrier 1 (bar.sync) once their own mma
// work is done and add their pieces to the outputs with the factors q S gets: gamma^(r0+1), then
// the row factor gamma^(t-r0) * scale. Barrier 1 counts 32 (NSW + 3) threads, the state warps and
// output warps 1..3 (output warp 0 takes no piece and never uses it); each of these passes it once per
// chunk of a pass with outputs and never in the states-only pass (both sides skip it there).
// Reuse: the pieces of chunk c+1 are written after (A) of chunk c+1, which no thread passes before
// every output warp has read the pieces of chunk c (before its (B) of chunk c); and a phase of
// barrier 1 completes before (B) of its chunk, so the arrivals of two chunks never mix.
// =================================================================================================

template <int KMAX, int BV, int STAGES, int NSW>
struct rtk_chunk_f32_smem {
  static constexpr int C = 64;
  static constexpr int KS = KMAX + 4;  // row stride of the q and k tiles (floats), 4 mod 32
  static constexpr int VS = BV + 4;    // row stride of the v tile, 4 mod 32
  static constexpr int SS = BV + 8;    // row stride of the fp32 state copy, 8 mod 32
  static constexpr int Q = 0, K = Q + C * KS, V = K + C * KS;
  static constexpr int STAGE = V + C * VS;
  static constexpr int S = STAGES * STAGE;  // the state copy, KMAX x SS
  static constexpr int P = S + KMAX * SS;   // the NSW q S pieces of the state warps (16-byte aligned)
  static constexpr int PIECE = 32 * BV / NSW;  // floats of one piece: 16 rows x 2 BV / NSW columns
  static constexpr int ELEMS = P + NSW * PIECE;
  static constexpr int THREADS = 128 + 32 * NSW;  // 4 output warps, NSW state warps
  static constexpr int BYTES = ELEMS * 4;
};

#ifndef RTK_F32_KUNROLL  // unrolling of the k-step loops of q S and q k^T in rtk_chunk_fwd_f32 (knob; 2 measured 1.79 ms against 1.32 at (4,32,4096,128) on an H200)
#define RTK_F32_KUNROLL 1
#endif

// Who computes which part of q S (see above) with NSW state warps and NT n-tiles: output warp W
// the n-tiles below own(W); the state warps pieces of PT n-tiles each, piece `slot` covering
// n-tiles n0(slot) .. + PT - 1 of row block rb(slot); slot(W, nt) the piece that holds n-tile nt of
// row block W (nt >= own(W)).
template <int NT, int NSW>
struct rtk_f32_pieces {
  static constexpr int PT = 2 * NT / NSW;
  __host__ __device__ static constexpr int own(int W) { return W == 0 ? NT : W == 3 ? 0 : NSW == 4 ? NT / 2 : W == 1 ? 3 * NT / 4 : NT / 4; }
  __host__ __device__ static constexpr int slot(int W, int nt) { return W == 1 ? 0 : W == 2 ? 1 + (nt - own(2)) / PT : NSW / 2 + nt / PT; }
  __host__ __device__ static constexpr int rb(int sl) { return sl == 0 ? 1 : sl < NSW / 2 ? 2 : 3; }
  __host__ __device__ static constexpr int n0(int sl) { return sl == 0 ? own(1) : sl < NSW / 2 ? own(2) + (sl - 1) * PT : (sl - NSW / 2) * PT; }
  static_assert(PT >= 1 && (NT - own(1)) == PT && (NT - own(2)) == (NSW / 2 - 1) * PT, "pieces");
};

// Named barrier 1 of rtk_chunk_fwd_f32 (the q S pieces, see above): the NSW state warps arrive,
// output warps 1..3 wait. Both order this thread's earlier shared-memory accesses before the
// barrier completes (the "memory" clobbers keep the compiler from moving them across).
template <int NSW> __device__ __forceinline__ void rtk_f32_pieces_arrive() {
  asm volatile("bar.arrive 1, %0;" ::"n"(32 * (NSW + 3)) : "memory");
}
template <int NSW> __device__ __forceinline__ void rtk_f32_pieces_wait() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * (NSW + 3)) : "memory");
}

template <int KMAX, int BV, int STAGES, bool EXACT, bool VEC, int MINB>
__global__ void __launch_bounds__(rtk_chunk_f32_smem<KMAX, BV, STAGES, EXACT ? 8 : 4>::THREADS, MINB)
rtk_chunk_fwd_f32(RTK_FWD_PARAMS(float), rtk_i64 seg_len, int states_only) {
  RTK_FWD_SIZES;
  constexpr int NSW = EXACT ? 8 : 4;  // state warps (see above)
  typedef rtk_chunk_f32_smem<KMAX, BV, STAGES, NSW> L;
  typedef rtk_f32_pieces<BV / 8, NSW> PC;
  constexpr int C = L::C, KS = L::KS, VS = L::VS, SS = L::SS;
  constexpr int NT = BV / 8;     // 8-wide n-tiles of the value columns
  constexpr int HT = 4 * NT / NSW;  // n-tiles of a state warp's columns (all, or half the tile)
  constexpr int QT = PC::PT;        // n-tiles of a q S piece (a half or a quarter of the tile)
  constexpr int MT = KMAX / 64;     // 16-row m-tiles of state rows per state warp (KMAX / 4 rows)
  constexpr int LT = L::THREADS - 128;  // loader threads: the state warps
  static_assert(BV % 32 == 0 && KMAX % 64 == 0 && (STAGES == 1 || STAGES == 2), "bad tile");
  static_assert(KS % 32 == 4 && VS % 32 == 4 && SS % 32 == 8, "padding: see the bank notes");
  static_assert(L::P % 4 == 0 && L::PIECE == QT * 32 * 4, "piece buffer: float4 per lane and n-tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* const sm = reinterpret_cast<float*>(smem_raw);
  float* const sS = sm + L::S;
  float4* const sP = reinterpret_cast<float4*>(sm + L::P);  // pieces: [slot][n-tile][lane], 4 floats

  RTK_CHUNK_CTA(float, 3);  // k-steps of 8 columns
  const float lgd = log_decay[h];  // log(gamma)

  typedef rtk_chunk_loader<float, KMAX, BV, LT> LD;
  const LD ld(tid - 128, Dk, dv_here, qb, kb, vb, q_sn, k_sn, v_sn);
  constexpr int VROWS = LD::VROWS;
  const int st = ld.st, vcol = ld.vcol, vrow = ld.vrow;
  // Returns (without VEC) whether a value of v this thread stored is Inf or NaN; with VEC false
  // (the pieces are checked after the copy completed).
  auto load_chunk = [&](int chunk, int stage) -> bool {
    float* sQ = sm + stage * L::STAGE + L::Q;
    float* sK = sm + stage * L::STAGE + L::K;
    float* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if (VEC) {
      ld.template copy<C, KS, VS>(rtk_smem_addr(sQ + ld.qrow * KS + ld.qcol), rtk_smem_addr(sK + ld.qrow * KS + ld.qcol),
                                  rtk_smem_addr(sV + vrow * VS + vcol), n0, NS, !states_only);
      return false;
    } else {
      #pragma unroll 4
      for (int e = st; e < C * KMAX; e += LT) {
        const int r = e / KMAX, col = e - r * KMAX;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const bool ok = n < NS && col < Dk;
        if (!states_only) sQ[r * KS + col] = ok ? qb[n * q_sn + col] : 0.f;
        sK[r * KS + col] = ok ? kb[n * k_sn + col] : 0.f;
      }
      bool bad = false;
      #pragma unroll 4
      for (int e = st; e < C * BV; e += LT) {
        const int r = e / BV, col = e - r * BV;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const float x = (n < NS && col < dv_here) ? vb[n * v_sn + col] : 0.f;
        sV[r * VS + col] = x;
        bad |= rtk_nonfinite(x);
      }
      return bad;
    }
  };

  const int nchunks = (NS + C - 1) / C;
  bool loaded_bad = false;  // without VEC: Inf/NaN among the v values of the last load_chunk
  if (!out_warp) {
    loaded_bad = load_chunk(0, 0);
    rtk_cp_async_commit();
  }

  // Chunk prologue shared by both warp groups: (state warps) load the next chunk (two stages) or
  // this one (one stage), wait for this one, look for non-finite v; barrier (A). Returns whether
  // this chunk's v holds Inf/NaN.
  auto begin_chunk = [&](int chunk) -> bool {
    bool my_bad = false;
    if (!out_warp) {
      const int stage = STAGES == 2 ? (chunk & 1) : 0;
      if (STAGES == 2) {
        my_bad = loaded_bad;
        if (chunk + 1 < nchunks) loaded_bad = load_chunk(chunk + 1, stage ^ 1);
        rtk_cp_async_commit();
        rtk_cp_async_wait<1>();
      } else {
        if (chunk > 0) loaded_bad = load_chunk(chunk, 0);  // after (B): everyone is done with the stage
        my_bad = loaded_bad;
        rtk_cp_async_commit();
        rtk_cp_async_wait<0>();
      }
      if (VEC) {  // the pieces this thread copied itself
        const float* sV = sm + stage * L::STAGE + L::V;
        #pragma unroll
        for (int u = 0; u < C / VROWS; ++u) {
          const float4 x = *reinterpret_cast<const float4*>(sV + (vrow + u * VROWS) * VS + vcol);
          my_bad |= rtk_nonfinite(x.x) | rtk_nonfinite(x.y) | rtk_nonfinite(x.z) | rtk_nonfinite(x.w);
        }
      }
    }
    return __syncthreads_or(my_bad) != 0;  // (A) tiles and state copy visible
  };

  if (out_warp) {
    __syncthreads();  // (matches the state warps' start barrier: the first state copy)
    // ---- output warp W: rows r0 = 16 W .. r0+15 of each chunk. Called with constant W below, once
    // per warp: inlined, each call is compiled with fixed loop bounds (the p[] and o_acc[] indices
    // must be compile-time values so that they stay in registers).
    auto out_loop = [&](const int W) {
      const int r0 = 16 * W;
      // n-tiles 0 .. OWN-1 of this warp's q S are computed here, the rest come as pieces
      const int OWN = PC::own(W);
      const rtk_chunk_decay dec(lg2, scale, g, t4, r0);  // as in rtk_chunk_fwd

      for (int chunk = 0; chunk < nchunks; ++chunk) {
        const bool v_bad = begin_chunk(chunk);
        const int stage = STAGES == 2 ? (chunk & 1) : 0;
        const int n0 = chunk * C;
        const int len = min(C, NS - n0);
        const float* sQ = sm + stage * L::STAGE + L::Q;
        const float* sK = sm + stage * L::STAGE + L::K;
        const float* sV = sm + stage * L::STAGE + L::V;
        if (states_only) {  // first pass of the split-sequence strategy: no outputs, no pieces
          __syncthreads();
          continue;
        }
        float o_acc[NT][4];
        float p[8][4];  // scores of the 16 rows against key tiles 0 .. 2W+1 (8 keys each)
        rtk_zero(o_acc);
        rtk_zero(p);

        // q_t S (n-tiles < OWN) and q_t . k_s over 8-wide k-steps d0 = 8 kq, sharing the q fragments
        // (two k-steps per pass: the loads of the second overlap the mma of the first)
        #pragma unroll RTK_F32_KUNROLL
        for (int kq = 0; kq < kt_used; ++kq) {
          // A = q rows r0 + g (+8), columns d0 + t4 (+4): bank 4 g + t4 (+const), conflict-free
          rtk_u32 ah[4], al[4];
          {
            const float* qa = sQ + (r0 + g) * KS + kq * 8 + t4;
            rtk_split_tf32<EXACT>(qa[0], ah[0], al[0]);
            rtk_split_tf32<EXACT>(qa[8 * KS], ah[1], al[1]);
            rtk_split_tf32<EXACT>(qa[4], ah[2], al[2]);
            rtk_split_tf32<EXACT>(qa[8 * KS + 4], ah[3], al[3]);
          }
          // B = state copy rows d0 + t4 (+4), column nt*8 + g: bank 8 t4 + g, conflict-free
          const float* sb = sS + (kq * 8 + t4) * SS + g;
          #pragma unroll
          for (int nt = 0; nt < OWN; ++nt) {
            rtk_u32 bh0, bl0, bh1, bl1;
            rtk_split_tf32<EXACT>(sb[nt * 8], bh0, bl0);
            rtk_split_tf32<EXACT>(sb[4 * SS + nt * 8], bh1, bl1);
            rtk_mma1688_x3<EXACT>(o_acc[nt], ah, al, bh0, bh1, bl0, bl1);
          }
          // B = k^T: (k = column d0 + t4 (+4), n = key 8 j + g) = k row 8 j + g: bank 4 g + t4
          const float* kt = sK + g * KS + kq * 8 + t4;
          #pragma unroll
          for (int j = 0; j < 2 * W + 2; ++j) {
            rtk_u32 bh0, bl0, bh1, bl1;
            rtk_split_tf32<EXACT>(kt[j * 8 * KS], bh0, bl0);
            rtk_split_tf32<EXACT>(kt[j * 8 * KS + 4], bh1, bl1);
            rtk_mma1688_x3<EXACT>(p[j], ah, al, bh0, bh1, bl0, bl1);
          }
        }

        // gamma^(r0+1) q_t S (the n-tiles of the pieces are still zero); the keys left of the
        // diagonal block get gamma^(r0-s)
        #pragma unroll
        for (int nt = 0; nt < OWN; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) o_acc[nt][e] *= dec.inter0;
        dec.scale_left(p, W);
        // o_acc += P[:, 8 kk ..] V[8 kk .., :] (kk a compile-time value). The score accumulator's
        // columns are 2 t4 (+1), the A operand's t4 (+4): since the k index is summed, A column t4
        // is taken as key 2 t4 and A column t4 + 4 as key 2 t4 + 1, so A = {c0, c2, c1, c3}, and
        // the B rows follow: b0 = v[8 kk + 2 t4], b1 = v[8 kk + 2 t4 + 1] (bank 8 t4 + g (+4)).
        auto pv = [&](int kk) {
          rtk_u32 ah[4], al[4];
          rtk_split_tf32<EXACT>(p[kk][0], ah[0], al[0]);
          rtk_split_tf32<EXACT>(p[kk][2], ah[1], al[1]);
          rtk_split_tf32<EXACT>(p[kk][1], ah[2], al[2]);
          rtk_split_tf32<EXACT>(p[kk][3], ah[3], al[3]);
          const float* vr = sV + (kk * 8 + 2 * t4) * VS + g;
          #pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float x0 = vr[nt * 8], x1 = vr[VS + nt * 8];
            if (v_bad) {  // rare: zero Inf/NaN in the operand (the outputs are marked below)
              x0 = rtk_nonfinite(x0) ? 0.f : x0;
              x1 = rtk_nonfinite(x1) ? 0.f : x1;
            }
            rtk_u32 bh0, bl0, bh1, bl1;
            rtk_split_tf32<EXACT>(x0, bh0, bl0);
            rtk_split_tf32<EXACT>(x1, bh1, bl1);
            rtk_mma1688_x3<EXACT>(o_acc[nt], ah, al, bh0, bh1, bl0, bl1);
          }
        };
        #pragma unroll
        for (int kk = 0; kk < 2 * W; ++kk) pv(kk);
        dec.scale_rows(o_acc);
        // the diagonal block (key tiles 2W, 2W+1)
        #pragma unroll
        for (int jd = 0; jd < 2; ++jd) {
          dec.mask_diag(p[2 * W + jd], jd);
          pv(2 * W + jd);
        }

        if (W > 0) {  // the pieces of q S the state warps computed for these rows
          rtk_f32_pieces_wait<NSW>();
          #pragma unroll
          for (int nt = OWN; nt < NT; ++nt) {
            const int slot = PC::slot(W, nt);
            const float4 x = sP[(slot * QT + nt % QT) * 32 + lane];
            o_acc[nt][0] = fmaf(x.x * dec.inter0, dec.row_lo, o_acc[nt][0]);
            o_acc[nt][1] = fmaf(x.y * dec.inter0, dec.row_lo, o_acc[nt][1]);
            o_acc[nt][2] = fmaf(x.z * dec.inter0, dec.row_hi, o_acc[nt][2]);
            o_acc[nt][3] = fmaf(x.w * dec.inter0, dec.row_hi, o_acc[nt][3]);
          }
        }

        if (v_bad) {
          // rare: NaN where the causal sum reaches a non-finite v_s (rows t >= s, same column),
          // as rtk_chunk_mark_nonfinite but with one pass over the keys s <= r0 + 15 (compact
          // code: this is compiled once per output warp)
          int first[NT][2];  // first key s with v_s[c] non-finite in the thread's columns c (64: none)
          #pragma unroll
          for (int nt = 0; nt < NT; ++nt) first[nt][0] = first[nt][1] = C;
          #pragma unroll 1
          for (int s2 = r0 + 15; s2 >= 0; --s2)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              #pragma unroll
              for (int b = 0; b < 2; ++b)
                if (rtk_nonfinite(sV[s2 * VS + nt * 8 + 2 * t4 + b])) first[nt][b] = s2;
          #pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
              if (r0 + g + (e >> 1) * 8 >= first[nt][e & 1]) o_acc[nt][e] = __int_as_float(0x7fc00000);
        }
        rtk_chunk_store_rows<RTK_F32>(ob, o_acc, n0, r0, g, t4, len, o_sn, v0, dv_here, ovec_full);
        __syncthreads();  // (B) done with the state copy, the pieces and this stage
      }
    };
    switch (warp) {
      case 0: out_loop(0); break;
      case 1: out_loop(1); break;
      case 2: out_loop(2); break;
      default: out_loop(3); break;
    }
  } else {
    // ---- state warps: fp32 state in registers (rows sr0 .. sr0 + KMAX/4 - 1, columns cb .. cb +
    // BV/2 - 1 of the tile), fp32 copy in smem
    const int sw = warp - 4;  // 0 .. NSW-1, also the slot of this warp's q S piece
    const int sr0 = (sw & 3) * MT * 16, cb = (sw >> 2) * HT * 8;
    // this warp's q S piece (see above): rows of output warp prb, n-tiles pn0 .. pn0 + QT - 1
    const int prb = PC::rb(sw), pn0 = PC::n0(sw);
    float s_acc[MT][HT][4];
    const rtk_chunk_state<MT, HT> sf = {sr0, g, t4, bh, Dk, Dv, v0 + cb, dv_here - cb, state_slot};
    sf.load(s_acc, init_state);
    // float2 stores at row r, columns c, c+1: bank 8 g + 2 t4 (+1) per half warp, conflict-free
    auto store_state_copy = [&]() {
      sf.pairs(s_acc, [&](int r, int c, float lo, float hi) { rtk_store_pair<RTK_F32>(sS + r * SS + cb + c, lo, hi); });
    };
    // gamma^C of a whole chunk in double precision, rounded once
    const float carry_full = (float)exp((double)lgd * (double)C);
    __syncthreads();  // (matches the output warps' start barrier)
    store_state_copy();
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      begin_chunk(chunk);
      const int stage = STAGES == 2 ? (chunk & 1) : 0;
      const int n0 = chunk * C;
      const int len = min(C, NS - n0);
      const float* sK = sm + stage * L::STAGE + L::K;
      const float* sV = sm + stage * L::STAGE + L::V;
      if (!states_only) {
        // the q S piece, from the state copy as it entered the chunk, as raw fp32 sums
        const float* sQ = sm + stage * L::STAGE + L::Q;
        float pacc[1][QT][4];
        rtk_zero(pacc[0]);
        #pragma unroll RTK_F32_KUNROLL
        for (int kq = 0; kq < kt_used; ++kq) {
          // A = q rows 16 prb + g (+8), columns 8 kq + t4 (+4): bank 4 g + t4 (+const)
          rtk_u32 pa_h[1][4], pa_l[1][4];
          const float* qa = sQ + (16 * prb + g) * KS + kq * 8 + t4;
          rtk_split_tf32<EXACT>(qa[0], pa_h[0][0], pa_l[0][0]);
          rtk_split_tf32<EXACT>(qa[8 * KS], pa_h[0][1], pa_l[0][1]);
          rtk_split_tf32<EXACT>(qa[4], pa_h[0][2], pa_l[0][2]);
          rtk_split_tf32<EXACT>(qa[8 * KS + 4], pa_h[0][3], pa_l[0][3]);
          // B = state copy rows 8 kq + t4 (+4), column (pn0 + nt) * 8 + g: bank 8 t4 + g (+const)
          const float* sb = sS + (kq * 8 + t4) * SS + pn0 * 8 + g;
          rtk_u32 bh[QT][2], bl[QT][2];
          #pragma unroll
          for (int nt = 0; nt < QT; ++nt) {
            rtk_split_tf32<EXACT>(sb[nt * 8], bh[nt][0], bl[nt][0]);
            rtk_split_tf32<EXACT>(sb[4 * SS + nt * 8], bh[nt][1], bl[nt][1]);
          }
          rtk_mma1688_x3_grid<EXACT>(pacc, pa_h, pa_l, bh, bl, [](int, int) { return true; });
        }
        // 16 bytes per lane and n-tile, consecutive lanes: conflict-free
        #pragma unroll
        for (int nt = 0; nt < QT; ++nt) {
          float4 x;
          x.x = pacc[0][nt][0];
          x.y = pacc[0][nt][1];
          x.z = pacc[0][nt][2];
          x.w = pacc[0][nt][3];
          sP[(sw * QT + nt) * 32 + lane] = x;
        }
        rtk_f32_pieces_arrive<NSW>();  // output warps 1..3 may read the piece
      }
      // delta = (K * w)^T V, w_s = gamma^(len-1-s), over 8-token k-steps s0 = 8 kk
      float d_acc[MT][HT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < HT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) d_acc[mt][nt][e] = 0.f;
      // all_mt: every m-tile of this warp holds rows < Dk (the usual case: no condition around the
      // mma, which would cost a warp sync each); otherwise m-tiles wholly past Dk are skipped
      auto delta_steps = [&](const bool all_mt) {
      #pragma unroll 1
      for (int kk = 0; kk * 8 < len; ++kk) {
        const int sa = kk * 8 + t4, sb = sa + 4;  // the thread's tokens (A columns t4, t4 + 4)
        const float wa = sa < len ? rtk_exp2(lg2 * (float)(len - 1 - sa)) : 0.f;
        const float wb = sb < len ? rtk_exp2(lg2 * (float)(len - 1 - sb)) : 0.f;
        // A = (K w)^T: (row = state row sr0 + 16 mt + g (+8), col = token sa / sb)
        //   = k[token][state row]: bank 4 t4 + g (+const), conflict-free
        rtk_u32 ah[MT][4], al[MT][4];
        const float* ka = sK + sa * KS + sr0 + g;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rtk_split_tf32<EXACT>(ka[mt * 16] * wa, ah[mt][0], al[mt][0]);
          rtk_split_tf32<EXACT>(ka[mt * 16 + 8] * wa, ah[mt][1], al[mt][1]);
          rtk_split_tf32<EXACT>(ka[4 * KS + mt * 16] * wb, ah[mt][2], al[mt][2]);
          rtk_split_tf32<EXACT>(ka[4 * KS + mt * 16 + 8] * wb, ah[mt][3], al[mt][3]);
        }
        // B = v rows sa, sb, column cb + nt*8 + g: bank 4 t4 + g (+const), conflict-free
        const float* vr = sV + sa * VS + cb + g;
        rtk_u32 bh[HT][2], bl[HT][2];
        #pragma unroll
        for (int nt = 0; nt < HT; ++nt) {
          rtk_split_tf32<EXACT>(vr[nt * 8], bh[nt][0], bl[nt][0]);
          rtk_split_tf32<EXACT>(vr[4 * VS + nt * 8], bh[nt][1], bl[nt][1]);
        }
        // m-tiles wholly past Dk stay zero
        rtk_mma1688_x3_grid<EXACT>(d_acc, ah, al, bh, bl, [&](int mt, int) { return all_mt || sr0 + mt * 16 < Dk; });
      }
      };
      if (sr0 + (MT - 1) * 16 < Dk) delta_steps(true); else delta_steps(false);
      // S = gamma^len S + delta, one rounding per element and chunk
      const float carry = len == C ? carry_full : (float)exp((double)lgd * (double)len);
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < HT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) s_acc[mt][nt][e] = fmaf(s_acc[mt][nt][e], carry, d_acc[mt][nt][e]);
      __syncthreads();  // (B) the output warps are done with the state copy, everyone with this stage
      store_state_copy();
    }
    sf.store(s_acc, final_state);
  }
}
