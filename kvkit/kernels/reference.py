"""Plain-torch references for every kernel: the CPU path and the ground truth of the tests.

Conventions shared with the Triton kernels
------------------------------------------
* ``q [B, Hq, Tq, D]`` (callers may pass ``[B, Hq, D]``; the public wrappers add/remove ``Tq``),
  keys/values ``[B, Hkv, N, D]``, query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA).
* Index lists are canonical ``[B, Hidx, Ti, L]``: ``Hidx`` = Hkv (one list per KV head, shared by its
  query group) or Hq (one per query head); ``Ti`` = 1 (one list for all Tq query tokens) or Tq (one
  list per query token). Entry -1, or any entry outside ``[0, N)``, means "no token".
* All Tq query tokens see the same keys (no causal mask among them); callers that need causality
  among new tokens attend to those separately and combine with :func:`merge_attn`.
* Softmax statistics in fp32. A query row with no visible key returns zeros and lse = -inf.
* ``lse`` is the natural-log log-sum-exp of the scaled (and biased) scores, ``[B, Hq, Tq]`` fp32.

``upcast=True`` (the CPU path) computes everything in fp32; ``upcast=False`` runs the matmuls in the
input dtype (bf16/fp16) like a plain low-precision torch implementation: the tests' error yardstick.
Pass fp64 inputs with ``upcast=False`` for the fp64 ground truth.
"""

from __future__ import annotations

import torch

from .quant import dequantize

NEG_INF = float("-inf")


# ---- core ------------------------------------------------------------------------------------------
def attend(q, kg, vg, ok, bias=None, *, scale: float, upcast: bool = True):
    """Softmax attention of ``q [B, Hq, Tq, D]`` over per-list keys.

    kg, vg ``[B, Hidx, Ti, L, D]`` (Ti in {1, Tq}); ok ``[B, Hidx, Ti, L]`` bool (False = no key);
    bias ``[B, Hidx, Ti, L]`` additive (natural-log units) or None.
    Returns out ``[B, Hq, Tq, D]`` (q.dtype) and lse ``[B, Hq, Tq]`` (fp32, or fp64 for fp64 inputs).
    """
    B, Hq, Tq, D = q.shape
    Hidx, Ti = kg.shape[1], kg.shape[2]
    GH = Hq // Hidx
    cdt = torch.float32 if (upcast or q.dtype in (torch.float16, torch.bfloat16)) else q.dtype
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    qv = q.reshape(B, Hidx, GH, Tq, D)
    mm = (lambda t: t.to(cdt)) if upcast else (lambda t: t)
    if Ti == 1:
        s = torch.einsum("bhgtd,bhld->bhgtl", mm(qv), mm(kg[:, :, 0]))
    else:
        s = torch.einsum("bhgtd,bhtld->bhgtl", mm(qv), mm(kg))
    s = s.to(stat) * scale
    okb = ok[:, :, None]  # [B, Hidx, 1, Ti, L] broadcasts over GH (and over Tq when Ti == 1)
    if bias is not None:
        s = s + bias[:, :, None].to(stat)
    s = s.masked_fill(~okb, NEG_INF)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    lsum = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(lsum > 0, lsum, torch.ones_like(lsum))
    lse = (torch.log(lsum) + m).squeeze(-1)  # log(0) = -inf for empty rows
    pv = p.to(cdt) if upcast else p.to(vg.dtype)
    if Ti == 1:
        out = torch.einsum("bhgtl,bhld->bhgtd", pv, mm(vg[:, :, 0]))
    else:
        out = torch.einsum("bhgtl,bhtld->bhgtd", pv, mm(vg))
    return out.reshape(B, Hq, Tq, D).to(q.dtype), lse.reshape(B, Hq, Tq)


