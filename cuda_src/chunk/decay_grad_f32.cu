// chunk/decay_grad_f32.cu -- rtk_chunk_decay_grad_f32: dL/dlog(gamma) of fp32 inputs on TF32 tensor
// cores (mma.sync m16n8k8), for the kernel backward of float32 in both fp32_precision modes.
//
// The math, the walk, the warp tiling of S and W, the weight tables, the intra block and the
// fixed-order sums are rtk_chunk_decay_grad's (decay_grad.cu has them; dlog.cuh the shared
// pieces). What differs is how an operand reaches the tensor cores:
// - q, k, v, do sit in shared memory as fp32 (cp.async or element by element, zero-filled past Dk,
//   Dv and N), STAGES deep (two where they fit, one at KMAX 256 and with row slices).
// - Each chunk's k^T v sums start from zero and join S and W by fp32 FMAs: the tensor cores' adder
//   truncates, and with S as the mma accumulator that bias compounds over a long sequence.
// - Where CTAs are very few, SLICES = 2 CTAs share a walk, each with half the state's rows.
// - A per-token weight multiplies its operand in fp32, and the product is then split for the mma:
//   EXACT (3xTF32, the "exact" mode) as hi + lo, each product lo*hi' + hi*lo' + hi*hi' (about 20
//   significant bits, include/tf32.cuh); otherwise rounded once to TF32 (the "tf32" mode). The 16-bit
//   kernel rounds the weighted operand to 16 bits, which is what fp32 must not lose.
// - k-steps of 8 tokens (state part) or 8 columns (intra part) with plain 32-bit shared loads.
//
// Shared memory layout: rows unpadded (KMAX or BV floats) with the 16-byte groups of row r permuted
// by XOR with 4 h(r & 7), h(x) = 2 (x & 3) + (x >> 2) (rtk_dgf_col). The state part reads a column
// slice of 8 consecutive rows per instruction (A = x^T: element (row i, token t) is x[t][i], lanes
// (g, t4) at x[kk*8 + t4][i0 + g]), the intra part 8 rows at 4 consecutive columns (lanes at
// x[r0 + g][c0 + t4]). With h(0..3) = 0, 2, 4, 6 the first pattern's four rows land in four different
// 8-bank blocks, and with h a permutation of 0..7 the second's eight rows in eight different 4-bank
// groups: every fragment load is conflict-free (a padded stride serves only one of the two).
#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/tf32.cuh"
#include "dlog.cuh"

template <int KMAX, int BV, int STAGES>
struct rtk_dgf_smem {
  static constexpr int C = 64;
  static constexpr int Q = 0, K = Q + C * KMAX, V = K + C * KMAX, DO = V + C * BV;
  static constexpr int STAGE = DO + C * BV;
  static constexpr int BYTES = STAGES * STAGE * 4;
};

// Where column c of row r of a tile lives within its row (see the header).
__device__ __forceinline__ int rtk_dgf_col(int r, int c) { return c ^ ((((r & 3) << 1) | ((r >> 2) & 1)) << 2); }

