"""The PyCUDA backend without a GPU and without PyCUDA: backend selection by RTKERNELS_BACKEND, the
ELF symbol reader on cubins NVRTC produces here, the kernel-name lookup (demangled or not), cache
keys apart from NVRTC's, the glue to ``pycuda.compiler`` and GPUArray results (through a stand-in
``pycuda`` package), and, where nvcc is installed, real nvcc compiles whose lowered names equal
NVRTC's. The GPU half is tests/test_gpu_pycuda.py."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
import warnings

import pytest
import torch

import rtkernels
from rtkernels import api
from rtkernels.jit import arrays, backend, compile_offline, compiler_nvcc as cn, jit, kernel_cache as kc

FLEET = ["rtk_fleet_reduce<0>", "rtk_fleet_reduce<1>"]


@pytest.fixture(scope="module")
def fleet_cubin():
    """NVRTC's sm_80 cubin of both fleet instances: two kernels of one template in one image."""
    return compile_offline("fleet.cu", FLEET, "sm_80")


# --------------------------------------------------------------------------------------- ELF

def test_kernel_symbols_of_an_nvrtc_cubin_are_its_lowered_names(fleet_cubin):
    assert sorted(cn.kernel_symbols(fleet_cubin.cubin)) == sorted(fleet_cubin.lowered_names.values())
    symbols = cn.elf_symbols(fleet_cubin.cubin)
    assert any(s.type == 3 for s in symbols)  # the section symbols are read too (STT_SECTION)
    one = compile_offline("chunk/seg_scan.cu", ["rtk_chunk_seg_scan"], "sm_80")
    assert cn.kernel_symbols(one.cubin) == [one.lowered_names["rtk_chunk_seg_scan"]]


def test_without_the_entry_flag_every_global_function_counts(fleet_cubin, monkeypatch):
    monkeypatch.setattr(cn, "_STO_CUDA_ENTRY", 0)  # a toolchain that sets no flag: nothing carries it
    found = cn.kernel_symbols(fleet_cubin.cubin)  # the kernels and the compiler's global helpers
    assert set(fleet_cubin.lowered_names.values()) < set(found)


def test_ptx_entries_are_its_lowered_names():
    ptx = compile_offline("fleet.cu", FLEET, "compute_80")
    assert sorted(cn.ptx_entries(ptx.cubin)) == sorted(ptx.lowered_names.values())


