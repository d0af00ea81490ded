"""Just-in-time compilation and launching of rtkernels' kernels on torch tensors.

Kernels are compiled at first use for the device of the tensors they run on, by the compiler
backend of :mod:`rtkernels.jit.backend`: NVRTC through CuPy's binding
(:func:`~rtkernels.jit.compiler.compile_offline`), or nvcc through PyCUDA
(:func:`~rtkernels.jit.compiler_nvcc.compile_nvcc`). They are kept on disk by
:mod:`rtkernels.jit.kernel_cache`, loaded with the CUDA driver (:mod:`rtkernels.jit.driver`:
ctypes on libcuda), memoised per (device, source, template
instance, options), and launched on torch's current stream of that device. Pointers are passed as
Python ints (``tensor.data_ptr()``), so a launch wraps no tensor and copies nothing. A process whose
kernels are all in the disk cache never imports CuPy or loads NVRTC (the PyCUDA backend runs
``nvcc --version`` once, for the cache key).
"""

from __future__ import annotations

import functools
import struct
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from . import backend, driver, kernel_cache
from .backend import backend_name, compiler_available
from .compiler import BASE_OPTIONS
from .sources import load_source
from .tensor_map import TensorMaps

__all__ = ["cupy_available", "compiler_available", "backend_name", "kernels_available", "get_function", "launch",
           "Kernel", "BoundLaunch", "compile_log"]

_lock = threading.Lock()
_compile_log: list[dict[str, Any]] = []
_functions: dict[tuple[int, str, str, tuple[str, ...]], Any] = {}
_ARCH_OPTIONS = ("-arch=", "--gpu-architecture=")


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """True when CuPy is installed (its CUDA driver binding imports) and torch sees a CUDA device.
    CuPy itself is imported only when a kernel has to be compiled. Whether the kernels can run is
    :func:`compiler_available` (CuPy or PyCUDA, as ``$RTKERNELS_BACKEND`` picks)."""
    return backend.cupy_problem() is None and backend.torch_sees_gpu()


def kernels_available(device: torch.device) -> bool:
    """True when rtkernels' CUDA kernels can run on ``device``: a CUDA device and a usable compiler
    backend (:func:`compiler_available`)."""
    return device.type == "cuda" and compiler_available()


def _split_arch(extra_options: tuple[str, ...], default: str) -> tuple[str, tuple[str, ...]]:
    """(architecture, options without it): an ``-arch=`` option names it (e.g. sm_90a for the
    wgmma kernels), else ``default``."""
    arch = next((o.split("=", 1)[1] for o in extra_options if o.startswith(_ARCH_OPTIONS)), default)
    return arch, tuple(o for o in extra_options if not o.startswith(_ARCH_OPTIONS))


