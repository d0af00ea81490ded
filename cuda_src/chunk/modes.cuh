// chunk/modes.cuh -- the chunk forward kernels' struct parameter and what one launch does (mode).
#pragma once
#include "../include/params.cuh"

// The mode of rtk_chunk_fwd: the whole fused pass (init_state: the state entering the
// CTA's segment, slot z), the states-only pass of the split-sequence strategy, or the fused pass
// after rtk_chunk_states (init_state: its slots, see rtk_chunk_state::fold; the final state is
// stored by the last segment, unslotted).
#define RTK_MODE_FUSED 0
#define RTK_MODE_STATES 1
#define RTK_MODE_FOLD 2

// The chunk kernels' struct parameter: the forward's shape, then the segment length (tokens per
// segment of the split-sequence strategy; grid.z is the segment), the mode, and for RTK_MODE_FOLD
// the tokens of each slot the states pass wrote (a divisor of seg_len: a segment's state folds
// seg_len / fold_len slots, so the states pass can run more CTAs than there are segments), then packed
// sequences (rtkernels/methods/chunk/packed.py): the address of S + 1 int64 offsets on the device
// (0: none; grid.x is then S * H and the batch is one), the address of a bool saying they are valid,
// and 1 where the launch is reversed (kernel row n is tensor row N-1-n); then the address of a
// fourth operand x read with v's strides (the DLOG and DUAL instances of rtk_chunk_fwd); read only by
// the DLOG instances (the backward's dq pass with dlog(gamma)), the address of the float partial
// sums ([segments * rows, value tiles, H]) and of the final state's gradient G (fp32 [rows * H, Dv,
// Dk] contiguous, the forward's state layout; 0: none); and for the DUAL instances (the backward's
// fused dk and dv pass) the address of the second output o2, written with k's strides.
// CHUNK_FIELDS in rtkernels/methods/chunk/plan.py mirrors the fields after f.
struct rtk_chunk_shape {
  rtk_fwd_shape f;
  rtk_i64 seg_len, mode, fold_len;
  rtk_i64 cu_seqlens, cu_valid, cu_reverse;
  rtk_i64 x, dlog_out, dlog_g, out2;
};