@pytest.mark.parametrize("mangle", [lambda b: b"not an elf" + b, lambda b: b[:40], lambda b: b[:len(b) // 2],
                                    lambda b: b[:4] + b"\x01" + b[5:]])  # junk, header only, truncated, ELF32
def test_anything_but_a_whole_elf64_image_is_a_value_error(fleet_cubin, mangle):
    with pytest.raises(ValueError):
        cn.elf_symbols(mangle(fleet_cubin.cubin))


# --------------------------------------------------------------------------------------- names

K0, K1 = "_Z16rtk_fleet_reduceILi0EEvPKfPN6rtk_ioIXT_EE1TE15rtk_fleet_shape", \
         "_Z16rtk_fleet_reduceILi1EEvPKfPN6rtk_ioIXT_EE1TE15rtk_fleet_shape"
D0, D1 = "void rtk_fleet_reduce<0>(float const*, rtk_io<0>::T*, rtk_fleet_shape)", \
         "void rtk_fleet_reduce<1>(float const*, rtk_io<1>::T*, rtk_fleet_shape)"
SEG = "_Z18rtk_chunk_seg_scanPKfPfS0_S1_PKv18rtk_seg_scan_shape"


def test_demangled_text_picks_the_instance_among_several():
    assert cn.lowered_name("rtk_fleet_reduce<1>", [K0, K1], [D0, D1]) == K1
    assert cn.lowered_name("rtk_fleet_reduce< 0 >", [K0, K1], [D0, D1]) == K0  # spacing does not matter
    assert cn.lowered_name("rtk_chunk_seg_scan", [SEG], ["rtk_chunk_seg_scan(float const*, float*)"]) == SEG
    assert cn.lowered_name("plain_c_kernel", ["plain_c_kernel", K0], None) == "plain_c_kernel"  # extern "C"


def test_the_only_kernel_of_the_template_is_found_without_a_demangler_or_a_matching_spelling():
    assert cn.lowered_name("rtk_fleet_reduce<1>", [K1, SEG], None) == K1
    assert cn.lowered_name("rtk_fleet_reduce<0 + 1>", [K1], [D1]) == K1  # spelled unlike the demangler
    assert cn.lowered_name("rtk_chunk_seg_scan", [K0, SEG], None) == SEG
    with pytest.raises(LookupError, match="kernels: void rtk_fleet_reduce<0>.*, void rtk_fleet_reduce<7>"):
        cn.lowered_name("rtk_fleet_reduce<1>", [K0, K1], [D0, "void rtk_fleet_reduce<7>(float const*)"])
    with pytest.raises(LookupError, match="kernels: none"):
        cn.lowered_name("rtk_fleet_reduce<1>", [], None)
    with pytest.raises(LookupError):  # a template's instance is not the plain function of that name
        cn.lowered_name("rtk_chunk_seg_scan<1>", [SEG], None)


def test_the_parameter_list_is_dropped_however_nested():
    assert cn._signature_free("void f<1, true>(void (*)(int), float const*)") == "voidf<1,true>"
    assert cn._signature_free("g") == "g"


@pytest.mark.skipif(cn.find_demangler() is None, reason="no cu++filt or c++filt here")
def test_the_demangler_reads_nvrtc_names(fleet_cubin):
    kernels = cn.kernel_symbols(fleet_cubin.cubin)
    demangled = cn.demangle(kernels)
    assert demangled is not None and all("rtk_fleet_reduce<" in d for d in demangled)
    for expr, lowered in fleet_cubin.lowered_names.items():
        assert cn.lowered_name(expr, kernels, demangled) == lowered


def test_a_missing_or_failing_demangler_gives_none():
    assert cn.demangle([K0], tool="/nonexistent/c++filt") is None
    assert cn.demangle([K0], tool=sys.executable) is None  # exits with an error on this input


# --------------------------------------------------------------------------------------- source, arch

def test_the_prepared_source_forces_each_instance_and_drops_pragma_once():
    text = cn.prepare_source('#pragma once\nint x;\n  #  pragma   once  \n', ["f<1, 2>", "g"])
    assert "pragma" not in text and "int x;" in text
    assert "(const void*)&f<1, 2>;" in text and "(const void*)&g;" in text
    assert text.count("\n") >= 4  # the pragma lines stay as empty lines: line numbers hold


@pytest.mark.parametrize("target, want", [("sm_90a", ("compute_90a", "sm_90a", "cubin")),
                                          ("sm_80", ("compute_80", "sm_80", "cubin")),
                                          ("compute_121", ("compute_121", None, "ptx"))])
def test_gencode_one_target_per_compile(target, want):
    assert cn.gencode(target) == want


def test_gencode_rejects_other_targets():
    with pytest.raises(ValueError):
        cn.gencode("90a")


# --------------------------------------------------------------------------------------- backend choice

@pytest.fixture
def choose(monkeypatch):
    """Set RTKERNELS_BACKEND and which packages import (a stand-in pycuda.driver), then choose."""
    def run(env, cupy=True, pycuda=False, nvcc=True):
        if env is None:
            monkeypatch.delenv(backend.ENV_BACKEND, raising=False)
        else:
            monkeypatch.setenv(backend.ENV_BACKEND, env)
        monkeypatch.setattr(backend, "cupy_problem", lambda: None if cupy else "CuPy is not installed")
        for name in ("pycuda", "pycuda.driver"):
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            monkeypatch.setitem(sys.modules, name, mod if pycuda else None)
        monkeypatch.setattr(cn, "find_nvcc", lambda: "/opt/cuda/bin/nvcc" if nvcc else None)
        backend.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = backend.selection()
        return chosen, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    yield run
    backend.reset()


@pytest.mark.parametrize("env, cupy, pycuda, nvcc, want", [
    (None, True, True, True, "cupy"),        # auto: CuPy first
    ("", False, True, True, "pycuda"),       # auto: PyCUDA where CuPy is not
    ("auto", False, True, False, None),      # PyCUDA without nvcc cannot compile
    (None, False, False, True, None),        # neither: the torch paths
    ("pycuda", True, True, True, "pycuda"),  # explicit, beside a working CuPy
    (" PyCUDA ", True, True, True, "pycuda"),
    ("cupy", True, True, True, "cupy"),
])
def test_backend_selection(choose, env, cupy, pycuda, nvcc, want):
    chosen, warned = choose(env, cupy, pycuda, nvcc)
    assert chosen.name == want and not warned
    if want is None:
        assert "nvcc" in chosen.reason if pycuda else "not installed" in chosen.reason


@pytest.mark.parametrize("env, cupy, pycuda, missing", [("pycuda", True, False, "PyCUDA is not installed"),
                                                        ("cupy", False, True, "CuPy is not installed"),
                                                        ("nvrtc", True, True, "is not one of cupy, pycuda or auto")])
def test_an_explicit_backend_that_is_not_usable_warns_and_never_falls_back(choose, env, cupy, pycuda, missing):
    chosen, warned = choose(env, cupy, pycuda)
    assert chosen.name is None and missing in chosen.reason
    assert len(warned) == 1 and missing in warned[0] and "torch paths" in warned[0]
    backend.selection()  # cached: no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.selection()


def test_the_gates_follow_the_backend_and_cupy_available_does_not(choose, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    choose("pycuda", cupy=True, pycuda=False)
    jit.cupy_available.cache_clear()
    try:
        assert not backend.compiler_available() and not jit.kernels_available(torch.device("cuda", 0))
        assert jit.cupy_available()  # its meaning is unchanged: CuPy is there
        choose(None, cupy=False, pycuda=True)
        assert backend.compiler_available() and jit.kernels_available(torch.device("cuda", 0))
        assert not jit.kernels_available(torch.device("cpu")) and jit.backend_name() == "pycuda"
    finally:
        jit.cupy_available.cache_clear()


# --------------------------------------------------------------------------------------- cache

def test_cache_keys_and_entries_apart_from_nvrtc(choose, monkeypatch, tmp_path):
    monkeypatch.setattr(cn, "_version_text", lambda nvcc: "Cuda compilation tools, release 13.0, V13.0.88")
    choose(None, cupy=True)
    assert jit._cache_tag() == ""
    nvrtc = kc.cache_key("text", "k<1>", ("-std=c++17",), "sm_90a", compiler=jit._cache_tag())
    assert nvrtc == kc.cache_key("text", "k<1>", ("-std=c++17",), "sm_90a")  # NVRTC's keys as before
    choose("pycuda", pycuda=True)
    tag = jit._cache_tag()
    assert "nvcc" in tag and "V13.0.88" in tag and cn.NVCC_FORMAT in tag
    nvcc = kc.cache_key("text", "k<1>", ("-std=c++17",), "sm_90a", compiler=tag)
    assert nvcc != nvrtc
    monkeypatch.setattr(cn, "_version_text", lambda nvcc: "Cuda compilation tools, release 13.1, V13.1.80")
    assert kc.cache_key("text", "k<1>", ("-std=c++17",), "sm_90a", compiler=jit._cache_tag()) != nvcc

    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    kc.save(nvcc, kc.CachedKernel(b"\x7fELF nvcc", "_Z1kILi1EEvv", "cubin"), (13, 0), "sm_90a", compiler="nvcc")
    meta = json.loads((tmp_path / "kernels" / f"{nvcc}.json").read_text())
    assert (meta["compiler"], meta["version"]) == ("nvcc", "13.0") and "nvrtc" not in meta
    assert kc.load(nvcc).image == b"\x7fELF nvcc" and kc.recorded_nvrtc() is None  # nvrtc.json untouched
    old = {k: v for k, v in meta.items() if k not in ("compiler", "version")}  # an entry of before
    (tmp_path / "kernels" / f"{nvcc}.json").write_text(json.dumps({**old, "nvrtc": "12.9"}))
    assert kc.load(nvcc).lowered == "_Z1kILi1EEvv"


@pytest.mark.parametrize("arch, archs, want", [("sm_90a", (75, 80, 90, 120), ("cubin", "sm_90a")),
                                               ("sm_130", (75, 80, 90, 120), ("ptx", "compute_120")),
                                               ("sm_130", (), ("cubin", "sm_130"))])
def test_the_pycuda_backend_compiles_with_nvcc(choose, monkeypatch, arch, archs, want):
    choose("pycuda", pycuda=True)
    seen = []
    monkeypatch.setattr(cn, "nvcc_archs", lambda: archs)
    monkeypatch.setattr(cn, "nvcc_version", lambda: (13, 0))
    monkeypatch.setattr(cn, "compile_nvcc", lambda src, names, target, opts: seen.append(target) or
                        types.SimpleNamespace(cubin=b"img", lowered_names={names[0]: "_Z1k"}))
    kernel, version = jit._compile("scan.cu", "k<1>", arch, ())
    assert (kernel.kind, seen[0]) == want and version == (13, 0) and kernel.lowered == "_Z1k"


# --------------------------------------------------------------------------------------- a stand-in PyCUDA

@pytest.fixture
def fake_pycuda(monkeypatch):
    """``pycuda``, ``pycuda.driver``, ``pycuda.compiler`` and ``pycuda.gpuarray`` as small stand-ins:
    ``compile`` records its arguments and returns ``fake.image``; GPUArray keeps its arguments."""
    fake = types.SimpleNamespace(calls=[], image=b"", fail=None)
    mods = {name: types.ModuleType(name) for name in ("pycuda", "pycuda.driver", "pycuda.compiler", "pycuda.gpuarray")}

    class CompileError(Exception):
        def __init__(self, msg, command_line, stdout=None, stderr=None):
            super().__init__(f"{msg}\n[stderr:\n{stderr}]")
            self.command_line, self.stdout, self.stderr = command_line, stdout, stderr

    class PointerHolderBase:
        def __int__(self):
            return self.get_pointer()

    class GPUArray:
        def __init__(self, shape, dtype, allocator=None, base=None, gpudata=None, strides=None, order="C"):
            self.shape, self.dtype, self.gpudata, self.strides = shape, dtype, gpudata, strides

    def compile(source, nvcc="nvcc", options=None, keep=False, no_extern_c=False, arch=None, code=None,
                cache_dir=None, include_dirs=None, target="cubin"):
        fake.calls.append(dict(source=source, nvcc=nvcc, options=options, no_extern_c=no_extern_c, arch=arch,
                               code=code, cache_dir=cache_dir, target=target))
        if fake.fail:
            raise CompileError("nvcc compilation of kernel.cu failed", [nvcc], stderr=fake.fail)
        warnings.warn("The CUDA compiler succeeded, but said the following:\nwarning #177-D")
        return fake.image

    mods["pycuda.driver"].CompileError, mods["pycuda.driver"].PointerHolderBase = CompileError, PointerHolderBase
    mods["pycuda.compiler"].compile, mods["pycuda.gpuarray"].GPUArray = compile, GPUArray
    for name, mod in mods.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(cn, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    arrays._torch_memory.cache_clear()
    yield fake
    arrays._torch_memory.cache_clear()


def test_compile_through_pycuda_hands_it_one_target_and_no_cache(fake_pycuda, fleet_cubin):
    fake_pycuda.image = fleet_cubin.cubin  # what nvcc would return: an image holding both instances
    prog = cn.compile_nvcc("fleet.cu", FLEET, "sm_90a", ("-DX=1",), via_pycuda=True)
    call = fake_pycuda.calls[0]
    assert (call["arch"], call["code"], call["target"], call["nvcc"]) == ("compute_90a", "sm_90a", "cubin",
                                                                          "/opt/cuda/bin/nvcc")
    assert call["no_extern_c"] and call["cache_dir"] is False and call["options"] == ["-std=c++17", "-DX=1"]
    assert "(const void*)&rtk_fleet_reduce<1>;" in call["source"]
    assert prog.lowered_names == fleet_cubin.lowered_names and "#177-D" in prog.log


def test_an_nvcc_error_through_pycuda_is_a_kernel_compile_error(fake_pycuda):
    fake_pycuda.fail = "kernel.cu(3): error: identifier \"x\" is undefined"
    with pytest.raises(rtkernels.jit.KernelCompileError, match=r"nvcc failed to compile rtk_fleet_reduce<0>"
                                                               r"(.|\n)*identifier \"x\" is undefined"):
        cn.compile_nvcc("fleet.cu", FLEET[:1], "sm_80", via_pycuda=True)


class _FakeGPUArray:
    """A CUDA array as PyCUDA's GPUArray presents itself (class name and module), over a CPU tensor
    (DLPack, so that torch takes it on this machine)."""

    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<f4", "data": (0, False), "version": 3}

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


_FakeGPUArray.__name__, _FakeGPUArray.__module__ = "GPUArray", "pycuda.gpuarray"


def test_gpuarray_is_told_from_other_cuda_arrays():
    class Sub(_FakeGPUArray):
        pass

    x = torch.zeros(2)
    assert arrays.is_gpuarray(_FakeGPUArray(x)) and arrays.is_gpuarray(Sub(x))
    assert not arrays.is_gpuarray(x) and not arrays.is_gpuarray(types.SimpleNamespace(__cuda_array_interface__={}))


def test_a_result_becomes_a_gpuarray_over_the_same_memory(fake_pycuda):
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).transpose(1, 2)
    a = arrays.as_gpuarray(t)
    assert a.shape == (2, 4, 3) and str(a.dtype) == "float32" and a.strides == (48, 4, 16)
    assert int(a.gpudata) == t.data_ptr() and a.gpudata.tensor.data_ptr() == t.data_ptr()  # no copy, kept alive
    with pytest.raises(TypeError, match="bfloat16"):
        arrays.as_gpuarray(t.to(torch.bfloat16))


def test_gpuarray_inputs_give_gpuarray_outputs(fake_pycuda):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    fq, fk, fv = (_FakeGPUArray(x) for x in (q, k, v))
    assert api._to_torch(fq, "q")[1] == "pycuda"
    out, state = rtkernels.causal_linear_attention(fq, fk, fv, 0.9, return_state=True)
    want, want_state = rtkernels.causal_linear_attention(q, k, v, 0.9, return_state=True)
    assert type(out).__name__ == "GPUArray" and type(state).__name__ == "GPUArray"
    assert torch.equal(out.gpudata.tensor, want) and torch.equal(state.gpudata.tensor, want_state)
    with pytest.raises(TypeError, match="CUDA arrays \\(pycuda\\)"):  # never a silent detach
        rtkernels.causal_linear_attention(fq, fk, fv, 0.9, initial_state=torch.zeros(1, 2, 4, 4, requires_grad=True))


# --------------------------------------------------------------------------------------- real nvcc

needs_nvcc = pytest.mark.skipif(cn.find_nvcc() is None, reason="nvcc is not installed here")


@needs_nvcc
def test_nvcc_compiles_the_wgmma_instance_for_sm90a_with_nvrtcs_lowered_name():
    """The 16-bit chunk kernel's wgmma instance (sm_90a only), straight through nvcc as PyCUDA runs
    it: the image is a cubin whose kernel symbol is the name NVRTC lowers the expression to."""
    from rtkernels.methods import kernel_instances

    expr = next(e for e in kernel_instances()["chunk/fwd16.cu"] if e.endswith(", true>"))  # WG = true
    prog = cn.compile_nvcc("chunk/fwd16.cu", [expr], "sm_90a", via_pycuda=False)
    assert prog.cubin[:4] == b"\x7fELF" and cn.kernel_symbols(prog.cubin) == [prog.lowered_names[expr]]
    assert prog.lowered_names == compile_offline("chunk/fwd16.cu", [expr], "sm_90a").lowered_names
    assert "pragma once" not in prog.log


@needs_nvcc
def test_nvcc_errors_name_the_kernel_and_carry_the_log():
    with pytest.raises(rtkernels.jit.KernelCompileError, match="nvcc failed to compile rtk_fleet_reduce<7>") as info:
        cn.compile_nvcc("fleet.cu", ["rtk_fleet_reduce<7>"], "sm_80", via_pycuda=False)
    assert "error" in info.value.log


@needs_nvcc
def test_nvcc_ptx_for_a_gpu_newer_than_the_compiler(fleet_cubin):
    """PTX (what the driver compiles on a GPU nvcc does not know): NUL-terminated text, and the
    instance found among its ``.entry`` names under NVRTC's lowered name."""
    prog = cn.compile_nvcc("fleet.cu", FLEET[:1], "compute_80", via_pycuda=False)
    assert prog.cubin.endswith(b"\0") and b".entry" in prog.cubin
    assert prog.lowered_names == {FLEET[0]: fleet_cubin.lowered_names[FLEET[0]]}


@needs_nvcc
def test_nvcc_version_and_archs():
    assert cn.nvcc_version() >= (11, 0) and 80 in cn.nvcc_archs()
    assert cn.cache_tag().startswith(cn.NVCC_FORMAT + " nvcc ")


def test_the_autotune_fingerprint_names_the_compiler_of_the_backend(monkeypatch):
    """The store file of a GPU is keyed by the compiler of its kernels: NVRTC's version as before
    with CuPy (existing stores stay valid), "nvcc-X.Y" with PyCUDA (no NVRTC needed there)."""
    from rtkernels.autotune import keys
    from rtkernels.jit import kernel_cache

    props = types.SimpleNamespace(name="Fake GPU", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(kernel_cache, "recorded_nvrtc", lambda: (12, 8))
    monkeypatch.setattr(cn, "nvcc_version", lambda: (13, 0))
    monkeypatch.setattr(backend, "backend_name", lambda: "cupy")
    with_cupy = keys.device_fingerprint(0)
    monkeypatch.setattr(backend, "backend_name", lambda: "pycuda")
    with_pycuda = keys.device_fingerprint(0)
    assert with_cupy["nvrtc"] == "12.8" and with_pycuda["nvrtc"] == "nvcc-13.0"
    assert keys.file_stem(with_cupy) != keys.file_stem(with_pycuda)