def _gather_rows(x, idx, hkv_of):
    """x ``[B, Hkv, N, F]`` -> rows ``[B, Hidx, Ti, L, F]`` at token ids ``idx [B, Hidx, Ti, L]`` (clamped).
    A contiguous x is read with one ``index_select`` of whole rows (a row copy, not per-element indexing)."""
    B, Hidx, Ti, L = idx.shape
    Hkv, N, F = x.shape[1], x.shape[2], x.shape[3]
    b = torch.arange(B, device=idx.device).view(B, 1, 1, 1)
    h = hkv_of.view(1, Hidx, 1, 1)
    t = idx.clamp(0, max(N - 1, 0))
    if x.is_contiguous() and N > 0:
        rows = ((b * Hkv + h) * N + t).view(-1)
        return x.view(-1, F).index_select(0, rows).view(B, Hidx, Ti, L, F)
    return x[b, h, t]


def chunks_to_tokens(chunk_ids, chunk_size: int, n: int):
    """chunk ids ``[..., C]`` -> token ids ``[..., C*chunk_size]``; -1 for padding chunks and for tokens >= n."""
    ar = torch.arange(chunk_size, device=chunk_ids.device)
    tok = chunk_ids.long()[..., None] * chunk_size + ar
    tok = torch.where((chunk_ids[..., None] >= 0) & (tok < n), tok, torch.full_like(tok, -1))
    return tok.flatten(-2)


def _token_ok(tok, mask, N):
    """Visible keys for token ids ``tok [B, Hidx, Ti, L]``: in range and not masked by ``mask [B, N]``."""
    ok = (tok >= 0) & (tok < N)
    if mask is not None and N > 0:
        b = torch.arange(tok.shape[0], device=tok.device).view(-1, 1, 1, 1)
        ok = ok & mask[b, tok.clamp(0, N - 1)]
    return ok


# ---- sparse / chunked decode -------------------------------------------------------------------------
def sparse_decode_ref(q, k, v, idx, *, scale, mask=None, bias=None, upcast=True):
    """Attention of ``q [B, Hq, Tq, D]`` over the keys listed in ``idx [B, Hidx, Ti, L]`` (token ids into
    ``k, v [B, Hkv, N, D]``). ``mask [B, N]`` bool, ``bias [B, Hkv, N]`` additive. Returns (out, lse)."""
    B, Hkv, N, D = k.shape
    Hidx = idx.shape[1]
    hkv_of = torch.arange(Hidx, device=idx.device) // (Hidx // Hkv)
    idx = idx.long()
    ok = _token_ok(idx, mask, N)
    kg, vg = _gather_rows(k, idx, hkv_of), _gather_rows(v, idx, hkv_of)
    bg = None
    if bias is not None:
        bg = _gather_rows(bias[..., None], idx, hkv_of)[..., 0]
    return attend(q, kg, vg, ok, bg, scale=scale, upcast=upcast)


def dense_decode_ref(q, k, v, *, scale, mask=None, bias=None, upcast=True):
    """Attention over all N keys (no gather): the reference of ``weighted_decode``. bias ``[B, Hkv, N]``."""
    B, Hkv, N, D = k.shape
    ok = torch.ones(B, Hkv, 1, N, dtype=torch.bool, device=k.device)
    if mask is not None:
        ok = ok & mask[:, None, None, :]
    b = None if bias is None else bias[:, :, None, :]
    if b is not None:
        ok = ok & (b != NEG_INF)
    return attend(q, k[:, :, None], v[:, :, None], ok, b, scale=scale, upcast=upcast)


def merge_attn(out1, lse1, out2, lse2):
    """Combine two partial attentions over disjoint key sets.

    out ``[..., D]`` with lse ``[...]`` (natural log). Returns (out, lse) of attention over the union;
    rows where both parts are empty (lse = -inf) give zeros and -inf.
    """
    if out1.shape != out2.shape or lse1.shape != lse2.shape or out1.shape[:-1] != lse1.shape:
        raise ValueError(
            f"kvkit.kernels.merge_attn: shapes must be out [..., D] and lse [...] for both parts, got "
            f"{tuple(out1.shape)}/{tuple(lse1.shape)} and {tuple(out2.shape)}/{tuple(lse2.shape)}"
        )
    out, lse = merge_partials(torch.stack([out1.float(), out2.float()]), torch.stack([lse1.float(), lse2.float()]))
    return out.to(out1.dtype), lse


