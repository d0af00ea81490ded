"""Compiling rtkernels' CUDA sources with nvcc: the PyCUDA backend's compiler.

:func:`compile_nvcc` takes the same inlined source text as NVRTC
(:func:`rtkernels.jit.sources.load_source`) and returns the same :class:`CompiledProgram` as
:func:`rtkernels.jit.compiler.compile_offline`, so the kernel cache and the driver path take
either. It needs no GPU and no CUDA context: nvcc runs as a program.

Three things differ from NVRTC:

- **Instances.** nvcc has no name expressions. Each requested template instance is made to exist
  by taking its address in a host variable appended to the text
  (``static const void* rtk_instance_0 = (const void*)&rtk_scan_fwd<0, 64, 32, 16, 256>;``): the
  front end then instantiates the kernel and emits it into the device code, as a ``<<<...>>>``
  launch would. This needs nothing but the expression, not the kernel's parameter types (which an
  explicit ``template __global__ void f<...>(...);`` instantiation would).
- **Lowered names.** The mangled name is read back from the image: the kernel symbols of the
  cubin's ELF symbol table (:func:`elf_symbols`, pure Python) or the ``.entry`` lines of PTX. The
  instance is found by :func:`lowered_name`: first by demangling (``cu++filt``, which ships with
  the toolkit, or binutils' ``c++filt``: CUDA mangles by the Itanium C++ ABI, which both decode)
  and comparing the text with the expression, then, when no demangler is found or the expression
  is spelled differently from the demangler's output (``1 + 1``, an enumerator's name), by being
  the only kernel of that template in the image. rtkernels' sources hold one ``__global__``
  template each and instantiate nothing themselves, so the forced instance is that only kernel;
  a second instance of the same template (where demangling is what tells them apart) and a kernel
  missing from the image are errors naming the kernels found. Reimplementing Itanium mangling for
  the expressions' grammar was the alternative; it would have to follow every argument kind
  (types, enums, unsigned literals) the demangler already handles.
- **Architecture.** A cubin for ``sm_XY[a]`` is asked for as ``-arch compute_XY[a] -code sm_XY[a]``
  (what ``-gencode=arch=compute_XY[a],code=sm_XY[a]`` means): one target, which ``--cubin``
  requires, and never an ``sm_90`` pass over the ``sm_90a`` (wgmma) code. PTX for ``compute_XY``.

How nvcc is run: through ``pycuda.compiler.compile`` (the PyCUDA backend) or directly by
:func:`run_nvcc`, with the same command line (``nvcc --cubin <options> -arch A -code C
kernel.cu`` in a temporary directory). PyCUDA's own compile cache is turned off: the kernel lands
in rtkernels' cache (:mod:`rtkernels.jit.kernel_cache`) under a key that names nvcc and its
version (:func:`cache_tag`), so NVRTC's and nvcc's images never mix. The architecture is always
passed: with none, PyCUDA adds the current context's device (``-arch sm_90`` beside ours).
nvcc needs its host compiler (gcc) even for a cubin; it preprocesses with it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .compiler import BASE_OPTIONS, CompiledProgram, KernelCompileError
from .sources import load_source

__all__ = ["NvccCompileError", "find_tool", "find_nvcc", "find_demangler", "nvcc_version", "nvcc_archs",
           "cache_tag", "prepare_source", "gencode", "run_nvcc", "run_pycuda", "ElfSymbol", "elf_symbols",
           "kernel_symbols", "ptx_entries", "demangle", "lowered_name", "compile_nvcc"]

#: Changes when what this module hands nvcc changes (the appended lines, the options): part of
#: :func:`cache_tag`, so such a change never reuses an older image.
NVCC_FORMAT = "rtkernels-nvcc-1"

_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)


class NvccCompileError(KernelCompileError):
    """nvcc rejected a source (a :class:`KernelCompileError`, with nvcc's output as ``log``)."""

    def __init__(self, source: str, names: Sequence[str], log: str):
        super().__init__(source, list(names), log)
        self.args = (f"nvcc failed to compile {', '.join(self.names)} from {source}:\n{log.strip()}",)


# --------------------------------------------------------------------------------------- tools

def find_tool(name: str) -> Optional[str]:
    """The path of the CUDA toolkit program ``name``: on PATH, else in ``$CUDA_HOME/bin``,
    ``$CUDA_PATH/bin`` or ``/usr/local/cuda/bin``; None when absent."""
    found = shutil.which(name)
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(Path(root, "bin", name), os.X_OK):
            return str(Path(root, "bin", name))
    return None


@functools.lru_cache(maxsize=1)
def find_nvcc() -> Optional[str]:
    """nvcc's path (see :func:`find_tool`), or None."""
    return find_tool("nvcc")


@functools.lru_cache(maxsize=1)
def find_demangler() -> Optional[str]:
    """``cu++filt`` (next to nvcc, else where :func:`find_tool` looks), else ``c++filt``; or None."""
    nvcc = find_nvcc()
    if nvcc:  # nvcc may be a wrapper script elsewhere: also look next to the real file
        for d in dict.fromkeys((Path(nvcc).parent, Path(nvcc).resolve().parent)):
            if os.access(d / "cu++filt", os.X_OK):
                return str(d / "cu++filt")
    return find_tool("cu++filt") or shutil.which("c++filt")


def _nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (looked on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin and "
                                "/usr/local/cuda/bin); the PyCUDA backend compiles with it")
    return nvcc


@functools.lru_cache(maxsize=None)
def _version_text(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return " ".join(lines[-2:])  # "Cuda compilation tools, release 13.0, V13.0.88 Build cuda_13.0.r13.0/..."


def nvcc_version() -> tuple[int, int]:
    """(major, minor) of nvcc's release, e.g. (13, 0)."""
    m = re.search(r"release (\d+)\.(\d+)", _version_text(_nvcc()))
    if m is None:
        raise RuntimeError(f"cannot read nvcc's version from {_version_text(_nvcc())!r}")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=None)
def _archs(nvcc: str) -> tuple[int, ...]:
    r = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)
    return tuple(sorted({int(m) for m in re.findall(r"sm_(\d+)", r.stdout)})) if r.returncode == 0 else ()


