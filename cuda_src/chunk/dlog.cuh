// chunk/dlog.cuh -- what the two dlog(gamma) kernels share (decay_grad.cu on 16-bit inputs,
// decay_grad_f32.cu on fp32): how 8 warps tile the state, the per-token weights, the causal block's
// tiles, fragment sums, the per-CTA constants and the CTA's fixed-order sum. decay_grad.cu's header
// has the math.
#pragma once
#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"

// A CTA's place in the walk: (batch, head) and value tile (BV columns from v0, dv_here of them
// real) in rtk_head_tile's order, log2(gamma), the chunk count, and where its rows of q, k (all columns)
// and v, do (the tile's columns) start; do's strides are the shape struct's o_* fields. With
// seg_len > 0 (a multiple of 64) the walk is segment blockIdx.z's: tokens z seg_len .., N of them.
template <class T, int BV>
struct rtk_dg_cta {
  int bh, tile, b, h, v0, dv_here, N, Dk, nchunks;
  float lg2;
  const T *qb, *kb, *vb, *db;
  rtk_i64 q_sn, k_sn, v_sn, d_sn;

  __device__ __forceinline__ rtk_dg_cta(const rtk_fwd_shape& p, const T* q, const T* k, const T* v, const T* dout,
                                        const void* decay, rtk_i64 seg_len = 0) {
    const int H = (int)p.H;
    rtk_head_tile(bh, tile);
    b = bh / H;
    h = bh - b * H;
    v0 = tile * BV;
    dv_here = min(BV, (int)p.Dv - v0);
    const rtk_i64 n0 = seg_len > 0 ? (rtk_i64)blockIdx.z * seg_len : 0;
    N = (int)(seg_len > 0 ? min(seg_len, p.N - n0) : p.N);
    Dk = (int)p.Dk;
    nchunks = (N + 63) / 64;
    lg2 = rtk_head_log_decay(decay, p.decay_mode, h) * 1.4426950408889634f;
    qb = q + (rtk_i64)b * p.q_sb + (rtk_i64)h * p.q_sh + n0 * p.q_sn;
    kb = k + (rtk_i64)b * p.k_sb + (rtk_i64)h * p.k_sh + n0 * p.k_sn;
    vb = v + (rtk_i64)b * p.v_sb + (rtk_i64)h * p.v_sh + n0 * p.v_sn + v0;
    db = dout + (rtk_i64)b * p.o_sb + (rtk_i64)h * p.o_sh + n0 * p.o_sn + v0;
    q_sn = p.q_sn;
    k_sn = p.k_sn;
    v_sn = p.v_sn;
    d_sn = p.o_sn;
  }

