// chunk/modes.cuh -- what one launch of a chunk forward kernel does (its last parameter).
#pragma once

// The last parameter of rtk_chunk_fwd: the whole fused pass (init_state: the state entering the
// CTA's segment, slot z), the states-only pass of the split-sequence strategy, or the fused pass
// after rtk_chunk_states (init_state: its slots, see rtk_chunk_state::fold; the final state is
// stored by the last segment, unslotted).
#define RTK_MODE_FUSED 0
#define RTK_MODE_STATES 1
#define RTK_MODE_FOLD 2