// acc (+)= (x * wa)^T y over the first 8 ksteps tokens of a chunk: x = q or k (tile sX, rows of XS
// floats; the warp's state rows sr0..), y = do or v (tile sY, rows of YS floats; columns cb ..
// cb + 8 NT - 1), wa the fp32 token weights (shared). TWO: also acc_b (+)= (x * wb)^T y from the same
// loads of x and y. Fragments (include/tf32.cuh): A (row i, column t) = x[t][sr0 + 16 mt + i] w[t],
// B (k = t, n = j) = y[t][cb + 8 nt + j]; this thread's tokens ta = 8 kk + t4 and tb = ta + 4.
template <bool EXACT, bool TWO, int XS, int YS, int MT, int NT>
__device__ __forceinline__ void rtk_dgf_product(float (&acc_a)[MT][NT][4], const float* wa, float (&acc_b)[MT][NT][4],
                                                const float* wb, const float* sX, const float* sY, int ksteps,
                                                int sr0, int cb, int g, int t4) {
  const auto all = [](int, int) { return true; };
  #pragma unroll 1
  for (int kk = 0; kk < ksteps; ++kk) {
    const int ta = kk * 8 + t4, tb = ta + 4;
    const float* xa = sX + ta * XS;
    const float* xb = sX + tb * XS;
    float x[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int i = sr0 + mt * 16 + g;
      x[mt][0] = xa[rtk_dgf_col(ta, i)];
      x[mt][1] = xa[rtk_dgf_col(ta, i + 8)];
      x[mt][2] = xb[rtk_dgf_col(tb, i)];
      x[mt][3] = xb[rtk_dgf_col(tb, i + 8)];
    }
    rtk_u32 bh[NT][2], bl[NT][2];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int j = cb + nt * 8 + g;
      rtk_split_tf32<EXACT>(sY[ta * YS + rtk_dgf_col(ta, j)], bh[nt][0], bl[nt][0]);
      rtk_split_tf32<EXACT>(sY[tb * YS + rtk_dgf_col(tb, j)], bh[nt][1], bl[nt][1]);
    }
    // the weighted A fragments of one weight row, then their products
    auto weighted = [&](const float* w, float (&acc)[MT][NT][4]) {
      const float w_a = w[ta], w_b = w[tb];
      rtk_u32 ah[MT][4], al[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        rtk_split_tf32<EXACT>(x[mt][0] * w_a, ah[mt][0], al[mt][0]);
        rtk_split_tf32<EXACT>(x[mt][1] * w_a, ah[mt][1], al[mt][1]);
        rtk_split_tf32<EXACT>(x[mt][2] * w_b, ah[mt][2], al[mt][2]);
        rtk_split_tf32<EXACT>(x[mt][3] * w_b, ah[mt][3], al[mt][3]);
      }
      rtk_mma1688_x3_grid<EXACT>(acc, ah, al, bh, bl, all);
    };
    weighted(wa, acc_a);
    if (TWO) weighted(wb, acc_b);
  }
}

// p (+)= X[r0 .. r0 + 15] Y[c0 .. c0 + 15]^T over `steps` k-steps of 8 columns (X, Y tiles with rows
// of S floats; p[j] the 8 columns c0 + 8 j ..): A (row i, col c) = X[r0 + i][8 ks + c], B (k = c,
// n = j) = Y[c0 + 8 j' + j][8 ks + c].
template <bool EXACT, int S>
__device__ __forceinline__ void rtk_dgf_scores(float (&p)[1][2][4], const float* sX, const float* sY, int steps,
                                               int r0, int c0, int g, int t4) {
  const auto all = [](int, int) { return true; };
  const int ra = r0 + g, rb = r0 + g + 8;
  #pragma unroll 1
  for (int ks = 0; ks < steps; ++ks) {
    const int c = ks * 8 + t4;
    rtk_u32 ah[1][4], al[1][4], bh[2][2], bl[2][2];
    rtk_split_tf32<EXACT>(sX[ra * S + rtk_dgf_col(ra, c)], ah[0][0], al[0][0]);
    rtk_split_tf32<EXACT>(sX[rb * S + rtk_dgf_col(rb, c)], ah[0][1], al[0][1]);
    rtk_split_tf32<EXACT>(sX[ra * S + rtk_dgf_col(ra, c + 4)], ah[0][2], al[0][2]);
    rtk_split_tf32<EXACT>(sX[rb * S + rtk_dgf_col(rb, c + 4)], ah[0][3], al[0][3]);
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = c0 + 8 * j + g;
      rtk_split_tf32<EXACT>(sY[r * S + rtk_dgf_col(r, c)], bh[j][0], bl[j][0]);
      rtk_split_tf32<EXACT>(sY[r * S + rtk_dgf_col(r, c + 4)], bh[j][1], bl[j][1]);
    }
    rtk_mma1688_x3_grid<EXACT>(p, ah, al, bh, bl, all);
  }
}