  // Tokens 64 chunk .. + 63 into the tiles sQ, sK (KMAX columns) and sV, sD (BV columns), zeros past
  // Dk, the tile's columns and N (all 256 threads): 16-byte cp.async pieces with VEC (every row
  // 16-byte aligned; the caller commits), else element by element. atk(r, c) / atv(r, c): the
  // offset of row r, column c in a q/k tile / a v/do tile (padding or permutation: the caller's).
  template <int KMAX, bool VEC, class AtK, class AtV>
  __device__ __forceinline__ void load(int chunk, T* sQ, T* sK, T* sV, T* sD, AtK atk, AtV atv) const {
    constexpr int C = 64, PIECE = 16 / (int)sizeof(T);   // elements of a 16-byte piece
    constexpr int QP = KMAX / PIECE, VP = BV / PIECE;     // pieces of a q/k row and of a v/do row
    constexpr int QROWS = 256 / QP, VROWS = 256 / VP;     // rows one pass of the 256 threads covers
    const int tid = threadIdx.x;
    const rtk_i64 n0 = (rtk_i64)chunk * C;
    const int rows = (int)min((rtk_i64)C, (rtk_i64)N - n0);
    if (VEC) {  // bytes past Dk / Dv / N are zero-filled (nothing read there)
      // thread tid copies the piece at column qcol (vcol) of rows qrow + i * QROWS (vrow + i * VROWS):
      // one pointer per operand, stepped by a multiple of the row stride
      const int qrow = tid / QP, qcol = (tid % QP) * PIECE, vrow = tid / VP, vcol = (tid % VP) * PIECE;
      const int qbytes = max(0, min(16, (Dk - qcol) * (int)sizeof(T)));
      const int vbytes = max(0, min(16, (dv_here - vcol) * (int)sizeof(T)));
      const T* qp = qb + (n0 + qrow) * q_sn + (qbytes ? qcol : 0);
      const T* kp = kb + (n0 + qrow) * k_sn + (qbytes ? qcol : 0);
      const T* vp = vb + (n0 + vrow) * v_sn + (vbytes ? vcol : 0);
      const T* dp = db + (n0 + vrow) * d_sn + (vbytes ? vcol : 0);
      #pragma unroll
      for (int i = 0; i < C / QROWS; ++i, qp += QROWS * q_sn, kp += QROWS * k_sn) {
        const int r = qrow + i * QROWS;
        const bool in = r < rows;  // rows past N: nothing read, zeros
        const int at = atk(r, qcol);
        rtk_cp_async16(rtk_smem_addr(sQ + at), in ? (const void*)qp : (const void*)qb, in ? qbytes : 0);
        rtk_cp_async16(rtk_smem_addr(sK + at), in ? (const void*)kp : (const void*)kb, in ? qbytes : 0);
      }
      #pragma unroll
      for (int i = 0; i < C / VROWS; ++i, vp += VROWS * v_sn, dp += VROWS * d_sn) {
        const int r = vrow + i * VROWS;
        const bool in = r < rows;
        const int at = atv(r, vcol);
        rtk_cp_async16(rtk_smem_addr(sV + at), in ? (const void*)vp : (const void*)vb, in ? vbytes : 0);
        rtk_cp_async16(rtk_smem_addr(sD + at), in ? (const void*)dp : (const void*)db, in ? vbytes : 0);
      }
    } else {  // rows not 16-byte aligned
      for (int e = tid; e < C * KMAX; e += 256) {
        const int r = e / KMAX, col = e % KMAX;
        const bool ok = r < rows && col < Dk;
        const rtk_i64 n = n0 + r;
        sQ[atk(r, col)] = ok ? qb[n * q_sn + col] : (T)0;
        sK[atk(r, col)] = ok ? kb[n * k_sn + col] : (T)0;
      }
      for (int e = tid; e < C * BV; e += 256) {
        const int r = e / BV, col = e % BV;
        const bool ok = r < rows && col < dv_here;
        const rtk_i64 n = n0 + r;
        sV[atv(r, col)] = ok ? vb[n * v_sn + col] : (T)0;
        sD[atv(r, col)] = ok ? db[n * d_sn + col] : (T)0;
      }
    }
  }
};

// How the 8 warps tile the KMAX x BV state: RW warps along the rows (16 rows at least each), CW
// along the columns; each warp holds MT x NT fragments of 16 x 8.
template <int KMAX, int BV>
struct rtk_dg_split {
  static constexpr int RW = KMAX >= 128 ? 8 : KMAX / 16, CW = 8 / RW;
  static constexpr int ROWS = KMAX / RW, COLS = BV / CW;
  static constexpr int MT = ROWS / 16, NT = COLS / 8;
  static_assert(RW * CW == 8 && ROWS % 16 == 0 && COLS % 16 == 0, "bad tile");
};

// The fp32 weight of token t (0..63) in a chunk of len tokens, per table row: normalised to at
// most 1 (n1 = max_{1<=m<=64} m gamma^m, as log2n1).
__device__ __forceinline__ float rtk_dg_weight(int row, int t, int len, float lg2, float log2n1) {
  switch (row) {
    case 0: return t < len ? (float)(t + 1) * rtk_exp2(lg2 * (float)(t + 1) - log2n1) : 0.f;  // A1'
    case 1: return t < len ? rtk_exp2(lg2 * (float)t) : 0.f;  // A2'
    // D2': s = L-1 (weight 0) by a select, gamma^0 / n1 may overflow
    case 2: return t < len - 1 ? (float)(len - 1 - t) * rtk_exp2(lg2 * (float)(len - 1 - t) - log2n1) : 0.f;
    default: return t < len ? rtk_exp2(lg2 * (float)(len - 1 - t)) : 0.f;  // D1
  }
}

// The CTA's constants in shared memory (read there, they keep no register through the chunk
// loop): wconst = {gamma^C, gamma^(last chunk's length), n1, gamma} and dtab[d] = d gamma^d (the
// intra weights). The carries in fp64 (their rounding compounds over the chunks; lg2's rounding
// moves them by at most |L log gamma| * 6e-8, relative). Returns log2(n1). The caller's first
// barrier publishes them.
__device__ __forceinline__ float rtk_dg_constants(int tid, float lg2, int N, int nchunks, float* wconst, float* dtab) {
  constexpr int C = 64;
  float log2n1 = lg2;
  #pragma unroll 1
  for (int m = 2; m <= C; ++m) log2n1 = fmaxf(log2n1, log2f((float)m) + lg2 * (float)m);
  if (tid < 2) wconst[tid] = (float)exp2((double)lg2 * (double)(tid == 0 ? C : N - (nchunks - 1) * C));
  if (tid == 2) wconst[2] = rtk_exp2(log2n1);
  if (tid == 3) wconst[3] = rtk_exp2(lg2);
  if (tid < C) dtab[tid] = (float)tid * rtk_exp2(lg2 * (float)tid);
  return log2n1;
}

