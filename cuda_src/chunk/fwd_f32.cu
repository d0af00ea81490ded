// chunk/fwd_f32.cu -- rtk_chunk_fwd_f32: fp32 inputs on TF32 tensor cores (mma.sync m16n8k8).
//
// The algorithm, warp roles, barriers and parameters of rtk_chunk_fwd (chunk/fwd16.cu), so the
// launch code, the split-sequence strategy and rtk_chunk_seg_scan serve both; the CTA place, loader,
// decay factors, stores and state fragments are the same headers.
//
// EXACT (3xTF32): every mma operand x is split as x = hi + lo (hi: x truncated to TF32, lo = x - hi)
// and each product is lo*hi' + hi*lo' + hi*hi' with fp32 accumulation: about fp32 accuracy.
// Without EXACT: one TF32 mma per product, about 1e-3 relative error.
//
// Differences from the 16-bit kernel: fp32 tiles in shared memory read with plain 32-bit loads
// (ldmatrix moves 16-bit elements), rows padded so every fragment load is conflict-free; an fp32
// state copy; each chunk's state contribution accumulated in fresh registers and added with one
// FMA, S = gamma^len S + delta (gamma^len in double: its error compounds over chunks); STAGES = 1
// where two stages of fp32 tiles do not fit (KMAX 256).
//
// EXACT runs 12 warps (4 output warps, NSW = 8 state warps, each a quarter of the state's rows and
// half its columns): the splits leave issue slots a third warp per SM sub-partition fills. TF32
// runs NSW = 4 (256 threads). The state warps also compute pieces of q S (rtk_f32_pieces), so the
// output warps, whose work grows with their rows, do not hold everyone up; they hand them over
// through named barrier 1. docs/design.md has the protocol and docs/performance.md the timings.

#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/tf32.cuh"
#include "cta.cuh"
#include "decay.cuh"
#include "epilogue.cuh"
#include "loader.cuh"
#include "modes.cuh"

template <int KMAX, int BV, int STAGES, int NSW>
struct rtk_chunk_f32_smem {
  static constexpr int C = 64;
  static constexpr int KS = KMAX + 4;  // row stride of the q and k tiles (floats), 4 mod 32
  static constexpr int VS = BV + 4;    // row stride of the v tile, 4 mod 32
  static constexpr int SS = BV + 8;    // row stride of the fp32 state copy, 8 mod 32
  // rtk_cta_sync_or's two-word ring lives in the unused padding of the state copy's row 0
  // (columns BV, BV + 1): at KMAX 256 the tiles fill the 227 KB, with no word to spare elsewhere
  static constexpr int RING = BV;
  static constexpr int Q = 0, K = Q + C * KS, V = K + C * KS;
  static constexpr int STAGE = V + C * VS;
  static constexpr int S = STAGES * STAGE;  // the state copy, KMAX x SS
  static constexpr int P = S + KMAX * SS;   // the NSW q S pieces of the state warps (16-byte aligned)
  static constexpr int PIECE = 32 * BV / NSW;  // floats of one piece: 16 rows x 2 BV / NSW columns
  static constexpr int ELEMS = P + NSW * PIECE;
  static constexpr int THREADS = 128 + 32 * NSW;  // 4 output warps, NSW state warps
  static constexpr int BYTES = ELEMS * 4;
};

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
  asm volatile("barrier.arrive 1, %0;" ::"n"(32 * (NSW + 3)) : "memory");
}
template <int NSW> __device__ __forceinline__ void rtk_f32_pieces_wait() {
  asm volatile("barrier.sync 1, %0;" ::"n"(32 * (NSW + 3)) : "memory");
}

