"""The backward's dq pass folding the forward's states-pass slots, and its dv pass the dk pass's
(marker ``gpu``): a split training step keeps the forward's slots and the dq pass takes them,
transposed, instead of running its own states pass (:func:`rtkernels.methods.chunk.launch.transposed_slots`);
the dk pass keeps its slots and the dv pass takes them the same way. The gradients must
match autograd through the fp64 reference, with and without an initial state, at gamma 0.9 and
0.99 in fp16 and bf16 (where a wrong power of gamma in a slot would show), and the slots must
really be taken where the dq pass splits the sequence as the forward does (a fixed decay: the dq
pass of a trainable one in bf16 carries W in its own states pass)."""

from __future__ import annotations

import pytest
import torch

from inputs import force_chunk

import rtkernels
from rtkernels.methods.chunk import launch

from reference import reference
from test_gpu_grad import _case
from tolerances import assert_close

pytestmark = pytest.mark.gpu

#: (B, H, N, Dk, Dv, layout): Dk = Dv (the split always matches), Dk != Dv, the other layout.
SHAPES = [(1, 2, 1030, 64, 64, "bhnd"), (1, 2, 4096, 64, 128, "bhnd"), (2, 2, 700, 128, 128, "bnhd")]


@pytest.mark.parametrize("stateful", (True, False), ids=("state", "nostate"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dq_pass_takes_the_forward_slots(shape, dtype, stateful, monkeypatch):
    force_chunk(monkeypatch, segments=3)
    taken = []
    real = launch.transposed_slots

    def spy(launcher, slots, fold):
        got = real(launcher, slots, fold)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(launch, "transposed_slots", spy)
    b, h, n, dk, dv, layout = shape
    for gamma in (0.9, 0.99):
        (q, k, v, s0, decay, w, ws), want = _case(shape, dtype, gamma)  # decay requires grad there
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, s0)]
        # a fixed decay: a trainable one in bf16 takes the dq pass that sums dlog(gamma), whose states
        # pass also carries W and so runs as before
        res = rtkernels.causal_linear_attention(*leaves[:3], decay.detach().float(), scale=0.8, method="chunk", layout=layout,
                                                initial_state=leaves[3] if stateful else None,
                                                return_state=True)
        out, state = res
        loss = (out.float() * w.float()).sum() + (state * ws).sum()
        loss.backward()
        if not stateful:  # the fp64 reference without the initial state
            refs = [x.detach().double().requires_grad_(True) for x in (q, k, v, decay)]
            ro, rs = reference(*refs[:3], refs[3], 0.8, layout)
            want = torch.autograd.grad((ro * w.double()).sum() + (rs * ws.double()).sum(), refs[:3])
        for name, x, r in zip(("q", "k", "v"), leaves[:3], want[:3]):
            assert_close(x.grad, r, dtype, f"d{name} {dtype} {shape} gamma={gamma} state={stateful}", n=n)
    # per step: the dq pass (the forward's slots), then the dv pass (the dk pass's slots); with
    # Dk != Dv the dk and dv passes may tile and split differently, and the dv pass then runs its own
    assert taken[0::2] and all(taken[0::2]), f"the dq pass ran its own states pass: {taken}"
    if dk == dv:
        assert taken[1::2] and all(taken[1::2]), f"the dv pass ran its own states pass: {taken}"
