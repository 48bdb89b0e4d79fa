"""Attention with an additive per-key log-weight (Chelsea's merged keys; also plain masking).

``score = scale * q.k + log_weight[b, kv_head, n]``: a merged key standing for ``c`` tokens gets
``log(c)`` so it weighs as ``c`` identical keys (ToMe's proportional attention); ``-inf`` hides a key.
The Triton path is the dense mode (MODE 0) of ``sparse._gather_attn_kernel`` with ``HAS_BIAS``:
all N keys, GQA rows grouped per KV head, split-K + reduce.

Reference: :func:`kvkit.kernels.reference.dense_decode_ref`.
"""

from __future__ import annotations

from .sparse import gather_attn


def weighted_decode_triton(q4, k, v, log_weight, *, scale, mask=None, num_splits=None):
    """q4 ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, N, D]``, log_weight ``[B, Hkv, N]`` or None, mask ``[B, N]``."""
    return gather_attn(q4, k, v, None, mode=0, scale=scale, mask=mask, bias=log_weight, num_splits=num_splits)