template <int KMAX, int BV, int STAGES, bool EXACT, bool VEC, int MINB>
__global__ void __launch_bounds__(rtk_chunk_f32_smem<KMAX, BV, STAGES, EXACT ? 8 : 4>::THREADS, MINB)
rtk_chunk_fwd_f32(RTK_FWD_POINTERS(float), const __grid_constant__ rtk_chunk_shape p) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  const rtk_i64 seg_len = p.seg_len;
  const int states_only = (int)p.mode;  // RTK_MODE_STATES (1) or RTK_MODE_FUSED (0)
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
  rtk_u32* const or_ring = reinterpret_cast<rtk_u32*>(sS + L::RING);  // rtk_cta_sync_or
  float4* const sP = reinterpret_cast<float4*>(sm + L::P);  // pieces: [slot][n-tile][lane], 4 floats

  RTK_CHUNK_CTA(float, 3);  // k-steps of 8 columns
  const float lgd = rtk_head_log_decay(decay, decay_mode, h);  // log(gamma)

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
  if (tid == 0) or_ring[0] = or_ring[1] = 0u;  // before both groups' start barrier
  bool loaded_bad = false;  // without VEC: Inf/NaN among the v values of the last load_chunk
  if (!out_warp) {
    if (nchunks > 0) loaded_bad = load_chunk(0, 0);  // none: an empty packed sequence (no copy left in flight)
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
    return rtk_cta_sync_or(my_bad, or_ring, (rtk_u32)chunk);  // (A) tiles and state copy visible
  };

  if (out_warp) {
    rtk_cta_sync();  // (matches the state warps' start barrier: the first state copy)
    // ---- output warp W: rows r0 = 16 W .. r0+15 of each chunk. Called with constant W below, once
    // per warp: inlined, each call is compiled with fixed loop bounds (the p[] and o_acc[] indices
    // must be compile-time values so that they stay in registers).
    auto out_loop = [&](const int W) {
      const int r0 = 16 * W;
      // n-tiles 0 .. OWN-1 of this warp's q S are computed here, the rest come as pieces
      const int OWN = PC::own(W);
      const rtk_chunk_decay dec(lg2, out_scale, g, t4, r0);  // as in rtk_chunk_fwd

      for (int chunk = 0; chunk < nchunks; ++chunk) {
        const bool v_bad = begin_chunk(chunk);
        const int stage = STAGES == 2 ? (chunk & 1) : 0;
        const int n0 = chunk * C;
        const int len = min(C, NS - n0);
        const float* sQ = sm + stage * L::STAGE + L::Q;
        const float* sK = sm + stage * L::STAGE + L::K;
        const float* sV = sm + stage * L::STAGE + L::V;
        if (states_only) {  // first pass of the split-sequence strategy: no outputs, no pieces
          rtk_cta_sync();
          continue;
        }
        float o_acc[NT][4];
        float p[8][4];  // scores of the 16 rows against key tiles 0 .. 2W+1 (8 keys each)
        rtk_zero(o_acc);
        rtk_zero(p);

        // q_t S (n-tiles < OWN) and q_t . k_s over 8-wide k-steps d0 = 8 kq, sharing the q fragments
        // (two k-steps per pass: the loads of the second overlap the mma of the first)
        #pragma unroll 1  // unrolling measured slower (registers)
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

        if (v_bad)  // rare: NaN where the causal sum reaches a non-finite v_s (rows t >= s, same column)
          rtk_chunk_mark_from_first<NT, C>(o_acc, r0, g, t4, [&](int s2, int c) { return rtk_nonfinite(sV[s2 * VS + c]); });
        rtk_chunk_store_rows<RTK_F32>(ob, o_acc, n0, r0, g, t4, len, o_sn, v0, dv_here, ovec_full);
        rtk_cta_sync();  // (B) done with the state copy, the pieces and this stage
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
    if (seq_bad) rtk_frag_scale(s_acc, __int_as_float(0x7fc00000));  // invalid packed offsets: NaN states
    // float2 stores at row r, columns c, c+1: bank 8 g + 2 t4 (+1) per half warp, conflict-free
    auto store_state_copy = [&]() {
      sf.pairs(s_acc, [&](int r, int c, float lo, float hi) { rtk_store_pair<RTK_F32>(sS + r * SS + cb + c, lo, hi); });
    };
    // gamma^C of a whole chunk in double precision, rounded once
    const float carry_full = (float)exp((double)lgd * (double)C);
    rtk_cta_sync();  // (matches the output warps' start barrier)
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
        #pragma unroll 1  // unrolling measured slower (registers)
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
      rtk_frag_zero(d_acc);
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
      rtk_cta_sync();  // (B) the output warps are done with the state copy, everyone with this stage
      store_state_copy();
    }
    sf.store(s_acc, final_state);
  }
}
