"""The attention primitives every store calls: transformers' own sdpa (exact layers), the prefix + causal-suffix
split for verification forwards, and :func:`attend_slots`, THE slot attention of compressed stores."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvkit import kernels
from kvkit.kernels.view import DecodeView

_SDPA_EXTRAS = ("position_bias", "softcap", "cache", "s_aux", "sinks")

#: torch's SDPA backends a CUDA decode read may use: everything but cuDNN, whose plan cache is keyed on the key
#: length, so a decode step (one more key every step) would build new plans on the host at every call
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def seam_decode(query, keys, values, scaling, *, pos=None, qpos=None, extra_mask=None, log_weight=None):
    """One decode query per row through the decode seam (:func:`kvkit.kernels.decode`, which picks the backend), or
    None where the kernels package leaves the read to the caller's SDPA path (its ``torch_path="caller"``).

    query ``[B, Hq, 1, D]``; keys/values ``[B, H, n, D]``; pos ``[B, Hp, n]`` (-1 = not read) with qpos ``[1]``,
    or both None (every slot read); extra_mask ``[B, Hp|1, 1, n]`` bool folded into pos; log_weight
    ``[B, H|1, n]``. Returns ``(out [B, 1, Hq, D], lse [B, Hq, 1] fp32)``. The view is built only where a kernel
    reads it.
    """

    def view():
        p = pos if extra_mask is None else torch.where(extra_mask[:, :, 0, :], pos, -1)
        B, H, n = query.shape[0], keys.shape[1], keys.shape[2]
        lw = None if log_weight is None else log_weight.to(torch.float32).expand(B, H, n).contiguous()
        return DecodeView(keys, values, pos=p, qpos=None if p is None else qpos[-1], log_weight=lw)

    r = seam_view(query, view, scaling)
    return None if r is None else (r[0][:, None], r[1][:, :, None])


def seam_view(query, view, scaling, torch_path: str = "caller"):
    """:func:`kvkit.kernels.decode` of ``query [B, Hq, 1, D]`` over a store's own :class:`DecodeView` (or a function
    building it). Returns ``(out [B, Hq, D], lse [B, Hq] fp32)``, or None where the kernels package leaves the read to
    the caller (``torch_path="caller"``: the CPU, a multi-token step, a failed launch)."""
    if query.shape[2] != 1:
        return None
    return kernels.decode(query[:, :, 0], view, scale=scaling, return_lse=True, torch_path=torch_path)


def decode_backends(query: torch.Tensor):
    """Context for an SDPA call of ``query [B, H, T, D]``: on CUDA with one query token, the backends of
    :data:`_DECODE_BACKENDS` (a local choice for this call; torch's global flags are left as the user set them);
    otherwise (prefill, verification, the CPU) torch's own choice."""
    if query.is_cuda and query.shape[-2] == 1:
        return sdpa_kernel(_DECODE_BACKENDS)
    return contextlib.nullcontext()


def plain_sdpa_call(kwargs) -> bool:
    """True when transformers passes none of the extras (position bias, softcap, paged cache, sinks) that only
    its own ``sdpa_attention_forward`` handles: kvkit's CPU shortcuts may then replace it."""
    return not any(kwargs.get(k) is not None for k in _SDPA_EXTRAS) and not torch.compiler.is_compiling()


def hf_sdpa(module, query, key, value, attention_mask, scaling, dropout=0.0, output_unused=False, **kwargs):
    """transformers' own sdpa attention (bit-identical to an unpatched ``sdpa`` model).

    One CPU shortcut: for a multi-token forward with a mask over a cache (chunked prefill, speculative
    verification) on a GQA model, transformers repeats every K/V head ``num_key_value_groups`` times
    (a full copy of the layer's KV per forward, because CUDA's masked GQA would fall back to the math
    kernel). torch's CPU flash kernel runs masked GQA natively (``enable_gqa``) and gives the same
    bits (``tests/core/test_core.py::test_cpu_masked_gqa_matches_transformers_bitwise``); cost measured by
    ``benchmarks/speculative/profile_verify.py`` (results/speculative).

    ``output_unused=True``: the caller discards the output of this prefill attention (a replayed prefill,
    :func:`kvkit.workloads.shared_prefill.replay_prefill`: the stores keep K/V and their statistics from the query,
    never the output); a call whose queries span all its keys (the prompt's own attention) then returns zeros
    ``[B, T, Hq, Dv]`` instead of computing it.
    """
    if output_unused and query.shape[2] == key.shape[2]:
        B, Hq, T, _ = query.shape
        return query.new_zeros(B, T, Hq, value.shape[-1])
    if (
        attention_mask is not None
        and query.device.type == "cpu"
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and plain_sdpa_call(kwargs)
    ):
        # (folding each K/V head's query heads into one query block would read K/V once per K/V head, but
        # changes the flash kernel's blocking and so the bits; enable_gqa keeps them)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    with decode_backends(query):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    return out


def attend_static(module, query, keys, values, attention_mask, length, scaling, dropout=0.0, **kwargs):
    """Attention of a static layer's step (:class:`kvkit.stores.full.StaticFullStore`): fixed shapes, no host read.

    query ``[B, Hq, T, D]`` are the T newest tokens, written at slots ``length - T .. length - 1`` of the buffers
    keys/values ``[B, H, cap, D]``; attention_mask ``[B, 1, T, cap]`` bool (transformers' causal + padding mask over
    the capacity; True = read) or None (then slot j is read by query t iff ``j <= length - T + t``). The query heads
    of each KV head are folded into one block (K/V read once per KV head, not once per query head as transformers'
    masked GQA does). With transformers' extras (softcap, sinks, position bias), dropout or a float mask it is
    transformers' own sdpa over the buffers. Returns ``[B, T, Hq, D]``.
    """
    B, Hq, T, D = query.shape
    H, cap = keys.shape[1], keys.shape[2]
    m = attention_mask
    if (dropout or any(kwargs.get(k) is not None for k in _SDPA_EXTRAS) or Hq % H
            or (m is not None and (m.dtype != torch.bool or m.dim() != 4))):
        return hf_sdpa(module, query, keys, values, attention_mask, scaling, dropout, **kwargs)
    G = Hq // H
    if T == 1:
        # the fused split-K kernel (an opaque operator in the compiled graph): slots [0, length) are held (the loop
        # stops there: free capacity is not read), the mask's hidden slots (padding) get a -inf log-weight
        def view():
            lw = None
            if m is not None:
                lw = torch.zeros(m.shape[0], cap, device=query.device).masked_fill(~m[:, 0, 0], float("-inf"))
                lw = lw[:, None].expand(B, H, cap)
            return DecodeView(keys, values, length=length.reshape(1).expand(B), log_weight=lw)

        r = seam_view(query, view, scaling)
        if r is not None:
            return r[0][:, None]
    if m is None:
        qpos = length - T + torch.arange(T, device=query.device)
        m = (torch.arange(cap, device=query.device)[None, :] <= qpos[:, None])[None, None]  # [1, 1, T, cap]
    m = m[:, :, None].expand(m.shape[0], m.shape[1], G, T, cap).reshape(m.shape[0], m.shape[1], G * T, cap)
    q = query.reshape(B, H, G * T, D)  # query head h*G + g reads KV head h; row g*T + t
    with decode_backends(query):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=scaling)
    out = torch.nan_to_num(out, nan=0.0)  # a row that sees nothing (padding query) reads zeros
    return out.reshape(B, Hq, T, D).transpose(1, 2)


