"""The cached call on the GPU (marker ``gpu``): a repeated call signature skips the checks and the
planning and relaunches the planned kernel with the new data; these tests check that the cached
call computes what the full path computes and refuses what it refuses."""

import pytest
import torch

from inputs import force_chunk

import rtkernels
from rtkernels import call_cache

from reference import reference
from tolerances import assert_close

pytestmark = pytest.mark.gpu


def _qkv(b, h, n, dk, dv, dtype=torch.bfloat16, layout="bhnd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda d: (b, h, n, d)) if layout == "bhnd" else (lambda d: (b, n, h, d))
    q = (torch.randn(shape(dk), generator=g, device="cuda") / dk ** 0.5).to(dtype)
    k = (torch.randn(shape(dk), generator=g, device="cuda") / dk ** 0.5).to(dtype)
    v = torch.randn(shape(dv), generator=g, device="cuda").to(dtype)
    return q, k, v


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("shape", [(2, 3, 65, 40, 72), (1, 2, 4096, 128, 128), (1, 3, 2, 129, 1), (2, 3, 100, 200, 40)])
def test_repeated_calls_follow_the_data(shape, layout):
    """Dk over 128 runs as key pieces on Hopper, whose later pieces add a temporary into the output:
    a cached call hands the launch the caller's tensor ([B, N, H, Dv] for "bnhd"), which must be
    read as the [B, H, N, Dv] view the plan saw (a property test found the transposed add)."""
    call_cache.clear()
    decay = torch.tensor([0.5, 0.999, 0.9])[: shape[1]]
    for seed in range(3):  # the first call plans and caches; the others are cached calls
        q, k, v = _qkv(*shape, layout=layout, seed=seed)
        out = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", layout=layout)
        assert_close(out, reference(q, k, v, decay, layout=layout)[0], torch.bfloat16, "cached call")
    assert call_cache.size() == 1


def test_in_place_change_of_a_host_decay_is_seen():
    call_cache.clear()
    q, k, v = _qkv(1, 2, 300, 64, 64)
    d = torch.tensor([0.5, 0.9])
    rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
    d.fill_(0.99)
    out = rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
    assert_close(out, reference(q, k, v, d)[0], torch.bfloat16, "decay changed in place")
    d.fill_(1.5)
    with pytest.raises(ValueError, match="decay"):
        rtkernels.causal_linear_attention(q, k, v, d, method="chunk")


def test_misaligned_views_get_their_own_plan():
    call_cache.clear()
    q, k, v = _qkv(1, 2, 200, 64, 64)
    rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q2 = flat[1:].view(q.shape)  # 2 bytes off: the kernel must not use 16-byte loads
    q2.copy_(q)
    out = rtkernels.causal_linear_attention(q2, k, v, 0.9, method="chunk")
    assert_close(out, reference(q, k, v, torch.full((2,), 0.9))[0], torch.bfloat16, "misaligned q")
    assert call_cache.size() == 2


def test_bad_arguments_still_refused_after_caching():
    call_cache.clear()
    q, k, v = _qkv(1, 2, 64, 16, 16)
    rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
    with pytest.raises(TypeError, match="scale"):
        rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", scale=True)
    with pytest.raises(TypeError, match="return_state"):
        rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", return_state=1)
    with pytest.raises(ValueError, match="decay"):
        rtkernels.causal_linear_attention(q, k, v, 0.0, method="chunk")


def test_decode_loop_with_state_matches_the_whole_sequence():
    call_cache.clear()
    q, k, v = _qkv(2, 2, 40, 32, 48)
    d = torch.tensor([0.8, 0.99])
    whole, s_whole = rtkernels.causal_linear_attention(q, k, v, d, method="chunk", return_state=True)
    out, s = rtkernels.causal_linear_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], d, method="chunk",
                                               return_state=True)
    outs = [out]
    for t in range(8, 40):  # one token at a time from the state: cached after the first
        o, s = rtkernels.causal_linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], d,
                                                 method="chunk", initial_state=s, return_state=True)
        outs.append(o)
    ref, ref_state = reference(q, k, v, d)
    assert_close(torch.cat(outs, 2), ref, torch.bfloat16, "decode loop")
    assert_close(whole, ref, torch.bfloat16, "whole sequence")
    # the state's k^T v products take 16-bit operands (decay-weighted k rounded to bf16): bf16 error
    assert_close(s, ref_state, torch.bfloat16, "state after the decode loop")
    assert_close(s_whole, ref_state, torch.bfloat16, "state of the whole sequence")


def _cached_grid(q, k, v, decay):
    """The grid of the fused pass the cached call of this signature launches."""
    key = call_cache.call_key(q, k, v, decay, None, 1.0, "chunk", "bhnd", None, False)
    hit = call_cache.lookup(key)
    assert hit is not None, "the call was not cached"
    return hit.launcher.fused.grid


def test_overrides_and_autotune_changes_replan(monkeypatch, tmp_path):
    """Forcing the plan (chunk.override) and writing a tuned entry into the autotune store each
    give the same call signature a new plan, which runs the forced or tuned config."""
    from rtkernels.autotune import answers
    from rtkernels.autotune.keys import bucket, device_fingerprint
    from rtkernels.autotune.store import Store

    call_cache.clear()
    q, k, v = _qkv(1, 1, 4096, 128, 128)
    ref = reference(q, k, v, torch.full((1,), 0.999))[0]
    rtkernels.causal_linear_attention(q, k, v, 0.999, method="chunk")
    heuristic = _cached_grid(q, k, v, 0.999)
    force_chunk(monkeypatch, segments=3)
    out = rtkernels.causal_linear_attention(q, k, v, 0.999, method="chunk")
    assert_close(out, ref, torch.bfloat16, "forced segments")
    assert call_cache.size() == 2 and _cached_grid(q, k, v, 0.999)[2] == 3
    monkeypatch.undo()  # the heuristic's plan again, from the cache
    assert _cached_grid(q, k, v, 0.999) == heuristic
    # a tuned entry for the call's bucket, with a config the heuristic does not pick on any GPU:
    # the mma.sync kernel, 32 value columns (4 tiles), 2 segments
    dev = q.get_device()
    tuned = {"wgmma": False, "bv": 32, "segments": 2}
    store = Store(device_fingerprint(dev), tmp_path)
    store.put(bucket(q.dtype, 1, 4096, 128, 128), {"method": "chunk", "configs": {"chunk": tuned}})
    answers.use_store(dev, store)  # the store's answers changed: cached plans are stale
    try:
        assert answers.lookup(q, v)["configs"]["chunk"] == tuned
        out = rtkernels.causal_linear_attention(q, k, v, 0.999, method="chunk")
        assert_close(out, ref, torch.bfloat16, "tuned config")
        assert call_cache.size() == 3, "the store change must give a new plan"
        assert _cached_grid(q, k, v, 0.999) == (1, 4, 2), "the new plan must run the tuned config"
    finally:
        answers.clear()  # forget the test's store: the next lookup reads the run's own store again
