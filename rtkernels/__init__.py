"""rtkernels: exponentially decaying causal linear attention, every method, correct and fast.

    o_i = scale * sum_{j <= i} gamma_h^(i-j) (q_i . k_j) v_j
"""

import sys as _sys

from .api import DTYPES, LAYOUTS, METHOD_NAMES, causal_linear_attention
from .decay import set_strict_decay
from .decode import decode
from .env import VERSION as __version__
from .normalized import FEATURES, linear_attention
from .methods import METHODS
from .methods.chunk import backward as _chunk_backward  # puts the kernel backward first in BACKWARD_IMPLS
from .methods.chunk import decay_grad as _chunk_decay_grad
from . import ops as ops  # the torch.library ops; the call routes to them under torch.compile / torch.func
from . import decode_op as _decode_op  # the decode step's op; decode routes to it under torch.compile

# Former module names, kept working: rtkernels.kernel_backward and rtkernels.decay_grad now live
# in the chunk method's package.
kernel_backward = _sys.modules[f"{__name__}.kernel_backward"] = _chunk_backward
decay_grad = _sys.modules[f"{__name__}.decay_grad"] = _chunk_decay_grad

__all__ = ["causal_linear_attention", "linear_attention", "decode", "set_strict_decay", "METHODS", "METHOD_NAMES",
           "LAYOUTS", "DTYPES", "FEATURES", "__version__"]
