// normalize/bwd.cu -- the backward of normalize/fwd.cu, one pass over the rows. With
// d_i = den_i + eps (fp32, den saved by the forward), s_i = num_i (+ u_i) in fp32 and g_i the
// incoming gradient of o_i:
//
//   d_num_i = g_i / d_i                         (also d_u_i: the same tensor)
//   dden_i  = -((g_i . s_i) / d_i) / d_i  (+ the incoming gradient of den_i, if any)
//   dq_i    = (dden_i * scale) z_i              dz_i = (dden_i * scale) q_i        dG_i = dden_i
//
// dden uses the fp32 ratio s_i / d_i, not the rounded output (one rounding fewer), all sums and
// quotients are fp32, each gradient is rounded once to the element type. dq, dz and dden are
// written only where their pointers are not null (what autograd needs); dden is fp32 [B, H, N],
// summed over the batch by the caller for dG. The gradients of q and z through num and u are the
// core calls' backward, not this kernel's.
#include "row.cuh"

#define RTK_NORM_BWD_POINTERS(ELEM)                                                          \
  const ELEM* __restrict__ grad, const ELEM* __restrict__ num, const ELEM* __restrict__ u,   \
  const float* __restrict__ den, const float* __restrict__ grad_den,                       \
  const ELEM* __restrict__ q, const ELEM* __restrict__ z, ELEM* __restrict__ dnum,          \
  ELEM* __restrict__ dq, ELEM* __restrict__ dz, float* __restrict__ dden

// dst = sd * src over the kq chunks of the row (each value rounded once): dq from z, dz from q.
template <class C>
__device__ __forceinline__ void rtk_norm_scale_row(typename C::T* dst, const typename C::T* src, float sd,
                                                   const rtk_norm_row& w) {
  for (int c = w.valid ? w.lt : w.kq; c < w.kq; c += w.team) {
    float x[C::E];
    C::load(src + c * C::E, x);
    #pragma unroll
    for (int e = 0; e < C::E; ++e) x[e] *= sd;
    C::store(dst + c * C::E, x);
  }
}

// den, grad_den and dden are contiguous [B, H, N]; the other operands have their strides in p.
template <int DT, bool V16, bool ONEPQK>
__global__ void __launch_bounds__(RTK_NORM_THREADS)
rtk_normalize_bwd(RTK_NORM_BWD_POINTERS(typename rtk_io<DT>::T), const __grid_constant__ rtk_norm_shape p) {
  typedef rtk_chunk<DT, V16> C;
  typedef typename rtk_io<DT>::T T;
  constexpr int E = C::E;
  const rtk_norm_row w = rtk_norm_locate<E>(p);
  const T* gr = grad + rtk_norm_at(w, p.d_sb, p.d_sh, p.d_sn);
  const T* nr = num + rtk_norm_at(w, p.n_sb, p.n_sh, p.n_sn);
  const T* ur = ONEPQK ? u + rtk_norm_at(w, p.u_sb, p.u_sh, p.u_sn) : nullptr;
  T* dnr = dnum + rtk_norm_at(w, p.o_sb, p.o_sh, p.o_sn);
  const float d = w.valid ? den[w.r] + (float)p.eps : 1.f;

  float t = 0.f;
  for (int c = w.valid ? w.lt : w.kv; c < w.kv; c += w.team) {
    float x[E], s[E], b[E];
    C::load(gr + c * E, x);
    C::load(nr + c * E, s);
    if constexpr (ONEPQK) C::load(ur + c * E, b);
    #pragma unroll
    for (int e = 0; e < E; ++e) {
      if constexpr (ONEPQK) s[e] += b[e];
      t = fmaf(x[e], s[e], t);
      x[e] = x[e] / d;
    }
    C::store(dnr + c * E, x);
  }
  t = rtk_team_sum(t, w.team);
  float dd = -((t / d) / d);
  if (grad_den != nullptr && w.valid) dd += grad_den[w.r];
  if (dden != nullptr && w.valid && w.lt == 0) dden[w.r] = dd;
  const float sd = dd * (float)p.scale;

  if (dq != nullptr)
    rtk_norm_scale_row<C>(dq + rtk_norm_at(w, p.x_sb, p.x_sh, p.x_sn), z + rtk_norm_at(w, p.z_sb, p.z_sh, p.z_sn),
                          sd, w);
  if (dz != nullptr)
    rtk_norm_scale_row<C>(dz + rtk_norm_at(w, p.x_sb, p.x_sh, p.x_sn), q + rtk_norm_at(w, p.q_sb, p.q_sh, p.q_sn),
                          sd, w);
}
