"""Selection helpers of ShadowKV's decode: chunk scores and top-k.

These are small matmuls/reductions (C = N/chunk_size landmarks), run in torch on every device; the
heavy part of a sparse decode step is the attention (``lowrank_decode``).

* :func:`chunk_scores` -- ``q . landmark`` (optionally softmaxed over chunks, ShadowKV), max over the
  query heads of each KV group (and over the query tokens, or per token).
* :func:`topk_indices` -- top-k ids per row with -1 padding, optional forced ids (e.g. chunk 0).
"""

from __future__ import annotations

import torch

from .reference import chunk_scores as _chunk_scores_ref


def chunk_scores(q, landmarks, reduce="max", *, softmax=False, scale=None, chunk_mask=None, per_token=False):
    """Scores ``[B, Hkv, C]`` fp32 of chunks for the current query.

    q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; landmarks ``[B, Hkv, C, D]``; reduce "max" (default) or
    "mean" over the query heads of a KV group (and the Tq tokens); softmax=True applies a softmax over
    the chunks of each query head before reducing (ShadowKV); chunk_mask ``[B, Hkv, C]`` bool hides chunks.
    per_token=True: one score list per query token, ``[B, Hkv, Tq, C]`` (a 3-D q counts as Tq = 1).
    """
    if q.dim() not in (3, 4) or landmarks.dim() != 4:
        raise ValueError(f"kvkit.kernels.chunk_scores: q must be [B, Hq, (Tq,) D] and landmarks [B, Hkv, C, D], "
                         f"got {tuple(q.shape)} and {tuple(landmarks.shape)}")
    if q.shape[0] != landmarks.shape[0] or q.shape[-1] != landmarks.shape[-1] or q.shape[1] % landmarks.shape[1]:
        raise ValueError(f"kvkit.kernels.chunk_scores: q {tuple(q.shape)} does not fit landmarks "
                         f"{tuple(landmarks.shape)} (batch, head dim, Hq multiple of Hkv)")
    return _chunk_scores_ref(q, landmarks, reduce=reduce, softmax=softmax, scale=scale, chunk_mask=chunk_mask,
                             per_token=per_token)


def topk_indices(scores, k, *, force=None, sort=True, dtype=torch.int64):
    """Top-``k`` ids along the last dim of ``scores [..., C]``.

    Entries whose score is -inf (masked) are returned as -1 (so lists of rows with fewer than k
    candidates are padded, as the decode kernels expect). ``force``: ids (list of ints, or a tensor
    broadcastable to ``[..., F]``) always kept, taking F of the k slots (TriForce keeps chunk 0).
    ``sort``: return ids in increasing order (better memory locality for the gather).
    """
    C = scores.shape[-1]
    k = int(k)
    if k < 0:
        raise ValueError(f"kvkit.kernels.topk_indices: k must be >= 0, got {k}")
    s = scores.float()
    if force is not None:
        f = torch.as_tensor(force, device=scores.device, dtype=torch.long)
        f = f.expand(*scores.shape[:-1], f.shape[-1]) if f.dim() else f.expand(*scores.shape[:-1], 1)
        s = s.scatter(-1, f.clamp(0, C - 1), float("inf"))
    kk = min(k, C)
    top = s.topk(kk, dim=-1)
    ids = torch.where(top.values == float("-inf"), torch.full_like(top.indices, -1), top.indices)
    if kk < k:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], k - kk), -1)], dim=-1)
    if sort:
        big = torch.iinfo(torch.int64).max
        ids = torch.where(ids < 0, big, ids).sort(dim=-1).values
        ids = torch.where(ids == big, -1, ids)
    return ids.to(dtype)
