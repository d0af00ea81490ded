"""What a tuning result is keyed by: the device fingerprint and the shape bucket.

* The **fingerprint** of a device says which results files may be used on it: the rtkernels
  version, the hash of every kernel source and header (:func:`rtkernels.jit.sources_hash`),
  the GPU's name, compute capability and multiprocessor count, and the NVRTC version. Each
  fingerprint has its own results file, named by it; a file whose recorded fingerprint differs
  from the device's is never used.
* The **shape bucket** of a call is its dtype and, rounded up to powers of two, B*H (the
  parallelism the kernels see), N, Dk and Dv: e.g. ``"bf16-bh128-n4096-dk128-dv128"``. A call
  looks its bucket up once per exact shape; later calls of that shape cost one dict lookup.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["Fingerprint", "device_fingerprint", "fingerprint_digest", "file_stem", "bucket", "pow2",
           "dtype_name"]

#: The fingerprint's fields, in order.
Fingerprint = dict  # {"rtkernels", "sources", "gpu", "capability", "sms", "nvrtc"}
FIELDS = ("rtkernels", "sources", "gpu", "capability", "sms", "nvrtc")


def device_fingerprint(device_index: int) -> Fingerprint:
    """The fingerprint of CUDA device ``device_index`` (needs torch with CUDA and a compiler
    backend). Its ``"nvrtc"`` field names the compiler of the kernels: NVRTC's version (``"13.0"``)
    with the CuPy backend, ``"nvcc-13.0"`` with the PyCUDA one (tuned on other machine code, the
    two never share a store file; the CuPy form is unchanged, so existing stores stay valid)."""
    import torch

    from ..env import VERSION as __version__
    from ..jit import nvrtc_version, sources_hash
    from ..jit.backend import backend_name
    from ..jit.kernel_cache import recorded_nvrtc

    p = torch.cuda.get_device_properties(device_index)
    if backend_name() == "pycuda":
        from ..jit.compiler_nvcc import nvcc_version

        compiler = "nvcc-{}.{}".format(*nvcc_version())
    else:  # the NVRTC that compiled the cached kernels (no NVRTC load in a warm process), else the one at hand
        compiler = "{}.{}".format(*(recorded_nvrtc() or nvrtc_version()))
    return {"rtkernels": __version__, "sources": sources_hash(), "gpu": p.name,
            "capability": f"{p.major}.{p.minor}", "sms": int(p.multi_processor_count),
            "nvrtc": compiler}


def fingerprint_digest(fp: Fingerprint) -> str:
    """12 hex digits of a sha256 over the fingerprint's canonical JSON."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def file_stem(fp: Fingerprint) -> str:
    """The results file's name without ``.json``: readable GPU name, capability, SMs, digest,
    e.g. ``"nvidia-h200-cc9.0-132sm-3f2a9c0d1e4b"``."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(fp.get("gpu", "gpu")).lower()).strip("-") or "gpu"
    return f"{gpu}-cc{fp.get('capability', '?')}-{fp.get('sms', '?')}sm-{fingerprint_digest(fp)}"


def pow2(x: int, least: int = 1) -> int:
    """The smallest power of two >= max(x, least)."""
    x = max(int(x), least)
    return 1 << (x - 1).bit_length()


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (a short name passes through)."""
    if isinstance(dtype, str):
        return dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        text = str(dtype).replace("torch.", "")
        name = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(text, text)
        _DTYPE_NAMES[dtype] = name
    return name


def bucket(dtype: Any, bh: int, n: int, dk: int, dv: int) -> str:
    """The shape bucket of a call: ``"<dtype>-bh<B*H>-n<N>-dk<Dk>-dv<Dv>"``, each size rounded up to
    a power of two (head sizes to at least 16)."""
    return f"{dtype_name(dtype)}-bh{pow2(bh)}-n{pow2(n)}-dk{pow2(dk, 16)}-dv{pow2(dv, 16)}"
