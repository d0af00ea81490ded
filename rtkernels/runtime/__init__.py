"""The former name of :mod:`rtkernels.jit`, kept so that code written against it keeps working.

``rtkernels.runtime`` and its submodules (``compiler``, ``driver``, ``kernel_cache``, ``sources``,
``dtypes``) are the very modules of :mod:`rtkernels.jit`; new code imports ``rtkernels.jit``.
"""

import sys as _sys

from .. import jit as _jit
from ..jit import *  # noqa: F401,F403
from ..jit import __all__  # noqa: F401
from ..jit import compiler, driver, dtypes, kernel_cache, sources  # noqa: F401

for _name in ("compiler", "driver", "dtypes", "kernel_cache", "sources"):
    _sys.modules[f"{__name__}.{_name}"] = getattr(_jit, _name)
