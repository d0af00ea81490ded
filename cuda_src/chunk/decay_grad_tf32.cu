// chunk/decay_grad_tf32.cu -- rtk_chunk_decay_grad_tf32: dL/dlog(gamma) of fp32 inputs in the "tf32"
// mode on TF32 wgmma (sm_90a), for 16-byte aligned rows and Dk <= 128.
//
// The sum, the walk, the weight tables and the fixed-order CTA sum are rtk_chunk_decay_grad_f32's
// (decay_grad.cu's header has the math, dlog.cuh the shared pieces). A CTA covers KMAX x BV of the
// state with KMAX * BV = 128 * 64; each of warpgroups 0 and 1 owns a 64 x 64 block of it (KMAX 128:
// rows 64 r..; KMAX 64: columns 64 r..) and, per chunk of 64 tokens:
// - A1', A2' = (q w)^T do over its block: A from registers (q times the token weight, rounded to
//   TF32), B = do^T; then <S, A1'> and <W, A2'> entry by entry in registers;
// - D1, D2' = (k w)^T v the same way, each from zero, joining S and W by fp32 FMAs (the tensor
//   cores' adder truncates, which compounds over a long sequence where S is the accumulator).
// The intra term, P = q k^T, P~ = (t - s) gamma^(t - s) P below the diagonal, then
// sum_t do_t . (P~ v)_t: with KMAX 64 each state warpgroup adds it over its 64 value columns
// (every term is linear in the value columns) between its state products. With KMAX 128 a third
// warpgroup (the causal one, 384 threads) computes it whole, q k^T over all 128 key columns, while
// the other two run the state chain: the state warpgroups were the latency-bound part, six
// dependent 64 x 64 x 64 products a chunk, now four. setmaxnreg moves registers from the causal
// warpgroup (96 a thread) to the state ones (200), within the launch's 168 a thread.
// TF32 wgmma reads shared-memory operands K-major only, so v and do are stored transposed (4-byte
// cp.async, rtk_tf32_vt_elem) with keys at rtk_tf32_key_col, which lets P~'s accumulator be P~ v's A
// operand. Each thread rounds what it copied to TF32 in place (cvt.rna: the tensor cores would
// truncate, a bias the fp64 checks see at gamma 0.9, where the intra term dominates); the weighted
// A fragments and P~, just multiplied, by rtk_tf32_operand. Two stages: chunk c + 1 loads while c is
// computed, one CTA barrier a chunk. NaN in, NaN out: every product reaches the sum.
//
// Split sequence (grid.z segments of seg_len tokens; few (batch, head, tile) CTAs and a long
// sequence): the STATES instance walks each segment but the last with the recurrences alone (k and
// v loaded, no sums), from the initial state (segment 0) or zero, and leaves its S and W in slots
// (state_frag.cuh's fold_with layout); the summing walk of segment z > 0 folds them into the S and
// W entering it. Every segment writes its own row of partial sums; the last adds <G, W_end>.

#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/tf32.cuh"
#include "../include/wgmma_sm90.cuh"
#include "dlog.cuh"

// Byte offsets in shared memory: per stage q and k (C x KMAX, K-major), v^T and do^T (BV x C, keys
// at rtk_tf32_key_col), 128-byte swizzled in regions of 32 floats.
template <int KMAX>
struct rtk_dgt_smem {
  static constexpr int C = 64, BV = 128 * 64 / KMAX;
  static constexpr int Q = 0, K = C * KMAX * 4, VT = 2 * C * KMAX * 4, DT = VT + BV * C * 4, STAGE = DT + BV * C * 4;
  static constexpr int BYTES = 2 * STAGE + 1024;  // + slack to align the base to 1024 bytes
};

// The struct parameter: the forward's shape, then the segment length (grid.z is the segment; a
// multiple of 64, or N for one segment).
struct rtk_dgt_shape {
  rtk_fwd_shape f;
  rtk_i64 seg_len;
};

