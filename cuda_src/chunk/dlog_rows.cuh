// chunk/dlog_rows.cuh -- dL/dlog(gamma) inside the backward's passes (rtk_chunk_fwd, fwd16.cu, DLOG):
// the output warps' per-chunk sums, rows of a product dotted with x and intra-chunk scores weighted
// by their distance. rtkernels/methods/chunk/decay_grad.py has the math and sums the CTAs' floats.
//
// DLOG 1, W (the dq pass: q = dL/do, k = v, v = k of the forward, x = its q): per chunk, over the
// tile's BV columns (every term is linear in x and v, so the tiles' sums add up),
//   scale * sum_t x_t . ( (t+1) gamma^(t+1) q_t S + gamma^(t+1) q_t W )
//     + sum_{s<t} (t-s) P_ts (x_t . v_s)                       (P_ts = scale gamma^(t-s) q_t . k_s)
// with W = dS/dlog(gamma) carried beside S by the state warps,
//   W = gamma^len (W + len S) + sum_s (len-1-s) gamma^(len-1-s) k_s^T v_s,
// published as a 16-bit copy like S's (fp16: W times dn, rtk_dlog_norm, its copy scaled by its own
// power of two). With a final-state gradient G (p.dlog_g) the CTA that ends the sequence adds
// <G, W_end>, W's fp32 registers dotted by the state warps. Split into segments (RTK_MODE_FOLD), a
// CTA starts from S and W entering its segment, which rtk_chunk_states<..., DLOG> leaves in the
// slots (rtk_chunk_state::fold_with).
//
// DLOG 2, the Z split (docs/design.md): each pair's distance is the rest of the later token's
// chunk, the rest of the earlier one's, and the lengths of the chunks between. The dq pass walks
// chunks that end at the last token (chunk 0 the short one, as the reversed dk/dv pass's are) and
// sums scale * sum_t x_t . ( t gamma^(t+1) q_t S + gamma^(t+1) q_t Z ), with Z = gamma^len (Z + len S)
// (W's step without its product; len - 1 for the last chunk, so that <G, Z_end> is G's term). The
// dk/dv pass (DUAL: q = k of the forward, k = its q, x = its v) sums the intra-chunk term
// sum_{s<t} (t-s) P_ts (x_t . v_s) from its two score matrices and (t+1) q_t . o2_t' (t in the chunk
// that ends the sequence), o2' its second output's part from later chunks. <S_0, dS_0> is the
// caller's. Each CTA writes one float to dlog_out[segment][row][tile][h].
#pragma once
#include "../include/copy.cuh"
#include "../include/types.cuh"
#include "../include/wgmma_sm90.cuh"

// sum over this thread's elements of x_t . (f_t acc_t), for the warp's rows t = r0 + g (factor
// f_lo) and r0 + g + 8 (f_hi) of a chunk: acc in the mma accumulator layout (NT n-tiles of 8
// columns), x the chunk's 16-bit x tile in shared memory, piece p of row r at element off(r, p).
template <int DT, int NT, class Off>
__device__ __forceinline__ float rtk_dlog_rows(const float (&acc)[NT][4], const rtk_u16* sX, int r0, int g, int t4,
                                               float f_lo, float f_hi, Off off) {
  float sum = 0.f;
  #pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = r0 + g + 8 * hh;
    float row = 0.f;
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float x0, x1;
      rtk_unpack2<DT>(*reinterpret_cast<const rtk_u32*>(sX + off(t, nt) + 2 * t4), x0, x1);
      row = fmaf(x0, acc[nt][2 * hh], fmaf(x1, acc[nt][2 * hh + 1], row));
    }
    sum = fmaf(hh ? f_hi : f_lo, row, sum);
  }
  return sum;
}

// sum over s < t of (t - s) P_ts (x_t . v_s) over this thread's score fragments (the warp's rows
// from r0; xv in wgmma's accumulator order): a select above and on the diagonal, where x . v may
// be Inf and P is 0.
__device__ __forceinline__ float rtk_dlog_intra(const float (&p)[8][4], const float (&xv)[32], int r0, int g, int t4) {
  float sum = 0.f;
  #pragma unroll
  for (int j = 0; j < 8; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = r0 + g + (e >> 1) * 8 - (8 * j + 2 * t4 + (e & 1));
      sum += d > 0 ? (float)d * p[j][e] * xv[4 * j + e] : 0.f;
    }
  return sum;
}

// DLOG 3: Z kept only as its 16-bit copy sZ, laid out as the state copy sS (KMAX x BV, 128-byte
// swizzled, rtk_chunk_smem::s_off). Z <- carry (Z + m S) is elementwise: the state warps (thread t
// of 128) step it once per period from the copy of S the output warps used, after their own copy
// store and after the output warps have arrived at barrier 3 (their q Z wgmma has landed), then
// fence the async proxy (the next period's wgmma reads Z).
template <int DT, int KMAX, int BV>
__device__ __forceinline__ void rtk_zcopy_step(const rtk_u16* sS, rtk_u16* sZ, float carry, int m, int t) {
  rtk_named_sync(3, 256);
  constexpr int PIECES = KMAX * BV / 8;
  static_assert(PIECES % 256 == 0, "two pieces a thread per loop step");
  // two pieces a loop step, both loaded before either store (the compiler cannot tell sS from sZ,
  // so with one piece each step's loads waited on the step before's store)
  #pragma unroll 1
  for (int i = t; i < PIECES; i += 256) {
    uint4 sv[2], zv[2];
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
      sv[u] = reinterpret_cast<const uint4*>(sS)[i + 128 * u];
      zv[u] = reinterpret_cast<const uint4*>(sZ)[i + 128 * u];
    }
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
      rtk_u32* zw = reinterpret_cast<rtk_u32*>(&zv[u]);
      const rtk_u32* sw = reinterpret_cast<const rtk_u32*>(&sv[u]);
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        float s_lo, s_hi, z_lo, z_hi;
        rtk_unpack2<DT>(sw[e], s_lo, s_hi);
        rtk_unpack2<DT>(zw[e], z_lo, z_hi);
        zw[e] = rtk_pack2<DT>(carry * fmaf((float)m, s_lo, z_lo), carry * fmaf((float)m, s_hi, z_hi));
      }
      reinterpret_cast<uint4*>(sZ)[i + 128 * u] = zv[u];
    }
  }
  rtk_fence_proxy_async();
}

