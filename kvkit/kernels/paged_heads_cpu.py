"""Decode attention over vLLM's bf16 paged KV cache where every (row, KV head) reads its own list of blocks.

vLLM's CPU op (``cpu_attention_with_kv_cache``) takes one block table per row, shared by all heads. DuoAttention
(``duo`` in the vLLM plugin) needs more: a *retrieval* head reads every block of its row, a *streaming* head only
the sink blocks and the most recent ones. :func:`decode` attends single-token queries ``q [n, H * G, D]`` over
per-(row, KV head) block lists ``blocks [n, H, W]`` (block ids) with ``ntok [n, H]`` tokens: every listed block
is full except the last, which holds ``ntok - (nblk - 1) * bs`` tokens (``nblk = ceil(ntok / bs)``). The G query
heads of a KV head (GQA, vLLM's order: query head ``j`` uses KV head ``j // G``) share its reads. Keys are cached
after RoPE, so attention over a subset of a row's blocks is exact softmax attention over the tokens listed.

Page layout: a layer's cache is vLLM's ``[num_blocks, kv_heads, block_size, 2 * head_size]`` tensor, viewed as
``[num_blocks, kv_heads, 2 * block_size, head_size]`` and split in two: the key page of (block, head) is the first
``bs * D`` elements of its slab, the value page the next ``bs * D``. The order *inside* a page depends on the ISA
vLLM's ``cpu_attn_reshape_and_cache`` writes for (read back from it, ``tests/vllm/test_vllm_duo.py``):

* ``"amx"`` (bf16 on AMX machines, ``D % 32 == 0``): keys in 16-token tiles ``[bs/16][D/2][16][2]`` (channel pairs
  of 16 tokens: one 64-byte line = 16 tokens x 2 channels), values in 16-channel groups ``[D/16][bs/2][16][2]``
  (token pairs: one line = 2 tokens x 16 channels);
* ``"vec"`` (the ``vec`` / ``vec16`` ISAs): keys channel-major ``[D][bs]``, values token-major ``[bs][D]``.

Either way a 64-byte load feeds 16 fp32 lanes, bf16 -> fp32 by a 16-bit shift (``x << 16`` / ``x & 0xffff0000``
on the pair words), no shuffles. One OpenMP task per (row, KV head) (dynamic schedule: a retrieval head's task is
longer than a streaming head's); per listed block the G query rows' scores are computed 16 tokens at a time, an
online softmax (vectorised exp) rescales the G x D accumulators held in vector registers, and the block's values
are accumulated. :func:`decode_ref` is the plain-torch reference (gather the listed tokens, softmax, matmul) and
the fallback without a C compiler; ``KVKIT_PAGED_HEADS_CPU=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import VEC_C, Kernel, c_source

LAYOUTS = ("amx", "vec")

_SRC = VEC_C + c_source("paged_heads_cpu.c")


# --- page layout --------------------------------------------------------------------------------------------------
def layout_for_isa(isa: str) -> str:
    """The page layout vLLM's ``cpu_attn_reshape_and_cache`` writes for ``isa``."""
    if isa == "amx":
        return "amx"
    if isa in ("vec", "vec16"):
        return "vec"
    raise NotImplementedError(f"kvkit paged heads: vLLM's {isa!r} CPU page layout is not supported (amx, vec, vec16)")


