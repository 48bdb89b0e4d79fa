"""Low-rank pre-RoPE keys with chunk landmarks (ShadowKV, arXiv:2410.21465): the compression steps and the decode
steps of ``shadowkv``'s store, as plain functions.

Notation: ``B`` rows, ``H`` KV heads (``Hq = G x H`` query heads), head size ``D``, chunks of ``c`` tokens, ``C``
chunks per row at most (``N = C x c`` chunk tokens), rank ``r``.

Compression of a held prompt (keys post-RoPE, as the cache receives them):

* :func:`chunk_layout`: which stored tokens make up each row's chunks (from its first real token, the local window
  left out);
* :func:`factorize_keys`: truncated SVD of the chunk tokens' pre-RoPE keys, heads concatenated (``[N, H x D]`` per
  row): ``U [B, N, r]`` shared by the heads and ``S V^T`` split per KV head ``[B, H, r, D]``;
* :func:`rope_layout`: the chunk tokens' RoPE positions, one offset per row when they are contiguous;
* :func:`landmarks_and_outliers` / :func:`outlier_slots`: the landmark of every chunk -- the mean post-RoPE key (the
  paper) or its channel-wise max and min side by side (``minmax``, ``[.., 2D]``) -- and per KV head the chunks least
  similar to their mean (lowest min-cosine-similarity), kept exact and out of the landmarks.

Decode:

* :func:`select_chunks` (any number of query tokens) / :func:`top_chunks` (one token, landmarks in fp32 already):
  ``softmax(score / sqrt(D))`` per query head, max over a KV head's query group, top chunks; the score is ``q .
  mean`` for mean landmarks, and for min-max landmarks the largest ``q . k`` any key of the chunk can have,
  ``relu(q) . max + min(q, 0) . min`` (:func:`bound_query`: one matmul over ``[relu(q), min(q, 0)]``);
* :func:`gather_value_chunks`: the selected chunks' rows of an offloaded value store, on the query's device;
* :func:`rebuild_keys`: ``U[rows] @ (S V^T)[head]`` with RoPE at the tokens' positions, in torch;
* :func:`attend_parts`: one softmax over several slot sets (concatenated when small, else merged by log-sum-exp);
* :class:`RopeTables`: the RoPE tables (rows = positions) a cache's layers share for the torch paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvkit.kernels import chunk_scores, merge_attn, topk_indices
from kvkit.kernels.reference import chunks_to_tokens
from kvkit.model_info import apply_rope, inverse_rope
from kvkit.stores.attend import attend_slots


@dataclass
class RopeTables:
    """What one cache's ShadowKV layers share: the RoPE table of the torch decode paths (rows = positions,
    ``(cos, sin)`` each ``[P, Dr]`` fp32 from the model's own rotary module; it depends on the model, not on
    the batch, and is not KV, so ``nbytes`` does not count it)."""

    tables: dict = field(default_factory=dict)  # device -> (cos, sin)

    def rope_table(self, rope, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for positions ``0 .. >= n-1`` on ``device`` (computed once, grown when needed)."""
        t = self.tables.get(device)
        if t is None or t[0].shape[0] < n:
            cos, sin = rope(torch.arange(n, device=device)[None])
            t = (cos[0].to(device, torch.float32).contiguous(), sin[0].to(device, torch.float32).contiguous())
            self.tables[device] = t
        return t

    def rope_half(self, rope, n: int, device):
        """The first ``Dr/2`` columns of :meth:`rope_table`'s ``(cos, sin)`` when the table has the rotate_half
        layout (each row's two halves equal, as transformers' rotary modules build it), else None."""
        cos, sin = self.rope_table(rope, n, device)
        key = (device, "half", cos.shape[0])
        if key not in self.tables:
            h = cos.shape[-1] // 2
            ok = torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])
            self.tables[key] = (cos[:, :h].contiguous(), sin[:, :h].contiguous()) if ok else None
        return self.tables[key]