def nvcc_archs() -> tuple[int, ...]:
    """The SM versions nvcc can emit a cubin for, e.g. (75, 80, ..., 121); () when nvcc cannot list
    them (then every architecture is tried as a cubin)."""
    return _archs(_nvcc())


def cache_tag() -> str:
    """What the kernel cache key adds for an nvcc compile: this module's format and nvcc's full
    version (release and build), so that another nvcc, or NVRTC, never reuses the image."""
    return f"{NVCC_FORMAT} nvcc {_version_text(_nvcc())}"


# --------------------------------------------------------------------------------------- compile

def prepare_source(text: str, name_expressions: Sequence[str]) -> str:
    """The text nvcc compiles: ``text`` (an inlined source) without ``#pragma once`` (each header
    is in it once already; the host preprocessor warns about the pragma in a main file), and with
    one line per expression that takes the instance's address so that it is compiled."""
    body = _PRAGMA_ONCE.sub("", text)
    forced = "".join(f"static const void* const rtk_instance_{i} [[maybe_unused]] = (const void*)&{expr};\n"
                     for i, expr in enumerate(name_expressions))
    return f'{body}\n#line 1 "<rtkernels instances>"\n{forced}'


def gencode(target: str) -> tuple[str, Optional[str], str]:
    """(``-arch`` value, ``-code`` value or None, nvcc output kind) for a target: ``"sm_90a"`` ->
    ``("compute_90a", "sm_90a", "cubin")``, ``"compute_90"`` -> ``("compute_90", None, "ptx")``."""
    if target.startswith("compute_"):
        return target, None, "ptx"
    if not target.startswith("sm_"):
        raise ValueError(f"target must be sm_XY[a] (a cubin) or compute_XY (PTX), got {target!r}")
    return "compute_" + target[3:], target, "cubin"


def _command(nvcc: str, options: Sequence[str], arch: str, code: Optional[str], kind: str) -> list[str]:
    """The command line ``pycuda.compiler.compile`` runs for these arguments (less its include)."""
    return [nvcc, f"--{kind}", *options, "-arch", arch, *(["-code", code] if code else []), "kernel.cu"]


def run_nvcc(nvcc: str, text: str, options: Sequence[str], arch: str, code: Optional[str],
             kind: str) -> tuple[bytes, str]:
    """Run nvcc on ``text`` in a temporary directory: (the image, nvcc's output). Raises
    :class:`subprocess.CalledProcessError` carrying the output when nvcc fails."""
    with tempfile.TemporaryDirectory(prefix="rtkernels-nvcc-") as d:
        Path(d, "kernel.cu").write_text(text)
        cmd = _command(nvcc, options, arch, code, kind)
        r = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
        out = Path(d, f"kernel.{kind}")
        if r.returncode != 0 or not out.is_file():
            raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
        return out.read_bytes(), r.stdout + r.stderr


