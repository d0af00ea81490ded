"""Tensor maps for Hopper's tensor copies (``cp.async.bulk.tensor``), passed to a kernel by value.

A tensor map (``CUtensorMap``, 128 opaque bytes) describes a strided tensor in global memory and
the box one copy moves; the driver builds it (``cuTensorMapEncodeTiled``) and a kernel takes it
as a ``__grid_constant__`` parameter. Only the base address changes between calls on tensors of
the same shape and strides, and the driver swaps it in place (``cuTensorMapReplaceAddress``), so a
planned launch encodes its maps once and each call pays one short driver call per map whose
tensor moved. Both calls go through ctypes on ``libcuda``; where it cannot be opened that way,
:meth:`TensorMaps.encode` answers False and callers keep their other load path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional, Sequence

from . import driver

__all__ = ["MAP_BYTES", "TensorMaps", "replace_address_function"]

#: Size of one tensor map; its alignment is 64 bytes.
MAP_BYTES = 128
#: CUtensorMapDataType UINT16 (the copies move bits: fp16 and bf16 alike).
_UINT16 = 1
#: CUtensorMapSwizzle 128B, CUtensorMapL2promotion 128B.
_SWIZZLE_128B, _L2_128B = 3, 2


@functools.lru_cache(maxsize=1)
def _calls() -> Optional[tuple[Any, Any]]:
    """(cuTensorMapEncodeTiled, cuTensorMapReplaceAddress) with their argument types, or None."""
    lib = driver._lib()
    if lib is None or not hasattr(lib, "cuTensorMapEncodeTiled") or not hasattr(lib, "cuTensorMapReplaceAddress"):
        return None
    vp, u32p, u64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    enc, rep = lib.cuTensorMapEncodeTiled, lib.cuTensorMapReplaceAddress
    enc.argtypes = [vp, ctypes.c_int, ctypes.c_uint32, vp, u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int, ctypes.c_int]
    rep.argtypes = [vp, vp]
    enc.restype = rep.restype = ctypes.c_int
    return enc, rep


def replace_address_function() -> Optional[int]:
    """The address of ``cuTensorMapReplaceAddress`` (for compiled callers), or None."""
    calls = _calls()
    return None if calls is None else ctypes.cast(calls[1], ctypes.c_void_p).value


class TensorMaps:
    """A kernel parameter of ``count`` tensor maps in a row (a struct of ``rtk_tmap`` fields), kept
    in a 64-byte aligned buffer at :attr:`address`, whose maps follow pointer parameters of a
    launch: ``sources[i] = (index, delta)`` says that map i's base address is the launch's pointer
    ``head[index]`` minus ``delta`` bytes (a reversed pass passes the address of the last row).
    Maps never encoded stay zero (a kernel instance that does not read them)."""

    __slots__ = ("_raw", "address", "sources", "_bases")

    def __init__(self, count: int, sources: Sequence[tuple[int, int]] = ()):
        self._raw = ctypes.create_string_buffer(MAP_BYTES * count + 64)
        self.address = (ctypes.addressof(self._raw) + 63) & ~63
        self.sources = tuple(sources)
        self._bases = [0] * len(self.sources)

    def encode(self, index: int, base: int, dims: Sequence[int], strides: Sequence[int], box: Sequence[int]) -> bool:
        """Map ``index`` over 16-bit elements at ``base``: ``dims`` innermost first (the innermost
        contiguous), ``strides`` the byte strides of the others, ``box`` the elements one copy
        moves per dimension, rows of the box swizzled by 128 bytes. False where the driver refuses
        the description (e.g. a stride not a multiple of 16 bytes): then use another load path."""
        calls = _calls()
        if calls is None:
            return False
        rank = len(dims)
        status = calls[0](ctypes.c_void_p(self.address + MAP_BYTES * index), _UINT16, rank, ctypes.c_void_p(base),
                          (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*strides),
                          (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)), 0,
                          _SWIZZLE_128B, _L2_128B, 0)
        if status == 0 and index < len(self._bases):
            self._bases[index] = base
        return status == 0

    def image(self) -> bytes:
        """The maps as encoded (``count`` x :data:`MAP_BYTES`), for a caller that copies them."""
        return ctypes.string_at(self.address, len(self._raw) - 64)

    def update(self, head: Sequence[int]) -> None:
        """Point each map at its source pointer of this launch's ``head`` (a driver call only for a
        map whose tensor moved since the last launch)."""
        bases, rep = self._bases, None
        for i, (index, delta) in enumerate(self.sources):
            base = head[index] - delta
            if base != bases[i]:
                rep = rep or _calls()[1]
                driver.check(rep(ctypes.c_void_p(self.address + MAP_BYTES * i), ctypes.c_void_p(base)),
                             "cuTensorMapReplaceAddress")
                bases[i] = base
