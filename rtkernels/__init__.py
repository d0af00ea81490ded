"""rtkernels: exponentially decaying causal linear attention, every method, correct and fast.

    o_i = scale * sum_{j <= i} gamma_h^(i-j) (q_i . k_j) v_j
"""

from . import kernel_backward as _kernel_backward  # registers the chunk-kernel backward (BACKWARD_IMPLS)
from .api import DTYPES, LAYOUTS, METHOD_NAMES, causal_linear_attention
from .methods import METHODS

from .env import VERSION as __version__

__all__ = ["causal_linear_attention", "METHODS", "METHOD_NAMES", "LAYOUTS", "DTYPES", "__version__"]
