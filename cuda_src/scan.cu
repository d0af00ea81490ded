// scan.cu -- the sequential state scan (LeetDecoding's causal_dot_product method), also the
// rank-tile kernel of the fleet method.
//
//   S_i = gamma_h * S_{i-1} + k_i^T v_i          (Dk x Dv state, fp32)
//   o_i = scale * q_i S_i
//
// One CTA per (batch*head, tile of BV value columns, tile of KMAX state rows) walks the tokens in
// order. With one row tile (gridDim.z == 1, the scan method) it writes the output. With several
// (the fleet method: the ranks r of sum_r diag(q_r) L_gamma diag(k_r) V split over CTAs) each CTA
// writes its rank tile's partial output, unscaled, to an fp32 workspace, and fleet.cu's reduction
// sums the tiles in a fixed order. Thread t owns
// value column c = t % BV and the KPT state rows g*KPT .. g*KPT+KPT-1 of k-group g = t / BV, all in
// registers. Tokens come in groups of T: the group is staged in shared memory (the next group is
// prefetched into registers while the current one is computed), each thread runs the T-step
// recurrence on its own rows with no barrier in between and leaves its partial q_i S_i in shared
// memory, and the partials are summed over the k-groups in a fixed order (deterministic) when the
// group is written out.
//
// The decay is applied as S + (gamma - 1) * S with gamma - 1 = expm1(log_decay) held exactly in
// fp32, so a gamma close to 1 does not drift the way multiplying by a rounded fp32 gamma would.
#include "include/params.cuh"

// The forward's shape, then the fp32 workspace [gridDim.z, B*H, N, Dv] of per-tile outputs (used
// when gridDim.z > 1: the rank tiles of the fleet method; written only).
struct rtk_scan_shape {
  rtk_fwd_shape f;
  float* partial;
};

// f(u, e, tt, cc) for each element e = tid + u * NT (u < PER) that a thread takes of a token
// group's tile of W columns, row-major: token tt = e / W, column cc. q and k go through one call:
// their loads and stores stay interleaved (split, ptxas allocated differently and spilled in places).
template <int W, int NT, int PER, class F>
__device__ __forceinline__ void rtk_scan_share(int tid, F f) {
  #pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = tid + u * NT;
    const int tt = e / W;
    f(u, e, tt, e - tt * W);
  }
}

