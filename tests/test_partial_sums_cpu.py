"""PartialSums without a GPU: the dq pass's partial sums of dlog(gamma) and their total share one
buffer; the sum kernel is replaced by a host function that reads and writes the same addresses."""

import ctypes

import torch

from rtkernels.decay import LogDecay
from rtkernels.methods.chunk import decay_grad


class _HostSum:
    """Stands in for ``rtk_chunk_decay_grad_sum``: out[h] = sum over rows of partial[row * H + h]."""

    def bind(self, grid, block, smem, dev, n_ptrs, tail):
        rows, h, _mode = tail

        def run(partial, out, decay):
            src = (ctypes.c_float * (rows * h)).from_address(partial)
            dst = (ctypes.c_float * h).from_address(out)
            for j in range(h):
                dst[j] = sum(src[r * h + j] for r in range(rows))
        return run


def test_partial_sums_and_their_total_share_one_aligned_buffer(monkeypatch):
    monkeypatch.setattr(decay_grad, "get_function", lambda *a, **kw: _HostSum())
    for sequences, h, d in ((3, 5, 128), (1, 1, 64), (7, 3, 200)):
        q = torch.zeros(1, h, 10, d)
        sums = decay_grad.PartialSums(q, q, LogDecay(torch.device("cpu"), host=(-0.1,) * h), sequences)
        rows, tiles, hh = sums.shape
        assert (rows, hh) == (sequences, h) and tiles == -(-d // 64)
        buf = sums.buffer()
        n = rows * tiles * h
        parts = torch.arange(1.0, n + 1)
        buf[:n] = parts  # what the dq pass writes at the buffer's start
        buf[n:] = float("nan")
        total = sums.total(buf, 0)
        assert total.shape == (h,) and total.is_contiguous()
        assert total.data_ptr() % 16 == 0 and (total.data_ptr() - buf.data_ptr()) % 256 == 0
        assert total.data_ptr() >= buf.data_ptr() + 4 * n, "the total must not overlap the partial sums"
        torch.testing.assert_close(total, parts.view(rows * tiles, h).sum(0))
