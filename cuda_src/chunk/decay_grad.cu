// chunk_decay_grad.cu -- dL/dlog(gamma) of the chunked operator, for the kernel backward
// (rtkernels/decay_grad.py launches it; rtkernels.decay_grad.torch_w_recurrence is the same
// computation in torch operations, which the CPU tests check against autograd in fp64).
//
// Math, per (batch, head), chunks of C = 64 tokens (the last one L <= C long), local index t
// (queries) / s (keys) in a chunk. S_c is the state entering chunk c and W_c = dS_c/dlog(gamma)
// its derivative with respect to log(gamma) (forward-mode, carried along with S):
//
//   S_0 = S0 (or 0),  W_0 = 0
//   S_{c+1} = gamma^L S_c + sum_s gamma^(L-1-s) k_s^T v_s
//   W_{c+1} = gamma^L (W_c + L S_c) + sum_s (L-1-s) gamma^(L-1-s) k_s^T v_s
//   dL/dlog(gamma) = scale * sum_c [ sum_t gamma^(t+1) q_t ((t+1) S_c + W_c) do_t^T
//                                    + sum_{s<t} (t-s) gamma^(t-s) (q_t . k_s)(do_t . v_s) ]
//                    + <G, W_end>
//
// with do = dL/do, G = dL/d(final state) (absent: 0), W_end the W after the last chunk and
// <A, B> = sum_ab A_ab B_ab. (o_t = scale q_t S_t with S_t = gamma^(t+1) S_c + sum_{s<=t}
// gamma^(t-s) k_s^T v_s inside the chunk; dS_t/dlog(gamma) = (t+1) gamma^(t+1) S_c + gamma^(t+1)
// W_c + sum_s (t-s) gamma^(t-s) k_s^T v_s; the chain rule through every o_t and the final state.)
// Every weight is non-negative and only non-negative powers of gamma appear: no cancellation
// between terms and no overflow for any gamma in (0, 1] and any N. (The identity through
// sum_i i q_i . dq_i - ... is exact too but cancels catastrophically in 16-bit.)
//
// The query-side terms are inner products with Dk x Dv matrices shaped like the state update:
//
//   sum_t gamma^(t+1) q_t ((t+1) S_c + W_c) do_t^T = <S_c, A1_c> + <W_c, A2_c>,
//   A1_c = sum_t (t+1) gamma^(t+1) q_t^T do_t,   A2_c = sum_t gamma^(t+1) q_t^T do_t,
//
// so S, W and the four products A1, A2, D1 = sum_s gamma^(L-1-s) k_s^T v_s and D2 = sum_s
// (L-1-s) gamma^(L-1-s) k_s^T v_s all live in fp32 registers in one mma fragment layout, and
// <S, A1>, <W, A2>, <G, W_end> are elementwise in registers: no 16-bit copy of S or W is ever
// formed (W grows like N^2 and would overflow fp16).
//
// Kernel: one CTA of 8 warps per (batch*head, tile of BV value columns) walks the chunks. Per
// chunk, q, k (KMAX columns), v and do (the tile's BV columns) sit in shared memory, loaded with
// cp.async (VEC: every row 16-byte aligned) or element by element (otherwise), double-buffered
// (one barrier per chunk: the load of chunk c+1 is issued right after the barrier that opens
// chunk c, into the stage chunk c-1 used), zero-filled beyond Dk, Dv and N.
// - State part: warp w owns a ROWS x COLS slice of S and W (8 warps tile KMAX x BV; rows first)
//   and one scratch fragment T: T = A1' -> acc1 += <S, T>; T = A2' -> acc2 += <W, T>; then
//   W = gamma^L (W + L S) and S = gamma^L S (old S enters W first), and one pass over k and v
//   gives T = D2' and S += D1 (mma into S), W += n1 T. Each product is an mma m16n8k16 over the
//   chunk's tokens with A = x^T (ldmatrix.trans of q or k) and B = y (ldmatrix.trans of do or v),
//   as chunk.cu's state warps form k^T v; the per-token weight multiplies the A operand, rounded
//   once to 16 bits (the weight as two 16-bit parts, two packed fma: rtk_dg_weigh). The weights
//   come from a shared table made once per CTA (full chunks and the last one) and are normalised
//   to at most 1 so that fp16 cannot overflow and small gamma keeps its precision (gamma = 1e-6
//   would be an fp16 subnormal): with n1 = max_{1<=m<=64} m gamma^m,
//     A1' = A1 / n1  (weights (t+1) gamma^(t+1) / n1),   A2' = A2 / gamma  (weights gamma^t),
//     D2' = D2 / n1  (weights (L-1-s) gamma^(L-1-s) / n1), D1 as it is (weights <= 1),
//   and n1, gamma are multiplied back in fp32.
// - Intra part: the causal 64 x 64 block, as 10 tiles of 16 x 16 (t >= s tiles) spread over the
//   8 warps: Q K^T over Dk and dO V^T over this tile's columns by mma (fp32, from the exact
//   16-bit inputs), times (t-s) gamma^(t-s) in fp32 (a table by t-s), summed. s > t is a select (an Inf score
//   there must not make NaN), s = t a product with weight 0 (a NaN there reaches the sum, as in
//   the torch formula).
// The tile's share of the intra term (do . v over its columns) and of <S, A1>, <W, A2>, <G, W>
// (its columns) add up over the value tiles to the whole. Each thread keeps fp32 partial sums; the
// CTA reduces them in a fixed order (warp shuffles, then warp 0..7 through shared memory, no
// atomics) and writes partial[(b * gridDim.y + tile) * H + h]; rtk_chunk_decay_grad_sum adds them
// over batches and tiles in a fixed order (deterministic).
//
// NaN: any NaN in q, k, v or do of a (batch, head) reaches its partial sum (products with weight
// 0 included); the state terms keep NaN through S and W.
#include "../include/copy.cuh"
#include "../include/mma_sm80.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "dlog.cuh"

