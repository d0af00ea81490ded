"""Autotuning: per-GPU, per-shape-bucket choice of the method (``method="auto"``) and of every
kernel's template parameters and launch strategy.

Modules:

* :mod:`.space` -- ``Space``: a kernel method's declarative config space (each method module owns
  its ``TUNE_SPACE`` and a ``tuned_launch(config, ...)`` adapter); ``Problem``, ``Limits``.
* :mod:`.keys` -- the device fingerprint (rtkernels version, sources hash, GPU name, compute
  capability, SM count, NVRTC version) and the shape bucket (dtype, B*H, N, Dk, Dv rounded up to
  powers of two).
* :mod:`.store` -- the JSON results file per fingerprint under :func:`cache_dir` (atomic, merged
  under a lock, robust to corrupt / foreign / read-only files).
* :mod:`.tuner` -- the tuning loop over candidates ``(method, config)``, with an injectable
  timer and validator.
* :mod:`.answers` -- the hot path: the store's answers per call shape, the forced candidate.
* :mod:`.cuda` -- the GPU side: candidates from the method registry, inputs, CUDA-event timing
  with an L2 flush, validation against the torch path; :func:`tune`.

The hot path (:func:`selection`, :func:`tuned_config`) is one dict lookup keyed by the exact call
shape; the first call of a shape resolves its bucket in the store (reading the file once per
process) and memoises the answer. A call never tunes unless asked: ``RTKERNELS_AUTOTUNE=1`` (or
:func:`set_autotune_on_miss`) makes the first call of an untuned bucket tune it.
"""

from .cuda import tune
from .keys import bucket, device_fingerprint, dtype_name
from .answers import (ENV_AUTOTUNE, Selection, autotune_on_miss, clear, forced, generation, lookup, plan_state,
                     record, selection, set_autotune_on_miss, store_for_device, tuned_config, use_store)
from .space import Config, Limits, Problem, Space, freeze
from .store import ENV_CACHE_DIR, Store, cache_dir, store_dir
from .tuner import Candidate, Trial, TuneResult

__all__ = [
    "ENV_AUTOTUNE", "ENV_CACHE_DIR", "Selection", "Space", "Problem", "Limits", "Candidate", "Trial",
    "TuneResult", "Store", "Config", "freeze", "cache_dir", "store_dir", "bucket", "selection", "tuned_config", "lookup",
    "tune", "record", "store_for_device", "use_store", "forced", "set_autotune_on_miss",
    "autotune_on_miss", "clear", "generation", "plan_state", "device_fingerprint", "dtype_name",
]
