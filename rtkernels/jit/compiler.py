"""Compiling rtkernels' CUDA sources with NVRTC.

:func:`compile_offline` drives NVRTC through CuPy's binding (``cupy.cuda.nvrtc``) on the prepared
source text (:func:`rtkernels.jit.sources.load_source`) with :data:`BASE_OPTIONS`. It needs
neither a GPU nor a driver, so CI uses it to compile every kernel configuration for sm_80 and
sm_90a; :func:`rtkernels.jit.jit.get_function` uses it for the GPU at hand and keeps the
result in rtkernels' kernel cache (:mod:`rtkernels.jit.kernel_cache`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .sources import load_source

__all__ = ["BASE_OPTIONS", "KernelCompileError", "CompiledProgram", "compile_offline", "nvrtc_version",
           "nvrtc_archs", "whole_cubin"]

#: NVRTC options of every rtkernels compile (the architecture is added per route).
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)


class KernelCompileError(RuntimeError):
    """A kernel failed to compile; the message names the kernel and carries NVRTC's log."""

    def __init__(self, source: str, names: list[str] | tuple[str, ...], log: str):
        self.source = source
        self.names = tuple(names)
        self.log = log
        super().__init__(
            f"NVRTC failed to compile {', '.join(self.names)} from {source}:\n{log.strip()}"
        )


@dataclass(frozen=True)
class CompiledProgram:
    """Result of :func:`compile_offline`."""

    source: str
    arch: str
    cubin: bytes  # the image: a cubin for sm_XX, PTX text (NUL-terminated) for compute_XX
    lowered_names: dict[str, str]
    log: str


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads."""
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())  # type: ignore[return-value]


def nvrtc_archs() -> tuple[int, ...]:
    """The SM versions NVRTC can emit a cubin for, e.g. (75, 80, 86, 89, 90, 100, ...)."""
    from cupy.cuda import nvrtc

    return tuple(int(x) for x in nvrtc.getSupportedArchs())


def whole_cubin(image: bytes) -> bytes:
    """``image`` with the last byte that CuPy's ``nvrtc.getCUBIN`` drops put back (a zero).

    CuPy treats the cubin like PTX text and strips what it takes for a NUL terminator, so its
    image is one byte short of ``nvrtcGetCUBINSize``. The driver still loads it (the byte dropped
    is the top byte of the last header table's last 64-bit field, 0, and a Python ``bytes`` ends
    in a NUL), but nvdisasm and cuobjdump reject the file. An ELF64 image that is exactly one
    byte short of the end of its section or program header table gets the zero back; anything
    else is returned as it is.
    """
    if len(image) < 64 or image[:5] != b"\x7fELF\x02":
        return image
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<4H", image, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + b"\0" if end == len(image) + 1 else image


def compile_offline(
    source: str, name_expressions: list[str] | tuple[str, ...], arch: str = "sm_90",
    extra_options: tuple[str, ...] = (),
) -> CompiledProgram:
    """Compile ``cuda_src/<source>`` for ``arch`` (e.g. ``"sm_80"``; ``"compute_90"`` gives PTX)
    with no GPU needed.

    Every entry of ``name_expressions`` (e.g. ``"rtk_scan_fwd<0, 64, 32, 16, 256>"``) is
    instantiated; the returned program maps each to its lowered (mangled) name.
    """
    from cupy.cuda import nvrtc

    text = load_source(source)
    options = [*BASE_OPTIONS, *extra_options, f"--gpu-architecture={arch}"]
    prog = nvrtc.createProgram(text, source, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(source, list(name_expressions), f"{exc}\n{log}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in name_expressions}
        if arch.startswith("compute_"):
            ptx = nvrtc.getPTX(prog)
            cubin = (ptx.encode() if isinstance(ptx, str) else bytes(ptx)).rstrip(b"\0") + b"\0"
        else:
            cubin = whole_cubin(bytes(nvrtc.getCUBIN(prog)))
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledProgram(source, arch, bytes(cubin), lowered, log)
