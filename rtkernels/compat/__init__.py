"""Drop-in call shapes of other libraries, computed by rtkernels: :mod:`.leetdecoding`
(LeetDecoding's ``causal_linear_decoder``) and :mod:`.fla` (flash-linear-attention's
``chunk_simple_gla`` and ``fused_recurrent_simple_gla``). Import the one you need."""