// Parameters as rtk_chunk_decay_grad's, the views fp32 with a unit last stride. Two CTAs share a
// multiprocessor where their shared memory fits (then 128 registers a thread); S, W and the two
// scratch fragments take (2 + 2 / NG) MT NT 4 of them (64 at KMAX 128, BV 32).
// SLICES > 1 (few (batch, head, tile) CTAs for the GPU): CTA z = blockIdx.z owns rows z KMAX /
// SLICES .. of S and W (the state terms are sums over the rows) and the causal block's tiles
// i = z mod SLICES (it still loads whole q and k rows for q_t . k_s), so SLICES CTAs share a walk.
template <int KMAX, int BV, int STAGES, int SLICES, bool EXACT, bool VEC>
__global__ void __launch_bounds__(256, rtk_dgf_smem<KMAX, BV, STAGES>::BYTES <= 110 * 1024 ? 2 : 1)
rtk_chunk_decay_grad_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ dout, const void* __restrict__ decay,
                         const float* __restrict__ init_state, const float* __restrict__ grad_state,
                         float* __restrict__ partial, const __grid_constant__ rtk_fwd_shape p) {
  const float scale = (float)p.scale;
  typedef rtk_dgf_smem<KMAX, BV, STAGES> L;
  typedef rtk_dg_split<KMAX / SLICES, BV> P;  // the warps tile this CTA's rows of the state
  constexpr int C = L::C, MT = P::MT, NT = P::NT;
  constexpr int NG = MT * NT >= 8 ? 2 : 1;  // column groups of the scratch fragments
  static_assert(KMAX % 64 == 0 && BV % 32 == 0 && (STAGES == 1 || STAGES == 2), "bad tile");
  static_assert(SLICES == 1 || (SLICES == 2 && KMAX >= 128), "bad slices");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* const sm = reinterpret_cast<float*>(smem_raw);
  __shared__ float red[8];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const rtk_dg_cta<float, BV> cta(p, q, k, v, dout, decay);
  const int bh = cta.bh, N = cta.N, Dk = cta.Dk, Dv = (int)p.Dv, v0 = cta.v0, dv_here = cta.dv_here;
  const int nchunks = cta.nchunks;
  const float lg2 = cta.lg2;  // log2(gamma)

  // ---- loading chunk `chunk` into stage `stage` (rows permuted: rtk_dgf_col) ---------------------
  auto load_chunk = [&](int chunk, int stage) {
    float* st = sm + stage * L::STAGE;
    cta.template load<KMAX, VEC>(chunk, st + L::Q, st + L::K, st + L::V, st + L::DO,
                                 [](int r, int c) { return r * KMAX + rtk_dgf_col(r, c); },
                                 [](int r, int c) { return r * BV + rtk_dgf_col(r, c); });
  };

  if (nchunks > 0) {
    load_chunk(0, 0);
    rtk_cp_async_commit();
  }

  // ---- this warp's slice of the state: rows sr0.., columns c0.. of the tile ----------------------
  const int sr0 = blockIdx.z * (KMAX / SLICES) + (warp % P::RW) * P::ROWS, c0 = (warp / P::RW) * P::COLS;
  const bool state_live = sr0 < Dk && c0 < dv_here;  // else S, W stay 0 and the products are skipped
  const rtk_chunk_state<MT, NT> frag = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, 0};
  float s_acc[MT][NT][4], w_acc[MT][NT][4];
  frag.load(s_acc, init_state);
  rtk_frag_zero(w_acc);

  // the token weights and constants (rtk_dg_tables_f32); the chunk loop's first barrier publishes them
  __shared__ float wtab[2][4][C];
  __shared__ float dtab[C], wconst[4];
  rtk_dg_tables_f32(tid, lg2, N, nchunks, wtab, wconst, dtab);

  float acc1 = 0.f, acc2 = 0.f, acci = 0.f;  // sum <S, A1'>, sum <W, A2'>, the intra term
  const int kt_used = (Dk + 7) >> 3, vt_used = (dv_here + 7) >> 3;

  for (int chunk = 0; chunk < nchunks; ++chunk) {
    const int stage = STAGES == 2 ? (chunk & 1) : 0;
    if (STAGES == 1 && chunk > 0) {
      __syncthreads();  // every warp is done with the stage
      load_chunk(chunk, 0);
      rtk_cp_async_commit();
    }
    rtk_cp_async_wait<0>();
    __syncthreads();  // chunk's tiles visible; (two stages) every warp is done with the other one
    if (STAGES == 2 && chunk + 1 < nchunks) {
      load_chunk(chunk + 1, stage ^ 1);
      rtk_cp_async_commit();
    }
    const int len = (int)min((rtk_i64)C, (rtk_i64)N - (rtk_i64)chunk * C);
    const int ksteps = (len + 7) >> 3;
    const float* sQ = sm + stage * L::STAGE + L::Q;
    const float* sK = sm + stage * L::STAGE + L::K;
    const float* sV = sm + stage * L::STAGE + L::V;
    const float* sD = sm + stage * L::STAGE + L::DO;

    // ---- state part (as rtk_chunk_decay_grad's) ----------------------------------------------------
    if (state_live) {
      const int last = len == C ? 0 : 1;
      const float carry = wconst[last], n1 = wconst[2], fl = (float)len;
      const float* wt = wtab[last][0];
      // per group of NTG n-tiles (scratch fragments of that width keep the registers down)
      #pragma unroll
      for (int grp = 0; grp < NG; ++grp) {
        constexpr int NTG = NT / NG;
        const int cb = c0 + grp * NTG * 8;
        float t_acc[MT][NTG][4], d_acc[MT][NTG][4];
        // A1' (t_acc) and A2' (d_acc) in one pass over q and do: acc1 += <S, A1'>, acc2 += <W, A2'>
        // (old S and W)
        rtk_frag_zero(t_acc);
        rtk_frag_zero(d_acc);
        rtk_dgf_product<EXACT, true, KMAX, BV>(t_acc, wt + 0 * C, d_acc, wt + 1 * C, sQ, sD, ksteps, sr0, cb, g, t4);
        acc1 += rtk_dg_dot(s_acc, t_acc, grp * NTG);
        acc2 += rtk_dg_dot(w_acc, d_acc, grp * NTG);
        // D2' (t_acc) and D1 (d_acc) in one pass over k and v, each from zero: S and W never pass
        // through the tensor cores' adder, which truncates (a bias of about 2^-23 a pass that
        // compounds over the chunks: 1.7e-4 at N = 16384, gamma = 1, when S took D1 by mma)
        rtk_frag_zero(t_acc);
        rtk_frag_zero(d_acc);
        rtk_dgf_product<EXACT, true, KMAX, BV>(t_acc, wt + 2 * C, d_acc, wt + 3 * C, sK, sV, ksteps, sr0, cb, g, t4);
        // W = gamma^L (W + L S) + n1 D2' (the old S), S = gamma^L S + D1
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int nt = 0; nt < NTG; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              float& sv = s_acc[mt][grp * NTG + nt][e];
              float& w = w_acc[mt][grp * NTG + nt][e];
              w = fmaf(n1, t_acc[mt][nt][e], carry * fmaf(fl, sv, w));
              sv = fmaf(carry, sv, d_acc[mt][nt][e]);
            }
      }
    }

    // ---- intra part: tiles z + SLICES warp (+ 8 SLICES) of the causal block -----------------------
    #pragma unroll 1
    for (int i = blockIdx.z + SLICES * warp; i < 10; i += 8 * SLICES) {
      int r, c;
      rtk_dg_tile(i, r, c);
      if (16 * r >= len) continue;  // rows past the sequence
      float sc[1][2][4], dp[1][2][4];
      rtk_frag_zero(sc);
      rtk_frag_zero(dp);
      rtk_dgf_scores<EXACT, KMAX>(sc, sQ, sK, kt_used, 16 * r, 16 * c, g, t4);  // q_t . k_s
      rtk_dgf_scores<EXACT, BV>(dp, sD, sV, vt_used, 16 * r, 16 * c, g, t4);    // do_t . v_s, the tile's columns
      acci = rtk_dg_intra(sc[0], dp[0], r, c, g, t4, dtab, acci);
    }
  }

  rtk_dg_finish(frag, w_acc, grad_state, scale, wconst, acc1, acc2, acci, red,
                partial + (((rtk_i64)cta.b * gridDim.y + cta.tile) * SLICES + blockIdx.z) * p.H + cta.h);
}
