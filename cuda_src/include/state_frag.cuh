// state_frag.cuh -- a warp's fp32 fragment of a Dk x Dv state: scaling, loading, folding, storing.
#pragma once
#include "types.cuh"

// Every element of MT x NT accumulator fragments times f.
template <int MT, int NT> __device__ __forceinline__ void rtk_frag_scale(float (&x)[MT][NT][4], float f) {
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) x[mt][nt][e] *= f;
}

// Every element of MT x NT accumulator fragments set to zero.
template <int MT, int NT> __device__ __forceinline__ void rtk_frag_zero(float (&x)[MT][NT][4]) {
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) x[mt][nt][e] = 0.f;
}

// The largest |x| over a warp's MT x NT fragments (a NaN is skipped, as fmaxf skips it), or -1 when
// that is Inf or above 3e38 (the fp16 copy is then left unscaled). Eight partial maxima keep the
// dependency chain short, and one redux adds the lanes: the maxima are non-negative and never NaN,
// so their bit patterns order as their values.
template <int MT, int NT> __device__ __forceinline__ float rtk_frag_warp_absmax(const float (&x)[MT][NT][4]) {
  float m[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) m[(nt & 1) * 4 + e] = fmaxf(m[(nt & 1) * 4 + e], fabsf(x[mt][nt][e]));
  const float t = fmaxf(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])), fmaxf(fmaxf(m[4], m[5]), fmaxf(m[6], m[7])));
  rtk_u32 bits;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(bits) : "r"(__float_as_uint(t)));
  return bits < __float_as_uint(3.0e38f) ? __uint_as_float(bits) : -1.f;
}

// W = dS/dlog(gamma) before the state's step S <- gamma^len S + (this chunk's keys), which it
// differentiates: W <- gamma^len (W + len S) (the keys' own term is added with S's). NORM (fp16,
// whose W is carried times dn, rtk_dlog_norm): W dn <- gamma^len W dn + (gamma^len dn len) S, the
// factor formed first so that a large dn (small gamma) cannot overflow.
template <bool NORM = false, int MT, int NT>
__device__ __forceinline__ void rtk_frag_dlog_step(float (&w)[MT][NT][4], const float (&s)[MT][NT][4], float carry,
                                                   int len, float dn = 1.f) {
  const float cl = carry * dn * (float)len;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e)
        w[mt][nt][e] = NORM ? fmaf(cl, s[mt][nt][e], carry * w[mt][nt][e])
                            : carry * (w[mt][nt][e] + (float)len * s[mt][nt][e]);
}

// A warp's fp32 fragment of a state (m-tile mt: rows sr0 + MSTEP mt .. + 15, NT n-tiles of value
// columns from v0; the chunk kernels' state warps, the decay gradient's accumulators; MSTEP 16:
// a warp's own rows, 64: a wgmma warpgroup's, whose warp w holds rows 16 w.. of each 64): where
// element (mt, nt, e) lives in a [slots, B*H, Dk, Dv] buffer, and whether it is a real (row < Dk,
// column < Dv) element; loading the initial state and storing the final one.
template <int MT, int NT, int MSTEP = 16>
struct rtk_chunk_state {
  int sr0, g, t4, bh, Dk, Dv, v0, dv_here;
  rtk_i64 state_slot;

