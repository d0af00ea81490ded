"""LeetDecoding's ``causal_linear_decoder``, with one meaning of gamma for every method.

For code moving from LeetDecoding (arXiv 2501.02573): same signature and ``[B, H, N, D]`` layout,
every one of its method names, the input dtype out, any device. Unlike LeetDecoding, gamma means
the same thing whichever method runs:

* ``is_need_exp=True``  -> ``M[i, j] = exp(-gamma (i - j))`` (gamma is a rate, >= 0);
* ``is_need_exp=False`` -> ``M[i, j] = gamma ** (i - j)`` (gamma is a factor in (0, 1]).
"""

from __future__ import annotations

from typing import Any, Optional

from ..api import causal_linear_attention

__all__ = ["causal_linear_decoder", "METHOD_MAP"]

#: LeetDecoding's method names and the rtkernels method each one runs (None: automatic choice).
METHOD_MAP: dict[Optional[str], str] = {
    None: "auto",
    "vanilla": "vanilla",
    "recursion": "recursion",
    "block-based": "block",
    "FleetAttention": "fleet",
    "FleetAttention_torch": "fleet",
    "causal_dot_product": "scan",
    "causal_dot_product_torch": "scan",
    "lightningAttention2": "chunk",
    "lightningAttention2_torch": "chunk",
}


def causal_linear_decoder(q: Any, k: Any, v: Any, is_mask_weight: bool = False, gamma: Any = None,
                          is_need_exp: bool = True, attn_method: Optional[str] = None) -> Any:
    """LeetDecoding's entry point: ``o_i = sum_{j <= i} M[i, j] (q_i . k_j) v_j``.

    Args:
        q, k: ``[B, H, N, Dk]``; v: ``[B, H, N, Dv]``.
        is_mask_weight: use a decaying mask (requires ``gamma``); False gives the plain causal mask.
        gamma: ``[H]`` tensor (or a float), one value per head; see ``is_need_exp``.
        is_need_exp: True: gamma is a rate, M = exp(-gamma (i - j)); False: gamma is the factor,
            M = gamma ** (i - j).
        attn_method: one of LeetDecoding's names (:data:`METHOD_MAP`) or an rtkernels method name;
            None picks automatically.

    Returns:
        ``[B, H, N, Dv]`` in the input dtype, on the input device. Same complexity as the method
        it maps to (README's methods table).
    """
    if not isinstance(is_mask_weight, bool):
        raise TypeError(f"is_mask_weight must be a bool, got {type(is_mask_weight).__name__}")
    if not isinstance(is_need_exp, bool):
        raise TypeError(f"is_need_exp must be a bool, got {type(is_need_exp).__name__}")
    if gamma is not None and not is_mask_weight:
        raise ValueError("gamma is only used with is_mask_weight=True; pass is_mask_weight=True "
                         "to apply it, or leave gamma=None for the plain causal mask")
    if is_mask_weight and gamma is None:
        raise ValueError("is_mask_weight=True needs gamma: a [H] tensor of decay values, one per head")
    from ..methods import METHODS

    if attn_method in METHOD_MAP:
        method = METHOD_MAP[attn_method]
    elif isinstance(attn_method, str) and attn_method in METHODS:
        method = attn_method
    else:
        names = ", ".join(repr(m) for m in METHOD_MAP if m is not None)
        raise ValueError(f"attn_method must be None or one of {names} (or an rtkernels method name), "
                         f"got {attn_method!r}")
    if not is_mask_weight:
        return causal_linear_attention(q, k, v, method=method)
    if is_need_exp:
        return causal_linear_attention(q, k, v, decay_rate=gamma, method=method)
    return causal_linear_attention(q, k, v, decay=gamma, method=method)