# ---- compression ---------------------------------------------------------------------------------------
def chunk_layout(first, S: int, chunk: int, local_chunks: int):
    """The chunks of each row: ``first [B]`` (long) its first real stored token, ``S`` tokens stored, the last
    ``local_chunks`` chunks and the ``(S - first) mod chunk`` tokens after them left out (the local window).

    Returns ``n_chunks [B]`` (long), ``tok [B, N]`` (the stored index of chunk token ``j``: ``first + j``, clamped)
    and ``tok_valid [B, N]`` bool (``j < n_chunks x chunk``), ``N = max(n_chunks) x chunk`` (0: nothing to
    compress)."""
    n_chunks = ((S - first) // chunk - local_chunks).clamp(min=0)  # [B]
    N = int(n_chunks.max()) * chunk
    j = torch.arange(N, device=first.device)
    tok = (first[:, None] + j[None]).clamp(max=S - 1)  # [B, N]
    tok_valid = j[None] < (n_chunks * chunk)[:, None]  # [B, N]
    return n_chunks, tok, tok_valid


def factorize_keys(kc, cos, sin, valid, rank: int):
    """Rank-``r`` factors of the pre-RoPE keys of the chunk tokens ``kc [B, H, N, D]`` (post-RoPE, rotated by
    ``cos, sin [B, 1, N, Dr]``), ``r = min(rank, N, H x D)``: the keys are un-rotated exactly (fp32), the tokens
    outside ``valid [B, N]`` zeroed (a zero row leaves the singular vectors of the others unchanged), and
    ``[N, H x D]`` per row is factored by an fp32 SVD. Returns ``U [B, N, r]`` and ``SV [B, H, r, D]`` (``S V^T``
    split per KV head), both in ``kc``'s dtype, contiguous."""
    B, H, N, D = kc.shape
    k_pre = inverse_rope(kc.float(), cos, sin) * valid[:, None, :, None]
    X = k_pre.permute(0, 2, 1, 3).reshape(B, N, H * D)
    U, Sv, Vh = torch.linalg.svd(X, full_matrices=False)  # fp32
    r = min(rank, Sv.shape[-1])
    SV = (Sv[..., :r, None] * Vh[:, :r]).view(B, r, H, D).permute(0, 2, 1, 3)
    return U[..., :r].to(kc.dtype).contiguous(), SV.to(kc.dtype).contiguous()


def rope_layout(rp, valid):
    """How the chunk tokens' RoPE positions ``rp [B, N]`` (int32; ``valid [B, N]`` the real ones) are stored:
    ``(base [B, 1], None, hi)`` when every row's are ``base + j``, else ``(None, rp, hi)``; ``hi`` is 1 + the largest
    position a rebuilt key is rotated at (the RoPE table's length)."""
    N = rp.shape[1]
    j = torch.arange(N, device=rp.device)
    base = rp[:, :1]
    if bool(((rp == base + j[None].to(rp.dtype)) | ~valid).all()):
        return base.contiguous(), None, int(base.max()) + N
    return None, rp.contiguous(), int(rp.max()) + 1


LANDMARKS = ("mean", "minmax")


def landmarks_and_outliers(kc, n_chunks, chunk: int, n_out: int, landmark: str = "mean"):
    """Chunk landmarks and outlier chunks of the post-RoPE chunk keys ``kc [B, H, C x chunk, D]`` (row ``b`` has
    ``n_chunks[b]`` real chunks). ``landmark="mean"`` (the paper): a chunk's landmark is the mean of its keys (fp32),
    ``[.., D]``; ``"minmax"``: the channel-wise max and min of its keys side by side, ``[.., 2D]`` (what
    :func:`bound_query` scores). Per KV head the ``min(n_out, C)`` real chunks with the lowest min-cosine-similarity
    of a key to the chunk's mean are outliers (both kinds).

    Returns ``landmarks [B, H, C - n_out, D or 2D]`` (``kc``'s dtype), ``lm_ids [B, H, C - n_out]`` int32 (the chunk
    of each landmark: the non-outlier chunks in chunk order; a row's padding chunks last), ``out_ids [B, H, n_out]``
    (increasing) and ``chunk_valid [B, C]`` bool."""
    if landmark not in LANDMARKS:
        raise ValueError(f"landmark must be one of {LANDMARKS}, got {landmark!r}")
    B, H, N, D = kc.shape
    C = N // chunk
    k5 = kc.float().view(B, H, C, chunk, D)
    mean = k5.mean(dim=3)  # [B, H, C, D]
    chunk_valid = torch.arange(C, device=kc.device)[None] < n_chunks[:, None]  # [B, C]
    cos_sim = F.cosine_similarity(k5, mean[:, :, :, None], dim=-1).amin(-1)  # [B, H, C]
    cos_sim = cos_sim.masked_fill(~chunk_valid[:, None], float("inf"))
    n_out = min(n_out, C)
    out_ids = (-cos_sim).topk(n_out, dim=-1).indices.sort(dim=-1).values  # [B, H, n_out]
    is_out = torch.zeros(B, H, C, dtype=torch.bool, device=kc.device)
    is_out.scatter_(-1, out_ids, True)
    # non-outlier chunks first, in chunk order (stable sort)
    lm_ids = torch.sort(is_out.to(torch.int8), dim=-1, stable=True).indices[..., : C - n_out].to(torch.int32)
    lm = mean if landmark == "mean" else torch.cat([k5.amax(dim=3), k5.amin(dim=3)], dim=-1)
    landmarks = lm.gather(2, lm_ids.long()[..., None].expand(-1, -1, -1, lm.shape[-1])).to(kc.dtype)
    return landmarks, lm_ids, out_ids, chunk_valid


def bound_query(query, width: int):
    """The query that scores landmarks of ``width``: ``query [..., D]`` itself for mean landmarks (``width == D``);
    ``[relu(q), min(q, 0)]`` ``[..., 2D]`` for min-max landmarks (``width == 2D``), whose product with ``[max,
    min]`` is ``sum_d max(q_d max_d, q_d min_d)``: the largest ``q . k`` any key of the chunk can have."""
    D = query.shape[-1]
    if width == D:
        return query
    if width != 2 * D:
        raise ValueError(f"landmarks of width {width} fit neither a query of head size {D} nor its bound ({2 * D})")
    return torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)


