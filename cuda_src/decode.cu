// decode.cu -- one decode step against a pool of fp32 states: T new tokens per sequence.
//
//   for t = 0 .. T-1:   S <- gamma_h S + k_t^T v_t,   o_t = scale * q_t S     (S: Dk x Dv, fp32)
//
// S is row `slot` of a pool [slots, H, Dk, Dv], read once and written back once (in place);
// slot = indices[b] (int32 or int64), or b without indices. A slot outside [0, slots) -- a negative
// index marks padding -- leaves the pool alone and gives zero outputs. The step is memory bound:
// it moves the fp32 state twice (read and write), so each CTA keeps its slice of the state in
// registers across the T tokens and touches it with 16-byte loads and stores where aligned.
//
// One CTA of 128 threads per (batch, head, tile of BV = 8 * VEC value columns). Thread t owns the
// VEC columns c0 + (t % 8) * VEC .. +VEC-1 of the state rows r = t / 8 + 16 j (j < KMAX / 16): a
// warp covers four rows of 8 * VEC contiguous floats, every 32-byte sector whole. q, k (all Dk
// rows) and v (the tile's columns) of up to TG tokens are staged in shared memory; each thread
// runs the recurrence on its rows with no barrier between tokens, its partial q_t S sums are
// reduced over the four row groups of a warp with shuffles and over the four warps through shared
// memory, in a fixed order (deterministic).
//
// gamma S is formed as S + (gamma - 1) S with gamma - 1 = expm1(log gamma) in fp32, as the scan
// kernel does, so a gamma close to 1 does not drift. NaN is data: one in q_t reaches o_t, one in
// k_t or v_t the state and every later output; an invalid decay makes the head's state NaN.
#include "include/params.cuh"

// The seven pointers of a decode launch: the inputs, the output, the decay argument, the pool and
// the slot indices (nullptr: sequence b uses slot b).
#define RTK_DECODE_POINTERS(ELEM)                                                           \
  const ELEM* __restrict__ q, const ELEM* __restrict__ k, const ELEM* __restrict__ v,       \
  ELEM* __restrict__ o, const void* __restrict__ decay, float* __restrict__ state,         \
  const void* __restrict__ indices

// The forward's shape (N: the T tokens of the step), then the pool and the launch geometry.
// rtkernels/decode.py builds it in this order (8 bytes per field).
struct rtk_decode_shape {
  rtk_fwd_shape f;
  rtk_i64 slots;                  // rows of the pool
  rtk_i64 s_slot, s_head, s_row;  // element strides of the pool (its columns are contiguous)
  rtk_i64 index_mode;             // 0: slot b; 1: int32 indices; 2: int64 indices
  rtk_i64 col_tiles;              // value-column tiles per (batch, head): ceil(Dv / BV)
};