def _target(device_index: int, extra_options: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(architecture, options without it): an ``-arch=`` option names it, else the device's
    compute capability."""
    if any(o.startswith(_ARCH_OPTIONS) for o in extra_options):
        return _split_arch(extra_options, "")
    major, minor = torch.cuda.get_device_capability(device_index)
    return _split_arch(extra_options, f"sm_{major}{minor}")


def _cache_key(source: str, name_expression: str, arch: str, opts: tuple[str, ...]) -> str:
    """The disk-cache key of one instance (what :func:`get_function` and :func:`precompile` look up)."""
    return kernel_cache.cache_key(load_source(source), name_expression, (*BASE_OPTIONS, *opts), arch,
                                  compiler=_cache_tag())


def _compile(source: str, name_expression: str, arch: str,
             opts: tuple[str, ...]) -> tuple[kernel_cache.CachedKernel, tuple[int, int]]:
    """The backend's compiler (NVRTC, or nvcc for PyCUDA): a cubin for ``arch``; PTX for the newest
    architecture the compiler knows when it does not know ``arch`` (a GPU newer than the compiler:
    the driver compiles the PTX). Returns the kernel and the compiler's (major, minor)."""
    if backend_name() == "pycuda":
        from . import compiler_nvcc as c

        compile_, archs, version = c.compile_nvcc, c.nvcc_archs, c.nvcc_version
    else:
        from . import compiler as c

        compile_, archs, version = c.compile_offline, c.nvrtc_archs, c.nvrtc_version
    sm = int("".join(ch for ch in arch.split("_", 1)[1] if ch.isdigit()))
    kind, target = "cubin", arch
    known = archs()
    if known and sm not in known:  # () : the compiler cannot list them; try the cubin
        kind, target = "ptx", f"compute_{max((x for x in known if x <= sm), default=min(known))}"
    prog = compile_(source, [name_expression], target, opts)
    return kernel_cache.CachedKernel(prog.cubin, prog.lowered_names[name_expression], kind), version()


def _cache_tag() -> str:
    """What the kernel cache key adds for the backend's compiler: nothing for NVRTC (the keys of
    existing caches stay valid), nvcc's format and version for PyCUDA."""
    if backend_name() == "pycuda":
        from .compiler_nvcc import cache_tag

        return cache_tag()
    return ""


def get_function(source: str, name_expression: str, device_index: int,
                 extra_options: tuple[str, ...] = (), dynamic_smem: int = 0) -> "Kernel":
    """The compiled kernel ``name_expression`` of ``cuda_src/<source>`` on device ``device_index``.

    Loads it from the kernel cache or compiles it (and caches it), and memoises the function.
    ``dynamic_smem``: bytes of dynamic shared memory the kernel will be launched with; above the
    default 48 KiB the function's limit is raised once here. Raises :class:`KernelCompileError`
    with the compiler's log (NVRTC's or nvcc's) when the source does not compile.
    """
    key = (device_index, source, name_expression, extra_options)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            t0 = time.perf_counter()
            arch, opts = _target(device_index, extra_options)
            compiler = "nvcc" if backend_name() == "pycuda" else "nvrtc"
            ckey = _cache_key(source, name_expression, arch, opts)
            cached = kernel_cache.load(ckey)
            from_cache = cached is not None
            if cached is None:
                cached, version = _compile(source, name_expression, arch, opts)
                kernel_cache.save(ckey, cached, version, arch, compiler=compiler)
            fn = Kernel.load(cached, device_index, dynamic_smem)
            _compile_log.append({"source": source, "name": name_expression, "device": device_index,
                                 "options": list(extra_options), "from_cache": from_cache, "compiler": compiler,
                                 "seconds": time.perf_counter() - t0})
            _functions[key] = fn
    return fn


def precompile(requests: Sequence[tuple[str, str, tuple[str, ...]]], arch: str, jobs: int = 0,
               on_done: Optional[Callable[[str, str, str], None]] = None) -> dict[str, list]:
    """Compile every ``(source, name expression, extra options)`` of ``requests`` for ``arch``
    (e.g. ``"sm_90"``; an ``-arch=`` option of a request wins, as in :func:`get_function`) into the
    disk cache, on ``jobs`` threads (0: one per core; NVRTC and nvcc run outside the GIL). Needs
    no GPU. An instance already cached is not compiled again. ``on_done(source, name, what)`` is
    called as each finishes (``what``: "compiled", "cached" or the error).

    Returns ``{"compiled": [...], "cached": [...], "failed": [(name, error), ...]}`` (name
    expressions). A later process on a GPU of that architecture finds these kernels in the cache,
    as :func:`get_function` keys them, and compiles nothing."""
    import concurrent.futures
    import os

    compiler = "nvcc" if backend_name() == "pycuda" else "nvrtc"

    def one(request: tuple[str, str, tuple[str, ...]]) -> str:
        source, name, extra = request
        a, opts = _split_arch(tuple(extra), arch)
        key = _cache_key(source, name, a, opts)
        if kernel_cache.load(key) is not None:
            return "cached"
        cached, version = _compile(source, name, a, opts)
        kernel_cache.save(key, cached, version, a, compiler=compiler)
        return "compiled"

    done: dict[str, list] = {"compiled": [], "cached": [], "failed": []}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        futures = {pool.submit(one, r): r for r in requests}
        for fut in concurrent.futures.as_completed(futures):
            source, name, _ = futures[fut]
            try:
                what = fut.result()
                done[what].append(name)
            except Exception as exc:  # noqa: BLE001 -- reported per instance, the others go on
                what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                done["failed"].append((name, what))
            if on_done is not None:
                on_done(source, name, what)
    return done


def compile_log() -> list[dict[str, Any]]:
    """One record per kernel this process has obtained through :func:`get_function`: ``source``,
    ``name``, ``device``, ``options``, ``from_cache``, ``compiler`` (``"nvrtc"`` or ``"nvcc"``) and
    ``seconds`` (wall time of the compile and the module load; from the kernel cache only the load)."""
    return [dict(r) for r in _compile_log]


def _raw_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # the handle without building a Stream object
    def _raw_stream(device_index: int) -> int:  # noqa: F811
        return torch._C._cuda_getCurrentRawStream(device_index)


class Kernel:
    """A compiled kernel loaded on one device (the driver module stays loaded while it lives).

    Every rtkernels kernel takes its ``pointers`` pointer parameters, then one struct passed by
    value whose fields are all 8 bytes wide (``cuda_src/include/params.cuh``). :meth:`launch` packs
    the argument tuple (the pointers, then the struct's fields in order) into one reusable buffer, a
    Python int as a 64-bit integer and a float as a double, and hands ``cuLaunchKernel`` one slot
    per pointer and the rest of the buffer as the struct.
    """

    def __init__(self, module: int, function: int, device_index: int):
        self.module, self._ptr, self.device_index = module, function, device_index
        self._launch_kernel = driver.launch_kernel()
        self._layouts: dict[tuple[int, int], tuple[struct.Struct, Any, int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, cached: kernel_cache.CachedKernel, device_index: int, dynamic_smem: int = 0) -> "Kernel":
        """Load a compiled image on ``device_index`` (in torch's primary context of that device)."""
        with torch.cuda.device(device_index):
            torch.cuda.current_stream(device_index)  # torch's context exists from here on
            try:
                module = driver.module_load_data(cached.image)
            except (driver.CudaDriverError, driver.LaunchError) as exc:  # ctypes' or CuPy's binding
                # a thread with no current context (an autograd worker loading a kernel the forward
                # never used), as _launch handles for launches: make torch's current, load again
                if getattr(exc, "status", None) != driver.INVALID_CONTEXT:
                    raise
                driver.make_primary_current(device_index)
                module = driver.module_load_data(cached.image)
            function = driver.module_get_function(module, cached.lowered)
            if dynamic_smem > 48 * 1024:
                driver.func_set_attribute(function, driver.MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem)
        return cls(module, function, device_index)

    @property
    def attributes(self) -> dict[str, int]:
        """Registers, local (spill) memory and static shared memory of the compiled kernel."""
        attr = {"max_threads_per_block": driver.MAX_THREADS_PER_BLOCK, "shared_size_bytes": driver.SHARED_SIZE_BYTES,
                "local_size_bytes": driver.LOCAL_SIZE_BYTES, "num_regs": driver.NUM_REGS}
        return {k: driver.func_get_attribute(self._ptr, a) for k, a in attr.items()}

    @staticmethod
    def _layout(args: Sequence[Any], pointers: Optional[int], extra: int = 0) -> tuple[struct.Struct, Any, int]:
        """The packer of ``args``, its buffer, and the kernel-parameter array: one slot per
        pointer, then the start of the struct (the remaining fields), then ``extra`` (the address
        of one more parameter, when not 0); ``pointers`` None: one slot per argument (a kernel of
        8-byte parameters only)."""
        import ctypes

        fmt = "<" + "".join("d" if isinstance(a, float) else "q" for a in args)
        buf = ctypes.create_string_buffer(8 * len(args))
        base = ctypes.addressof(buf)
        slots = len(args) if pointers is None else min(len(args), pointers + 1)
        addresses = [base + 8 * i for i in range(slots)] + ([extra] if extra else [])
        params = (ctypes.c_void_p * len(addresses))(*addresses)
        return struct.Struct(fmt), (buf, params), ctypes.addressof(params)

    def bind(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, device_index: int,
             n_head: int, tail: Sequence[Any], maps: Optional[TensorMaps] = None, late: int = 0) -> "BoundLaunch":
        """This kernel with its grid, block, shared memory and the struct (``tail``) fixed; the
        ``n_head`` pointer parameters come with each call: see :class:`BoundLaunch`. ``maps``: the
        kernel's last parameter, tensor maps that follow the pointers of each call. ``late``: the
        struct's last ``late`` fields (integers) come with each call too, after the pointers."""
        return BoundLaunch(self, grid, block, shared_mem, device_index, n_head, tuple(tail), maps, late)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[Any],
               shared_mem: int, device_index: int, pointers: Optional[int] = None) -> None:
        """Launch on torch's current stream: ``args`` are the ``pointers`` pointer parameters,
        then the fields of the kernel's struct parameter (``pointers`` None: every argument is
        one 8-byte parameter, as before the struct)."""
        stream = _raw_stream(device_index)
        with self._lock:
            layout = self._layouts.get((len(args), pointers))
            if layout is None:
                layout = self._layouts[(len(args), pointers)] = self._layout(args, pointers)
            packer, (buf, _), params_ptr = layout
            packer.pack_into(buf, 0, *args)
            _launch(self, grid, block, shared_mem, stream, params_ptr, device_index)


def _launch(k: "Kernel", g: tuple[int, int, int], b: tuple[int, int, int], shared_mem: int, stream: int,
            params: int, device_index: int) -> None:
    """``cuLaunchKernel`` of ``k`` with the parameter array at ``params``; a thread without a current
    context (e.g. an autograd worker that has made no CUDA call yet) gets torch's primary context
    made current and the launch retried. Raises :class:`~rtkernels.jit.driver.CudaDriverError`."""
    try:
        status = k._launch_kernel(k._ptr, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream, params, 0)
    except driver.LaunchError as exc:
        status = int(exc.status)
    if not status:  # launched (CuPy's binding returns None, ctypes 0)
        return
    if status == driver.INVALID_CONTEXT:
        driver.make_primary_current(device_index)
        status = driver.launch_status(k._launch_kernel, k._ptr, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                      stream, params, 0)
    driver.check(status, "cuLaunchKernel")


class BoundLaunch:
    """A launch of one kernel whose grid, block, shared memory and struct parameter are fixed:
    ``bound(*head)`` launches it on torch's current stream with its ``n_head`` pointer parameters
    (Python ints). The struct is packed once into a parameter buffer owned by this object, so a
    call packs only the pointers (the host path of a cached API call). With ``maps``
    (:class:`~rtkernels.jit.tensor_map.TensorMaps`, the kernel's last parameter) each call also
    points the maps at their tensors among the pointers. With ``late`` > 0 a call passes the
    struct's last ``late`` fields after the pointers (addresses that change per call, e.g. of a
    fourth operand), packed into their place at the struct's end."""

    __slots__ = ("kernel", "grid", "block", "shared_mem", "dev", "n_head", "tail", "maps", "_head", "_buf",
                 "_params", "_lock", "_late", "_late_at")

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                 device_index: int, n_head: int, tail: tuple, maps: Optional[TensorMaps] = None, late: int = 0):
        self.kernel, self.grid, self.block, self.shared_mem = kernel, grid, block, shared_mem
        self.dev, self.n_head, self.tail, self.maps = device_index, n_head, tail, maps
        self._lock = threading.Lock()
        packer, (buf, params), self._params = Kernel._layout((0,) * n_head + tail, n_head,
                                                             0 if maps is None else maps.address)
        packer.pack_into(buf, 0, *((0,) * n_head), *tail)
        self._buf, self._head = (buf, params), struct.Struct(f"<{n_head}q")
        self._late = struct.Struct(f"<{late}q") if late else None
        self._late_at = 8 * (n_head + len(tail) - late)

    def parameters(self) -> Optional[tuple[int, tuple, tuple, int, int, bytes, bytes, tuple]]:
        """The launch as plain values for a compiled caller (:mod:`rtkernels.compiled_call`):
        ``(CUfunction, grid, block, shared memory, n_head, parameter words, maps, map sources)``,
        the words being the packed parameters (the caller writes the ``n_head`` pointer slots),
        ``maps`` the tensor-map parameter as encoded (empty bytes without one) and ``map sources``
        its :attr:`TensorMaps.sources` (map i follows pointer slot ``index`` less ``delta`` bytes:
        the caller swaps each map's address on its own copy). None for a launch whose calls pass
        ``late`` fields."""
        if self._late is not None:
            return None
        maps = b"" if self.maps is None else self.maps.image()
        sources = () if self.maps is None else self.maps.sources
        return (self.kernel._ptr, tuple(self.grid), tuple(self.block), self.shared_mem, self.n_head,
                bytes(self._buf[0].raw), maps, tuple(sources))

    def __call__(self, *head: int) -> None:
        if torch._C._cuda_getDevice() != self.dev:
            with torch.cuda.device(self.dev):  # the device's primary context current for the launch
                self(*head)
            return
        stream = _raw_stream(self.dev)
        with self._lock:
            if self._late is None:
                self._head.pack_into(self._buf[0], 0, *head)
            else:
                n = self.n_head
                self._head.pack_into(self._buf[0], 0, *head[:n])
                self._late.pack_into(self._buf[0], self._late_at, *head[n:])
            if self.maps is not None:
                self.maps.update(head)
            _launch(self.kernel, self.grid, self.block, self.shared_mem, stream, self._params, self.dev)


def launch(fn: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int],
           args: Sequence[Any], device_index: int, shared_mem: int = 0, *, pointers: Optional[int] = None) -> None:
    """Launch ``fn`` on torch's current stream of ``device_index`` (asynchronous): ``args`` are
    its ``pointers`` pointer parameters, then the fields of its struct parameter."""
    if torch.cuda.current_device() == device_index:
        fn.launch(grid, block, args, shared_mem, device_index, pointers)
        return
    with torch.cuda.device(device_index):  # the device's primary context current for the launch
        fn.launch(grid, block, args, shared_mem, device_index, pointers)
