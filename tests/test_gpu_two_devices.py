"""Two GPUs in one process (marker ``gpu``; skipped with fewer than two): the device index follows
the tensors, one kernel cache serves both devices, the cached call keeps its launches per device,
streams of the second device, the backward and the decode step there, and mixed devices refused.

Run on a machine with two GPUs: ``python -m pytest -m gpu tests/test_gpu_two_devices.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import rtkernels
from rtkernels.jit.files import cache_dir

from reference import reference
from tolerances import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

H = 3


def _inputs(n, dk, dv, dtype, device, seed, b=2):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(b, H, n, dk, generator=g) / dk ** 0.5).to(device, dtype)
    k = (torch.randn(b, H, n, dk, generator=g) / dk ** 0.5).to(device, dtype)
    v = torch.randn(b, H, n, dv, generator=g).to(device, dtype)
    return q, k, v


def _gammas(device="cpu"):
    return torch.tensor([0.9, 0.99, 0.5], dtype=torch.float64, device=device)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_second_device_while_first_is_current(dtype):
    """Tensors on cuda:1 with cuda:0 current: the kernels run on cuda:1 (the output lives there and
    is right), and the current device is left as it was."""
    assert torch.cuda.current_device() == 0
    q, k, v = _inputs(193, 64, 96, dtype, "cuda:1", seed=1)
    out, state = rtkernels.causal_linear_attention(q, k, v, _gammas("cuda:1").float(), method="chunk",
                                                   return_state=True)
    assert out.device == torch.device("cuda:1") and state.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    ref, ref_state = reference(q, k, v, _gammas())
    assert_close(out, ref, dtype, "cuda:1 output")
    assert_close(state, ref_state, dtype, "cuda:1 state")  # 16-bit: the k-v products take 16-bit operands


_CACHE_PROBE = """
import sys, torch, rtkernels
dev = sys.argv[1]
g = torch.Generator().manual_seed(2)
q, k, v = (torch.randn(2, 3, 77, d, generator=g).to(dev, torch.bfloat16) for d in (40, 40, 24))
out = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
torch.save(out.cpu(), sys.argv[2])
"""


def test_one_kernel_cache_serves_both_devices(tmp_path):
    """Two fresh processes share one empty cache directory: the first runs a call on cuda:0 and
    compiles, the second runs it on cuda:1 and must load what the first cached (no new entry,
    same GPU model), with the same bits."""
    if torch.cuda.get_device_capability(0) != torch.cuda.get_device_capability(1):
        pytest.skip("different GPU architectures compile different kernels")
    env = {**os.environ, "RTKERNELS_CACHE_DIR": str(tmp_path / "cache")}
    kernels = tmp_path / "cache" / "kernels"
    subprocess.run([sys.executable, "-c", _CACHE_PROBE, "cuda:0", str(tmp_path / "o0.pt")], env=env, check=True)
    first = sorted(kernels.glob("*.bin"))
    assert first, "the first process cached no kernel"
    subprocess.run([sys.executable, "-c", _CACHE_PROBE, "cuda:1", str(tmp_path / "o1.pt")], env=env, check=True)
    assert sorted(kernels.glob("*.bin")) == first, "cuda:1 compiled its own copy of a cached kernel"
    o0, o1 = torch.load(tmp_path / "o0.pt"), torch.load(tmp_path / "o1.pt")
    assert torch.equal(o0, o1), "one kernel, one input: the two devices must agree bit for bit"
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 77, d, generator=g).to(torch.bfloat16) for d in (40, 40, 24))
    ref, _ = reference(q, k, v, torch.full((3,), 0.9, dtype=torch.float64))
    assert_close(o1, ref, torch.bfloat16, "cuda:1")


@pytest.mark.parametrize("decay_on_device", (False, True))
def test_cached_call_alternating_devices(decay_on_device):
    """The same shapes alternately on cuda:0 and cuda:1, many times: the call cache must keep one
    launch per device (a kernel handle or stream of the other device would fault or race)."""
    xs = [_inputs(130, 64, 64, torch.float16, f"cuda:{d}", seed=3) for d in (0, 1)]
    decays = [(_gammas(f"cuda:{d}").float() if decay_on_device else 0.9) for d in (0, 1)]
    outs = {0: [], 1: []}
    for _ in range(4):
        for d in (0, 1):
            q, k, v = xs[d]
            outs[d].append(rtkernels.causal_linear_attention(q, k, v, decays[d], method="chunk"))
    for d in (0, 1):
        assert all(o.device == torch.device(f"cuda:{d}") for o in outs[d])
        assert all(torch.equal(o, outs[d][0]) for o in outs[d])
    assert torch.equal(outs[0][0].cpu(), outs[1][0].cpu())
    gam = _gammas() if decay_on_device else torch.full((H,), 0.9, dtype=torch.float64)
    ref, _ = reference(*xs[1], gam.float().double() if decay_on_device else gam)
    assert_close(outs[1][-1], ref, torch.float16, "alternating, cuda:1")


def test_streams_of_the_second_device():
    """A call inside ``torch.cuda.stream(s)`` for a stream of cuda:1 runs on that stream: work queued
    on it before the call (an in-place change of v) is seen, and the result is ready after
    ``s.synchronize()`` alone."""
    q, k, v = _inputs(1000, 128, 128, torch.bfloat16, "cuda:1", seed=4)
    v_used = v * 2
    s = torch.cuda.Stream(device="cuda:1")
    s.wait_stream(torch.cuda.current_stream("cuda:1"))
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the stream busy so an unordered launch would race
        v.mul_(2)
        out = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk")
    s.synchronize()
    ref, _ = reference(q, k, v_used, torch.full((H,), 0.99, dtype=torch.float64))
    assert_close(out, ref, torch.bfloat16, "stream of cuda:1")


def test_both_devices_at_once_from_two_threads():
    """Two threads, one per device, each with its own stream, many calls: each gets the bits of a
    serial call on its device."""
    inputs = {d: _inputs(512, 64, 64, torch.bfloat16, f"cuda:{d}", seed=5) for d in (0, 1)}
    serial = {d: rtkernels.causal_linear_attention(*inputs[d], 0.95, method="chunk") for d in (0, 1)}
    got, errors = {}, []

    def work(d):
        try:
            with torch.cuda.device(d):
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    outs = [rtkernels.causal_linear_attention(*inputs[d], 0.95, method="chunk") for _ in range(20)]
                s.synchronize()
            got[d] = outs
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for d in (0, 1):
        assert all(torch.equal(o, serial[d]) for o in got[d])


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_backward_on_the_second_device(dtype):
    """Forward and backward on cuda:1 with a trainable decay tensor there: gradients on cuda:1,
    equal to the fp64 reference's."""
    q, k, v = _inputs(150, 64, 48, dtype, "cuda:1", seed=6)
    s0 = torch.randn(2, H, 64, 48, device="cuda:1") * 0.1
    lg = torch.log(_gammas("cuda:1").float()).requires_grad_(True)
    for x in (q, k, v, s0):
        x.requires_grad_(True)
    out, st = rtkernels.causal_linear_attention(q, k, v, decay_rate=-lg, initial_state=s0, method="chunk",
                                                return_state=True)
    g = torch.Generator(device="cpu").manual_seed(7)
    go = torch.randn(out.shape, generator=g).to("cuda:1", dtype)
    gs = torch.randn(st.shape, generator=g).to("cuda:1")
    grads = torch.autograd.grad([out, st], [q, k, v, s0, lg], [go, gs])
    assert all(x.device == torch.device("cuda:1") for x in grads)
    lg64 = lg.detach().double().requires_grad_(True)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, s0)]
    ro, rs = reference(*leaves[:3], torch.exp(lg64), initial_state=leaves[3])
    want = torch.autograd.grad([ro, rs], leaves + [lg64], [go.double(), gs.double()])
    for name, a, b in zip(("dq", "dk", "dv", "ds0"), grads[:4], want[:4]):
        assert_close(a, b, dtype, name)
    torch.testing.assert_close(grads[4].double(), want[4], rtol=2e-2, atol=2e-2 * want[4].abs().max().item())