// Shared memory: two stages of q, k (64 x KMAX) and v, do (64 x BV), rows padded by 16 bytes
// (conflict-free ldmatrix).
template <int KMAX, int BV>
struct rtk_dg_smem {
  static constexpr int C = 64;
  static constexpr int KS = KMAX + 8, VS = BV + 8;
  static constexpr int Q = 0, K = Q + C * KS, V = K + C * KS, DO = V + C * VS;
  static constexpr int STAGE = DO + C * VS;
  static constexpr int ELEMS = 2 * STAGE;
  static constexpr int BYTES = ELEMS * 2;
};

// x * w for a packed pair x and a token-pair weight w given as packed 16-bit parts (hi, lo), w =
// hi + lo: x * lo first, then x * hi + that in one fma, so the pair is rounded once to 16 bits up
// to |x lo| 2^-8 <= |x w| 2^-16 (two instructions where an fp32 multiply takes five).
template <int DT> __device__ __forceinline__ rtk_u32 rtk_dg_weigh(rtk_u32 x, uint2 w) {
  return rtk_fma2<DT>(x, w.x, rtk_mul2<DT>(x, w.y));
}

// acc (+)= (x * wa)^T y over the first 16 ksteps tokens of a chunk: x = q or k (tile at shared
// address sX, row stride KS elements; the warp's rows sr0..), y = do or v (at sY, stride VS;
// columns cb .. cb + 8 NA - 1), wa the token weights (a shared table: at 2p, 2p + 1 the packed hi
// and lo parts of the weights of tokens 2p, 2p + 1; see rtk_dg_weigh). As chunk.cu's state warps: A = x^T and B = y by ldmatrix.trans, mma
// m16n8k16. TWO: also acc_b[.][nb0 + .] (+)= (x * wb)^T y with the same fragments of x and y
// (nb0 a constant after unrolling, so acc_b stays in registers).
template <int DT, bool TWO, int KS, int VS, int MT, int NA, int NB>
__device__ __forceinline__ void rtk_dg_product(float (&acc_a)[MT][NA][4], const rtk_u32* wa, float (&acc_b)[MT][NB][4],
                                               int nb0, const rtk_u32* wb, rtk_u32 sX, rtk_u32 sY, int ksteps,
                                               int sr0, int cb, int lane) {
  const int t4 = lane & 3;
  #pragma unroll 1
  for (int kk = 0; kk < ksteps; ++kk) {
    const int ta = kk * 16 + 2 * t4;  // this thread's tokens: ta, ta + 1, ta + 8, ta + 9 (ta even)
    const uint2 a01 = *reinterpret_cast<const uint2*>(wa + ta), a89 = *reinterpret_cast<const uint2*>(wa + ta + 8);
    uint2 b01 = a01, b89 = a89;
    if (TWO) {
      b01 = *reinterpret_cast<const uint2*>(wb + ta);
      b89 = *reinterpret_cast<const uint2*>(wb + ta + 8);
    }
    rtk_u32 xa[MT][4], xb[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      rtk_u32 raw[4];
      rtk_ldsm_x4_trans(raw, sX + 2 * ((kk * 16 + (lane & 7) + (lane >> 4) * 8) * KS + sr0 + mt * 16 + ((lane >> 3) & 1) * 8));
      xa[mt][0] = rtk_dg_weigh<DT>(raw[0], a01);
      xa[mt][1] = rtk_dg_weigh<DT>(raw[1], a01);
      xa[mt][2] = rtk_dg_weigh<DT>(raw[2], a89);
      xa[mt][3] = rtk_dg_weigh<DT>(raw[3], a89);
      if (TWO) {
        xb[mt][0] = rtk_dg_weigh<DT>(raw[0], b01);
        xb[mt][1] = rtk_dg_weigh<DT>(raw[1], b01);
        xb[mt][2] = rtk_dg_weigh<DT>(raw[2], b89);
        xb[mt][3] = rtk_dg_weigh<DT>(raw[3], b89);
      }
    }
    #pragma unroll
    for (int np = 0; np < NA / 2; ++np) {
      rtk_u32 bb[4];
      rtk_ldsm_x4_trans(bb, sY + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + cb + np * 16 + (lane >> 4) * 8));
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        rtk_mma16816<DT>(acc_a[mt][2 * np], xa[mt], bb[0], bb[1]);
        rtk_mma16816<DT>(acc_a[mt][2 * np + 1], xa[mt], bb[2], bb[3]);
        if (TWO) {
          rtk_mma16816<DT>(acc_b[mt][nb0 + 2 * np], xb[mt], bb[0], bb[1]);
          rtk_mma16816<DT>(acc_b[mt][nb0 + 2 * np + 1], xb[mt], bb[2], bb[3]);
        }
      }
    }
  }
}

