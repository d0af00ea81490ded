import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """Each test run gets its own cache directory (compiled kernels and the autotune store), so
    what this machine tuned or cached never changes which configurations the tests exercise. Set
    once in the controlling process: xdist workers inherit it and share the compiled kernels.
    ``RTKERNELS_TEST_CACHE_DIR`` names a directory to use instead (to keep kernels across runs)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        import tempfile

        os.environ["RTKERNELS_CACHE_DIR"] = (os.environ.get("RTKERNELS_TEST_CACHE_DIR")
                                             or tempfile.mkdtemp(prefix="rtkernels-tests-"))


def _gpu_ready() -> bool:
    from rtkernels.jit import compiler_available

    return torch.cuda.is_available() and compiler_available()


@pytest.fixture(scope="session", autouse=True)
def _compiled_entry():
    """On a GPU, cached calls run through the compiled entry (rtkernels.compiled_call), built up
    front as a long-running process has it after its first half minute; RTKERNELS_COMPILED_CALL=0
    runs the suite on Python's cached path instead."""
    if _gpu_ready():
        from rtkernels import compiled_call

        compiled_call.build(wait=True)
    yield


def pytest_collection_modifyitems(config, items):
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy or PyCUDA (a kernel compiler backend)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