def causal_suffix_attention(query, keys, values, attention_mask, scaling):
    """Attention of the T newest tokens of a cache over all n held, as prefix + suffix; CPU only.

    query ``[B, Hq, T, D]`` are the queries of the last T of the n keys ``[B, H, n, D]``; the mask must be
    the plain causal one (every prefix key visible to every query; no padding, no sliding window),
    otherwise this returns None and the caller uses the masked kernel. The prefix (n - T keys) runs
    through torch's CPU flash kernel with no mask and the query heads of each K/V head folded into one
    block (K/V read once per K/V head), the T x T causal suffix in plain torch, and the two merge by
    their log-sum-exp. For speculative verification (T = gamma + 1; cost in results/speculative). Same math as
    sdpa, different rounding (~1e-6). Returns ``[B, T, Hq, D]``.
    """
    B, Hq, T, D = query.shape
    H, n = keys.shape[1], keys.shape[2]
    if query.device.type != "cpu" or T < 2 or n <= T or Hq % H or values.shape[-1] != D:
        return None
    causal = torch.ones(T, n, dtype=torch.bool, device=query.device).tril(n - T)
    if attention_mask is not None:
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        if m.dim() != 4 or m.shape[-2:] != (T, n) or not torch.equal(m, causal.expand_as(m)):
            return None
    return prefix_suffix_attention(query, keys, values, scaling)[0]


