"""Compiling rtkernels' CUDA sources with NVRTC.

Two routes share the same prepared source text (:func:`rtkernels.runtime.sources.load_source`) and
the same options (:data:`BASE_OPTIONS`):

* :func:`compile_offline` drives NVRTC directly through ``cupy.cuda.nvrtc``. It needs neither a GPU
  nor a driver, so CI uses it to compile every kernel configuration for sm_80 and sm_90.
* :func:`rtkernels.runtime.jit.get_function` compiles through ``cupy.RawModule`` for the GPU at
  hand; CuPy caches the result on disk, keyed on the full text (headers included, since they are
  inlined), the options, the architecture and the NVRTC version.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sources import load_source

__all__ = ["BASE_OPTIONS", "KernelCompileError", "CompiledProgram", "compile_offline", "nvrtc_version"]

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
    cubin: bytes
    lowered_names: dict[str, str]
    log: str


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads."""
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())  # type: ignore[return-value]


def compile_offline(
    source: str, name_expressions: list[str] | tuple[str, ...], arch: str = "sm_90",
    extra_options: tuple[str, ...] = (),
) -> CompiledProgram:
    """Compile ``cuda_src/<source>`` for ``arch`` (e.g. ``"sm_80"``) with no GPU needed.

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
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledProgram(source, arch, bytes(cubin), lowered, log)
