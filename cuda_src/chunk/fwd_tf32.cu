// chunk/fwd_tf32.cu -- rtk_chunk_fwd_tf32: fp32 inputs on TF32 wgmma (sm_90a), the "tf32" mode.
//
// rtk_chunk_fwd's algorithm, warp roles and barrier per chunk (chunk/fwd16.cu), for float32 rows
// that are 16-byte aligned, Dk <= KMAX <= 128, BV = 64 value columns a CTA: the output warpgroup
// loads q and computes q k^T and q S^T-copy from shared memory and P v with P from registers; the
// state warpgroup loads k and v, rounds v to TF32 in place, updates S (fp32 registers) by wgmma and
// publishes a TF32 copy of S^T. Two tile stages and two state copies: one CTA barrier per chunk.
// (The state warpgroup is the slower side of that barrier, so q's copies are the output warps':
// (4, 32, 4096, 128) 0.81 -> 0.68 ms.)
//
// wgmma reads TF32 operands from shared memory only K-major (the contracted index contiguous), so
// v is stored transposed: each state thread copies single floats of v's rows into v^T's columns
// (4-byte cp.async; global reads stay coalesced across the warp). P's accumulator holds keys
// 2 t4, 2 t4 + 1 of each 8 where a TF32 A fragment has columns t4, t4 + 4, so key s sits at v^T
// column (s & ~7) | 4 (s & 1) | ((s & 7) >> 1), and the state update's A fragments (k^T) follow.
// The tensor cores ignore a TF32 operand's 13 low bits: q and k are read raw (truncated); P, k w,
// v (in place, with the check for Inf/NaN) and the S copy are rounded to nearest; P, k w and the S
// copy after a chunk, results of a multiply or of the tensor cores (NaN 0x7FFFFFFF), by adding half
// an ulp to their bits (rtk_tf32_operand: one instruction, not three); raw values by cvt.
//
// S = gamma^len S (gamma^len in double, rounded once), then += (k w)^T v on the tensor cores, the
// k-steps pipelined. NaN in, NaN out: a chunk whose v holds Inf/NaN takes P v by FMAs over the
// cleaned values, then marks the rows the causal sum reaches. Modes RTK_MODE_FUSED and
// RTK_MODE_STATES (the split-sequence strategy's scan), packed sequences.
//
// Why q and k are not rounded: a pass over the tiles in shared memory costs more than wgmma saves
// (H100, (4, 32, 4096, 128): 1.15 ms rounded against 0.86, rtk_chunk_fwd_f32 1.04; error against
// fp64 4.5e-4 rounded, 6.4e-4 not, 4.2e-4 for rtk_chunk_fwd_f32). v is rounded where it is checked.
// Its states-only period costs about what a fused one does, so the plan splits the sequence for it
// by its own rule (rtkernels.methods.chunk.tf32_wg_segments; docs/performance.md, session 33).

#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/tf32.cuh"
#include "../include/wgmma_sm90.cuh"
#include "cta.cuh"
#include "decay.cuh"
#include "epilogue.cuh"
#include "modes.cuh"
#include "products.cuh"

// Byte offsets in shared memory: per stage a q and a k tile (C x KMAX, K-major) and v^T (BV x C,
// K-major), all 128-byte swizzled in regions of 32 floats; two copies of S^T (BV x KMAX); the ring.
template <int KMAX, int BV>
struct rtk_tf32_smem {
  static constexpr int C = 64;
  static constexpr int QB = C * KMAX * 4, Q = 0, K = QB, VT = 2 * QB, STAGE = 2 * QB + BV * C * 4;
  static constexpr int S = 2 * STAGE, SB = BV * KMAX * 4, RING = S + 2 * SB;
  static constexpr int BYTES = RING + 8 + 1024;  // + slack to align the base to 1024 bytes
  static __device__ __forceinline__ int off(int rows, int r, int c) { return rtk_swz_off32(rows, r, c); }
  static __device__ __forceinline__ int key_col(int s) { return rtk_tf32_key_col(s); }
};

