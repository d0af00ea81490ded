// chunk.cu -- the flagship: the chunked form, fused, on tensor cores (mma.sync m16n8k16).
//
// One CTA of NW warps per (batch*head, tile of BV value columns) walks the sequence in chunks of
// C = 16*NW tokens. With S the KMAX x BV state slice (fp32, in registers) entering a chunk of
// len <= C tokens, local index t:
//
//   o_t = scale * ( gamma^(t+1) q_t S  +  sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s )
//   S   = gamma^len S + sum_s gamma^(len-1-s) k_s^T v_s
//
// Only non-negative powers of gamma are formed (no overflow for any gamma in (0, 1], any N).
// Warp w computes output rows 16w .. 16w+15 of the chunk and owns state rows
// w*KMAX/NW .. (w+1)*KMAX/NW - 1. Operands are 16-bit (the input type) with fp32 accumulation;
// the state is kept in fp32 and a 16-bit copy of it is the operand of q_t S. For fp16 that copy
// is scaled by a power of two chosen from max|S| so that it cannot overflow.
//
// Chunks are double-buffered in shared memory with cp.async (VEC = true: 16-byte aligned rows)
// or loaded element by element (VEC = false: any strides).
//
// NaN semantics: a dense P V product would multiply the zeros above the diagonal of P with a
// NaN in a later row of V. So the V operand of P V has its non-finite values zeroed, and a warp
// that saw one marks exactly the outputs the causal sum reaches (rows t >= s, same column) NaN.
// The state update uses V as it is, so later chunks see the NaN through S.
#include "rtk_common.cuh"

template <int KMAX, int BV, int NW>
struct rtk_chunk_smem {
  static constexpr int C = 16 * NW;
  static constexpr int KS = KMAX + 8;  // row stride of the q and k tiles (16-bit elements)
  static constexpr int VS = BV + 8;    // row stride of the v tile and of the state copy
  static constexpr int Q = 0, K = Q + C * KS, V = K + C * KS;
  static constexpr int STAGE = V + C * VS;
  static constexpr int S = 2 * STAGE;  // 16-bit copy of the state, KMAX x VS
  static constexpr int ELEMS = S + KMAX * VS;
  static constexpr int BYTES = ELEMS * 2 + 16 * NW;  // + per-warp max|S| (fp16 scaling)
};