def test_decode_on_the_second_device():
    """Decode steps on cuda:1 (state pool there, permuted indices) equal one prefill of the whole
    sequence."""
    n, dk, dv = 6, 64, 64
    q, k, v = _inputs(n, dk, dv, torch.bfloat16, "cuda:1", seed=8)
    gam = _gammas("cuda:1").float()
    full, _ = rtkernels.causal_linear_attention(q, k, v, gam, return_state=True)
    pool = torch.zeros(5, H, dk, dv, device="cuda:1")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda:1")
    steps = [rtkernels.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], pool, gam, state_indices=idx)
             for t in range(n)]
    got = torch.cat(steps, dim=2)
    assert got.device == torch.device("cuda:1")
    torch.testing.assert_close(got.float(), full.float(), rtol=2e-2, atol=2e-2)
    assert pool[[0, 2, 4]].abs().sum().item() == 0, "rows no sequence names must stay untouched"


def test_mixed_devices_are_refused():
    q, k, v = _inputs(10, 8, 8, torch.float32, "cuda:0", seed=9)
    with pytest.raises(ValueError, match="device"):
        rtkernels.causal_linear_attention(q, k.to("cuda:1"), v, 0.9)
    with pytest.raises(ValueError, match="device"):
        rtkernels.causal_linear_attention(q, k, v, torch.full((H,), 0.9, device="cuda:1"))
    with pytest.raises(ValueError, match="device"):
        rtkernels.causal_linear_attention(q, k, v, 0.9, initial_state=torch.zeros(2, H, 8, 8, device="cuda:1"))


def test_cache_dir_is_the_tests_own():
    """The suite runs in its own temporary cache directory (conftest), not the machine's."""
    assert os.environ.get("RTKERNELS_CACHE_DIR") and str(cache_dir()) == os.environ["RTKERNELS_CACHE_DIR"]