def prefix_suffix_attention(query, keys, values, scaling):
    """:func:`causal_suffix_attention` without its checks (CPU; every prefix key visible, causal suffix, no
    padding): returns ``(out [B, T, Hq, D], lse [B, Hq, T] fp32)``. Also KVzip's reconstruction forward."""
    B, Hq, T, D = query.shape
    H, n = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = query.reshape(B, H, G * T, D)  # query head h * G + g reads K/V head h; row g * T + t
    out_p, lse_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys[:, :, : n - T], values[:, :, : n - T], scale=scaling)
    s = (q @ keys[:, :, n - T :].transpose(-1, -2)) * scaling  # [B, H, G*T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    s = s.masked_fill(~causal.repeat(G, 1), float("-inf"))
    lse_s = s.logsumexp(-1)
    out_s = s.softmax(-1) @ values[:, :, n - T :]
    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p * (lse_p - lse).exp().unsqueeze(-1) + out_s * (lse_s - lse).exp().unsqueeze(-1)
    return out.view(B, Hq, T, D).transpose(1, 2).to(query.dtype), lse.float().reshape(B, Hq, T)


def folded_masked_attention(query, keys, values, attention_mask, scaling):
    """Attention of T query tokens over all n held keys under any 4-D mask ``[B, 1, T, n]`` (bool, True = read, or
    additive float), with the query heads of each K/V head folded into one block so K/V are read once per K/V head
    (transformers' masked GQA path reads them once per query head); CPU only, else None. For speculative
    verification of rows that are not aligned (left padding, holes of rejected drafts), where
    :func:`causal_suffix_attention` does not apply. Same math as sdpa, different rounding (~1e-6).
    Returns ``[B, T, Hq, D]``; a query row that sees nothing reads zeros."""
    B, Hq, T, D = query.shape
    H, n = keys.shape[1], keys.shape[2]
    m = attention_mask
    if (query.device.type != "cpu" or Hq % H or m is None or m.dim() != 4 or m.shape[1] != 1
            or tuple(m.shape[-2:]) != (T, n) or values.shape[-1] != D):
        return None
    G = Hq // H
    q = query.reshape(B, H, G * T, D)  # query head h * G + g reads K/V head h; row g * T + t
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=query.dtype, device=query.device).masked_fill_(~m, float("-inf"))
    m = m.to(query.dtype).expand(B, 1, T, n).unsqueeze(2).expand(B, 1, G, T, n).reshape(B, 1, G * T, n)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=m, scale=scaling)
    out = torch.nan_to_num(out, nan=0.0)
    return out.view(B, H, G, T, D).reshape(B, Hq, T, D).transpose(1, 2).to(query.dtype)