def run_pycuda(nvcc: str, text: str, options: Sequence[str], arch: str, code: Optional[str],
               kind: str) -> tuple[bytes, str]:
    """:func:`run_nvcc` through ``pycuda.compiler.compile`` (its cache off, no ``extern "C"``
    wrapping: the sources are C++ templates). PyCUDA reports nvcc's output as warnings; they are
    returned as the log, as NVRTC's log is."""
    from pycuda.compiler import compile as pycuda_compile
    from pycuda.driver import CompileError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            image = pycuda_compile(text, nvcc=nvcc, options=list(options), no_extern_c=True, arch=arch, code=code,
                                   cache_dir=False, target=kind)
        except CompileError as exc:
            # its message holds the command line and nvcc's stdout and stderr
            raise subprocess.CalledProcessError(1, getattr(exc, "command_line", None) or [nvcc], None,
                                                str(exc)) from None
    return bytes(image), "\n".join(str(w.message) for w in caught)


def compile_nvcc(source: str, name_expressions: Sequence[str], arch: str = "sm_90",
                 extra_options: tuple[str, ...] = (), *, via_pycuda: Optional[bool] = None) -> CompiledProgram:
    """Compile ``cuda_src/<source>`` with nvcc for ``arch`` (``"sm_90a"``: a cubin; ``"compute_90"``:
    PTX), no GPU needed: :func:`rtkernels.jit.compiler.compile_offline`'s contract with nvcc.

    ``via_pycuda``: run nvcc through ``pycuda.compiler`` (True) or directly (False); None: PyCUDA
    when it imports. Raises :class:`NvccCompileError` with nvcc's output when the source does not
    compile, and a ``LookupError`` when an instance cannot be found in the image.
    """
    if via_pycuda is None:
        import importlib.util

        via_pycuda = importlib.util.find_spec("pycuda") is not None
    nvcc = _nvcc()
    text = prepare_source(load_source(source), name_expressions)
    march, code, kind = gencode(arch)
    run = run_pycuda if via_pycuda else run_nvcc
    try:
        image, log = run(nvcc, text, (*BASE_OPTIONS, *extra_options), march, code, kind)
    except subprocess.CalledProcessError as exc:
        raise NvccCompileError(source, list(name_expressions), f"{exc.stdout or ''}{exc.stderr or ''}") from None
    kernels = ptx_entries(image) if kind == "ptx" else kernel_symbols(image)
    demangled = demangle(kernels)
    lowered = {e: lowered_name(e, kernels, demangled) for e in name_expressions}
    if kind == "ptx":
        image = image.rstrip(b"\0") + b"\0"  # the driver takes PTX as a NUL-terminated string
    return CompiledProgram(source, arch, image, lowered, log)


# --------------------------------------------------------------------------------------- ELF

#: ELF constants used here (the System V ABI; STO_CUDA_ENTRY: NVIDIA's flag of a kernel).
_SHT_SYMTAB, _STT_FUNC, _STB_LOCAL, _STO_CUDA_ENTRY = 2, 2, 0, 0x10
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")


@dataclass(frozen=True)
class ElfSymbol:
    """One entry of an ELF symbol table: its name, type (``st_info & 15``), binding
    (``st_info >> 4``), ``st_other`` and section index."""

    name: str
    type: int
    bind: int
    other: int
    section: int


