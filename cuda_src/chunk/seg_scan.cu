// chunk/seg_scan.cu -- rtk_chunk_seg_scan.
//
// The middle pass of the split-sequence strategy. local[z] holds segment z's own final state (its
// pass over the segment started from zero); this turns them into the state entering each
// segment, s_in[z] = gamma^seg_len s_in[z-1] + local[z-1] with s_in[0] the initial state (or 0),
// and the final state gamma^last_len s_in[last] + local[last]. One thread per state element,
// segments in order: deterministic.
#include "../include/head_decay.cuh"

// Everything but the five pointers: segments, sizes, the segment and last-segment lengths, and
// how to read the decay argument.
struct rtk_seg_scan_shape {
  rtk_i64 nseg, BH, H, DkDv, seg_len, last_len, decay_mode;
};

__global__ void rtk_chunk_seg_scan(const float* __restrict__ local, float* __restrict__ s_in,
                                   const float* __restrict__ init_state, float* __restrict__ final_state,
                                   const void* __restrict__ decay, const __grid_constant__ rtk_seg_scan_shape p) {
  const rtk_i64 nseg = p.nseg, BH = p.BH, H = p.H, DkDv = p.DkDv, seg_len = p.seg_len, last_len = p.last_len;
  const rtk_i64 total = BH * DkDv;
  for (rtk_i64 e = (rtk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (rtk_i64)gridDim.x * blockDim.x) {
    const int h = (int)((e / DkDv) % H);
    const float lg = rtk_head_log_decay(decay, p.decay_mode, h);
    const float carry = expf(lg * (float)seg_len);
    float st = init_state != nullptr ? init_state[e] : 0.f;
    for (rtk_i64 z = 0; z < nseg; ++z) {
      s_in[z * total + e] = st;
      if (z + 1 < nseg) st = fmaf(carry, st, local[z * total + e]);
    }
    if (final_state != nullptr) final_state[e] = fmaf(expf(lg * (float)last_len), st, local[(nseg - 1) * total + e]);
  }
}

