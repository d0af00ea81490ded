// bench/profiling/tf32_wgmma_probe.cu -- a timing probe, not a product kernel: the chunked forward
// of float32 inputs with TF32 wgmma (sm_90a), to learn what a wgmma pass would take against
// rtk_chunk_fwd_f32's mma.sync (docs/performance.md, session 31). Driven by tf32_wgmma_probe.py.
//
// One CTA per (batch*head, 64 value columns), KMAX = 128 key columns, chunks of 64 tokens, two
// tile stages, two state copies, one CTA barrier per chunk, as rtk_chunk_fwd's wgmma path:
//   o_t = scale (gamma^(t+1) q_t S + sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s),
//   S   = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s.
// wgmma reads TF32 operands from shared memory only K-major, so v is stored transposed (v^T, the
// token index contiguous) by 4-byte cp.async, and q S reads a copy of S^T. The A operand of P v
// comes from the scores' accumulator registers: its k8 block holds tokens 2 t4 and 2 t4 + 1 where
// the TF32 A fragment expects t4 and t4 + 4, so token s sits at v^T column
// (s & ~7) | 4 (s & 1) | ((s & 7) >> 1).
// Whole chunks only (N a multiple of 64), Dk = 128, Dv a multiple of 64, contiguous [BH, N, D].
#include "include/copy.cuh"
#include "include/tf32.cuh"
#include "include/types.cuh"
#include "include/wgmma_sm90.cuh"