def _cstr(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    return data[offset:end if end >= 0 else len(data)].decode("utf-8", "replace")


def elf_symbols(image: bytes) -> list[ElfSymbol]:
    """Every symbol of every ``SHT_SYMTAB`` section of a 64-bit little-endian ELF image (a cubin),
    names read from the string table the section links. ValueError for anything else or for a
    truncated image."""
    data = bytes(image)
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    *_, shoff, _, _, _, _, shentsize, shnum, _ = _EHDR.unpack_from(data)

    def section(i: int) -> tuple:
        at = shoff + i * shentsize
        if shentsize < _SHDR.size or at < 0 or at + _SHDR.size > len(data):
            raise ValueError(f"truncated ELF image: section header {i} lies outside it")
        return _SHDR.unpack_from(data, at)

    if shnum == 0 and shoff:  # more than 0xff00 sections: the count is in section 0's sh_size
        shnum = section(0)[5]
    out: list[ElfSymbol] = []
    for i in range(shnum):
        _, kind, _, _, offset, size, link, _, _, entsize = section(i)
        if kind != _SHT_SYMTAB:
            continue
        _, _, _, _, str_offset, str_size, _, _, _, _ = section(link)
        entsize = entsize or _SYM.size
        if offset + size > len(data) or str_offset + str_size > len(data) or entsize < _SYM.size:
            raise ValueError("truncated ELF image: a symbol table or its strings lie outside it")
        names = data[str_offset:str_offset + str_size]
        for at in range(offset, offset + size - _SYM.size + 1, entsize):
            name, info, other, shndx, _, _ = _SYM.unpack_from(data, at)
            out.append(ElfSymbol(_cstr(names, name), info & 15, info >> 4, other, shndx))
    return out


def kernel_symbols(image: bytes) -> list[str]:
    """The names of the kernels in a cubin: function symbols that are not local and carry
    ``STO_CUDA_ENTRY`` (device functions that were not inlined are local, or lack the flag). Should
    no symbol carry the flag (a toolchain that does not set it), every non-local function."""
    funcs = [s for s in elf_symbols(image) if s.type == _STT_FUNC and s.bind != _STB_LOCAL and s.name]
    entries = [s for s in funcs if s.other & _STO_CUDA_ENTRY]
    return list(dict.fromkeys(s.name for s in (entries or funcs)))


def ptx_entries(ptx: bytes) -> list[str]:
    """The kernels (``.entry`` names) of PTX text."""
    text = bytes(ptx).rstrip(b"\0").decode("utf-8", "replace")
    return list(dict.fromkeys(re.findall(r"\.entry\s+([^\s(]+)", text)))


# --------------------------------------------------------------------------------------- names

def demangle(names: Sequence[str], tool: Optional[str] = None) -> Optional[list[str]]:
    """``names`` demangled, one per name, by ``tool`` (default :func:`find_demangler`) in one run;
    None when there is no demangler or it fails (callers then match without it)."""
    tool = tool or find_demangler()
    if tool is None or not names:
        return None if tool is None else []
    try:
        r = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.splitlines()
    return lines if r.returncode == 0 and len(lines) == len(names) else None


def _signature_free(demangled: str) -> str:
    """A demangled function name without its parameter list and spaces:
    ``"void f<1, true>(float const*)"`` -> ``"voidf<1,true>"``."""
    text = demangled.strip()
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i]
                break
    return re.sub(r"\s+", "", text)


def _template_name(expression: str) -> str:
    return expression.split("<", 1)[0].strip()


def lowered_name(expression: str, kernels: Sequence[str], demangled: Optional[Sequence[str]] = None) -> str:
    """The mangled name, among ``kernels`` (an image's kernel symbols), of the instance
    ``expression`` (e.g. ``"rtk_scan_fwd<0, 64, 32, 16, 256>"`` or ``"rtk_chunk_seg_scan"``).

    In order: a symbol equal to the expression (``extern "C"``); the one kernel whose demangled
    name (``demangled``, parallel to ``kernels``; None without a demangler) reads as the
    expression once spaces and the parameter list are dropped (``void`` before a template's name
    allowed); the one kernel of the expression's template (a global-namespace name, mangled
    ``_Z<length><name>``, followed by template arguments exactly when the expression has them).
    LookupError naming the kernels when none or several remain.
    """
    if expression in kernels:
        return expression
    want = re.sub(r"\s+", "", expression)
    if demangled is not None:
        hits = [k for k, d in zip(kernels, demangled) if _signature_free(d) in (want, "void" + want)]
        if len(hits) == 1:
            return hits[0]
    base = _template_name(expression)
    prefix = f"_Z{len(base)}{base}"
    templated = "<" in expression
    hits = [k for k in kernels if k.startswith(prefix) and (k[len(prefix):len(prefix) + 1] == "I") == templated]
    if len(hits) == 1:
        return hits[0]
    shown = ", ".join(d or k for k, d in zip(kernels, demangled or [None] * len(kernels))) or "none"
    raise LookupError(f"cannot tell which kernel of the image is {expression!r}; its kernels: {shown}")