// KMAX 256 holds up to 64 state values a thread: a minimum of one CTA per SM lets ptxas keep them in
// registers (left to itself it stopped at 128 registers and spilled); 0 leaves the others as they were.
template <int DT, int KMAX, int VEC>
__global__ void __launch_bounds__(128, KMAX > 128 ? 1 : 0)
rtk_decode_step(RTK_DECODE_POINTERS(typename rtk_io<DT>::T), const __grid_constant__ rtk_decode_shape p) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  typedef rtk_io<DT> io;
  constexpr int NT = 128, CT = 8, RG = NT / CT, WARPS = NT / 32;
  constexpr int BV = CT * VEC;     // value columns per CTA
  constexpr int RPT = KMAX / RG;   // state rows per thread
  constexpr int TG = 8;            // tokens staged at a time
  static_assert(KMAX % RG == 0 && (VEC == 1 || VEC == 4), "bad tile");

  __shared__ float sq[TG][KMAX];
  __shared__ float sk[TG][KMAX];
  __shared__ float sv[TG][BV];
  __shared__ float red[WARPS][TG][BV];

  const int tid = threadIdx.x, ct = tid % CT, rg = tid / CT, warp = tid / 32, lane = tid % 32;
  const rtk_i64 bh = blockIdx.x / p.col_tiles;
  const int c0 = (int)(blockIdx.x - bh * p.col_tiles) * BV;
  const int b = (int)(bh / H), h = (int)(bh - (rtk_i64)b * H);
  const int col = c0 + ct * VEC;  // this thread's first column

  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};
  typename io::T* ob = o + rtk_offset(os, b, h, 0);

  rtk_i64 slot = b;
  if (p.index_mode == 1) slot = static_cast<const int*>(indices)[b];
  else if (p.index_mode == 2) slot = static_cast<const rtk_i64*>(indices)[b];
  if (slot < 0 || slot >= p.slots) {  // padding, or a slot the pool does not have: zeros out, no state
    for (int e = tid; e < N * BV; e += NT) {
      const int tt = e / BV, cc = c0 + e % BV;
      if (cc < Dv) io::store(ob + (rtk_i64)tt * o_sn + cc, 0.f);
    }
    return;
  }

  // The decay before the state: the call (head_decay.cuh keeps it out of line) would otherwise
  // hold the state registers across it and spill some (KMAX 256).
  const float dm1 = expm1f(rtk_head_log_decay(decay, decay_mode, h));  // gamma - 1

  // The state slice next: its loads are in flight while the tokens are staged.
  float* sp = state + slot * p.s_slot + (rtk_i64)h * p.s_head;
  float S[RPT][VEC];
  #pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = rg + j * RG;
    const bool ok = r < Dk && col < Dv;  // VEC == 4 only when Dv % 4 == 0: the whole vector is in
    if constexpr (VEC == 4) {
      float4 x = {0.f, 0.f, 0.f, 0.f};
      if (ok) x = *reinterpret_cast<const float4*>(sp + r * p.s_row + col);
      S[j][0] = x.x; S[j][1] = x.y; S[j][2] = x.z; S[j][3] = x.w;
    } else {
      S[j][0] = ok ? sp[r * p.s_row + col] : 0.f;
    }
  }
  const typename io::T* qb = q + rtk_offset(qs, b, h, 0);
  const typename io::T* kb = k + rtk_offset(ks, b, h, 0);
  const typename io::T* vb = v + rtk_offset(vs, b, h, 0);
  for (int n0 = 0; n0 < N; n0 += TG) {
    const int tn = min(TG, N - n0);
    // Rows r >= Dk are staged as zeros: the state rows there stay 0 and add nothing to q S. (A
    // loop that issues every load before storing ran slower: more registers, fewer CTAs per SM.)
    for (int e = tid; e < tn * KMAX; e += NT) {
      const int tt = e / KMAX, r = e - tt * KMAX;
      const rtk_i64 n = (rtk_i64)(n0 + tt);
      sq[tt][r] = r < Dk ? io::load(qb + n * q_sn + r) : 0.f;
      sk[tt][r] = r < Dk ? io::load(kb + n * k_sn + r) : 0.f;
    }
    for (int e = tid; e < tn * BV; e += NT) {
      const int tt = e / BV, cc = e - tt * BV;
      sv[tt][cc] = c0 + cc < Dv ? io::load(vb + (rtk_i64)(n0 + tt) * v_sn + c0 + cc) : 0.f;
    }
    __syncthreads();

    for (int tt = 0; tt < tn; ++tt) {
      float vv[VEC], part[VEC];
      #pragma unroll
      for (int e = 0; e < VEC; ++e) {
        vv[e] = sv[tt][ct * VEC + e];
        part[e] = 0.f;
      }
      #pragma unroll
      for (int j = 0; j < RPT; ++j) {
        const float kk = sk[tt][rg + j * RG], qq = sq[tt][rg + j * RG];
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
          S[j][e] = fmaf(S[j][e], dm1, S[j][e]);  // gamma S, with gamma = 1 + dm1 exactly
          S[j][e] = fmaf(kk, vv[e], S[j][e]);
          part[e] = fmaf(qq, S[j][e], part[e]);
        }
      }
      // The four row groups of a warp are lanes 8 and 16 apart.
      #pragma unroll
      for (int e = 0; e < VEC; ++e) {
        part[e] += __shfl_xor_sync(0xffffffffu, part[e], 8);
        part[e] += __shfl_xor_sync(0xffffffffu, part[e], 16);
      }
      if (lane < CT) {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) red[warp][tt][ct * VEC + e] = part[e];
      }
    }
    __syncthreads();

    for (int e = tid; e < tn * BV; e += NT) {
      const int tt = e / BV, cc = e - tt * BV;
      if (c0 + cc < Dv) {
        float acc = red[0][tt][cc];
        #pragma unroll
        for (int w = 1; w < WARPS; ++w) acc += red[w][tt][cc];
        io::store(ob + (rtk_i64)(n0 + tt) * o_sn + c0 + cc, acc * scale);
      }
    }
    // The next group's staging writes sq/sk/sv, which nobody reads after the barrier above, and
    // red only after the next barrier, by which time every thread has summed this group's.
  }

  #pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = rg + j * RG;
    if (r < Dk && col < Dv) {
      if constexpr (VEC == 4) {
        const float4 x = {S[j][0], S[j][1], S[j][2], S[j][3]};
        *reinterpret_cast<float4*>(sp + r * p.s_row + col) = x;
      } else {
        sp[r * p.s_row + col] = S[j][0];
      }
    }
  }
}
