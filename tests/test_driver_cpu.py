"""rtkernels.jit.driver without a GPU: status checking."""

import pytest

from rtkernels.jit import driver


def test_zero_status_passes_and_nonzero_raises_naming_the_call():
    driver.check(0, "cuLaunchKernel")
    with pytest.raises(driver.CudaDriverError, match=r"cuLaunchKernel failed: .*\(700\)"):
        driver.check(700, "cuLaunchKernel")


def test_a_thread_without_a_context_gets_torchs_and_the_launch_is_retried(monkeypatch):
    """cuLaunchKernel answers CUDA_ERROR_INVALID_CONTEXT on a thread that has no current context
    (a fresh autograd worker thread): the launcher makes the device's primary context current and
    launches again, once; any other failure still raises."""
    import threading

    import torch

    from rtkernels.jit import jit

    statuses, made = [driver.INVALID_CONTEXT, 0], []

    def fake_launch(*args):
        return statuses.pop(0)

    k = jit.Kernel.__new__(jit.Kernel)
    k._ptr, k.device_index, k._launch_kernel = 1, 0, fake_launch
    k._layouts, k._lock = {}, threading.Lock()
    monkeypatch.setattr(jit, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(driver, "make_primary_current", lambda dev: made.append(dev))
    k.launch((1, 1, 1), (32, 1, 1), (0, 1, 2.0), 0, 0, 2)  # two pointers, then a struct field
    assert made == [0] and statuses == []

    bound = k.bind((1, 1, 1), (32, 1, 1), 0, 0, 2, (3, 4.0))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # CPU builds lack it
    statuses[:] = [driver.INVALID_CONTEXT, 0]
    bound(10, 20)
    assert made == [0, 0] and statuses == []
    statuses[:] = [driver.INVALID_CONTEXT, 700]
    with pytest.raises(driver.CudaDriverError, match=r"\(700\)"):
        bound(10, 20)


def test_a_binding_that_raises_is_read_as_its_status(monkeypatch):
    """CuPy's compiled launch binding (the default where cupy_backends imports) raises
    :data:`driver.LaunchError` carrying the driver's status instead of returning it: the same
    retry on CUDA_ERROR_INVALID_CONTEXT, the same CudaDriverError for anything else."""
    import threading

    from rtkernels.jit import jit

    class Raised(Exception):
        def __init__(self, status):
            super().__init__(status)
            self.status = status

    statuses, made = [driver.INVALID_CONTEXT, None], []

    def fake_launch(*args):
        status = statuses.pop(0)
        if status:
            raise Raised(status)
        return status  # None: launched

    monkeypatch.setattr(driver, "LaunchError", Raised)
    k = jit.Kernel.__new__(jit.Kernel)
    k._ptr, k.device_index, k._launch_kernel = 1, 0, fake_launch
    k._layouts, k._lock = {}, threading.Lock()
    monkeypatch.setattr(jit, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(driver, "make_primary_current", lambda dev: made.append(dev))
    k.launch((1, 1, 1), (32, 1, 1), (0, 1, 2.0), 0, 0, 2)
    assert made == [0] and statuses == []
    statuses[:] = [719]
    with pytest.raises(driver.CudaDriverError, match=r"\(719\)"):
        k.launch((1, 1, 1), (32, 1, 1), (0, 1, 2.0), 0, 0, 2)
    statuses[:] = [None, 700]
    assert driver.launch_status(fake_launch) == 0 and driver.launch_status(fake_launch) == 700


def test_a_thread_without_a_context_gets_torchs_and_the_load_is_retried(monkeypatch):
    """cuModuleLoadData answers CUDA_ERROR_INVALID_CONTEXT on a thread with no current context (an
    autograd worker loading a kernel the forward never used): Kernel.load makes the primary context
    current and loads again, once; any other failure still raises, and the status is on the error."""
    import contextlib

    import torch

    from rtkernels.jit import jit, kernel_cache

    made, answers = [], []

    def fake_load(image):
        status = answers.pop(0)
        driver.check(status, "cuModuleLoadData")
        return 5

    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: None)
    monkeypatch.setattr(driver, "module_load_data", fake_load)
    monkeypatch.setattr(driver, "module_get_function", lambda module, name: 7)
    monkeypatch.setattr(driver, "make_primary_current", lambda dev: made.append(dev))
    monkeypatch.setattr(driver, "launch_kernel", lambda: None)
    cached = kernel_cache.CachedKernel(b"", "k", "cubin")
    answers[:] = [driver.INVALID_CONTEXT, 0]
    k = jit.Kernel.load(cached, 3)
    assert (k.module, k._ptr, made, answers) == (5, 7, [3], [])
    answers[:] = [700]
    with pytest.raises(driver.CudaDriverError, match=r"\(700\)") as err:
        jit.Kernel.load(cached, 3)
    assert err.value.status == 700 and made == [3]


def test_a_bound_launch_packs_its_late_struct_fields_after_the_fixed_ones(monkeypatch):
    """``bind(..., late=m)``: a call passes the pointers, then the struct's last m fields; the
    kernel's parameter buffer holds the pointers, the fixed fields as bound and the late ones at the
    struct's end, and the parameter array points at each pointer and at the struct."""
    import ctypes
    import struct
    import threading

    import torch

    from rtkernels.jit import jit

    seen = []
    k = jit.Kernel.__new__(jit.Kernel)
    k._ptr, k.device_index, k._launch_kernel = 1, 0, lambda *args: seen.append(args) or 0
    k._layouts, k._lock = {}, threading.Lock()
    monkeypatch.setattr(jit, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    bound = k.bind((1, 1, 1), (32, 1, 1), 0, 0, 2, (3, 4.0, 0, 0), late=2)
    for late in ((7, 8), (9, -1)):
        bound(10, 20, *late)
        raw = bytes(bound._buf[0])
        assert struct.unpack("<qqqdqq", raw) == (10, 20, 3, 4.0, *late)
    params = seen[-1][9]  # the address of the parameter array: two pointer slots, then the struct
    slots = (ctypes.c_void_p * 3).from_address(params)
    base = ctypes.addressof(bound._buf[0])
    assert [s for s in slots] == [base, base + 8, base + 16]