// The float32 kernels' tables (rtk_dg_constants' and the fp32 token weights: wtab[0] for full
// chunks, wtab[1] for a shorter last one, rows A1', A2', D2', D1 of rtk_dg_weight), by the CTA's
// first 2 C threads. Returns log2(n1); the caller's first barrier publishes them.
__device__ __forceinline__ float rtk_dg_tables_f32(int tid, float lg2, int N, int nchunks, float (*wtab)[4][64],
                                                   float* wconst, float* dtab) {
  constexpr int C = 64;
  const float log2n1 = rtk_dg_constants(tid, lg2, N, nchunks, wconst, dtab);
  if (tid < 2 * C) {
    const int t = tid % C, len = tid < C ? C : N - (nchunks - 1) * C;
    #pragma unroll 1
    for (int row = 0; row < 4; ++row) wtab[tid / C][row][t] = rtk_dg_weight(row, t, len, lg2, log2n1);
  }
  return log2n1;
}

// <x[:, n0 .. n0 + NG - 1], y> over fragments (fp32): y holds the NG n-tiles of x from n0 on (n0
// a constant after unrolling, so x stays in registers).
template <int MT, int NT, int NG>
__device__ __forceinline__ float rtk_dg_dot(const float (&x)[MT][NT][4], const float (&y)[MT][NG][4], int n0) {
  float s = 0.f;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NG; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s = fmaf(x[mt][n0 + nt][e], y[mt][nt][e], s);
  return s;
}

// Tile i (0..9) of the causal block: rows 16 r.., columns 16 c.., c <= r.
__device__ __forceinline__ void rtk_dg_tile(int i, int& r, int& c) {
  r = i < 1 ? 0 : i < 3 ? 1 : i < 6 ? 2 : 3;
  c = i - r * (r + 1) / 2;
}

// The intra term of tile (r, c) of the causal block: sum over s <= t of p_ts dp_ts (t - s) gamma^(t-s)
// (dtab) from its two 16 x 8 score fragments (q_t . k_s and do_t . v_s, mma layout). s > t is a
// select (an Inf score there must not make NaN); s = t a product with weight 0 (NaN reaches the sum).
__device__ __forceinline__ float rtk_dg_intra(const float (&p)[2][4], const float (&dp)[2][4], int r, int c, int g,
                                              int t4, const float* dtab, float acc) {
  #pragma unroll
  for (int j = 0; j < 2; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = (16 * r + g + (e >> 1) * 8) - (16 * c + 8 * j + 2 * t4 + (e & 1));  // t - s
      if (d >= 0) acc = fmaf(p[j][e] * dp[j][e], dtab[d], acc);
    }
  return acc;
}

// The CTA's sum of one value per thread in a fixed order (warp shuffles, then warps 0 .. WARPS - 1
// through shared memory, no atomics), written by thread 0 to *out.
template <int WARPS>
__device__ __forceinline__ void rtk_dg_cta_sum(float val, float* red, float* out) {
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) val += __shfl_xor_sync(0xffffffffu, val, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = val;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w];
    *out = s;
  }
}

// The end of the walk: <G, W_end> over the warp's real state elements, the scale and the
// normalisers (acc1 = sum <S, A1'>, acc2 = sum <W, A2'>, acci the intra term), then the CTA's sum
// over its WARPS warps (rtk_dg_cta_sum), written by thread 0 to *out.
template <int MT, int NT, int WARPS = 8>
__device__ __forceinline__ void rtk_dg_finish(const rtk_chunk_state<MT, NT>& frag, const float (&w_acc)[MT][NT][4],
                                              const float* grad_state, float scale, const float* wconst, float acc1,
                                              float acc2, float acci, float* red, float* out) {
  float accg = 0.f;
  if (grad_state != nullptr) {
    frag.elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      if (real) accg = fmaf(grad_state[off], w_acc[mt][nt][e], accg);
    });
  }
  rtk_dg_cta_sum<WARPS>(fmaf(scale, fmaf(wconst[2], acc1, fmaf(wconst[3], acc2, acci)), accg), red, out);
}
