// chunk/states_tf32.cu -- rtk_chunk_states_tf32.
//
// The first pass of the split-sequence strategy for float32 in the "tf32" mode, as a kernel of its
// own: CTA (row, value tile, z) forms segment z's own final state, local[z] = sum_s
// gamma^(NS-1-s) k_s^T v_s over the segment's NS tokens from the initial state's slot z (none: from
// zero), chunk by chunk as S = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s, with the operands
// rtk_chunk_fwd_tf32's state warps use (k w rounded to TF32 after the multiply, v rounded to
// nearest, the carry from double). It writes slot z of final_state; rtk_chunk_seg_scan and the
// fused pass follow, as after the fused kernel's states-only mode, whose place it takes. Same
// parameters as rtk_chunk_fwd_tf32 (q and o are not read).
//
// Why: in rtk_chunk_fwd_tf32 the state warpgroup is the slower side of every chunk barrier, so its
// states-only mode costs about what a fused pass does (the output warps idle). Here all eight
// warps update S on mma.sync m16n8k8 (2 x 4 warp tiles of KMAX/2 x BV/4), every thread loads, the
// tile is as wide as BV = 128 so k is read once, and STAGES chunks of k and v are in flight. The
// operands stay row-major in shared memory (rows padded by 8 floats: the fragment reads of a warp,
// 4 tokens x 8 columns, hit 32 banks); the tensor cores take k^T and v from scalar reads, so
// nothing is transposed on the way in.
#include "../include/copy.cuh"
#include "../include/params.cuh"
#include "../include/state_frag.cuh"
#include "../include/tf32.cuh"
#include "cta.cuh"
#include "loader.cuh"
#include "modes.cuh"

template <int KMAX, int BV, int STAGES>
struct rtk_states_tf32_smem {
  static constexpr int C = 64, KS = KMAX + 8, VS = BV + 8;  // floats per stored row
  static constexpr int K = 0, V = C * KS, STAGE = V + C * VS;
  static constexpr int BYTES = STAGES * STAGE * 4;
};

template <int KMAX, int BV, int STAGES>
__global__ void __launch_bounds__(256, 1)
rtk_chunk_states_tf32(RTK_FWD_POINTERS(float), const __grid_constant__ rtk_chunk_shape p) {
  RTK_FWD_SHAPE(p.f);
  RTK_FWD_SIZES;
  typedef rtk_states_tf32_smem<KMAX, BV, STAGES> L;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  constexpr int MT = KMAX / 32, NT = BV / 32;  // a warp's 16-row m-tiles and 8-column n-tiles
  static_assert((KMAX == 64 || KMAX == 128) && (BV == 64 || BV == 128) && STAGES >= 2, "bad tile");
  static_assert(L::BYTES <= 227 * 1024, "shared memory");
  extern __shared__ __align__(16) float smf[];

  RTK_CHUNK_CTA(float, 3);
  (void)out_warp; (void)kt_used; (void)ovec_full; (void)out_scale; (void)lane;
  const int sr0 = (warp & 1) * (KMAX / 2), c0 = (warp >> 1) * (BV / 4);  // the warp's rows and columns

  // every thread loads: 16-byte pieces of the chunk's k and v rows, zeros past the chunk's tokens,
  // Dk and the tile's columns
  typedef rtk_chunk_loader<float, KMAX, BV, 256> LD;
  const LD ld(tid, Dk, dv_here, kb, kb, vb, k_sn, k_sn, v_sn);
  auto load_chunk = [&](int chunk, int stage) {
    float* sk = smf + stage * L::STAGE + L::K;
    float* sv = smf + stage * L::STAGE + L::V;
    ld.template copy<C, KS, VS>(0u, rtk_smem_addr(sk + ld.qrow * KS + ld.qcol),
                                rtk_smem_addr(sv + ld.vrow * VS + ld.vcol), chunk * C, NS, false);
  };

  const rtk_chunk_state<MT, NT, 16> sf = {sr0, g, t4, bh, Dk, Dv, v0 + c0, dv_here - c0, state_slot};
  float s_acc[MT][NT][4];
  sf.load(s_acc, init_state);
  if (seq_bad) rtk_frag_scale(s_acc, __int_as_float(0x7fc00000));
  const float lgd = rtk_head_log_decay(decay, decay_mode, h);
  const float carry_full = (float)exp((double)lgd * (double)C);
  // a full chunk's key weights for this thread's keys 8 kk + t4 and 8 kk + t4 + 4, computed once
  float w_full[C / 8][2];
  #pragma unroll
  for (int kk = 0; kk < C / 8; ++kk) {
    w_full[kk][0] = rtk_exp2(lg2 * (float)(C - 1 - 8 * kk - t4));
    w_full[kk][1] = rtk_exp2(lg2 * (float)(C - 5 - 8 * kk - t4));
  }

  const int nchunks = (NS + C - 1) / C;
  #pragma unroll
  for (int c = 0; c < STAGES - 1; ++c) {
    if (c < nchunks) load_chunk(c, c);
    rtk_cp_async_commit();
  }
  #pragma unroll 1
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    rtk_cp_async_wait<STAGES - 2>();
    __syncthreads();  // the chunk is visible to all; everyone is done with the stage loaded next
    if (chunk + STAGES - 1 < nchunks) load_chunk(chunk + STAGES - 1, (chunk + STAGES - 1) % STAGES);
    rtk_cp_async_commit();
    const float* sk = smf + (chunk % STAGES) * L::STAGE + L::K;
    const float* sv = smf + (chunk % STAGES) * L::STAGE + L::V;
    const int len = min(C, NS - chunk * C);
    rtk_frag_scale(s_acc, len == C ? carry_full : (float)exp((double)lgd * (double)len));
    #pragma unroll
    for (int kk = 0; kk < C / 8; ++kk) {
      // A = (k w)^T: rows = key columns sr0 + 16 mt + g (+8), columns = tokens s0, s1; B = v rows
      // s0, s1 at value column c0 + 8 nt + g
      const int s0 = 8 * kk + t4, s1 = s0 + 4;
      float w0 = w_full[kk][0], w1 = w_full[kk][1];
      if (len != C) {
        w0 = s0 < len ? rtk_exp2(lg2 * (float)(len - 1 - s0)) : 0.f;
        w1 = s1 < len ? rtk_exp2(lg2 * (float)(len - 1 - s1)) : 0.f;
      }
      rtk_u32 a[MT][4], bb[NT][2];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float* r0 = sk + s0 * KS + sr0 + 16 * mt + g;
        const float* r1 = sk + s1 * KS + sr0 + 16 * mt + g;
        a[mt][0] = rtk_tf32_operand(r0[0] * w0);
        a[mt][1] = rtk_tf32_operand(r0[8] * w0);
        a[mt][2] = rtk_tf32_operand(r1[0] * w1);
        a[mt][3] = rtk_tf32_operand(r1[8] * w1);
      }
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        bb[nt][0] = rtk_tf32(sv[s0 * VS + c0 + 8 * nt + g]);
        bb[nt][1] = rtk_tf32(sv[s1 * VS + c0 + 8 * nt + g]);
      }
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) rtk_mma1688_tf32(s_acc[mt][nt], a[mt], bb[nt][0], bb[nt][1]);
    }
  }
  sf.store(s_acc, final_state);
}
