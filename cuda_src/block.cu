// block.cu -- the block method on CUDA cores (Lightning Attention 2's block form).
//
// One CTA per (batch*head, tile of BV value columns) walks the sequence in blocks of C tokens,
// with the Dk x BV slice of the state S in shared memory (fp32). For a block of L <= C tokens:
//
//   A[t][s] = gamma^(t-s) (q_t . k_s)  for s <= t              (C x C, shared memory)
//   o_t     = scale * ( sum_{s<=t} A[t][s] v_s + gamma^(t+1) q_t S )
//   S       = gamma^L S + sum_s gamma^(L-1-s) k_s^T v_s
//
// Only non-negative powers of gamma are formed. The sums over s run over s <= t only, so a NaN
// in v_s reaches the rows t >= s and no others. Plain fp32 FMAs: the tensor-core version of the
// same algorithm is the chunk method.
#include "include/params.cuh"

template <int KMAX, int BV, int C>
struct rtk_block_smem {
  static constexpr int KP = KMAX + 1;  // padded rows: threads reading different k-rows hit different banks
  static constexpr int Q = 0, K = Q + C * KP, V = K + C * KP, A = V + C * BV, S = A + C * (C + 1);
  static constexpr int W = S + KMAX * BV;  // gamma^(len-1-s) of the block
  static constexpr int FLOATS = W + C;
};

template <int DT, int KMAX, int BV, int C, int NT>
__global__ void __launch_bounds__(NT)
rtk_block_fwd(RTK_FWD_POINTERS(typename rtk_io<DT>::T), const __grid_constant__ rtk_fwd_shape p) {
  RTK_FWD_SHAPE(p);
  RTK_FWD_SIZES;
  typedef rtk_io<DT> io;
  typedef rtk_block_smem<KMAX, BV, C> L;
  constexpr int KP = L::KP;
  constexpr int G = NT / BV;  // row groups
  static_assert(NT % BV == 0, "bad tile");
  extern __shared__ float smem[];
  float* sQ = smem + L::Q;
  float* sK = smem + L::K;
  float* sV = smem + L::V;
  float* sA = smem + L::A;
  float* sS = smem + L::S;
  float* sW = smem + L::W;

  const int bh = blockIdx.x;
  const int b = bh / H, h = bh - b * H;
  const int v0 = blockIdx.y * BV;
  const int tid = threadIdx.x;
  const int c = tid % BV, tg = tid / BV;
  const int col = v0 + c;
  const float lg = rtk_head_log_decay(decay, decay_mode, h);

  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};
  const typename io::T* qb = q + rtk_offset(qs, b, h, 0);
  const typename io::T* kb = k + rtk_offset(ks, b, h, 0);
  const typename io::T* vb = v + rtk_offset(vs, b, h, 0);
  typename io::T* ob = o + rtk_offset(os, b, h, 0);

  for (int kk = tg; kk < KMAX; kk += G)
    sS[kk * BV + c] = (init_state != nullptr && kk < Dk && col < Dv)
                          ? init_state[((rtk_i64)bh * Dk + kk) * Dv + col] : 0.f;

  for (int n0 = 0; n0 < N; n0 += C) {
    const int len = min(C, N - n0);
    // Stage the block (zeros past the end of the sequence and past Dk / Dv).
    for (int e = tid; e < C * KMAX; e += NT) {
      const int t = e / KMAX, kk = e - t * KMAX;
      const bool ok = t < len && kk < Dk;
      const rtk_i64 n = (rtk_i64)n0 + t;
      sQ[t * KP + kk] = ok ? io::load(qb + n * q_sn + kk) : 0.f;
      sK[t * KP + kk] = ok ? io::load(kb + n * k_sn + kk) : 0.f;
    }
    for (int e = tid; e < C * BV; e += NT) {
      const int t = e / BV, cc = e - t * BV;
      const bool ok = t < len && v0 + cc < Dv;
      sV[e] = ok ? io::load(vb + ((rtk_i64)n0 + t) * v_sn + v0 + cc) : 0.f;
    }
    if (tid < C) sW[tid] = tid < len ? expf(lg * (float)(len - 1 - tid)) : 0.f;
    __syncthreads();

    // Decayed causal scores of the block.
    for (int e = tid; e < C * C; e += NT) {
      const int t = e / C, s = e - t * C;
      float a = 0.f;
      if (s <= t) {
        #pragma unroll 8
        for (int kk = 0; kk < KMAX; ++kk) a = fmaf(sQ[t * KP + kk], sK[s * KP + kk], a);
        a *= expf(lg * (float)(t - s));
      }
      sA[t * (C + 1) + s] = a;
    }
    __syncthreads();

    // Outputs: intra-block part over s <= t, plus the carried state's part.
    for (int t = tg; t < len; t += G) {
      float intra = 0.f;
      for (int s = 0; s <= t; ++s) intra = fmaf(sA[t * (C + 1) + s], sV[s * BV + c], intra);
      float inter = 0.f;
      #pragma unroll 8
      for (int kk = 0; kk < KMAX; ++kk) inter = fmaf(sQ[t * KP + kk], sS[kk * BV + c], inter);
      if (col < Dv)
        io::store(ob + ((rtk_i64)n0 + t) * o_sn + col, scale * (intra + expf(lg * (float)(t + 1)) * inter));
    }
    __syncthreads();

    // State update, each thread its own (row, column) entries.
    const float carry = expf(lg * (float)len);
    for (int kk = tg; kk < KMAX; kk += G) {
      float acc = 0.f;
      for (int s = 0; s < len; ++s)
        acc = fmaf(sK[s * KP + kk] * sW[s], sV[s * BV + c], acc);
      sS[kk * BV + c] = fmaf(carry, sS[kk * BV + c], acc);
    }
    __syncthreads();
  }

  if (final_state != nullptr && col < Dv)
    for (int kk = tg; kk < Dk; kk += G) final_state[((rtk_i64)bh * Dk + kk) * Dv + col] = sS[kk * BV + c];
}