template <int DT, int KMAX, int BV, int NW, bool VEC>
__global__ void __launch_bounds__(NW * 32)
rtk_chunk_fwd(RTK_FWD_PARAMS(rtk_u16)) {
  RTK_FWD_SIZES;
  typedef rtk_chunk_smem<KMAX, BV, NW> L;
  constexpr int C = L::C, KS = L::KS, VS = L::VS;
  constexpr int NT = BV / 8;                // n-tiles of the value columns
  constexpr int MT = KMAX / (16 * NW);      // m-tiles of state rows per warp
  constexpr int PT = C / 8;                 // n-tiles of the score row block
  constexpr int NTHREADS = NW * 32;
  constexpr rtk_u32 EXP = rtk_expmask<DT>::v;
  static_assert(BV % 16 == 0 && KMAX % (16 * NW) == 0, "bad tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  rtk_u16* sm = reinterpret_cast<rtk_u16*>(smem_raw);
  float* s_red = reinterpret_cast<float*>(smem_raw + L::ELEMS * 2);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int v0 = blockIdx.y * BV;
  const float lg2 = log_decay[h] * 1.4426950408889634f;  // log2(gamma)

  const rtk_strides qs = {q_sb, q_sh, q_sn}, ks = {k_sb, k_sh, k_sn};
  const rtk_strides vs = {v_sb, v_sh, v_sn}, os = {o_sb, o_sh, o_sn};
  const rtk_u16* qb = q + rtk_offset(qs, b, h, 0);
  const rtk_u16* kb = k + rtk_offset(ks, b, h, 0);
  const rtk_u16* vb = v + rtk_offset(vs, b, h, 0) + v0;
  rtk_u16* ob = o + rtk_offset(os, b, h, 0);
  const int dv_here = min(BV, Dv - v0);  // value columns of this tile
  const int kt_used = (Dk + 15) >> 4;     // 16-wide k-steps that hold real q/k columns
  const bool ovec = ((o_sn & 1) == 0) && ((reinterpret_cast<size_t>(ob + v0) & 3) == 0);  // 4-byte stores

  // ---- loading one chunk into a stage -------------------------------------------------------
  auto load_chunk = [&](int chunk, int stage) {
    rtk_u16* sQ = sm + stage * L::STAGE + L::Q;
    rtk_u16* sK = sm + stage * L::STAGE + L::K;
    rtk_u16* sV = sm + stage * L::STAGE + L::V;
    const int n0 = chunk * C;
    if (VEC) {
      constexpr int QV = KMAX / 8, VV = BV / 8;  // 16-byte pieces per row
      for (int e = tid; e < C * QV; e += NTHREADS) {
        const int r = e / QV, col = (e - r * QV) * 8;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const int bytes = n < N ? max(0, min(16, (Dk - col) * 2)) : 0;
        const rtk_i64 off = bytes > 0 ? n * q_sn + col : 0;
        rtk_cp_async16(rtk_smem_addr(sQ + r * KS + col), qb + off, bytes);
        const rtk_i64 offk = bytes > 0 ? n * k_sn + col : 0;
        rtk_cp_async16(rtk_smem_addr(sK + r * KS + col), kb + offk, bytes);
      }
      for (int e = tid; e < C * VV; e += NTHREADS) {
        const int r = e / VV, col = (e - r * VV) * 8;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const int bytes = n < N ? max(0, min(16, (dv_here - col) * 2)) : 0;
        const rtk_i64 off = bytes > 0 ? n * v_sn + col : 0;
        rtk_cp_async16(rtk_smem_addr(sV + r * VS + col), vb + off, bytes);
      }
    } else {
      for (int e = tid; e < C * KMAX; e += NTHREADS) {
        const int r = e / KMAX, col = e - r * KMAX;
        const rtk_i64 n = (rtk_i64)n0 + r;
        const bool ok = n < N && col < Dk;
        sQ[r * KS + col] = ok ? qb[n * q_sn + col] : (rtk_u16)0;
        sK[r * KS + col] = ok ? kb[n * k_sn + col] : (rtk_u16)0;
      }
      for (int e = tid; e < C * BV; e += NTHREADS) {
        const int r = e / BV, col = e - r * BV;
        const rtk_i64 n = (rtk_i64)n0 + r;
        sV[r * VS + col] = (n < N && col < dv_here) ? vb[n * v_sn + col] : (rtk_u16)0;
      }
    }
  };

  // ---- the state: fp32 accumulators, and its 16-bit copy in shared memory ----------------------
  float s_acc[MT][NT][4];
  const int sr0 = w * MT * 16;  // first state row of this warp
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = sr0 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
        s_acc[mt][nt][e] = (init_state != nullptr && r < Dk && c < dv_here)
                               ? init_state[((rtk_i64)bh * Dk + r) * Dv + v0 + c] : 0.f;
      }

  float s_inv = 1.f;  // the copy holds S * 2^e; s_inv = 2^-e
  auto store_state_copy = [&]() {
    float mul = 1.f;
    if (DT == RTK_F16) {  // choose 2^e with max|S| * 2^e <= 2^14
      float m = 0.f;
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(s_acc[mt][nt][e]));
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      if (lane == 0) s_red[w] = m;
      __syncthreads();
      m = 0.f;
      bool finite = true;
      for (int i = 0; i < NW; ++i) {
        const float x = s_red[i];
        finite = finite && (x == x) && (x < 3.0e38f);  // fmaxf drops NaN: check each warp's value
        m = fmaxf(m, x);
      }
      int e = 0;
      if (finite && m > 0.f) e = min(60, max(-60, 14 - (int)ceilf(log2f(m))));
      mul = exp2f((float)e);
      s_inv = exp2f((float)-e);
    }
    rtk_u16* sS = sm + L::S;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = sr0 + mt * 16 + g + hh * 8, c = nt * 8 + 2 * t4;
          *reinterpret_cast<rtk_u32*>(sS + r * VS + c) =
              rtk_pack2<DT>(s_acc[mt][nt][2 * hh] * mul, s_acc[mt][nt][2 * hh + 1] * mul);
        }
  };

  const int nchunks = (N + C - 1) / C;
  load_chunk(0, 0);
  rtk_cp_async_commit();
  store_state_copy();
  if (!VEC) __syncthreads();  // chunk 0 was stored by other threads; the v check below reads it

  const rtk_u32 sS_addr = rtk_smem_addr(sm + L::S);
  const int r0 = 16 * w;  // this warp's first row within the chunk

  for (int chunk = 0; chunk < nchunks; ++chunk) {
    const int stage = chunk & 1;
    if (chunk + 1 < nchunks) load_chunk(chunk + 1, stage ^ 1);
    rtk_cp_async_commit();
    rtk_cp_async_wait<1>();
    // Each thread looks at the 16-byte v pieces of its index set for Inf/NaN (with VEC the pieces
    // it copied itself; without, pieces written before an earlier barrier); the barrier ORs them.
    bool my_bad = false;
    {
      const rtk_u16* sV = sm + stage * L::STAGE + L::V;
      constexpr int VV = BV / 8;
      for (int e = tid; e < C * VV; e += NTHREADS) {
        const int r = e / VV, col = (e - r * VV) * 8;
        const uint4 x = *reinterpret_cast<const uint4*>(sV + r * VS + col);
        my_bad |= rtk_nonfinite2<DT>(x.x) | rtk_nonfinite2<DT>(x.y) | rtk_nonfinite2<DT>(x.z) |
                  rtk_nonfinite2<DT>(x.w);
      }
    }
    const bool v_bad = __syncthreads_or(my_bad) != 0;  // (A) tiles and state copy visible

    const int n0 = chunk * C;
    const int len = min(C, N - n0);
    const rtk_u32 sQ_addr = rtk_smem_addr(sm + stage * L::STAGE + L::Q);
    const rtk_u32 sK_addr = rtk_smem_addr(sm + stage * L::STAGE + L::K);
    const rtk_u32 sV_addr = rtk_smem_addr(sm + stage * L::STAGE + L::V);

    // ---- q_t S and the scores q_t . k_s of this warp's 16 rows -------------------------------
    float o_acc[NT][4];
    float p[PT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[nt][e] = 0.f;
    #pragma unroll
    for (int j = 0; j < PT; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) p[j][e] = 0.f;
    const int ptiles = 2 * w + 2;  // score tiles at or left of the diagonal

    #pragma unroll
    for (int kstep = 0; kstep < KMAX / 16; ++kstep) {
      if (kstep < kt_used) {
        rtk_u32 a[4];
        rtk_ldsm_x4(a, sQ_addr + 2 * ((r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + kstep * 16 + (lane >> 4) * 8));
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          rtk_u32 bb[4];
          rtk_ldsm_x4_trans(bb, sS_addr + 2 * ((kstep * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + np * 16 + (lane >> 4) * 8));
          rtk_mma16816<DT>(o_acc[2 * np], a, bb[0], bb[1]);
          rtk_mma16816<DT>(o_acc[2 * np + 1], a, bb[2], bb[3]);
        }
        #pragma unroll
        for (int jp = 0; jp < PT / 2; ++jp) {
          if (2 * jp < ptiles) {
            rtk_u32 bb[4];
            rtk_ldsm_x4(bb, sK_addr + 2 * ((jp * 16 + (lane & 7) + (lane >> 4) * 8) * KS + kstep * 16 + ((lane >> 3) & 1) * 8));
            rtk_mma16816<DT>(p[2 * jp], a, bb[0], bb[1]);
            rtk_mma16816<DT>(p[2 * jp + 1], a, bb[2], bb[3]);
          }
        }
      }
    }

    // inter-chunk part: gamma^(t+1) (undoing the copy's 2^e)
    const float f_lo = rtk_exp2(lg2 * (float)(r0 + g + 1)) * s_inv;
    const float f_hi = rtk_exp2(lg2 * (float)(r0 + g + 9)) * s_inv;
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      o_acc[nt][0] *= f_lo; o_acc[nt][1] *= f_lo;
      o_acc[nt][2] *= f_hi; o_acc[nt][3] *= f_hi;
    }

    // causal mask (a select: a NaN score above the diagonal stays out) and decay gamma^(t-s)
    #pragma unroll
    for (int j = 0; j < PT; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = r0 + g + (e >> 1) * 8, s = j * 8 + 2 * t4 + (e & 1);
        p[j][e] = s <= t ? p[j][e] * rtk_exp2(lg2 * (float)(t - s)) : 0.f;
      }

    // ---- + P V over the key blocks at or left of the diagonal --------------------------------
    bool saw_bad = false;
    #pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      if (kk <= w) {
        rtk_u32 a[4];
        a[0] = rtk_pack2<DT>(p[2 * kk][0], p[2 * kk][1]);
        a[1] = rtk_pack2<DT>(p[2 * kk][2], p[2 * kk][3]);
        a[2] = rtk_pack2<DT>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = rtk_pack2<DT>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          rtk_u32 bb[4];
          rtk_ldsm_x4_trans(bb, sV_addr + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + np * 16 + (lane >> 4) * 8));
          if (v_bad) {  // rare: zero Inf/NaN in the operand, remember that this warp saw one
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              const rtk_u32 lo_bad = ((bb[i] & EXP) == EXP) ? 0x0000FFFFu : 0u;
              const rtk_u32 hi_bad = (((bb[i] >> 16) & EXP) == EXP) ? 0xFFFF0000u : 0u;
              saw_bad |= (lo_bad | hi_bad) != 0u;
              bb[i] &= ~(lo_bad | hi_bad);
            }
          }
          rtk_mma16816<DT>(o_acc[2 * np], a, bb[0], bb[1]);
          rtk_mma16816<DT>(o_acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    }
    if (v_bad && __any_sync(0xffffffffu, saw_bad)) {
      // rare: mark the outputs a non-finite v_s reaches (rows t >= s of the same column)
      const rtk_u16* sV = sm + stage * L::STAGE + L::V;
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = r0 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
          bool hit = false;
          for (int s = 0; s <= t; ++s) hit |= (sV[s * VS + c] & EXP) == EXP;
          if (hit) o_acc[nt][e] = __int_as_float(0x7fc00000);
        }
    }

    // ---- store this warp's output rows -------------------------------------------------------
    #pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = r0 + g + hh * 8;
      if (t < len) {
        rtk_u16* orow = ob + ((rtk_i64)n0 + t) * o_sn + v0;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = nt * 8 + 2 * t4;
          const float x0 = o_acc[nt][2 * hh] * scale, x1 = o_acc[nt][2 * hh + 1] * scale;
          if (ovec && c + 1 < dv_here) {
            *reinterpret_cast<rtk_u32*>(orow + c) = rtk_pack2<DT>(x0, x1);
          } else {
            if (c < dv_here) rtk_io<DT>::store(orow + c, x0);
            if (c + 1 < dv_here) rtk_io<DT>::store(orow + c + 1, x1);
          }
        }
      }
    }

    // ---- state update: S = gamma^len S + (K * w)^T V, w_s = gamma^(len-1-s) -------------------
    const float carry = rtk_exp2(lg2 * (float)len);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[mt][nt][e] *= carry;
    #pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      if (kk * 16 < len) {
        const int s_a = kk * 16 + 2 * t4, s_b = s_a + 8;
        const rtk_u32 wa = rtk_pack2<DT>(s_a < len ? rtk_exp2(lg2 * (float)(len - 1 - s_a)) : 0.f,
                                         s_a + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_a)) : 0.f);
        const rtk_u32 wb = rtk_pack2<DT>(s_b < len ? rtk_exp2(lg2 * (float)(len - 1 - s_b)) : 0.f,
                                         s_b + 1 < len ? rtk_exp2(lg2 * (float)(len - 2 - s_b)) : 0.f);
        rtk_u32 a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rtk_ldsm_x4_trans(a[mt], sK_addr + 2 * ((kk * 16 + (lane & 7) + (lane >> 4) * 8) * KS + sr0 + mt * 16 + ((lane >> 3) & 1) * 8));
          a[mt][0] = rtk_mul2<DT>(a[mt][0], wa);  // k_s * gamma^(len-1-s), s = kk*16 + 2*t4 + {0, 1}
          a[mt][1] = rtk_mul2<DT>(a[mt][1], wa);
          a[mt][2] = rtk_mul2<DT>(a[mt][2], wb);  // s + 8
          a[mt][3] = rtk_mul2<DT>(a[mt][3], wb);
        }
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          rtk_u32 bb[4];
          rtk_ldsm_x4_trans(bb, sV_addr + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + np * 16 + (lane >> 4) * 8));
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            rtk_mma16816<DT>(s_acc[mt][2 * np], a[mt], bb[0], bb[1]);
            rtk_mma16816<DT>(s_acc[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
    }
    __syncthreads();  // (B) every read of the state copy and of this stage is done
    store_state_copy();
  }

  if (final_state != nullptr) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = sr0 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t4 + (e & 1);
          if (r < Dk && c < dv_here) final_state[((rtk_i64)bh * Dk + r) * Dv + v0 + c] = s_acc[mt][nt][e];
        }
  }
}