def merge_partials(out, lse):
    """Combine ``S`` partial attentions over disjoint key sets, stacked in dim 0: out ``[S, ..., D]`` with lse
    ``[S, ...]`` (natural log). Returns (out ``[..., D]`` in out's dtype, lse ``[...]`` fp32) of attention over
    the union; a row whose parts are all empty (lse = -inf) gives zeros and -inf."""
    ls = lse.float()
    m = ls.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(ls - m)  # an empty part (lse -inf) weighs 0
    tot = w.sum(0)
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    merged = (out.float() * (w / safe)[..., None]).sum(0).to(out.dtype)
    return merged, torch.log(tot) + m


# ---- quantized decode --------------------------------------------------------------------------------
def quant_decode_ref(q, kpack, vpack, *, scale, mask=None, upcast=True):
    """Dequantize both packed stores (see ``quant.Packed``) and attend densely: the quant_decode reference."""
    k = dequantize(kpack, q.dtype if not upcast else torch.float32)
    v = dequantize(vpack, q.dtype if not upcast else torch.float32)
    if upcast:
        qq = q.float()
        out, lse = dense_decode_ref(qq, k, v, scale=scale, mask=mask, upcast=True)
        return out.to(q.dtype), lse
    return dense_decode_ref(q, k, v, scale=scale, mask=mask, upcast=False)


