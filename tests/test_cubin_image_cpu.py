"""NVRTC's cubin as rtkernels keeps it: the whole ELF image (CuPy's getCUBIN drops its last byte)."""
import struct

from rtkernels.jit import compile_offline
from rtkernels.jit.compiler import whole_cubin


def _elf_end(image: bytes) -> int:
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<4H", image, 54)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def test_compiled_cubin_is_whole_elf():
    image = compile_offline("chunk/seg_scan.cu", ["rtk_chunk_seg_scan"], "sm_80").cubin
    assert image[:4] == b"\x7fELF"
    assert len(image) >= _elf_end(image) > 64


def test_whole_cubin_restores_only_the_one_missing_byte():
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", header, 32, 64, 128)  # program headers at 64, section headers at 128
    struct.pack_into("<4H", header, 54, 56, 1, 64, 2)  # tables end at 120 and 256
    full = bytes(header) + bytes(256 - 64)
    assert whole_cubin(full[:-1]) == full
    assert whole_cubin(full) == full  # already whole
    assert whole_cubin(full[:-2]) == full[:-2]  # not the one-byte case: left alone
    ptx = b".version 8.0\n\0"
    assert whole_cubin(ptx) == ptx