def outlier_slots(kc, vc, out_ids, chunk_valid, tok, chunk: int):
    """The exact slots of the outlier chunks ``out_ids [B, H, n]``: keys and values ``[B, H, n x chunk, D]`` from
    the chunk tokens' ``kc, vc [B, H, N, D]``, and their storage positions ``[B, H, n x chunk]`` int32 (``tok [B,
    N]``; -1 in a row's padding chunks, ``chunk_valid [B, C]``)."""
    B, H, N, D = kc.shape
    n_out = out_ids.shape[-1]
    out_tok = (out_ids[..., None] * chunk + torch.arange(chunk, device=kc.device)).flatten(2)  # [B, H, n*c] in [0, N)
    og = out_tok[..., None].expand(-1, -1, -1, D)
    out_valid = chunk_valid.gather(1, out_ids.flatten(1)).view(B, H, n_out)
    out_valid = out_valid[..., None].expand(-1, -1, -1, chunk).flatten(2)
    out_spos = tok[:, None, :].expand(B, H, N).gather(2, out_tok)
    out_pos = torch.where(out_valid, out_spos, -1).to(torch.int32)  # storage positions, -1 = none
    return kc.gather(2, og).contiguous(), vc.gather(2, og).contiguous(), out_pos


# ---- decode --------------------------------------------------------------------------------------------
def select_chunks(query, landmarks, lm_ids, n_chunks, k: int, all_valid: bool):
    """Top ``k`` chunks per (row, KV head, query token) of ``query [B, Hq, T, D]`` by :func:`chunk_scores` over
    ``landmarks [B, H, Cl, D or 2D]`` (mean or min-max; chunk ids ``lm_ids [B, H, Cl]``; those ``>= n_chunks [B]``
    are padding unless ``all_valid``): chunk ids ``[B, H, T, k]``, -1 = none, increasing."""
    B, _, T, D = query.shape
    H, Cl = lm_ids.shape[1], lm_ids.shape[-1]
    lm_valid = None if all_valid else lm_ids < n_chunks.view(B, 1, 1)  # [B, H, Cl]
    q = bound_query(query, landmarks.shape[-1])
    s = chunk_scores(q, landmarks, softmax=True, scale=D ** -0.5, chunk_mask=lm_valid, per_token=True)  # [B,H,T,Cl]
    if lm_valid is not None:
        s = s.masked_fill(~lm_valid[:, :, None], float("-inf"))  # softmax gave them 0: never select them
    sel = topk_indices(s, k)  # landmark slots, -1 = none
    ids = lm_ids[:, :, None].expand(B, H, T, Cl).gather(-1, sel.clamp(min=0))
    return torch.where(sel >= 0, ids, -1)


