// normalize/fwd.cu -- the normalization of linear_attention, one pass over the rows:
//
//   den_i = scale * q_i . z_i  (+ G_i)           o_i = (num_i (+ u_i)) / (den_i + eps)
//
// per (batch, head, token) row i, with num = core(q, k, v), z = core(1, 1, k), and for "1+qk"
// u = core(1, 1, v) and G (fp32) from the other core calls (rtkernels/normalized.py). The dot takes
// the 16-bit products exactly in fp32 and sums them in fp32; den, eps, num + u and the quotient
// are fp32 (IEEE division); o is rounded once to the element type. den (without eps) is written
// as fp32 [B, H, N] for the backward. Memory bound: q, z, num (u) read once, o written once.
// NaN is data (nothing here masks or clamps); eps = 0 and den = 0 give 0/0 = NaN or inf.
#include "row.cuh"

#define RTK_NORM_FWD_POINTERS(ELEM)                                                          \
  const ELEM* __restrict__ q, const ELEM* __restrict__ z, const ELEM* __restrict__ num,      \
  const ELEM* __restrict__ u, const float* __restrict__ g, ELEM* __restrict__ o,            \
  float* __restrict__ den

// ONEPQK: "1+qk" (u and G are read); else u and g are null.
template <int DT, bool V16, bool ONEPQK>
__global__ void __launch_bounds__(RTK_NORM_THREADS)
rtk_normalize_fwd(RTK_NORM_FWD_POINTERS(typename rtk_io<DT>::T), const __grid_constant__ rtk_norm_shape p) {
  typedef rtk_chunk<DT, V16> C;
  typedef typename rtk_io<DT>::T T;
  constexpr int E = C::E;
  const rtk_norm_row w = rtk_norm_locate<E>(p);
  const T* qr = q + rtk_norm_at(w, p.q_sb, p.q_sh, p.q_sn);
  const T* zr = z + rtk_norm_at(w, p.z_sb, p.z_sh, p.z_sn);
  const T* nr = num + rtk_norm_at(w, p.n_sb, p.n_sh, p.n_sn);
  const T* ur = ONEPQK ? u + rtk_norm_at(w, p.u_sb, p.u_sh, p.u_sn) : nullptr;
  T* orow = o + rtk_norm_at(w, p.o_sb, p.o_sh, p.o_sn);

  // The first numerator chunk is loaded before the dot, so that its latency overlaps the
  // q and z loads and the team's reduction.
  float a0[E], u0[E];
  const bool first = w.valid && w.lt < w.kv;
  if (first) {
    C::load(nr + w.lt * E, a0);
    if constexpr (ONEPQK) C::load(ur + w.lt * E, u0);
  }
  float gi = 0.f;
  if (ONEPQK && w.valid) gi = g[rtk_norm_at(w, p.g_sb, p.g_sh, p.g_sn)];

  float dot = 0.f;
  for (int c = w.valid ? w.lt : w.kq; c < w.kq; c += w.team) {
    float x[E], y[E];
    C::load(qr + c * E, x);
    C::load(zr + c * E, y);
    #pragma unroll
    for (int e = 0; e < E; ++e) dot = fmaf(x[e], y[e], dot);
  }
  dot = rtk_team_sum(dot, w.team);
  const float scale = (float)p.scale, eps = (float)p.eps;
  const float dn = ONEPQK ? fmaf(scale, dot, gi) : scale * dot;
  const float d = dn + eps;
  if (w.valid && w.lt == 0) den[w.r] = dn;

  for (int c = w.valid ? w.lt : w.kv; c < w.kv; c += w.team) {
    float a[E], b[E];
    if (c == w.lt) {
      #pragma unroll
      for (int e = 0; e < E; ++e) { a[e] = a0[e]; b[e] = ONEPQK ? u0[e] : 0.f; }
    } else {
      C::load(nr + c * E, a);
      if constexpr (ONEPQK) C::load(ur + c * E, b);
    }
    #pragma unroll
    for (int e = 0; e < E; ++e) a[e] = (ONEPQK ? a[e] + b[e] : a[e]) / d;
    C::store(orow + c * E, a);
  }
}