def _cpu_flash(q, k, v, mask, scaling):
    """torch's CPU flash kernel with an optional float/bool mask; returns (out ``[B, H, M, D]``, lse ``[B, H, M]``)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scaling)


def attend_slots(query, keys, values, pos, qpos, scaling, extra_mask=None, *, log_weight=None, return_lse=False,
                 dense=False):
    """THE slot attention of every compressed store: queries over held slots, masked by the slots' own positions.

    query ``[B, Hq, T, D]``; keys/values ``[B, H, n, D]`` (H divides Hq); pos ``[B, Hp, n]`` int (Hp = 1 or H;
    -1 = padding / dead slot); qpos ``[T]`` absolute positions of the queries; extra_mask ``[B, Hp|1, T, n]`` bool
    or None (a policy's own read rule, e.g. StreamingLLM's window); log_weight ``[B, H|1, n]`` float or None, added
    to each key's score (Chelsea's ``log(cluster size)``; ``-inf`` hides a key). A slot is read when
    ``0 <= pos <= qpos`` (causal), extra_mask holds and its log_weight is not ``-inf``.

    Returns ``[B, T, Hq, D]`` in query's dtype, and with ``return_lse`` also the log-sum-exp ``[B, Hq, T]`` fp32
    (for :func:`kvkit.kernels.merge_attn`). A query that sees no slot reads zeros (lse ``-inf``).
    The query heads of each KV head are folded into one block, so K/V are read once per KV head. ``dense=True``
    is the caller's promise that every slot is visible to the (single) query (no padding, no dead slot, no
    extra mask): the read then runs unmasked. Nothing here reads a device value on the host (no synchronisation).
    """
    B, Hq, T, D = query.shape
    H, n = keys.shape[1], keys.shape[2]
    G = Hq // H
    if n and T == 1:
        dense1 = dense and extra_mask is None
        r = seam_decode(query, keys, values, scaling, pos=None if dense1 else pos, qpos=qpos,
                        extra_mask=None if dense1 else extra_mask, log_weight=log_weight)
        if r is not None:
            return r if return_lse else r[0]
    q = query.reshape(B, H, G * T, D)  # query head h*G + g reads KV head h; row g*T + t
    mask = None
    if n == 0:
        out = query.new_zeros(B, Hq, T, D).transpose(1, 2)
        lse = torch.full((B, Hq, T), float("-inf"), device=query.device)
        return (out, lse) if return_lse else out
    if not (dense and T == 1 and extra_mask is None):
        allowed = (pos[:, :, None, :] <= qpos.view(1, 1, T, 1)) & (pos[:, :, None, :] >= 0)  # [B, Hp, T, n]
        if extra_mask is not None:
            allowed = allowed & extra_mask
        mask = allowed.expand(B, H, T, n).unsqueeze(2).expand(B, H, G, T, n).reshape(B, H, G * T, n)
    if log_weight is not None:
        lw = log_weight.to(query.dtype if query.is_floating_point() else torch.float32)
        lw = lw.expand(B, H, n)[:, :, None, :].expand(B, H, G * T, n)
        mask = lw if mask is None else lw.masked_fill(~mask, float("-inf"))
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16) and (
        return_lse or log_weight is not None
    ):
        out, lse = _cpu_flash(q, keys, values, mask, scaling)
    elif return_lse:  # plain fp32 math (other devices)
        s = (q.float() @ keys.float().transpose(-1, -2)) * scaling
        if mask is not None:
            s = s + mask.float() if mask.dtype != torch.bool else s.masked_fill(~mask, float("-inf"))
        lse = s.logsumexp(-1)
        out = (s - lse.unsqueeze(-1)).exp().nan_to_num(0.0) @ values.float()
        out = out.to(query.dtype)
    else:
        with decode_backends(query):
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        lse = None
    if mask is not None:  # a query with nothing visible (padding inside a chunk) gives NaN
        out = torch.nan_to_num(out, nan=0.0)
    out = out.reshape(B, H, G, T, D).reshape(B, Hq, T, D).transpose(1, 2)
    if not return_lse:
        return out
    lse = lse.float().reshape(B, H, G, T).reshape(B, Hq, T)
    lse = torch.where(torch.isnan(lse), float("-inf"), lse)
    return out, lse
