"""Every CUDA source and every template instance the runtime can request compiles through NVRTC,
for each architecture the instances a GPU of it can request.

This runs without a GPU (NVRTC through ``cupy.cuda.nvrtc``) and must execute in CI: it is not
skipped when CuPy is missing, it fails.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rtkernels.instances import by_source, requests
from rtkernels.jit import KernelCompileError, compile_offline, list_sources, load_source, source_dir

ARCHS = ("sm_80", "sm_90a")  # sm_90a: the wgmma instances compile their Hopper path


def all_instances() -> dict[str, list[str]]:
    """Every instance the library can request (:func:`rtkernels.instances.by_source`)."""
    return by_source()


def arch_instances(arch: str) -> dict[str, list[str]]:
    """The instances a GPU of ``arch`` can request, by source: all of them on Hopper (sm_90a), the
    others without the sm_90a-only ones (:func:`rtkernels.instances.requests`), which never run
    there (their fallback bodies took 203 s of CPU to compile, about 100 s of CI on two cores)."""
    if arch == "sm_90a":
        return all_instances()
    out: dict[str, list[str]] = {}
    for source, name, _ in requests(arch):
        out.setdefault(source, []).append(name)
    return out


#: (source, arch) for every source with an instance that architecture can request
PAIRS = [(source, arch) for arch in ARCHS for source in sorted(arch_instances(arch))]


def test_every_source_has_instances():
    assert set(all_instances()) == set(list_sources()), "a .cu file no method asks for, or a missing one"


def test_sm80_compiles_all_but_the_hopper_only_instances():
    """sm_80 leaves out exactly the instances that carry sm_90a options (the wgmma and tensor-copy
    ones), and the forward keeps instances that run there."""
    hopper_only = {(s, n) for s, n, opts in requests("sm_90") if opts}
    every = {(s, n) for s, names in all_instances().items() for n in names}
    ampere = {(s, n) for s, names in arch_instances("sm_80").items() for n in names}
    assert hopper_only and ampere == every - hopper_only
    assert arch_instances("sm_80").get("chunk/fwd16.cu")


#: Instances per NVRTC program: a source's list is compiled in parts of at most this many, so that
#: CI's two cores share its largest source (chunk/fwd16.cu, about 100 instances) instead of one core
#: compiling it while the other has finished everything else.
PART = 25


@pytest.fixture(scope="module")
def compiled(request):
    """The (source, arch) pairs of the session's selected ``test_compiles`` cases, each compiled in
    parts of at most :data:`PART` instances on as many threads as there are cores, largest part
    first (NVRTC releases the GIL). Maps each pair to its parts' futures."""
    pairs = {(item.callspec.params["source"], item.callspec.params["arch"]) for item in request.session.items
             if getattr(item, "originalname", None) == "test_compiles"}
    jobs = [(pair, names[i:i + PART]) for pair in pairs
            for names in [arch_instances(pair[1])[pair[0]]] for i in range(0, len(names), PART)]
    jobs.sort(key=lambda job: -len(load_source(job[0][0])) * len(job[1]))
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    futures: dict[tuple[str, str], list] = {pair: [] for pair in pairs}
    for (source, arch), names in jobs:
        futures[(source, arch)].append((names, pool.submit(compile_offline, source, names, arch)))
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("source,arch", PAIRS)
def test_compiles(source, arch, compiled):
    parts = compiled[(source, arch)]
    assert sorted(n for names, _ in parts for n in names) == sorted(arch_instances(arch)[source])
    for names, future in parts:
        prog = future.result()
        assert len(prog.cubin) > 1000
        assert set(prog.lowered_names) == set(names)
        for lowered in prog.lowered_names.values():
            assert lowered.startswith("_Z") and lowered.encode() in prog.cubin


def test_header_is_inlined_with_line_markers():
    text = load_source("scan.cu")
    assert "#include" not in text
    assert '#line 1 "include/types.cuh"' in text and "struct rtk_io" in text
    assert text.count("struct rtk_io<RTK_F32>") == 1


def test_includes_resolve_against_the_including_file_once_each():
    text = load_source("chunk/fwd16.cu")  # includes ../include/*.cuh and chunk/*.cuh, types.cuh via several
    assert "#include" not in text
    assert text.count('#line 1 "include/types.cuh"') == 1 and '#line 1 "chunk/loader.cuh"' in text
    assert text.count("struct rtk_io<RTK_F32>") == 1


def _sources() -> list[Path]:
    return sorted(source_dir().rglob("*.cu"))


def test_one_kernel_per_file_and_no_lab_material():
    """Each .cu file holds one __global__ kernel and at most about 600 lines; no probe macros or
    experiment knobs anywhere in the kernel sources."""
    for path in _sources():
        text = path.read_text()
        assert text.count("__global__") == 1, path
        assert len(text.splitlines()) <= 600, path
    for path in [*_sources(), *source_dir().rglob("*.cuh")]:
        text = path.read_text()
        assert "RTK_PROBE" not in text and "KUNROLL" not in text, path


def test_compile_error_names_kernel_and_shows_log():
    bad = "rtk_scan_fwd<7, 64, 32, 16, 128>"  # element type code 7 does not exist
    with pytest.raises(KernelCompileError) as info:
        compile_offline("scan.cu", [bad], "sm_80")
    msg = str(info.value)
    assert bad in msg and "scan.cu" in msg
    assert "incomplete type" in msg or "error" in msg.lower()


def test_python_builds_the_kernel_parameters_in_their_declared_order():
    """fwd_args gives the seven pointer parameters of RTK_FWD_POINTERS, then the fields of
    rtk_fwd_shape in the order the header declares them (8 bytes each: ints, the scale a float)."""
    import re

    import torch

    from rtkernels.decay import LogDecay
    from rtkernels.methods._launch import FWD_FIELDS, FWD_POINTERS, fwd_args

    text = (source_dir() / "include" / "params.cuh").read_text()
    macro = re.search(r"#define RTK_FWD_POINTERS\(ELEM\)(.*?)\n\n", text, re.S).group(1)
    pointers = re.findall(r"\*\s*__restrict__\s+(\w+)", macro)
    body = re.search(r"struct rtk_fwd_shape \{(.*?)\};", text, re.S).group(1)
    fields = [name for decl in body.split(";") for name in re.findall(r"(\w+)\s*(?:,|$)", decl.strip())]
    assert len(pointers) == FWD_POINTERS and tuple(pointers + fields) == FWD_FIELDS
    x = torch.zeros(2, 3, 5, 4)
    args = fwd_args(x, x, x, x, LogDecay(x.device, host=(0.0,) * 3), None, None, 0.5)
    assert len(args) == len(FWD_FIELDS) and args[FWD_FIELDS.index("scale")] == 0.5
    assert all(type(a) is int for name, a in zip(FWD_FIELDS, args) if name != "scale")