namespace {
constexpr int C = 64, KM = 128, BV = 64;
constexpr int QB = C * KM * 4, VB = BV * C * 4, STAGE = 2 * QB + VB, SB = BV * KM * 4;
// shared memory: 2 STAGE + 2 SB = 229,376 bytes, + 1 KB for the 1024-byte alignment

// byte offset of float column c of row r in a K-major tile of `rows` rows, 128-byte swizzle
__device__ __forceinline__ int swz(int rows, int r, int c) {
  return (c >> 5) * (rows * 128) + r * 128 + ((((c >> 2) & 7) ^ (r & 7)) << 4) + ((c & 3) << 2);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256, 1)
rtk_tf32_probe(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, float* o,
               const float* log_decay, int H, int N, int Dv, float scale) {
  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* sm = smem_base + ((1024 - (rtk_smem_addr(smem_base) & 1023)) & 1023);
  const rtk_u32 base = rtk_smem_addr(sm);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int bh = blockIdx.x, h = bh % H, v0 = blockIdx.y * BV;
  const float lg2 = log_decay[h] * 1.4426950408889634f;
  const float* qb = q + (rtk_i64)bh * N * KM;
  const float* kb = k + (rtk_i64)bh * N * KM;
  const float* vb = v + (rtk_i64)bh * N * Dv + v0;
  float* ob = o + (rtk_i64)bh * N * Dv + v0;
  const int nchunks = N / C;
  auto stage_q = [&](int st) { return base + st * STAGE; };
  auto stage_k = [&](int st) { return base + st * STAGE + QB; };
  auto stage_vt = [&](int st) { return base + st * STAGE + 2 * QB; };
  auto scopy = [&](int slot) { return base + 2 * STAGE + slot * SB; };

  if (warp < 4) {
    // ---- output warpgroup: P = q k^T, O = q S^T-copy, O = f O + P' v ------------------------
    const int r_lo = 16 * warp + g, r_hi = r_lo + 8;  // this thread's two rows of the chunk
    const float f_lo = scale * exp2f(lg2 * (r_lo + 1)), f_hi = scale * exp2f(lg2 * (r_hi + 1));
    const float a_lo = exp2f(lg2 * r_lo), a_hi = exp2f(lg2 * r_hi), c_first = scale * exp2f(-lg2 * 2 * t4);
    const float g_m8 = exp2f(-lg2 * 8), g_m1 = exp2f(-lg2);
    __syncthreads();  // chunk 0 and the first copy in place
    for (int c = 0; c < nchunks; ++c) {
      const int st = c & 1;
      float p[32], acc[32];
      const unsigned long long dq = rtk_wg_desc(stage_q(st), 16, 1024), dk = rtk_wg_desc(stage_k(st), 16, 1024);
      const unsigned long long ds = rtk_wg_desc(scopy(c & 1), 16, 1024), dvt = rtk_wg_desc(stage_vt(st), 16, 1024);
      rtk_wg_fence();
      #pragma unroll
      for (int ks = 0; ks < KM / 8; ++ks) rtk_wgmma_tf32_ss(p, rtk_desc_at(dq, rtk_kmajor_step(C, ks)), rtk_desc_at(dk, rtk_kmajor_step(C, ks)), ks);
      #pragma unroll
      for (int ks = 0; ks < KM / 8; ++ks) rtk_wgmma_tf32_ss(acc, rtk_desc_at(dq, rtk_kmajor_step(C, ks)), rtk_desc_at(ds, rtk_kmajor_step(BV, ks)), ks);
      rtk_wg_commit();
      rtk_wg_wait<0>();
      // scores: gamma^(t-s) scale below the diagonal, 0 above, as gamma^t * gamma^-s (gamma near 1
      // here: a probe); O's rows by gamma^(t+1) scale
      {
        float cs = c_first;  // gamma^-(8j + 2 t4) scale
        #pragma unroll
        for (int j = 0; j < 8; ++j, cs *= g_m8) {
          const int s = 8 * j + 2 * t4;
          p[4 * j + 0] = s <= r_lo ? p[4 * j + 0] * a_lo * cs : 0.f;
          p[4 * j + 1] = s + 1 <= r_lo ? p[4 * j + 1] * a_lo * cs * g_m1 : 0.f;
          p[4 * j + 2] = s <= r_hi ? p[4 * j + 2] * a_hi * cs : 0.f;
          p[4 * j + 3] = s + 1 <= r_hi ? p[4 * j + 3] * a_hi * cs * g_m1 : 0.f;
        }
      }
      #pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] *= (i & 2) ? f_hi : f_lo;
      rtk_u32 pa[32];  // k8 block j of P: tokens 8j + 2 t4 (+1), rows g, g + 8, as TF32 A fragments
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        pa[4 * j] = rtk_tf32(p[4 * j]);
        pa[4 * j + 1] = rtk_tf32(p[4 * j + 2]);
        pa[4 * j + 2] = rtk_tf32(p[4 * j + 1]);
        pa[4 * j + 3] = rtk_tf32(p[4 * j + 3]);
      }
      rtk_wg_fence();
      #pragma unroll
      for (int j = 0; j < 8; ++j)
        rtk_wgmma_tf32_rs(acc, reinterpret_cast<const rtk_u32 (&)[4]>(pa[4 * j]), rtk_desc_at(dvt, rtk_kmajor_step(BV, j)), 1);
      rtk_wg_commit();
      rtk_wg_wait<0>();
      float* orow = ob + (rtk_i64)c * C * Dv;
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * t4;
        *reinterpret_cast<float2*>(orow + (rtk_i64)r_lo * Dv + col) = make_float2(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<float2*>(orow + (rtk_i64)r_hi * Dv + col) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
      }
      __syncthreads();  // done with stage st and copy c & 1
    }
  } else {
    // ---- state warpgroup: loads, S (128 x 64, fp32 registers) += (k w)^T v, the S^T copy ---------
    const int s_t = tid - 128, w = warp - 4;
    // this thread's pieces: q/k rows qr + 4u at column qc (16 bytes); v rows va + 2u at column vd (4 bytes)
    const int qr = s_t >> 5, qcol = (s_t & 31) * 4, va = s_t >> 6, vd = s_t & 63;
    const int q_even = (qcol >> 5) * (C * 128) + qr * 128 + ((((qcol >> 2) & 7) ^ (qr & 7)) << 4);
    const int q_odd = (qcol >> 5) * (C * 128) + qr * 128 + ((((qcol >> 2) & 7) ^ ((qr + 4) & 7)) << 4);
    auto load = [&](int c, int st) {
      const float* qc = qb + (rtk_i64)(c * C + qr) * KM + qcol;
      const float* kc = kb + (rtk_i64)(c * C + qr) * KM + qcol;
      #pragma unroll
      for (int u = 0; u < 16; ++u) {
        const int off = ((u & 1) ? q_odd : q_even) + u * 512;
        rtk_cp_async16(stage_q(st) + off, qc + u * 4 * KM, 16);
        rtk_cp_async16(stage_k(st) + off, kc + u * 4 * KM, 16);
      }
      const float* vc = vb + (rtk_i64)(c * C + va) * Dv + vd;
      #pragma unroll
      for (int u = 0; u < 32; ++u) {  // token va + 2u, column vd of v -> v^T row vd, column 8 (u >> 2) + 4 va + (u & 3)
        const int col = 8 * (u >> 2) + 4 * va + (u & 3);
        rtk_cp_async4(stage_vt(st) + (col >> 5) * (BV * 128) + vd * 128 + ((((col >> 2) & 7) ^ (vd & 7)) << 4) + ((col & 3) << 2),
            vc + (rtk_i64)(2 * u) * Dv, 4);
      }
    };
    float s_acc[2][32];
    #pragma unroll
    for (int m = 0; m < 2; ++m)
      #pragma unroll
      for (int i = 0; i < 32; ++i) s_acc[m][i] = 0.f;
    auto store_copy = [&](int slot) {  // S^T copy: row = value column n, column = key row m
      #pragma unroll
      for (int m = 0; m < 2; ++m)
        #pragma unroll
        for (int i = 0; i < 32; ++i) {
          const int row_m = 64 * m + 16 * w + g + ((i & 2) ? 8 : 0), col_n = 8 * (i >> 2) + 2 * t4 + (i & 1);
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(scopy(slot) + swz(BV, col_n, row_m)), "f"(s_acc[m][i]) : "memory");
        }
    };
    load(0, 0);
    rtk_cp_async_commit();
    store_copy(0);
    rtk_cp_async_wait<0>();
    rtk_fence_proxy_async();
    __syncthreads();
    for (int c = 0; c < nchunks; ++c) {
      const int st = c & 1;
      if (c + 1 < nchunks) load(c + 1, st ^ 1);
      rtk_cp_async_commit();
      const float carry = exp2f(lg2 * C);
      #pragma unroll
      for (int m = 0; m < 2; ++m)
        #pragma unroll
        for (int i = 0; i < 32; ++i) s_acc[m][i] *= carry;
      const unsigned long long dvt = rtk_wg_desc(stage_vt(st), 16, 1024);
      const rtk_u32 kt = stage_k(st);
      #pragma unroll 1
      for (int j = 0; j < 8; ++j) {  // k8 block j: logical k t4 / t4 + 4 hold tokens 8j + 2 t4 / + 1
        const int s0 = 8 * j + 2 * t4, s1 = s0 + 1;
        const float w0 = exp2f(lg2 * (C - 1 - s0)), w1 = exp2f(lg2 * (C - 1 - s1));
        rtk_u32 a[2][4];
        #pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int r0 = 64 * m + 16 * w + g;
          float x[4];
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x[0]) : "r"(kt + swz(C, s0, r0)));
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x[1]) : "r"(kt + swz(C, s0, r0 + 8)));
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x[2]) : "r"(kt + swz(C, s1, r0)));
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x[3]) : "r"(kt + swz(C, s1, r0 + 8)));
          a[m][0] = rtk_tf32(x[0] * w0);
          a[m][1] = rtk_tf32(x[1] * w0);
          a[m][2] = rtk_tf32(x[2] * w1);
          a[m][3] = rtk_tf32(x[3] * w1);
        }
        rtk_wg_fence();
        rtk_wgmma_tf32_rs(s_acc[0], a[0], rtk_desc_at(dvt, rtk_kmajor_step(BV, j)), 1);
        rtk_wgmma_tf32_rs(s_acc[1], a[1], rtk_desc_at(dvt, rtk_kmajor_step(BV, j)), 1);
        rtk_wg_commit();
        rtk_wg_wait<0>();
      }
      rtk_wg_pin(s_acc[0]);
      rtk_wg_pin(s_acc[1]);
      if (c + 1 < nchunks) store_copy(st ^ 1);  // the S entering chunk c + 1 (copy c & 1 is being read)
      rtk_cp_async_wait<0>();
      rtk_fence_proxy_async();
      __syncthreads();
    }
  }
}
