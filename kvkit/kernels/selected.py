"""Decode reads of listed tokens (:func:`sparse_decode`) and of every token with an additive per-key log-weight
(:func:`weighted_decode`): Triton on the path :func:`kvkit.kernels.dispatch.use_triton` picks, the torch reference
(fp32 math) elsewhere."""

from __future__ import annotations

import torch

from . import reference as _ref
from ._common import (
    check_indices,
    check_qkv,
    check_range,
    check_tensor,
    check_valid,
    debug,
    default_scale,
    fail,
)
from .dispatch import on_device, use_triton


def finish(out, lse, squeeze, return_lse):
    if squeeze:
        out, lse = out.squeeze(2), lse.squeeze(2)
    return (out, lse) if return_lse else out


def sparse_decode(q, k, v, indices, *, scale=None, index_mode="kv_head", valid=None, return_lse=False,
                  num_splits=None):
    """Decode attention over selected tokens.

    Parameters
    ----------
    q : ``[B, Hq, D]`` (one query token) or ``[B, Hq, Tq, D]`` (a few, e.g. speculative verification;
        all Tq tokens see the same selected keys, no causal mask among them).
    k, v : ``[B, Hkv, N, D]``, same dtype as q (fp16/bf16/fp32), Hq a multiple of Hkv (GQA).
    indices : int32/int64 token ids ``[B, Hkv, K]`` (index_mode="kv_head": one list per KV head, shared
        by its query group; each K/V row is read once per group) or ``[B, Hq, K]`` ("q_head"); a 4-D
        ``[B, Hidx, Tq, K]`` gives each query token its own list. -1 = no token (ragged padding).
    scale : softmax scale, default ``1/sqrt(D)``.
    valid : None, int lengths ``[B]`` (keys ``>= valid[b]`` ignored) or bool key mask ``[B, N]``.
    return_lse : also return the log-sum-exp ``[B, Hq]`` / ``[B, Hq, Tq]`` (fp32) for :func:`merge_attn`.
    num_splits : split-K factor of the Triton kernel (default: sized to the GPU).

    Returns out with q's shape and dtype (zeros where no key is visible; lse = -inf there).
    """
    fn = "sparse_decode"
    q4, squeeze, B, Hq, Tq, Hkv, N, D = check_qkv(fn, q, k, v)
    idx = check_indices(fn, indices, B, Hq, Hkv, Tq, index_mode, q.device)
    mask = check_valid(fn, valid, B, N, q.device)
    scale = default_scale(scale, D)
    if debug():
        check_range(fn, "indices", idx, N)
    if use_triton(q, k, v, idx):
        from .sparse import gather_attn

        with on_device(q):
            out, lse = gather_attn(q4, k, v, idx, mode=1, scale=scale, mask=mask, num_splits=num_splits)
    else:
        out, lse = _ref.sparse_decode_ref(q4, k, v, idx, scale=scale, mask=mask)
    return finish(out, lse, squeeze, return_lse)


def weighted_decode(q, k, v, log_weight=None, *, scale=None, valid=None, return_lse=False, num_splits=None):
    """Dense decode attention with an additive per-key bias.

    q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; k, v ``[B, Hkv, N, D]``; log_weight ``[B, Hkv, N]`` float
    (natural-log units, e.g. ``log(cluster_size)``; ``-inf`` hides a key) or None; valid as in
    :func:`sparse_decode`. Returns out (q's shape) [+ lse].
    """
    fn = "weighted_decode"
    q4, squeeze, B, Hq, Tq, Hkv, N, D = check_qkv(fn, q, k, v)
    if log_weight is not None:
        check_tensor(fn, "log_weight", log_weight, 3, (torch.float16, torch.bfloat16, torch.float32,
                                                      torch.float64), q.device)
        if tuple(log_weight.shape) != (B, Hkv, N):
            fail(fn, f"log_weight must be [B={B}, Hkv={Hkv}, N={N}], got {tuple(log_weight.shape)}")
    mask = check_valid(fn, valid, B, N, q.device)
    scale = default_scale(scale, D)
    if use_triton(q, k, v):
        from .weighted import weighted_decode_triton

        with on_device(q):
            out, lse = weighted_decode_triton(q4, k, v, log_weight, scale=scale, mask=mask, num_splits=num_splits)
    else:
        out, lse = _ref.dense_decode_ref(q4, k, v, scale=scale, mask=mask, bias=log_weight)
    return finish(out, lse, squeeze, return_lse)
