// chunk/loader.cuh -- loading a chunk of q, k, v into shared memory with cp.async.
#pragma once
#include "../include/copy.cuh"

// Loading one chunk into a stage, the state warps' job (they have slack; all THREADS threads of
// rtk_chunk_states). Thread st = tid - 128 (st = tid there) copies 16-byte pieces (E elements) at a fixed column of rows st / PIECES + pass * ROWS, so every
// address is a base pointer plus a multiple of the row stride. The pointers of pass 0 keep the
// column inside the row when it lies past Dk or Dv: nothing is read there, the zero-fill does the
// work.
template <typename T, int KMAX, int BV, int THREADS = 128>
struct rtk_chunk_loader {
  static constexpr int SZ = (int)sizeof(T), E = 16 / SZ;
  static constexpr int QV = KMAX / E, VV = BV / E;                  // 16-byte pieces per q/k row and per v row
  static constexpr int QROWS = THREADS / QV, VROWS = THREADS / VV;  // rows one pass of the loader threads covers
  int st, qcol, qrow, vcol, vrow, qbytes, vbytes;
  const T *qb, *kb, *vb, *q_first, *k_first, *v_first;
  rtk_i64 q_sn, k_sn, v_sn;

  __device__ __forceinline__ rtk_chunk_loader(int st_, int Dk, int dv_here, const T* qb_, const T* kb_,
                                              const T* vb_, rtk_i64 q_sn_, rtk_i64 k_sn_, rtk_i64 v_sn_)
      : st(st_), qcol((st_ % QV) * E), qrow(st_ / QV), vcol((st_ % VV) * E), vrow(st_ / VV),
        qbytes(max(0, min(16, (Dk - qcol) * SZ))), vbytes(max(0, min(16, (dv_here - vcol) * SZ))),
        qb(qb_), kb(kb_), vb(vb_),
        q_first(qb_ + (rtk_i64)qrow * q_sn_ + (qbytes ? qcol : 0)),
        k_first(kb_ + (rtk_i64)qrow * k_sn_ + (qbytes ? qcol : 0)),
        v_first(vb_ + (rtk_i64)vrow * v_sn_ + (vbytes ? vcol : 0)), q_sn(q_sn_), k_sn(k_sn_), v_sn(v_sn_) {}

  // cp.async of chunk rows n0 .. n0 + C - 1 (those < NS; the rest zero-filled) to this thread's
  // pieces at shared addresses dq, dk, dv (row strides KS and VS elements); q only when with_q
  // (the states-only pass of the split-sequence strategy reads no q).
  template <int C, int KS, int VS>
  __device__ __forceinline__ void copy(rtk_u32 dq, rtk_u32 dk, rtk_u32 dv, int n0, int NS, bool with_q) const {
    const char* qp = reinterpret_cast<const char*>(q_first + (rtk_i64)n0 * q_sn);
    const char* kp = reinterpret_cast<const char*>(k_first + (rtk_i64)n0 * k_sn);
    const rtk_i64 qstep = SZ * QROWS * q_sn, kstep = SZ * QROWS * k_sn;
    if (n0 + C <= NS) {  // a whole chunk: no row checks
      #pragma unroll
      for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
        if (with_q) rtk_cp_async16(dq + SZ * u * QROWS * KS, qp, qbytes);
        rtk_cp_async16(dk + SZ * u * QROWS * KS, kp, qbytes);
      }
    } else {
      #pragma unroll
      for (int u = 0; u < C / QROWS; ++u, qp += qstep, kp += kstep) {
        const bool in = n0 + qrow + u * QROWS < NS;
        if (with_q) rtk_cp_async16(dq + SZ * u * QROWS * KS, in ? (const void*)qp : (const void*)qb, in ? qbytes : 0);
        rtk_cp_async16(dk + SZ * u * QROWS * KS, in ? (const void*)kp : (const void*)kb, in ? qbytes : 0);
      }
    }
    copy_tile<C, VS>(dv, v_first, vb, n0, NS);
  }

  // The first row of this thread's pieces of a BV-wide tile like v's (same strides) at `base`.
  __device__ __forceinline__ const T* tile_first(const T* base) const {
    return base + (rtk_i64)vrow * v_sn + (vbytes ? vcol : 0);
  }
  // cp.async of chunk rows n0 .. n0 + C - 1 of a BV-wide tile with v's strides (first: its
  // tile_first, base: row 0), the rows >= NS zero-filled, to shared address dst.
  template <int C, int VS>
  __device__ __forceinline__ void copy_tile(rtk_u32 dst, const T* first, const T* base, int n0, int NS) const {
    const char* vp = reinterpret_cast<const char*>(first + (rtk_i64)n0 * v_sn);
    const rtk_i64 vstep = SZ * VROWS * v_sn;
    const bool whole = n0 + C <= NS;
    #pragma unroll
    for (int u = 0; u < C / VROWS; ++u, vp += vstep) {
      const bool in = whole || n0 + vrow + u * VROWS < NS;
      rtk_cp_async16(dst + SZ * u * VROWS * VS, in ? (const void*)vp : (const void*)base, in ? vbytes : 0);
    }
  }
};

// A chunk's tensor copies into a stage, by one thread (the TMA instances): the q and k tiles (KMAX
// wide; q unless with_q is false) and the v and, with XT, x tiles (BV wide from column v0), tokens
// y .. y + 63 of head h, batch b, all completing on mbarrier `bar`, which this call arms with their bytes.
template <int KMAX, int BV, bool XT>
__device__ __forceinline__ void rtk_chunk_tma_load(rtk_u32 sq, rtk_u32 sk, rtk_u32 sv, rtk_u32 sx, const rtk_tmap* q,
                                                   const rtk_tmap* k, const rtk_tmap* v, const rtk_tmap* x, bool with_q,
                                                   int y, int v0, int h, int b, rtk_u32 bar) {
  rtk_mbar_expect(bar, ((with_q ? KMAX : 0) + KMAX + (XT ? 2 : 1) * BV) * 64 * 2);
  if (with_q) rtk_tensor_load_boxes<KMAX / 64>(sq, q, 0, y, h, b, bar);
  rtk_tensor_load_boxes<KMAX / 64>(sk, k, 0, y, h, b, bar);
  rtk_tensor_load_boxes<BV / 64>(sv, v, v0, y, h, b, bar);
  if (XT) rtk_tensor_load_boxes<BV / 64>(sx, x, v0, y, h, b, bar);
}