def page_offsets(block_size: int, D: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(koff, voff)`` ``[bs, D]`` int64: the element offset of token ``t``, channel ``d`` inside a key / value page."""
    t = torch.arange(block_size).unsqueeze(1)
    d = torch.arange(D).unsqueeze(0)
    if layout == "amx":
        if D % 32 or block_size % 16:
            raise ValueError(f"kvkit paged heads: the amx layout needs D % 32 == 0 and bs % 16 == 0, got D={D} "
                             f"bs={block_size}")
        koff = (t // 16) * (16 * D) + (d // 2) * 32 + (t % 16) * 2 + d % 2
        voff = (d // 16) * (block_size * 16) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    elif layout == "vec":
        koff = d * block_size + t
        voff = t * D + d
    else:
        raise ValueError(f"kvkit paged heads: unknown layout {layout!r} (one of {LAYOUTS})")
    return koff, voff


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU layer cache ``[blocks, H, bs, 2 * D]`` -> (key pages, value pages) ``[blocks, H, bs, D]`` views."""
    nb, H, bs, D2 = kv_cache.shape
    return kv_cache.view(nb, H, 2 * bs, D2 // 2).chunk(2, dim=2)


def _flat_pages(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, H, bs, D]`` key or value pages (each page contiguous) -> ``[blocks, H, bs * D]`` view."""
    nb, H, bs, D = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != D:
        raise ValueError("kvkit paged heads: each page must be contiguous (stride (.., .., D, 1))")
    return torch.as_strided(cache, (nb, H, bs * D), (cache.stride(0), cache.stride(1), 1), cache.storage_offset())


def write(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          slots: torch.Tensor, layout: str) -> None:
    """Write ``key, value [T, H, D]`` into ``slots [T]`` (block * bs + offset) in ``layout`` (torch; what vLLM's
    ``cpu_attn_reshape_and_cache`` does, for tests without vLLM)."""
    nb, H, bs, D = key_cache.shape
    koff, voff = page_offsets(bs, D, layout)
    slots = slots.long()
    blk, t = slots // bs, slots % bs
    kp, vp = _flat_pages(key_cache), _flat_pages(value_cache)
    for h in range(H):
        kp[blk.unsqueeze(1), h, koff[t]] = key[:, h].to(kp.dtype)
        vp[blk.unsqueeze(1), h, voff[t]] = value[:, h].to(vp.dtype)


def gather(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, head: int,
           layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[n, D]`` of one KV head at ``slots [n]`` (fp32)."""
    nb, H, bs, D = key_cache.shape
    koff, voff = page_offsets(bs, D, layout)
    slots = slots.long()
    blk, t = slots // bs, slots % bs
    kp, vp = _flat_pages(key_cache), _flat_pages(value_cache)
    return kp[blk.unsqueeze(1), head, koff[t]].float(), vp[blk.unsqueeze(1), head, voff[t]].float()


def list_slots(blocks: torch.Tensor, ntok: int, block_size: int) -> torch.Tensor:
    """The slots of the ``ntok`` tokens a block list ``blocks [W]`` reads (every block full but the last)."""
    pos = torch.arange(int(ntok))
    return blocks.long()[pos // block_size] * block_size + pos % block_size


# --- reference ----------------------------------------------------------------------------------------------------
def decode_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
               ntok: torch.Tensor, scale: float, layout: str) -> torch.Tensor:
    """Plain torch: each (row, KV head)'s query heads over the tokens its block list reads; fp32 ``[n, H*G, D]``."""
    n, Hq, D = q.shape
    H, bs = key_cache.shape[1], key_cache.shape[2]
    G = Hq // H
    out = torch.zeros(n, Hq, D, dtype=torch.float32)
    for i in range(n):
        for h in range(H):
            L = int(ntok[i, h])
            if L <= 0:
                continue
            k, v = gather(key_cache, value_cache, list_slots(blocks[i, h], L, bs), h, layout)
            qi = q[i, h * G: (h + 1) * G].float()
            p = torch.softmax(qi @ k.T * scale, dim=-1)
            out[i, h * G: (h + 1) * G] = p @ v
    return out


# --- C kernel -----------------------------------------------------------------------------------------------------
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("paged_heads_cpu", _SRC, {
    "kvkit_paged_heads_decode": ([_P, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F, _P, _I], _I),
    "kvkit_paged_heads_decode_rows": ([_P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F,
                                       _P, _I64, _I], _I),
}, "KVKIT_PAGED_HEADS_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_PAGED_HEADS_CPU=0``."""
    return _KERNEL.available()


def decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
           ntok: torch.Tensor, scale: float, layout: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of single-token queries ``q [n, H*G, D]`` over per-(row, KV head) block lists.

    key_cache, value_cache : ``[num_blocks, H, bs, D]`` bf16 pages (:func:`split_cache` of vLLM's layer cache),
        in ``layout`` (:func:`layout_for_isa`).
    blocks : ``[n, H, W]`` block ids per (row, KV head); ntok : ``[n, H]`` tokens read (every listed block full
        but the last; ``ntok <= 0``: zero output).
    Returns fp32 ``[n, H*G, D]`` (into ``out`` if given, fp32 contiguous). The C kernel when available, else
    :func:`decode_ref`."""
    n, Hq, D = q.shape
    nb, H, bs, Dc = key_cache.shape
    if Dc != D or value_cache.shape != key_cache.shape:
        raise ValueError(f"kvkit paged heads: pages {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not "
                         f"match head size {D}")
    if Hq % H:
        raise ValueError(f"kvkit paged heads: {Hq} query heads do not group over {H} KV heads")
    if tuple(blocks.shape[:2]) != (n, H) or tuple(ntok.shape) != (n, H):
        raise ValueError(f"kvkit paged heads: blocks {tuple(blocks.shape)} / ntok {tuple(ntok.shape)} do not match "
                         f"{n} rows x {H} KV heads")
    if layout not in LAYOUTS or bs % 16 or D % 16 or (layout == "amx" and D % 32):
        page_offsets(bs, D, layout)  # raises, naming the problem
    ok = (available() and key_cache.dtype == torch.bfloat16 and value_cache.dtype == torch.bfloat16
          and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1 and key_cache.stride(2) == D)
    if not ok:
        r = decode_ref(q, key_cache, value_cache, blocks, ntok, scale, layout)
        if out is not None:
            out.copy_(r)
            return out
        return r
    qf = q.to(torch.float32).contiguous()
    bl = blocks.to(torch.int32).contiguous()
    nt = ntok.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous()
    if n == 0:
        return out
    with torch.profiler.record_function("kvkit::paged_heads_decode_cpu"):
        rc = _load().kvkit_paged_heads_decode(
            qf.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
            bl.data_ptr(), bl.shape[2], nt.data_ptr(), n, H, Hq // H, D, bs, int(layout == "amx"), float(scale),
            out.data_ptr(), max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_heads_cpu kernel refused shapes H={H} G={Hq // H} D={D} bs={bs} "
                           f"layout={layout}")
    return out


def decode_rows(query: torch.Tensor, tok: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                blocks: torch.Tensor, ntok: torch.Tensor, scale: float, layout: str, output: torch.Tensor) -> None:
    """The engine's call: rows ``tok [n]`` (int64) of ``query [T, H*G, D]`` attend as in :func:`decode` and their
    results land in the same rows of ``output [T, H*G, D]``. bf16 query / output with contiguous heads go straight
    through the C kernel (read and written in place); otherwise :func:`decode` and a copy."""
    T, Hq, D = query.shape
    H = key_cache.shape[1]
    fast = (available() and query.dtype == torch.bfloat16 and output.dtype == torch.bfloat16
            and key_cache.dtype == torch.bfloat16 and value_cache.dtype == torch.bfloat16
            and query.stride(2) == 1 and query.stride(1) == D and output.stride(2) == 1 and output.stride(1) == D
            and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1 and key_cache.stride(2) == D
            and tok.dtype == torch.int64 and tok.is_contiguous() and blocks.dtype == torch.int32
            and blocks.is_contiguous() and ntok.dtype == torch.int32 and ntok.is_contiguous()
            and tuple(blocks.shape[:2]) == (tok.numel(), H) and Hq % H == 0 and layout in LAYOUTS)
    if not fast:
        output[tok] = decode(query[tok], key_cache, value_cache, blocks, ntok, scale, layout).to(output.dtype)
        return
    n = tok.numel()
    if n == 0:
        return
    rc = _load().kvkit_paged_heads_decode_rows(
        query.data_ptr(), query.stride(0), tok.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.stride(0), key_cache.stride(1), blocks.data_ptr(), blocks.shape[2], ntok.data_ptr(), n, H, Hq // H,
        D, key_cache.shape[2], int(layout == "amx"), float(scale), output.data_ptr(), output.stride(0),
        max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_heads_cpu kernel refused shapes H={H} G={Hq // H} D={D} "
                           f"bs={key_cache.shape[2]} layout={layout}")