template <int KMAX, int BV>
__global__ void __launch_bounds__(256, 1)
rtk_chunk_fwd_tf32(RTK_FWD_POINTERS(float), const __grid_constant__ rtk_chunk_shape p) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  typedef rtk_tf32_smem<KMAX, BV> L;
  constexpr int C = L::C, NT = BV / 8, MT = KMAX / 64;
  constexpr int QP = KMAX / 4, QROWS = 128 / QP;  // 16-byte pieces of a q/k row; rows a pass covers
  static_assert(BV == 64 && (KMAX == 64 || KMAX == 128), "bad tile");
  static_assert(L::BYTES <= 227 * 1024, "shared memory");
  const bool states_only = p.mode == RTK_MODE_STATES;

  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* sm = smem_base + ((1024 - (rtk_smem_addr(smem_base) & 1023)) & 1023);
  const rtk_u32 base = rtk_smem_addr(sm);
  rtk_u32* or_ring = reinterpret_cast<rtk_u32*>(sm + L::RING);

  RTK_CHUNK_CTA(float, 3);
  (void)kt_used;
  const int nchunks = (NS + C - 1) / C;
  auto tile_q = [&](int stage) { return base + stage * L::STAGE + L::Q; };
  auto tile_k = [&](int stage) { return base + stage * L::STAGE + L::K; };
  auto tile_vt = [&](int stage) { return base + stage * L::STAGE + L::VT; };
  auto copy_s = [&](int slot) { return base + L::S + slot * L::SB; };

  // ---- loads: the output threads copy q (they alone read it), the state threads k and v^T. Thread
  // st of its warpgroup: q/k rows qr + QROWS u at column qc (16 bytes); v^T elements (4 bytes) as
  // rtk_tf32_vt_elem spreads them over the banks
  const int st = tid & 127, qr = st / QP, qc = (st % QP) * 4;
  const int qbytes = max(0, min(16, (Dk - qc) * 4));
  auto v_elem = [&](int u, int& s, int& d) { rtk_tf32_vt_elem<BV, 4>(st, u, s, d); };
  // rows of q (X = qb, tile_q) or k (X = kb, tile_k) of a chunk
  auto load_rows = [&](const float* xb, rtk_i64 x_sn, rtk_u32 tile, int chunk) {
    const int n0 = chunk * C;
    #pragma unroll
    for (int u = 0; u < C / QROWS; ++u) {
      const int r = qr + u * QROWS;
      const bool in = n0 + r < NS;
      rtk_cp_async16(tile + L::off(C, r, qc), in ? (const void*)(xb + (rtk_i64)(n0 + r) * x_sn + (qbytes ? qc : 0)) : xb,
                     in ? qbytes : 0);
    }
  };
  auto load_chunk = [&](int chunk, int stage) {  // the state threads' part
    const int n0 = chunk * C;
    load_rows(kb, k_sn, tile_k(stage), chunk);
    #pragma unroll
    for (int u = 0; u < C * BV / 128; ++u) {
      int s, d;
      v_elem(u, s, d);
      const bool in = n0 + s < NS && d < dv_here;
      rtk_cp_async4(tile_vt(stage) + L::off(BV, d, L::key_col(s)),
                    in ? (const void*)(vb + (rtk_i64)(n0 + s) * v_sn + d) : vb, in ? 4 : 0);
    }
  };
  // After this thread's copies of a chunk landed in `stage`: round its own pieces to TF32 in place and
  // say whether its v values hold Inf/NaN.
  auto round_chunk = [&](int stage) -> bool {
    bool bad = false;
    #pragma unroll
    for (int u = 0; u < C * BV / 128; ++u) {
      int s, d;
      v_elem(u, s, d);
      float* x = reinterpret_cast<float*>(sm + tile_vt(stage) - base + L::off(BV, d, L::key_col(s)));
      const float y = *x;
      const bool nf = rtk_nonfinite(y);  // kept as it is (rtk_tf32_operand's add needs a finite value)
      bad |= nf;
      *x = nf ? y : __uint_as_float(__float_as_uint(y) + 0x1000u);
    }
    return bad;
  };
  // The end of a period: chunk `next` landed (and, by the state warps, rounded; async proxy: wgmma
  // reads it), then the CTA barrier, which ORs whether its v holds Inf/NaN.
  auto end_period = [&](int next) -> bool {
    bool bad = false;
    rtk_cp_async_wait<0>();  // the output threads' q, the state threads' k and v
    if (!out_warp && next < nchunks) bad = round_chunk(next & 1);
    rtk_fence_proxy_async();
    return rtk_cta_sync_or(bad, or_ring, (rtk_u32)next);
  };

  if (tid == 0) or_ring[0] = or_ring[1] = 0u;
  rtk_cta_sync();

  if (out_warp) {
    // ---- output warps: rows r0 .. r0 + 15 of each chunk -------------------------------------------
    const int w = warp, r0 = 16 * warp;
    const rtk_chunk_decay dec(lg2, out_scale, g, t4, r0);
    const float f_lo = dec.inter0 * dec.row_lo, f_hi = dec.inter0 * dec.row_hi;
    auto scale_scores = [&](float (&pp)[8][4]) { dec.scale_scores_of(w, pp); };
    if (nchunks > 0 && !states_only) load_rows(qb, q_sn, tile_q(0), 0);
    rtk_cp_async_commit();
    bool v_bad = end_period(0);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk & 1, n0 = chunk * C, len = min(C, NS - n0);
      if (states_only) {
        v_bad = end_period(chunk + 1);
        continue;
      }
      if (chunk + 1 < nchunks) load_rows(qb, q_sn, tile_q(stage ^ 1), chunk + 1);  // read in period c - 1
      rtk_cp_async_commit();
      float o_acc[NT][4];
      float pr[8][4];
      float (&pa)[32] = reinterpret_cast<float (&)[32]>(pr);
      float (&oa)[32] = reinterpret_cast<float (&)[32]>(o_acc);
      const unsigned long long dq = rtk_wg_desc(tile_q(stage), 16, 1024), dk = rtk_wg_desc(tile_k(stage), 16, 1024);
      const unsigned long long ds = rtk_wg_desc(copy_s(stage), 16, 1024), dvt = rtk_wg_desc(tile_vt(stage), 16, 1024);
      rtk_wg_fence();
      #pragma unroll
      for (int ks = 0; ks < KMAX / 8; ++ks) rtk_wgmma_tf32_ss(pa, rtk_desc_at(dq, rtk_kmajor_step(C, ks)), rtk_desc_at(dk, rtk_kmajor_step(C, ks)), ks);
      rtk_wg_commit();
      #pragma unroll
      for (int ks = 0; ks < KMAX / 8; ++ks) rtk_wgmma_tf32_ss(oa, rtk_desc_at(dq, rtk_kmajor_step(C, ks)), rtk_desc_at(ds, rtk_kmajor_step(BV, ks)), ks);
      rtk_wg_commit();
      rtk_chunk_land<1>(pr, o_acc, f_lo, f_hi, scale_scores);
      if (!v_bad) {
        rtk_tf32_pv<true>(oa, pr, dvt, BV);  // P v: P from registers, v^T K-major
      } else {
        // rare: Inf/NaN in this chunk's v. P v by FMAs over the cleaned values (key s's scores come
        // from the lane that holds them), then NaN where the causal sum reaches a non-finite v_s
        const float* vt = reinterpret_cast<const float*>(sm + tile_vt(stage) - base);
        auto vt_at = [&](int col, int s) {  // the rounded value (the stored bits carry half an ulp more)
          return __uint_as_float(__float_as_uint(vt[L::off(BV, col, L::key_col(s)) >> 2]) & 0xffffe000u);
        };
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          #pragma unroll
          for (int e1 = 0; e1 < 2; ++e1)
            #pragma unroll 1
            for (int src = 0; src < 4; ++src) {
              const int s = 8 * j + 2 * src + e1;
              const float plo = __shfl_sync(0xffffffffu, pr[j][e1], (lane & ~3) | src);
              const float phi = __shfl_sync(0xffffffffu, pr[j][2 + e1], (lane & ~3) | src);
              #pragma unroll
              for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int b = 0; b < 2; ++b) {
                  float x = vt_at(nt * 8 + 2 * t4 + b, s);
                  x = rtk_nonfinite(x) ? 0.f : x;
                  o_acc[nt][b] = fmaf(plo, x, o_acc[nt][b]);
                  o_acc[nt][2 + b] = fmaf(phi, x, o_acc[nt][2 + b]);
                }
            }
        rtk_chunk_mark_from_first<NT, C>(o_acc, r0, g, t4, [&](int s2, int c) { return rtk_nonfinite(vt_at(c, s2)); });
      }
      rtk_chunk_store_rows<RTK_F32>(ob, o_acc, n0, r0, g, t4, len, o_sn, v0, dv_here, ovec_full);
      v_bad = end_period(chunk + 1);  // done with this stage and this state copy
    }
  } else {
    // ---- state warps: S (KMAX x BV, fp32) in registers as wgmma accumulators, rows 16 (w - 4) of
    // each 64; loads; the TF32 copy of S^T ---------------------------------------------------------
    const int sw = warp - 4;
    float s_acc[MT][NT][4];
    const rtk_chunk_state<MT, NT, 64> sf = {16 * sw, g, t4, bh, Dk, Dv, v0, dv_here, state_slot};
    sf.load(s_acc, init_state);
    if (seq_bad) rtk_frag_scale(s_acc, __int_as_float(0x7fc00000));  // invalid packed offsets: NaN states
    const float lgd = rtk_head_log_decay(decay, decay_mode, h);
    const float carry_full = (float)exp((double)lgd * (double)C);
    // S^T (row = value column, column = key row) rounded to TF32. The entering state is raw input,
    // whose NaN may have any bits (cvt); after a chunk S is a product of the multiply and the tensor
    // cores, whose NaN is 0x7FFFFFFF, so the one-instruction rounding serves
    auto store_copy = [&](int slot, bool raw) {
      unsigned char* cs = sm + L::S + slot * L::SB;
      sf.pairs(s_acc, [&](int r, int c, float lo, float hi) {
        *reinterpret_cast<float*>(cs + L::off(BV, c, r)) = raw ? rtk_round_tf32(lo) : __uint_as_float(rtk_tf32_operand(lo));
        *reinterpret_cast<float*>(cs + L::off(BV, c + 1, r)) = raw ? rtk_round_tf32(hi) : __uint_as_float(rtk_tf32_operand(hi));
      });
    };
    if (nchunks > 0) load_chunk(0, 0);
    rtk_cp_async_commit();
    store_copy(0, true);
    end_period(0);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk & 1, n0 = chunk * C, len = min(C, NS - n0);
      if (chunk + 1 < nchunks) load_chunk(chunk + 1, stage ^ 1);  // its stage was read in period c - 1
      rtk_cp_async_commit();
      // delta = (K w)^T V, w_s = gamma^(len-1-s) (0 past len), k-step kk: keys 8 kk + 2 t4 (+1) as
      // A columns t4, t4 + 4 (v^T's order); A rows = key rows 64 mt + 16 sw + g (+8)
      const unsigned long long dvt = rtk_wg_desc(tile_vt(stage), 16, 1024);
      const unsigned char* kt = sm + tile_k(stage) - base;
      const float carry = len == C ? carry_full : (float)exp((double)lgd * (double)len);
      rtk_frag_scale(s_acc, carry);
      rtk_u32 a[2][MT][4];  // two sets: k-step kk + 1's fragments form while kk's wgmma runs
      #pragma unroll
      for (int kk = 0; kk < C / 8; ++kk) {
        const int s0 = 8 * kk + 2 * t4, s1 = s0 + 1;
        const float w0 = s0 < len ? rtk_exp2(lg2 * (float)(len - 1 - s0)) : 0.f;
        const float w1 = s1 < len ? rtk_exp2(lg2 * (float)(len - 1 - s1)) : 0.f;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int m = 64 * mt + 16 * sw + g;
          a[kk & 1][mt][0] = rtk_tf32_operand(*reinterpret_cast<const float*>(kt + L::off(C, s0, m)) * w0);
          a[kk & 1][mt][1] = rtk_tf32_operand(*reinterpret_cast<const float*>(kt + L::off(C, s0, m + 8)) * w0);
          a[kk & 1][mt][2] = rtk_tf32_operand(*reinterpret_cast<const float*>(kt + L::off(C, s1, m)) * w1);
          a[kk & 1][mt][3] = rtk_tf32_operand(*reinterpret_cast<const float*>(kt + L::off(C, s1, m + 8)) * w1);
        }
        rtk_wg_fence();
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          rtk_wgmma_tf32_rs(reinterpret_cast<float (&)[32]>(s_acc[mt]), a[kk & 1][mt],
                            rtk_desc_at(dvt, rtk_kmajor_step(BV, kk)), 1);
        rtk_wg_commit();
        rtk_wg_wait<1>();
      }
      rtk_wg_wait<0>();
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) rtk_wg_pin(reinterpret_cast<float (&)[32]>(s_acc[mt]));
      if (chunk + 1 < nchunks) store_copy(stage ^ 1, false);  // the S entering chunk c + 1 (copy c % 2 is in use)
      end_period(chunk + 1);
    }
    sf.store(s_acc, final_state);
  }
}