# ---- low-rank keys (ShadowKV) ------------------------------------------------------------------------
def rope_cos_sin(pos, inv_freq, attention_scaling: float = 1.0):
    """HF convention: ``cos/sin [..., 2*len(inv_freq)]`` at integer positions ``pos [...]`` (angles in fp32)."""
    f = pos.to(torch.float32)[..., None] * inv_freq.to(pos.device, torch.float32)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rotate_half(x):
    """transformers' ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` on the first ``Dr = cos.shape[-1]`` dims (partial rotary keeps the
    rest): ``x [..., D]``, ``cos/sin`` broadcastable to ``[..., Dr]`` (HF layout, Dr <= D). The one RoPE of
    kvkit (``kvkit.model_info`` re-exports it)."""
    dr = cos.shape[-1]
    if dr == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dr], x[..., dr:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def reconstruct_keys(U, SV, tok, inv_freq, *, positions=None, position_offset=None, attention_scaling=1.0,
                     rope_table=None):
    """Post-RoPE keys from low-rank pre-RoPE factors, fp32 (fp64 for fp64 factors): the reference's key step.

    U ``[B, N, r]`` (shared by the heads), SV ``[B, Hkv, r, D]``, tok ``[B, Hkv, Ti, L]`` token rows
    (-1 = none, treated as row 0), positions ``[B, N]`` int (the original position of each row; default
    ``position_offset[b] + row``, offset default 0), inv_freq ``[Dr/2]`` (Dr <= D rotary dims).
    rope_table: optional ``(cos, sin)`` ``[P, Dr]`` whose row p is the rotation at position p (attention
    scaling included): its rows are gathered instead of evaluating cos/sin (inv_freq is then unused).
    Returns keys ``[B, Hkv, Ti, L, D]``: ``rope(U[tok] @ SV[h], pos[tok])``.
    """
    B, N, r = U.shape
    t = tok.long().clamp(0, max(N - 1, 0))
    b = torch.arange(B, device=U.device).view(B, 1, 1, 1)
    dt = torch.float64 if U.dtype == torch.float64 else torch.float32
    rows = (b * N + t).view(-1)  # row copies (index_select), not per-element indexing
    u = U.reshape(B * N, r).index_select(0, rows).view(*t.shape, r).to(dt)  # [B, Hkv, Ti, L, r]
    k_pre = torch.einsum("bhtlr,bhrd->bhtld", u, SV.to(dt))
    if positions is not None:
        pos = positions.long().reshape(-1).index_select(0, rows).view(t.shape)
    else:
        off = position_offset.long().view(B, 1, 1, 1) if position_offset is not None else 0
        pos = t + off
    if rope_table is not None:
        cos = rope_table[0].index_select(0, pos.view(-1)).view(*pos.shape, -1)
        sin = rope_table[1].index_select(0, pos.view(-1)).view(*pos.shape, -1)
    else:
        cos, sin = rope_cos_sin(pos, inv_freq, attention_scaling)  # angles in fp32, as transformers computes them
    return apply_rope(k_pre, cos.to(dt), sin.to(dt))


def lowrank_decode_ref(q, U, SV, v, tok, inv_freq, *, scale, positions=None, position_offset=None,
                       attention_scaling=1.0, v_gathered=False, mask=None, upcast=True, rope_table=None):
    """Attention over keys rebuilt by :func:`reconstruct_keys` at token rows ``tok [B, Hkv, Ti, L]`` and
    values ``v [B, Hkv, N, D]`` at those rows (or, with ``v_gathered``, ``v [B, Hkv, Ti*L, D]`` already
    in list order)."""
    B, N = U.shape[0], U.shape[1]
    Hkv = SV.shape[1]
    kg = reconstruct_keys(U, SV, tok, inv_freq, positions=positions, position_offset=position_offset,
                          attention_scaling=attention_scaling, rope_table=rope_table)
    ok = _token_ok(tok.long(), mask, N)
    if v_gathered:
        vg = v.reshape(B, Hkv, tok.shape[2], tok.shape[3], v.shape[-1])
    else:
        vg = _gather_rows(v, tok.long(), torch.arange(Hkv, device=tok.device))
    if upcast:
        out, lse = attend(q.float(), kg, vg.float(), ok, scale=scale, upcast=True)
        return out.to(q.dtype), lse
    kg = kg.to(q.dtype) if q.dtype != torch.float64 else kg.double()
    return attend(q, kg, vg, ok, scale=scale, upcast=False)


# ---- scoring -----------------------------------------------------------------------------------------
def chunk_scores(q, lm, *, reduce="max", softmax=False, scale=None, chunk_mask=None, per_token=False):
    """Chunk scores ``[B, Hkv, C]`` (fp32) for ``q [B, Hq, (Tq,) D]`` and landmarks ``lm [B, Hkv, C, D]``.

    score = q . landmark * scale (scale default 1/sqrt(D)); with ``softmax`` (ShadowKV) the scores are
    softmaxed over the chunks first; then reduced (``max`` or ``mean``) over the query heads of each
    KV group and over the Tq query tokens (``per_token``: not over the tokens, ``[B, Hkv, Tq, C]``).
    ``chunk_mask [B, Hkv, C]`` bool: False -> -inf (0 after softmax).
    """
    q4 = q.unsqueeze(2) if q.dim() == 3 else q
    B, Hq, Tq, D = q4.shape
    Hkv = lm.shape[1]
    # one batched matmul (an einsum here dispatches many more small ops, and a decode step calls this per layer)
    s = torch.matmul(q4.float().reshape(B, Hkv, (Hq // Hkv) * Tq, D), lm.float().transpose(-1, -2))
    s = s.view(B, Hkv, Hq // Hkv, Tq, -1) * (D ** -0.5 if scale is None else scale)
    if chunk_mask is not None:
        s = s.masked_fill(~chunk_mask[:, :, None, None], NEG_INF)
    if softmax:
        s = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    s = s if per_token else s.flatten(2, 3)
    if reduce == "max":
        return s.amax(dim=2)
    if reduce == "mean":
        return s.mean(dim=2)
    raise ValueError(f"kvkit.kernels.chunk_scores: reduce must be 'max' or 'mean', got {reduce!r}")


# ---- the decode seam: DecodeView (kvkit.kernels.view) -------------------------------------------------
# Fixed shapes and no host synchronisation (no .item(), bool(t), nonzero or boolean-mask indexing): this is
# also the compiled CPU path of kvkit.kernels.decode.
def dense_view_ref(q, view, *, scale, upcast=True):
    """Attention of one query token ``q [B, Hq, D]`` over the keys of ``view`` itself (not its parts).

    Slot rule (see :mod:`kvkit.kernels.view`): listed by ``index`` (or all cap slots), in ``[0, cap)``, below
    ``length``, with ``0 <= pos <= qpos``; ``log_weight`` added to the score. Returns out ``[B, Hq, D]``
    (q.dtype) and lse ``[B, Hq]`` (fp32; fp64 for fp64 inputs).
    """
    B, Hq, D = q.shape
    k, v = view.k, view.v
    H, cap = k.shape[1], k.shape[2]
    dev = q.device
    L = view.index.shape[2] if view.index is not None else cap
    if cap == 0 or L == 0:  # shapes only: nothing to read
        stat = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_zeros(B, Hq, D), torch.full((B, Hq), NEG_INF, dtype=stat, device=dev)
    if view.index is not None:
        slot = view.index.long()  # [B, H, L]
        ok = (slot >= 0) & (slot < cap)
        slot = slot.clamp(0, cap - 1)
        heads = torch.arange(H, device=dev)
        kg, vg = _gather_rows(k, slot[:, :, None], heads), _gather_rows(v, slot[:, :, None], heads)  # [B,H,1,L,D]
    else:
        slot = torch.arange(cap, device=dev).expand(B, H, cap)
        ok = torch.ones(B, H, cap, dtype=torch.bool, device=dev)
        kg, vg = k[:, :, None], v[:, :, None]
    if view.length is not None:
        ok = ok & (slot < view.length.reshape(B, -1, 1))  # [B, H or 1, 1]
    if view.pos is not None:
        p = view.pos.expand(B, H, cap)
        p = p.gather(2, slot) if view.index is not None else p
        ok = ok & (p >= 0) & (p <= view.qpos.reshape(-1, 1, 1))
    bias = None
    if view.log_weight is not None:
        bias = view.log_weight.gather(2, slot) if view.index is not None else view.log_weight
        bias = bias[:, :, None]
    out, lse = attend(q[:, :, None], kg, vg, ok[:, :, None], bias, scale=scale, upcast=upcast)
    return out[:, :, 0], lse[:, :, 0]


def packed_part_ref(q, part, *, scale, upcast=True):
    """A :class:`kvkit.kernels.view.PackedPart` read by dequantizing: ``q [B, Hq, D]`` -> out, lse ``[B, Hq]``."""
    N = part.k.shape[-2]
    mask = None
    if part.length is not None:
        mask = torch.arange(N, device=q.device)[None, :] < part.length[:, None]
    out, lse = quant_decode_ref(q[:, :, None], part.k, part.v, scale=scale, mask=mask, upcast=upcast)
    return out[:, :, 0], lse[:, :, 0]


def decode_ref(q, view, *, scale, upcast=True):
    """The reference of :func:`kvkit.kernels.decode`: one query token ``q [B, Hq, D]`` over a
    :class:`kvkit.kernels.DecodeView` and its parts, merged by log-sum-exp (:func:`merge_attn`).

    ``upcast=True`` computes in fp32; ``upcast=False`` runs the matmuls in the inputs' dtype (fp64 inputs:
    the ground truth; bf16: the low-precision yardstick). Returns out ``[B, Hq, D]`` (q.dtype) and lse ``[B, Hq]``.
    """
    res = []
    if view.k is not None:
        res.append(dense_view_ref(q, view, scale=scale, upcast=upcast))
    for part in view.parts:
        kind = getattr(part, "kind", None)
        if kind == "dense":
            res.append(decode_ref(q, part, scale=scale, upcast=upcast))
        elif kind == "packed":
            res.append(packed_part_ref(q, part, scale=scale, upcast=upcast))
        else:
            raise ValueError(f"kvkit.kernels.decode: cannot read a view part of type {type(part).__name__}")
    if not res:
        raise ValueError("kvkit.kernels.decode: the view holds nothing (no k/v and no parts)")
    out, lse = res[0]
    for o, s in res[1:]:
        out, lse = merge_attn(out, lse, o, s)
    return out.to(q.dtype), lse
