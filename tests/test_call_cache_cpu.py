"""The cached call's signature (rtkernels.call_cache.call_key): what may be cached, and that everything the
checks depend on is part of the key (so a cached call accepts exactly what the full path accepts)."""

import math

import pytest
import torch

from rtkernels import api, call_cache


def _qkv(dtype=torch.bfloat16):
    return tuple(torch.zeros(1, 2, 8, 4, dtype=dtype) for _ in range(3))


def key(q, k, v, decay=0.9, decay_rate=None, scale=1.0, method="chunk", layout="bhnd", s0=None, rs=False):
    return call_cache.call_key(q, k, v, decay, decay_rate, scale, method, layout, s0, rs)


def test_plain_call_has_a_key_and_it_is_stable():
    q, k, v = _qkv()
    assert key(q, k, v) is not None
    assert key(q, k, v) == key(q, k, v)
    assert key(q, k, v) == key(*_qkv())  # other tensors, same signature


@pytest.mark.parametrize("change", [
    dict(scale=True), dict(scale=0.5), dict(scale=2), dict(decay=0.5), dict(decay=1), dict(decay=None),
    dict(decay=None, decay_rate=0.1), dict(method="scan"), dict(layout="bnhd"), dict(rs=True),
    dict(s0=torch.zeros(1, 2, 4, 4)),
])
def test_every_argument_is_part_of_the_key(change):
    q, k, v = _qkv()
    other = key(q, k, v, **change)
    assert other is None or other != key(q, k, v)


def test_scale_true_never_shares_the_key_of_scale_1():
    q, k, v = _qkv()
    assert key(q, k, v, scale=True) is None  # a bool is refused by the full path: never cached
    assert key(q, k, v, scale=1) != key(q, k, v, scale=1.0)


def test_shape_stride_dtype_and_alignment_are_part_of_the_key():
    q, k, v = _qkv()
    base = key(q, k, v)
    assert key(torch.zeros(1, 2, 9, 4, dtype=q.dtype), k, v) != base
    assert key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v) != base
    assert key(*_qkv(torch.float16)) != base
    flat = torch.zeros(1 + q.numel(), dtype=q.dtype)
    assert key(flat[1:].view(q.shape), k, v) != base  # 2 bytes off the 16-byte alignment


def test_uncacheable_calls_have_no_key():
    q, k, v = _qkv()
    assert key(q.numpy() if q.dtype != torch.bfloat16 else q.float().numpy(), k, v) is None
    assert key(q, k, v, method=["chunk"]) is None
    assert key(q, k, v, rs=1) is None
    assert key(q, k, v, scale=[1.0]) is None
    qg = q.float().requires_grad_()
    tracked = key(qg, k.float(), v.float())
    assert tracked is not None  # a call with autograd history: its own signature
    with torch.no_grad():
        assert key(qg, k.float(), v.float()) not in (None, tracked)
    assert key(q.float(), k.float(), v.float()) not in (None, tracked)
    # a CPU decay that requires grad goes through its log in torch operations: never cached
    assert key(q, k, v, decay=torch.full((2,), 0.5, requires_grad=True)) is None


def test_host_decay_tensor_keyed_by_value():
    q, k, v = _qkv()
    d = torch.full((2,), 0.5)
    before = key(q, k, v, decay=d)
    assert key(q, k, v, decay=d) == before
    d.fill_(0.25)  # in place: the checked values are not reused
    assert key(q, k, v, decay=d) != before
    assert key(q, k, v, decay=d.clone()) == key(q, k, v, decay=d)  # equal values, equal checks and plan
    after, version = key(q, k, v, decay=d), d._version
    d.numpy()[0] = 1.5  # a write that leaves the version counter alone (also .data) is still seen
    assert d._version == version and key(q, k, v, decay=d) != after
    assert key(q, k, v, decay=d.double()) != key(q, k, v, decay=d)  # the dtype is part of it


def test_a_parameter_decay_is_keyed_as_the_tensor_it_is():
    """A model's trainable decay is an nn.Parameter: keyed like a plain tensor (it was never cached
    before: the full path on every call, about 40 µs of host time on an H200 host), by value on the
    CPU, and apart from a tensor when it requires grad in grad mode."""
    q, k, v = _qkv()
    p = torch.nn.Parameter(torch.full((2,), 0.5))
    with torch.no_grad():
        assert key(q, k, v, decay=p) is not None
        assert key(q, k, v, decay=p) == key(q, k, v, decay=torch.full((2,), 0.5))
        p.fill_(0.25)  # an optimizer's in-place step: the values change, so does the key
        assert key(q, k, v, decay=p) == key(q, k, v, decay=torch.full((2,), 0.25))
    assert key(q, k, v, decay=p) is None  # a CPU decay that requires grad in grad mode: never cached


def test_autotune_changes_invalidate_the_key():
    from rtkernels import autotune

    q, k, v = _qkv()
    before = key(q, k, v)
    autotune.clear(stores=False)
    assert key(q, k, v) != before


def test_cpu_calls_are_never_cached():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    call_cache.clear()
    out = api.causal_linear_attention(q, k, v, 0.9, method="chunk")
    assert not call_cache.size() and math.isfinite(float(out.sum()))


def test_a_forced_candidate_is_part_of_the_key_by_value():
    from rtkernels import autotune

    q, k, v = _qkv()
    base = key(q, k, v)
    a, b = (("bv", 64), ("segments", 1), ("wgmma", True)), (("bv", 128), ("segments", 1), ("wgmma", True))
    with autotune.forced("chunk", a):
        first = key(q, k, v)
    with autotune.forced("chunk", a):  # the tuner times one candidate call after call: one plan
        assert key(q, k, v) == first
    with autotune.forced("chunk", b):
        assert key(q, k, v) != first
    assert first != base and key(q, k, v) == base