  // the row and the column (within the tile) of element e of fragment (mt, nt)
  __device__ __forceinline__ int row(int mt, int e) const { return sr0 + mt * MSTEP + g + (e >> 1) * 8; }
  __device__ __forceinline__ int col(int nt, int e) const { return nt * 8 + 2 * t4 + (e & 1); }
  __device__ __forceinline__ bool at(int mt, int nt, int e, rtk_i64& off) const {
    const int r = row(mt, e), c = col(nt, e);
    off = state_slot + ((rtk_i64)bh * Dk + r) * Dv + v0 + c;
    return r < Dk && c < dv_here;
  }
  // f(mt, nt, e, off, real) for each element of the fragment (off and real as in at()).
  template <class F> __device__ __forceinline__ void elems(F f) const {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          rtk_i64 off;
          const bool real = at(mt, nt, e, off);
          f(mt, nt, e, off, real);
        }
  }
  // sum of x (r, c) * m[(v0 + c) * Dk + r] over the fragment's real elements, in a fixed order:
  // x dotted with the transpose of a [Dv, Dk] matrix, per thread (the dq pass holds S^T of the
  // forward's state, whose final-state gradient G is [Dk_forward = Dv, Dv_forward = Dk] here)
  __device__ __forceinline__ float dot_transposed(const float (&x)[MT][NT][4], const float* m) const {
    float acc = 0.f;
    elems([&](int mt, int nt, int e, rtk_i64, bool real) {
      if (real) acc = fmaf(x[mt][nt][e], m[(rtk_i64)(v0 + col(nt, e)) * Dk + row(mt, e)], acc);
    });
    return acc;
  }
  __device__ __forceinline__ void load(float (&s_acc)[MT][NT][4], const float* init_state) const {
    elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      s_acc[mt][nt][e] = (init_state != nullptr && real) ? init_state[off] : 0.f;
    });
  }
  // The state entering segment z = blockIdx.z of the split-sequence strategy from the slots the
  // states pass (rtk_chunk_states) wrote, each over slot_len tokens, per_seg slots per segment:
  // slot 0 the initial state, slot 1 the state after the first slot_len tokens, slot j > 1 the
  // state of tokens [(j-1) slot_len, j slot_len) alone (from zero). With m = z per_seg slots
  // before the segment: s = slot[min(m, 1)], then s = gamma^slot_len s + slot[j] for j = 2 .. m.
  __device__ __forceinline__ void fold(float (&s_acc)[MT][NT][4], const float* slots, float lgd, rtk_i64 slot_len,
                                       int per_seg, int bh_count) const {
    fold_with<false>(s_acc, s_acc, slots, lgd, slot_len, per_seg, bh_count);
  }
  // fold, and with WITH_W also W = dS/dlog(gamma) entering the segment (the backward's dq pass
  // of a trainable decay) from the W slots that follow the S slots (W slot j: the W of the state
  // in S slot j; slot 0's is 0, the initial state does not depend on gamma): w = W slot[1] (0 for
  // m = 0), then w = gamma^slot_len (w + slot_len s) + W slot[j], s before its step. NORM: the
  // slots and w hold W dn (fp16, rtk_frag_dlog_step's NORM).
  template <bool WITH_W, bool NORM = false>
  __device__ __forceinline__ void fold_with(float (&s_acc)[MT][NT][4], float (&w_acc)[MT][NT][4], const float* slots,
                                            float lgd, rtk_i64 slot_len, int per_seg, int bh_count,
                                            float dn = 1.f) const {
    const int m = blockIdx.z * per_seg;
    const rtk_i64 slot = (rtk_i64)bh_count * Dk * Dv;
    const float* w_slots = slots + (rtk_i64)((gridDim.z - 1) * per_seg + 1) * slot;  // after every S slot
    load(s_acc, slots + (m < 1 ? 0 : slot));
    if (WITH_W) load(w_acc, m < 1 ? nullptr : w_slots + slot);
    const float carry = expf(lgd * (float)slot_len), len = (float)slot_len, cl = carry * dn * len;
    #pragma unroll 1
    for (int j = 2; j <= m; ++j) {
      const float* sj = slots + j * slot;
      const float* wj = w_slots + j * slot;
      elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
        const float s = s_acc[mt][nt][e];
        if (WITH_W)
          w_acc[mt][nt][e] = NORM ? fmaf(cl, s, fmaf(carry, w_acc[mt][nt][e], real ? wj[off] : 0.f))
                                  : fmaf(carry, fmaf(len, s, w_acc[mt][nt][e]), real ? wj[off] : 0.f);
        s_acc[mt][nt][e] = fmaf(carry, s, real ? sj[off] : 0.f);
      });
    }
  }
  __device__ __forceinline__ void store(const float (&s_acc)[MT][NT][4], float* final_state) const {
    if (final_state == nullptr) return;
    elems([&](int mt, int nt, int e, rtk_i64 off, bool real) {
      if (real) final_state[off] = s_acc[mt][nt][e];
    });
  }
  // f(r, c, lo, hi) for each pair of adjacent elements (row r, columns c and c + 1) of the fragment.
  template <class F> __device__ __forceinline__ void pairs(const float (&s_acc)[MT][NT][4], F f) const {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          f(sr0 + mt * MSTEP + g + hh * 8, nt * 8 + 2 * t4, s_acc[mt][nt][2 * hh], s_acc[mt][nt][2 * hh + 1]);
  }
};
