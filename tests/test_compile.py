"""Every CUDA source and every template instance the runtime can request compiles through NVRTC.

This runs without a GPU (NVRTC through ``cupy.cuda.nvrtc``) and must execute in CI: it is not
skipped when CuPy is missing, it fails.
"""

import pytest

from rtkernels.methods import kernel_instances
from rtkernels.jit import KernelCompileError, compile_offline, list_sources, load_source

ARCHS = ("sm_80", "sm_90a")  # sm_90a: the wgmma instances compile their Hopper path


def test_every_source_has_instances():
    assert set(kernel_instances()) == set(list_sources()), "a .cu file no method asks for, or a missing one"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(kernel_instances()))
def test_compiles(source, arch):
    names = kernel_instances()[source]
    prog = compile_offline(source, names, arch)
    assert len(prog.cubin) > 1000
    assert set(prog.lowered_names) == set(names)
    for lowered in prog.lowered_names.values():
        assert lowered.startswith("_Z") and lowered.encode() in prog.cubin


def test_header_is_inlined_with_line_markers():
    text = load_source("scan.cu")
    assert '#include "rtk_common.cuh"' not in text
    assert '#line 1 "rtk_common.cuh"' in text and "struct rtk_io" in text
    assert text.count("struct rtk_io<RTK_F32>") == 1


def test_compile_error_names_kernel_and_shows_log():
    bad = "rtk_scan_fwd<7, 64, 32, 16, 128>"  # element type code 7 does not exist
    with pytest.raises(KernelCompileError) as info:
        compile_offline("scan.cu", [bad], "sm_80")
    msg = str(info.value)
    assert bad in msg and "scan.cu" in msg
    assert "incomplete type" in msg or "error" in msg.lower()