template <int DT, int KMAX, int BV, int T, int NT>
__global__ void __launch_bounds__(NT)
rtk_scan_fwd(RTK_FWD_POINTERS(typename rtk_io<DT>::T), const __grid_constant__ rtk_scan_shape p) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  float* __restrict__ partial = p.partial;
  typedef rtk_io<DT> io;
  constexpr int G = NT / BV;        // k-groups
  constexpr int KPT = KMAX / G;     // state rows per thread
  static_assert(NT % BV == 0 && KMAX % G == 0, "bad tile");
  constexpr int QK_ELEMS = T * KMAX;             // one of q or k per group
  constexpr int QK_PER_THREAD = (QK_ELEMS + NT - 1) / NT;
  constexpr int V_ELEMS = T * BV;
  constexpr int V_PER_THREAD = (V_ELEMS + NT - 1) / NT;

  __shared__ float sq[T][KMAX];
  __shared__ float sk[T][KMAX];
  __shared__ float sv[T][BV];
  __shared__ float spart[G][T][BV + 1];

  const int bh = blockIdx.x;
  const int b = bh / H, h = bh - b * H;
  const int v0 = blockIdx.y * BV;
  const int tid = threadIdx.x;
  const int c = tid % BV, g = tid / BV;
  const int col = v0 + c;
  const int r0 = blockIdx.z * KMAX;  // first state row (rank) of this CTA

  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};
  const typename io::T* qb = q + rtk_offset(qs, b, h, 0);
  const typename io::T* kb = k + rtk_offset(ks, b, h, 0);
  const typename io::T* vb = v + rtk_offset(vs, b, h, 0);
  typename io::T* ob = o + rtk_offset(os, b, h, 0);

  const float dm1 = expm1f(rtk_head_log_decay(decay, decay_mode, h));  // gamma - 1, exact enough in fp32

  float S[KPT];
  #pragma unroll
  for (int r = 0; r < KPT; ++r) {
    const int kr = r0 + g * KPT + r;
    S[r] = (init_state != nullptr && kr < Dk && col < Dv)
               ? init_state[((rtk_i64)bh * Dk + kr) * Dv + col] : 0.f;
  }

  // Register prefetch of one token group: q, k (T x KMAX each) and v (T x BV).
  float pq[QK_PER_THREAD], pk[QK_PER_THREAD], pv[V_PER_THREAD];
  auto fetch = [&](int n0) {
    rtk_scan_share<KMAX, NT, QK_PER_THREAD>(tid, [&](int u, int e, int tt, int kk) {
      const rtk_i64 n = (rtk_i64)n0 + tt;
      const bool ok = e < QK_ELEMS && n < N && r0 + kk < Dk;
      pq[u] = ok ? io::load(qb + n * q_sn + r0 + kk) : 0.f;
      pk[u] = ok ? io::load(kb + n * k_sn + r0 + kk) : 0.f;
    });
    rtk_scan_share<BV, NT, V_PER_THREAD>(tid, [&](int u, int e, int tt, int cc) {
      const rtk_i64 n = (rtk_i64)n0 + tt;
      const bool ok = e < V_ELEMS && n < N && v0 + cc < Dv;
      pv[u] = ok ? io::load(vb + n * v_sn + v0 + cc) : 0.f;
    });
  };
  auto stage = [&]() {
    rtk_scan_share<KMAX, NT, QK_PER_THREAD>(tid, [&](int u, int e, int tt, int kk) {
      if (e < QK_ELEMS) {
        sq[tt][kk] = pq[u];
        sk[tt][kk] = pk[u];
      }
    });
    rtk_scan_share<BV, NT, V_PER_THREAD>(tid, [&](int u, int e, int tt, int cc) {
      if (e < V_ELEMS) sv[tt][cc] = pv[u];
    });
  };

  fetch(0);
  for (int n0 = 0; n0 < N; n0 += T) {
    stage();
    __syncthreads();
    if (n0 + T < N) fetch(n0 + T);  // in flight while this group is computed

    const int tn = min(T, N - n0);  // tokens of this group (the last one may be short)
    #pragma unroll 4
    for (int tt = 0; tt < tn; ++tt) {
      const float vv = sv[tt][c];
      float part = 0.f;
      #pragma unroll
      for (int r = 0; r < KPT; ++r) {
        const int kr = g * KPT + r;
        S[r] = fmaf(S[r], dm1, S[r]);         // gamma * S, with gamma = 1 + dm1 exactly
        S[r] = fmaf(sk[tt][kr], vv, S[r]);
        part = fmaf(sq[tt][kr], S[r], part);
      }
      spart[g][tt][c] = part;
    }
    __syncthreads();

    // Sum the partials over the k-groups in a fixed order and write the group's outputs.
    for (int e = tid; e < T * BV; e += NT) {
      const int tt = e / BV, cc = e - tt * BV;
      const rtk_i64 n = (rtk_i64)n0 + tt;
      if (n < N && v0 + cc < Dv) {
        float acc = 0.f;
        #pragma unroll
        for (int gg = 0; gg < G; ++gg) acc += spart[gg][tt][cc];
        if (partial == nullptr) {
          io::store(ob + n * o_sn + v0 + cc, acc * scale);
        } else {
          partial[(((rtk_i64)blockIdx.z * gridDim.x + bh) * N + n) * Dv + v0 + cc] = acc;
        }
      }
    }
    // No third barrier: the next stage() writes sq/sk/sv, which every thread stopped reading
    // before the barrier above, and spart is written again only after the next group's barrier.
  }

  if (final_state != nullptr && col < Dv) {
    #pragma unroll
    for (int r = 0; r < KPT; ++r) {
      const int kr = r0 + g * KPT + r;
      if (kr < Dk) final_state[((rtk_i64)bh * Dk + kr) * Dv + col] = S[r];
    }
  }
}