// <G, Z> over thread t's pieces of the Z copy (after its last step), G a [Dv, Dk] matrix read
// transposed (rows r < dk, columns c < dv, the tile's first column v0).
template <int DT, int KMAX, int BV>
__device__ __forceinline__ float rtk_zcopy_dot(const rtk_u16* sZ, int t, const float* gm, int dk, int dv, int v0) {
  float acc = 0.f;
  for (int i = t; i < KMAX * BV / 8; i += 128) {
    const int region = i / (KMAX * 8), r = (i - region * KMAX * 8) >> 3;  // the inverse of rtk_swz_off
    const int c0 = 8 * (8 * region + ((i & 7) ^ (r & 7)));
    const uint4 zv = reinterpret_cast<const uint4*>(sZ)[i];
    const rtk_u32* zw = reinterpret_cast<const rtk_u32*>(&zv);
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      float z[2];
      rtk_unpack2<DT>(zw[e], z[0], z[1]);
      for (int h = 0; h < 2; ++h)
        if (r < dk && c0 + 2 * e + h < dv) acc = fmaf(z[h], gm[(rtk_i64)(v0 + c0 + 2 * e + h) * dk + r], acc);
    }
  }
  return acc;
}

// The state warps' barrier of their own (4, the 4 warps), once per chunk period, matching the output
// warps' barrier 5 (rtk_dlog_x_ready). It orders nothing: compute-sanitizer's racecheck counts every
// barrier a thread passes as one CTA-wide step, so with barrier 5 alone the two groups' counts drift
// apart and it reports accesses that barrier 0 orders as hazards. With both, its check stays exact
// (bench/profiling/racecheck_named_barrier.py shows both cases and a planted true race).
__device__ __forceinline__ void rtk_zcopy_state_sync() { rtk_named_sync(4, 128); }

// DLOG 3's x tile lives outside the stages, one buffer (shared memory then holds two S copies): the
// 128 output threads t load chunk rows n0 .. lim - 1 of x (row step x_sn, the tile's columns < dv;
// the rest zero-filled) at the start of the period, after the CTA barrier that ends the reads of the
// previous chunk's, into dst laid out as v (off); the state warps have brought the rows into L2 a
// period earlier (rtk_dlog_x_prefetch). rtk_dlog_x_ready: the pieces of all four warps are in.
// Not rtk_chunk_loader::copy_tile with a loader of the output threads: that build spilled less
// (ptxas 36/64 bytes against 148/232) but its pass ran 2 % slower on an H100 (session 31).
template <int C, int BV, int VS, class Off>
__device__ __forceinline__ void rtk_dlog_x_copy(rtk_u32 dst, const rtk_u16* x, rtk_i64 x_sn, int n0, int lim, int dv,
                                                int t, Off off) {
  constexpr int PIECES = BV / 8, ROWS = 128 / PIECES;
  const int col = (t % PIECES) * 8, row = t / PIECES, bytes = max(0, min(16, (dv - col) * 2));
  dst += 2 * off(row, t % PIECES);
  #pragma unroll
  for (int u = 0; u < C / ROWS; ++u) {
    const int r = n0 + row + u * ROWS;
    rtk_cp_async16(dst + 2 * u * ROWS * VS, r < lim ? (const void*)(x + (rtk_i64)r * x_sn + (bytes ? col : 0)) : x,
                   r < lim ? bytes : 0);
  }
  rtk_cp_async_commit();
}
__device__ __forceinline__ void rtk_dlog_x_ready() {
  rtk_cp_async_wait<0>();
  rtk_named_sync(5, 128);
}
// An L2 prefetch of chunk rows n0 .. lim - 1 of x (256 bytes each, two lines a row) by state thread st.
__device__ __forceinline__ void rtk_dlog_x_prefetch(const rtk_u16* x, rtk_i64 x_sn, int n0, int lim, int st) {
  const int r = n0 + (st >> 1);
  if (r < lim) asm volatile("prefetch.global.L2 [%0];" ::"l"(x + (rtk_i64)r * x_sn + 64 * (st & 1)));
}

// Z_0 = 0 over thread t's pieces, before the CTA barriers that precede the first read.
template <int KMAX, int BV>
__device__ __forceinline__ void rtk_zcopy_zero(rtk_u16* sZ, int t) {
  for (int i = t; i < KMAX * BV / 8; i += 128) reinterpret_cast<uint4*>(sZ)[i] = make_uint4(0u, 0u, 0u, 0u);
  rtk_fence_proxy_async();
}
