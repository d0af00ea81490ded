"""Every CUDA kernel instance rtkernels can request, with the compiler options it is requested
with: what ``rtkernels compile`` puts in the disk cache ahead of the first call, and what the CI
compile test compiles.

A request is ``(source under cuda_src/, template name expression, extra compiler options)``; the
wgmma instances (forward, states pass, the float32 dlog(gamma) kernel) carry ``-arch=sm_90a``
(they run on compute capability 9.0 only), every other instance compiles for the GPU's own
architecture.
"""

from __future__ import annotations

from .decode import instances as _decode_instances
from .methods import kernel_instances as _method_instances
from .methods.chunk import instance_options as _chunk_options
from .normalize_op import instances as _normalize_instances

__all__ = ["by_source", "requests"]

#: The architecture the sm_90a-only instances serve.
_HOPPER = "sm_90"


def by_source() -> dict[str, list[str]]:
    """Every instance, by source: the methods' (the registry), the decode step's and
    ``linear_attention``'s normalization's."""
    return {**_method_instances(), **_decode_instances(), **_normalize_instances()}


def requests(arch: str, sources: tuple[str, ...] = ()) -> list[tuple[str, str, tuple[str, ...]]]:
    """The requests a GPU of ``arch`` (e.g. ``"sm_90"``) can make, of ``sources`` only where given:
    the sm_90a instances only for ``sm_90``."""
    options = _chunk_options()
    out = []
    for source, names in sorted(by_source().items()):
        if sources and source not in sources:
            continue
        for name in names:
            opts = options.get(name, ())
            if opts and arch != _HOPPER:
                continue
            out.append((source, name, opts))
    return out
