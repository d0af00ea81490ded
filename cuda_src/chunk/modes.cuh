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
// segment of the split-sequence strategy; grid.z is the segment) and the mode.
struct rtk_chunk_shape {
  rtk_fwd_shape f;
  rtk_i64 seg_len, mode;
};