// Threads: 384 for the KMAX 128 walk (its causal warpgroup), else 256 (decay_grad.py: tf32_threads).
template <int KMAX, bool STATES>
__global__ void __launch_bounds__(KMAX == 128 && !STATES ? 384 : 256, 1)
rtk_chunk_decay_grad_tf32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ dout, const void* __restrict__ decay,
                          const float* __restrict__ init_state, const float* __restrict__ grad_state,
                          float* __restrict__ partial, float* __restrict__ slots,
                          const __grid_constant__ rtk_dgt_shape ps) {
  typedef rtk_dgt_smem<KMAX> L;
  const rtk_fwd_shape& p = ps.f;
  constexpr int C = L::C, BV = L::BV, NT = 8;
  static_assert(KMAX == 64 || KMAX == 128, "bad tile");
  static_assert(L::BYTES <= 227 * 1024 - 3 * 1024, "shared memory");
  const float scale = (float)p.scale;

  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* sm = smem_base + ((1024 - (rtk_smem_addr(smem_base) & 1023)) & 1023);
  const rtk_u32 base = rtk_smem_addr(sm);
  constexpr bool CWG = KMAX == 128 && !STATES;  // a causal warpgroup (the header)
  constexpr int WARPS = CWG ? 12 : 8;
  __shared__ float red[WARPS];
  __shared__ float wtab[2][4][C];
  __shared__ float dtab[C], wconst[4];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3, wg = warp >> 2, w4 = warp & 3;
  const bool causal = CWG && wg == 2;  // the causal block's warpgroup (no state, no copies)
  const rtk_dg_cta<float, BV> cta(p, q, k, v, dout, decay, ps.seg_len);
  const int bh = cta.bh, N = cta.N, Dk = cta.Dk, Dv = (int)p.Dv, v0 = cta.v0, dv_here = cta.dv_here;
  const int nchunks = cta.nchunks;
  const float lg2 = cta.lg2;
  // this warpgroup's block: rows r0.. of the state (and the key columns of its q k^T), value columns c0..
  const int r0 = KMAX == 128 ? 64 * wg : 0, c0 = KMAX == 128 ? 0 : 64 * wg;

  auto tile = [&](int stage, int which) { return base + stage * L::STAGE + which; };
  auto at = [&](int which, int stage, int off) -> float& {
    return *reinterpret_cast<float*>(sm + stage * L::STAGE + which + off);
  };

  // ---- loads. Rows 8 apart share a swizzle phase, so every copy of a thread is one of a few base
  // offsets plus a constant: q/k rows qr + QROWS u at column qc (16 bytes); v^T and do^T elements
  // (4 bytes, rtk_tf32_vt_elem) at keys vs[h] and value columns vd + 8 i ----------------------------
  constexpr int QP = KMAX / 4, QROWS = 256 / QP, VI = BV / 8;
  const int qr = tid / QP, qc = (tid % QP) * 4, qo = rtk_swz_off32(C, qr, qc);
  const int qbytes = max(0, min(16, (Dk - qc) * 4));
  int vs[2], vo[2], vd;
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    rtk_tf32_vt_elem<BV, 8>(tid, h * VI, vs[h], vd);
    vo[h] = rtk_swz_off32(BV, vd, rtk_tf32_key_col(vs[h]));
  }
  auto load_chunk = [&](int chunk, int stage) {
    const rtk_i64 n0 = (rtk_i64)chunk * C;
    const float* qp = cta.qb + (n0 + qr) * cta.q_sn + (qbytes ? qc : 0);
    const float* kp = cta.kb + (n0 + qr) * cta.k_sn + (qbytes ? qc : 0);
    #pragma unroll
    for (int u = 0; u < C / QROWS; ++u, qp += QROWS * cta.q_sn, kp += QROWS * cta.k_sn) {
      const bool in = n0 + qr + u * QROWS < N;
      const int o = qo + u * QROWS * 128;
      if (!STATES) rtk_cp_async16(tile(stage, L::Q) + o, in ? (const void*)qp : cta.qb, in ? qbytes : 0);
      rtk_cp_async16(tile(stage, L::K) + o, in ? (const void*)kp : cta.kb, in ? qbytes : 0);
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool row_in = n0 + vs[h] < N;
      const float* vp = cta.vb + (n0 + vs[h]) * cta.v_sn + vd;
      const float* dp = cta.db + (n0 + vs[h]) * cta.d_sn + vd;
      #pragma unroll
      for (int i = 0; i < VI; ++i) {
        const bool in = row_in && vd + 8 * i < dv_here;
        rtk_cp_async4(tile(stage, L::VT) + vo[h] + 1024 * i, in ? (const void*)(vp + 8 * i) : cta.vb, in ? 4 : 0);
        if (!STATES)
          rtk_cp_async4(tile(stage, L::DT) + vo[h] + 1024 * i, in ? (const void*)(dp + 8 * i) : cta.db, in ? 4 : 0);
      }
    }
  };
  // this thread's pieces of a landed stage, rounded to TF32 in place (q k^T reads q and k from
  // shared memory: truncated, they would bias every score by about -7e-4)
  auto round_chunk = [&](int stage) {
    #pragma unroll
    for (int u = 0; u < C / QROWS; ++u)
      #pragma unroll
      for (int which = STATES ? L::K : L::Q; which <= L::K; which += L::K - L::Q) {
        float4& x = reinterpret_cast<float4&>(at(which, stage, qo + u * QROWS * 128));
        x = make_float4(rtk_round_tf32(x.x), rtk_round_tf32(x.y), rtk_round_tf32(x.z), rtk_round_tf32(x.w));
      }
    #pragma unroll
    for (int h = 0; h < 2; ++h)
      #pragma unroll
      for (int i = 0; i < VI; ++i) {
        float& x = at(L::VT, stage, vo[h] + 1024 * i);
        x = rtk_round_tf32(x);
        if (!STATES) {
          float& y = at(L::DT, stage, vo[h] + 1024 * i);
          y = rtk_round_tf32(y);
        }
      }
  };

  if (nchunks > 0 && !causal) load_chunk(0, 0);
  rtk_cp_async_commit();
  rtk_dg_tables_f32(tid, lg2, N, nchunks, wtab, wconst, dtab);
  const int z = blockIdx.z, nseg = STATES ? gridDim.z + 1 : gridDim.z;
  float* const out = partial + (((rtk_i64)z * (gridDim.x / p.H) + cta.b) * gridDim.y + cta.tile) * p.H + cta.h;

  // ---- intra part: P~ = (t - s) gamma^(t - s) P for s < t (a select above the diagonal: an Inf
  // score there must not make NaN; a product with weight 0 on it), then sum_t do_t . (P~ v)_t over
  // value columns cv.. ----
  auto intra = [&](float (&pr)[NT][4], unsigned long long dvt, int stage, int cv, float& sum) {
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = (16 * w4 + g + 8 * (e >> 1)) - (8 * j + 2 * t4 + (e & 1));  // t - s
        pr[j][e] = d >= 0 ? pr[j][e] * dtab[d] : 0.f;
      }
    float ro[32];
    rtk_tf32_pv<false>(ro, pr, dvt, BV);
    #pragma unroll
    for (int e = 0; e < 4; ++e) {  // do[t][col]: column col + 8 nt at 1024 nt further
      const int t = 16 * w4 + g + 8 * (e >> 1), col = cv + 2 * t4 + (e & 1);
      const int o = rtk_swz_off32(BV, col, rtk_tf32_key_col(t));
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) sum = fmaf(ro[4 * nt + e], at(L::DT, stage, o + 1024 * nt), sum);
    }
  };
  // P = q k^T over all KMAX key columns of a stage, issued (the caller waits for it)
  auto scores = [&](float (&pa)[32], int stage) {
    const unsigned long long dq = rtk_wg_desc(tile(stage, L::Q), 16, 1024);
    const unsigned long long dk = rtk_wg_desc(tile(stage, L::K), 16, 1024);
    rtk_wg_fence();
    #pragma unroll
    for (int ks = 0; ks < KMAX / 8; ++ks)
      rtk_wgmma_tf32_ss(pa, rtk_desc_at(dq, rtk_kmajor_step(C, ks)), rtk_desc_at(dk, rtk_kmajor_step(C, ks)), ks);
    rtk_wg_commit();
  };
  if (causal) {
    // ---- the causal warpgroup: P = q k^T over all of Dk, then the intra part, chunk by chunk; the
    // state warps' barrier a chunk says when a stage has landed (rounded) and when it may be refilled
    rtk_reg_dealloc<96>();
    float acci = 0.f;
    for (int chunk = 0; chunk < nchunks; ++chunk) {
      const int stage = chunk & 1;
      __syncthreads();
      float pr[NT][4];
      float (&pa)[32] = reinterpret_cast<float (&)[32]>(pr);
      scores(pa, stage);
      rtk_wg_wait<0>();
      rtk_wg_pin(pa);
      intra(pr, rtk_wg_desc(tile(stage, L::VT), 16, 1024), stage, 0, acci);
    }
    rtk_dg_cta_sum<WARPS>(scale * acci, red, out);
    return;
  }
  if (CWG) rtk_reg_alloc<200>();  // the pool is 168 a thread at launch: 2 (200 - 168) <= 168 - 96

  const rtk_chunk_state<1, NT> frag = {r0 + 16 * w4, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, 0};
  float s_acc[1][NT][4], w_acc[1][NT][4];
  // S and W entering the segment: the initial state and 0 for segment 0 (and for every segment of
  // the states pass, whose slots hold each segment's own S and W), else folded from those slots
  const rtk_i64 slot = (rtk_i64)gridDim.x * Dk * Dv;
  if (STATES || z == 0) {
    frag.load(s_acc, z == 0 ? init_state : nullptr);
    rtk_frag_zero(w_acc);
  } else {
    frag.fold_with<true>(s_acc, w_acc, slots, rtk_head_log_decay(decay, p.decay_mode, cta.h), ps.seg_len, 1,
                         gridDim.x);
  }
  float (&sa)[32] = reinterpret_cast<float (&)[32]>(s_acc);
  float (&wa)[32] = reinterpret_cast<float (&)[32]>(w_acc);
  float acc1 = 0.f, acc2 = 0.f, acci = 0.f;  // sum <S, A1'>, sum <W, A2'>, the intra term

  // x1 (x2) = (x w_a)^T y ((x w_b)^T y) over the chunk, from zero: x = q or k (rows r0.. of the
  // block as A rows, tokens as A columns in v^T's key order), y^T = do^T or v^T (columns c0..).
  auto products = [&](float (&x1)[32], float (&x2)[32], rtk_u32 xs, const float* w_a, const float* w_b,
                      unsigned long long dy) {
    const unsigned char* x = sm + (xs - base);
    rtk_u32 a[2][2][4];  // two k-step sets: k-step kk + 1's fragments form while kk's wgmma runs
    const int m = r0 + 16 * w4 + g;  // tokens 8 kk + 2 t4 (+ 1): kk moves the offsets by 1024 kk
    const int o00 = rtk_swz_off32(C, 2 * t4, m), o01 = rtk_swz_off32(C, 2 * t4, m + 8);
    const int o10 = rtk_swz_off32(C, 2 * t4 + 1, m), o11 = rtk_swz_off32(C, 2 * t4 + 1, m + 8);
    // k-step kk's operands (x and the weights, shared memory), read one k-step ahead: the wgmma
    // fences order every shared-memory access, so a read after one waits out its latency there
    float xv[2][4], wv[2][4];
    auto read = [&](int kk, float (&xs4)[4], float (&ws4)[4]) {
      const int s0 = 8 * kk + 2 * t4;
      xs4[0] = *reinterpret_cast<const float*>(x + o00 + 1024 * kk);
      xs4[1] = *reinterpret_cast<const float*>(x + o01 + 1024 * kk);
      xs4[2] = *reinterpret_cast<const float*>(x + o10 + 1024 * kk);
      xs4[3] = *reinterpret_cast<const float*>(x + o11 + 1024 * kk);
      ws4[0] = w_a[s0], ws4[1] = w_a[s0 + 1], ws4[2] = w_b[s0], ws4[3] = w_b[s0 + 1];
    };
    read(0, xv[0], wv[0]);
    #pragma unroll
    for (int kk = 0; kk < C / 8; ++kk) {
      const float x00 = xv[kk & 1][0], x01 = xv[kk & 1][1], x10 = xv[kk & 1][2], x11 = xv[kk & 1][3];
      const float a0 = wv[kk & 1][0], a1 = wv[kk & 1][1], b0 = wv[kk & 1][2], b1 = wv[kk & 1][3];
      if (kk + 1 < C / 8) read(kk + 1, xv[(kk + 1) & 1], wv[(kk + 1) & 1]);
      rtk_u32 (&fa)[4] = a[kk & 1][0];
      rtk_u32 (&fb)[4] = a[kk & 1][1];
      fa[0] = rtk_tf32_operand(x00 * a0), fa[1] = rtk_tf32_operand(x01 * a0);
      fa[2] = rtk_tf32_operand(x10 * a1), fa[3] = rtk_tf32_operand(x11 * a1);
      fb[0] = rtk_tf32_operand(x00 * b0), fb[1] = rtk_tf32_operand(x01 * b0);
      fb[2] = rtk_tf32_operand(x10 * b1), fb[3] = rtk_tf32_operand(x11 * b1);
      rtk_wg_fence();
      rtk_wgmma_tf32_rs(x1, fa, rtk_desc_at(dy, rtk_kmajor_step(BV, kk)), kk);
      rtk_wgmma_tf32_rs(x2, fb, rtk_desc_at(dy, rtk_kmajor_step(BV, kk)), kk);
      rtk_wg_commit();
      rtk_wg_wait<1>();
    }
    rtk_wg_wait<0>();
    rtk_wg_pin(x1);
    rtk_wg_pin(x2);
  };

  for (int chunk = 0; chunk < nchunks; ++chunk) {
    const int stage = chunk & 1;
    rtk_cp_async_wait<0>();
    round_chunk(stage);
    rtk_fence_proxy_async();
    __syncthreads();  // chunk's tiles rounded and visible; every warp is done with the other stage
    if (chunk + 1 < nchunks) load_chunk(chunk + 1, stage ^ 1);
    rtk_cp_async_commit();
    const int n0 = chunk * C, len = min(C, N - n0), last = len == C ? 0 : 1;
    const float* wt = wtab[last][0];
    // descriptors: the block's columns c0.. of v^T / do^T are rows c0.. of those tiles
    const unsigned long long dvt = rtk_wg_desc(tile(stage, L::VT) + c0 * 128, 16, 1024);
    const unsigned long long ddt = rtk_wg_desc(tile(stage, L::DT) + c0 * 128, 16, 1024);

    // KMAX 64: P = q k^T over all 64 key columns, on the tensor cores while the state part runs
    float pr[NT][4];
    float (&pa)[32] = reinterpret_cast<float (&)[32]>(pr);
    if (!STATES && !CWG) scores(pa, stage);
    // ---- state part: acc1 += <S, A1'>, acc2 += <W, A2'> (the S and W entering the chunk) ----------
    {
      float t1[32], t2[32];
      if (!STATES) {
        products(t1, t2, tile(stage, L::Q), wt + 0 * C, wt + 1 * C, ddt);
        if (!CWG) rtk_wg_pin(pa);  // q k^T landed with them
        #pragma unroll
        for (int i = 0; i < 32; ++i) {
          acc1 = fmaf(sa[i], t1[i], acc1);
          acc2 = fmaf(wa[i], t2[i], acc2);
        }
        asm volatile("" : "+f"(acc1), "+f"(acc2));  // the dots before the next products (t1, t2 die here)
      }
      // W = gamma^L (W + L S) + n1 D2', S = gamma^L S + D1
      products(t1, t2, tile(stage, L::K), wt + 2 * C, wt + 3 * C, dvt);
      const float carry = wconst[last], n1 = wconst[2], fl = (float)len;
      #pragma unroll
      for (int i = 0; i < 32; ++i) {
        wa[i] = fmaf(n1, t1[i], carry * fmaf(fl, sa[i], wa[i]));
        sa[i] = fmaf(carry, sa[i], t2[i]);
      }
      rtk_wg_pin(sa);  // the step before the intra part's wgmma (t1, t2 die here)
      rtk_wg_pin(wa);
    }
    if (!STATES && !CWG) intra(pr, dvt, stage, c0, acci);
  }

  if (STATES) {  // this segment's own S and W into S slot z + 1 and W slot z + 1 (fold_with's layout)
    frag.store(s_acc, slots + (z + 1) * slot);
    frag.store(w_acc, slots + (nseg + z + 1) * slot);
    return;
  }
  // <G, W_end> belongs to the last segment; the partial sums are [segments * B, tiles, H]
  rtk_dg_finish<1, NT, WARPS>(frag, w_acc, z + 1 == nseg ? grad_state : nullptr, scale, wconst, acc1, acc2, acci,
                              red, out);
}