def top_chunks(query, lm, lm_valid, k: int):
    """One query token ``[B, Hq, 1, D]`` over the fp32 landmarks ``lm [B, H, Cl, D or 2D]`` (``lm_valid [B, H, Cl]``
    or None: all real): :func:`select_chunks`' scores (unsorted) as ``torch.topk`` of ``[B, H, Cl]``; a landmark not
    selectable scores -inf."""
    B, Hq, _, D = query.shape
    H, W = lm.shape[1], lm.shape[-1]
    q = bound_query(query.float(), W)
    # landmarks as the left operand: contiguous, so the batched matmul copies nothing
    s = torch.matmul(lm, q.view(B, H, Hq // H, W).transpose(-1, -2)).transpose(-1, -2)
    s = s * (D ** -0.5)  # [B, H, G, Cl]
    if lm_valid is not None:
        s = s.masked_fill(~lm_valid[:, :, None], float("-inf"))
        s = torch.softmax(s, dim=-1).nan_to_num_(0.0).amax(dim=2).masked_fill_(~lm_valid, float("-inf"))
    else:
        s = torch.softmax(s, dim=-1).amax(dim=2)
    return s.topk(min(k, s.shape[-1]), dim=-1)


def gather_value_chunks(v, ids, chunk: int, n_tokens: int, device):
    """Rows of the chunks ``ids [B, H, T, k]`` (-1 = none) of the value store ``v [B, H, N, D]`` on another device:
    ``[B, H, T x k x chunk, D]`` on ``device`` (in list order; a missing chunk or token reads row 0)."""
    B = v.shape[0]
    tok = chunks_to_tokens(ids.to(v.device), chunk, n_tokens).clamp(min=0)
    Bh = torch.arange(B, device=v.device).view(B, 1, 1, 1)
    Hh = torch.arange(v.shape[1], device=v.device).view(1, -1, 1, 1)
    return v[Bh, Hh, tok].flatten(2, 3).to(device, non_blocking=True)


def rebuild_keys(U, SV, rows, pos, half, table, shape, dtype):
    """Keys ``shape = (B, H, K)`` rebuilt in torch: ``U`` rows ``rows [B x H x K]`` (into ``U.view(B x N, r)``)
    times ``SV [B, H, r, D]`` (fp32, fp64 for fp64 factors), rotated at positions ``pos [B x H x K]``. ``half``: the
    rotate_half tables' first halves ``(cos, sin) [P, Dr/2]`` (rows = positions), or None: ``table()`` gives the
    full ``(cos, sin) [P, Dr]``. Returns ``[B, H, K, D]`` in ``dtype``."""
    B, H, K = shape
    r, D = U.shape[-1], SV.shape[-1]
    u = U.reshape(-1, r).index_select(0, rows).view(B, H, K, r)
    dt = torch.float64 if U.dtype == torch.float64 else torch.float32
    k_pre = torch.matmul(u.to(dt), SV.to(dt))  # [B, H, K, D]
    if half is not None:  # HF rotate_half layout: cos/sin repeat their first Dr/2 columns
        hc, hs = half
        h2 = hc.shape[-1]
        cos = hc.index_select(0, pos).view(B, H, K, h2).to(dt)
        sin = hs.index_select(0, pos).view(B, H, K, h2).to(dt)
        x1, x2 = k_pre[..., :h2], k_pre[..., h2 : 2 * h2]
        parts = [(x1 * cos).addcmul_(x2, sin, value=-1), (x2 * cos).addcmul_(x1, sin)]
        if 2 * h2 < D:
            parts.append(k_pre[..., 2 * h2 :])
        return torch.cat(parts, -1).to(dtype)
    cos, sin = table()
    cos = cos.index_select(0, pos).view(B, H, K, -1).to(dt)
    sin = sin.index_select(0, pos).view(B, H, K, -1).to(dt)
    return apply_rope(k_pre, cos, sin).to(dtype)


def attend_parts(query, parts, qpos, scaling: float, concat_below: int):
    """Attention of ``query [B, Hq, T, D]`` at positions ``qpos [T]`` over several slot sets ``parts`` (``(keys,
    values, pos)``, keys/values ``[B, H, n, D]``, pos ``[B, H, n]``, < 0 not read) in one softmax: a single
    attention over their concatenation when their keys hold at most ``concat_below`` elements, else one per part
    merged by log-sum-exp (which copies nothing). Returns ``[B, T, Hq, D]``."""
    if len(parts) > 1 and sum(k.numel() for k, _, _ in parts) <= concat_below:
        parts = [tuple(torch.cat(x, 2) for x in zip(*parts))]
    if len(parts) == 1:
        return attend_slots(query, *parts[0], qpos, scaling)
    out = lse = None
    for k, v, pos in parts:
        o, l_ = attend_slots(query, k, v, pos, qpos, scaling, return_lse=True)
        o = o.transpose(1, 2)  # [B, Hq, T, D]
        out, lse = (o, l_) if out is None else merge_attn(out, lse, o, l_)
    return out.transpose(1, 2)