// Parameters: q, k, v, do ([B, H, N, D] views, unit last stride), the decay argument, the initial
// state and the gradient of the final state (fp32 contiguous [B, H, Dk, Dv], or null), the
// partial sums [B, gridDim.y, H]; then the shape struct of the forward kernels (rtk_fwd_shape, do's strides in o's place).
// Registers: 128 a thread for KMAX <= 128 (two CTAs per multiprocessor: their shared memory fits),
// no spills; KMAX = 256 takes one CTA per multiprocessor (shared memory) and up to 255.
template <int DT, int KMAX, int BV, bool VEC>
__global__ void __launch_bounds__(256, KMAX <= 128 ? 2 : 1)
rtk_chunk_decay_grad(const rtk_u16* __restrict__ q, const rtk_u16* __restrict__ k, const rtk_u16* __restrict__ v,
                     const rtk_u16* __restrict__ dout, const void* __restrict__ decay,
                     const float* __restrict__ init_state, const float* __restrict__ grad_state,
                     float* __restrict__ partial, const __grid_constant__ rtk_fwd_shape p) {
  const float scale = (float)p.scale;
  typedef rtk_dg_smem<KMAX, BV> L;
  typedef rtk_dg_split<KMAX, BV> P;
  constexpr int C = L::C, KS = L::KS, VS = L::VS, MT = P::MT, NT = P::NT;
  constexpr int NG = MT * NT >= 8 ? 2 : 1;  // column groups of the scratch fragment
  static_assert(KMAX % 64 == 0 && BV % 32 == 0, "bad tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  rtk_u16* const sm = reinterpret_cast<rtk_u16*>(smem_raw);
  __shared__ float red[8];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const rtk_dg_cta<rtk_u16, BV> cta(p, q, k, v, dout, decay);
  const int bh = cta.bh, N = cta.N, Dk = cta.Dk, Dv = (int)p.Dv, v0 = cta.v0, dv_here = cta.dv_here;
  const int nchunks = cta.nchunks;
  const float lg2 = cta.lg2;  // log2(gamma)

  // ---- loading chunk `chunk` into stage `stage` (rows padded: KS, VS) ----------------------------
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* st = sm + stage * L::STAGE;
    cta.template load<KMAX, VEC>(chunk, st + L::Q, st + L::K, st + L::V, st + L::DO,
                                 [](int r, int c) { return r * KS + c; }, [](int r, int c) { return r * VS + c; });
  };

  if (nchunks > 0) {
    load_chunk(0, 0);
    rtk_cp_async_commit();
  }

  // ---- this warp's slice of the state: rows sr0.., columns c0.. of the tile ----------------------
  const int sr0 = (warp % P::RW) * P::ROWS, c0 = (warp / P::RW) * P::COLS;
  const bool state_live = sr0 < Dk && c0 < dv_here;  // else S, W stay 0 and the products are skipped
  const rtk_chunk_state<MT, NT> frag = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, 0};
  float s_acc[MT][NT][4], w_acc[MT][NT][4];
  frag.elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
    s_acc[mt][nt][e] = (init_state != nullptr && real) ? init_state[off] : 0.f;
    w_acc[mt][nt][e] = 0.f;
  });

  // The token weights, computed once: wtab[0] for full chunks, wtab[1] for a shorter last one;
  // rows A1' (t+1) gamma^(t+1) / n1, A2' gamma^t, D2' (L-1-s) gamma^(L-1-s) / n1 and D1
  // gamma^(L-1-s) (rtk_dg_weight), as 16-bit pairs (rtk_dg_weigh); the constants of
  // rtk_dg_constants. The chunk loop's first barrier publishes them.
  __shared__ __align__(16) rtk_u32 wtab[2][4][C];
  __shared__ float dtab[C], wconst[4];
  const float log2n1 = rtk_dg_constants(tid, lg2, N, nchunks, wconst, dtab);
  if (tid < 2 * C) {
    const int j = tid % C, t = j & ~1, len = tid < C ? C : N - (nchunks - 1) * C;
    #pragma unroll 1
    for (int row = 0; row < 4; ++row) {
      const float w0 = rtk_dg_weight(row, t, len, lg2, log2n1), w1 = rtk_dg_weight(row, t + 1, len, lg2, log2n1);
      const rtk_u32 hi = rtk_pack2<DT>(w0, w1);
      float h0, h1;
      rtk_unpack2<DT>(hi, h0, h1);
      wtab[tid / C][row][j] = (j & 1) ? rtk_pack2<DT>(w0 - h0, w1 - h1) : hi;
    }
  }

  float acc1 = 0.f, acc2 = 0.f, acci = 0.f;  // sum <S, A1'>, sum <W, A2'>, the intra term

  const int kt_used = (Dk + 15) >> 4, vt_used = (dv_here + 15) >> 4;

  for (int chunk = 0; chunk < nchunks; ++chunk) {
    const int stage = chunk & 1;
    rtk_cp_async_wait<0>();
    __syncthreads();  // chunk's tiles visible; every warp is done with the other stage
    if (chunk + 1 < nchunks) {
      load_chunk(chunk + 1, stage ^ 1);
      rtk_cp_async_commit();
    }
    const int len = (int)min((rtk_i64)C, (rtk_i64)N - (rtk_i64)chunk * C);
    const int ksteps = (len + 15) >> 4;
    const rtk_u32 sQ = rtk_smem_addr(sm + stage * L::STAGE + L::Q);
    const rtk_u32 sK = rtk_smem_addr(sm + stage * L::STAGE + L::K);
    const rtk_u32 sV = rtk_smem_addr(sm + stage * L::STAGE + L::V);
    const rtk_u32 sD = rtk_smem_addr(sm + stage * L::STAGE + L::DO);

    // ---- state part ------------------------------------------------------------------------------
    if (state_live) {
      const int last = len == C ? 0 : 1;
      const float carry = wconst[last], n1 = wconst[2], fl = (float)len;
      const rtk_u32* wt = wtab[last][0];
      // per group of NTG n-tiles (a scratch fragment T of that width keeps the registers down)
      #pragma unroll
      for (int grp = 0; grp < NG; ++grp) {
        constexpr int NTG = NT / NG;
        const int cb = c0 + grp * NTG * 8;
        float t_acc[MT][NTG][4];
        // A1' = sum_t (t+1) gamma^(t+1) / n1 q_t^T do_t;  acc1 += <S, A1'>   (old S)
        rtk_frag_zero(t_acc);
        rtk_dg_product<DT, false, KS, VS>(t_acc, wt + 0 * C, t_acc, 0, nullptr, sQ, sD, ksteps, sr0, cb, lane);
        acc1 += rtk_dg_dot(s_acc, t_acc, grp * NTG);
        // A2' = sum_t gamma^t q_t^T do_t;  acc2 += <W, A2'>   (old W)
        rtk_frag_zero(t_acc);
        rtk_dg_product<DT, false, KS, VS>(t_acc, wt + 1 * C, t_acc, 0, nullptr, sQ, sD, ksteps, sr0, cb, lane);
        acc2 += rtk_dg_dot(w_acc, t_acc, grp * NTG);
        // W = gamma^L (W + L S) + n1 D2' and S = gamma^L S + D1 on this group's columns, with
        // D2' = sum_s (L-1-s) gamma^(L-1-s) / n1 k_s^T v_s and D1 = sum_s gamma^(L-1-s) k_s^T v_s
        // in one pass over k and v: the old S enters W before S takes its new value
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int nt = 0; nt < NTG; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              float& sv = s_acc[mt][grp * NTG + nt][e];
              float& w = w_acc[mt][grp * NTG + nt][e];
              w = carry * fmaf(fl, sv, w);
              sv *= carry;
            }
        rtk_frag_zero(t_acc);
        rtk_dg_product<DT, true, KS, VS>(t_acc, wt + 2 * C, s_acc, grp * NTG, wt + 3 * C, sK, sV, ksteps, sr0, cb, lane);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int nt = 0; nt < NTG; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) w_acc[mt][grp * NTG + nt][e] = fmaf(n1, t_acc[mt][nt][e], w_acc[mt][grp * NTG + nt][e]);
      }
    }

    // ---- intra part: tiles warp, warp + 8 of the causal block ------------------------------------
    #pragma unroll 1
    for (int i = warp; i < 10; i += 8) {
      int r, c;
      rtk_dg_tile(i, r, c);
      if (16 * r >= len) continue;  // rows past the sequence
      float p[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float dp[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const int arow = 16 * r + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
      const int brow = 16 * c + (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
      #pragma unroll 1
      for (int ks = 0; ks < kt_used; ++ks) {  // q_t . k_s
        rtk_u32 a[4], bb[4];
        rtk_ldsm_x4(a, sQ + 2 * (arow * KS + ks * 16 + acol));
        rtk_ldsm_x4(bb, sK + 2 * (brow * KS + ks * 16 + bcol));
        rtk_mma16816<DT>(p[0], a, bb[0], bb[1]);
        rtk_mma16816<DT>(p[1], a, bb[2], bb[3]);
      }
      #pragma unroll 1
      for (int ks = 0; ks < vt_used; ++ks) {  // do_t . v_s over the tile's columns
        rtk_u32 a[4], bb[4];
        rtk_ldsm_x4(a, sD + 2 * (arow * VS + ks * 16 + acol));
        rtk_ldsm_x4(bb, sV + 2 * (brow * VS + ks * 16 + bcol));
        rtk_mma16816<DT>(dp[0], a, bb[0], bb[1]);
        rtk_mma16816<DT>(dp[1], a, bb[2], bb[3]);
      }
      acci = rtk_dg_intra(p, dp, r, c, g, t4, dtab, acci);
    }
  }

  rtk_dg_finish(frag, w_acc, grad_state, scale, wconst, acc1, acc2, acci, red,
                partial + ((rtk_i64)cta.b * gridDim.y + cta.tile) * p.H + cta.h);
}
