"""rtkernels.jit.driver without a GPU: status checking."""

import pytest

from rtkernels.jit import driver


def test_zero_status_passes_and_nonzero_raises_naming_the_call():
    driver.check(0, "cuLaunchKernel")
    with pytest.raises(driver.CudaDriverError, match=r"cuLaunchKernel failed: .*\(700\)"):
        driver.check(700, "cuLaunchKernel")
