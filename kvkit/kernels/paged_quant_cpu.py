"""Packed 4-bit / 8-bit K/V in a paged cache (vLLM's block layout): writes, reads, a C decode kernel, a torch reference.

Page format (one page = one block of ``bs`` tokens of one KV head, ``bs * C`` bytes, ``C = state_bytes(D, bits)``):

    [ K codes  DB x bs ][ V codes  bs x DB ][ K scale fp16 x bs ][ K min fp16 x bs ][ V scale fp16 x bs ][ V min fp16 x bs ]

with ``DB = D * bits / 8`` bytes of codes per token and head. Both keys and values are quantised **per token**
(asymmetric: ``x ~= code * scale + min`` over the ``D`` channels of one head of one token, codes in
``[0, 2**bits - 1]``), so a slot is written once, when its token is computed, and never re-quantised: no
residual buffer, no per-block statistics that change while a block fills (what a paged cache filled one decode
token at a time would need for per-channel key statistics). Codes use :mod:`kvkit.kernels.quant`'s packing: with
``P = 8 / bits`` values per byte, byte ``b`` holds channels ``b, b + DB, ...`` at bit offsets ``0, bits, ...``.
Bytes per token and head: ``2 * DB + 8`` (4-bit, D=64: 72 bytes against 256 for bf16 K+V, 3.56x; D=128: 136 vs
512, 3.76x; 8-bit: D=64 136 bytes, 1.88x).

* :func:`write` quantises the new tokens' K/V ``[T, H, D]`` into their slots (vectorised torch, one
  ``index_put`` per field).
* :func:`gather` dequantises listed slots back to float K/V (prefill reads the context of the rows it
  prefills this way; tests and the reference too).
* :func:`decode` attends single-token queries ``[n, H * G, D]`` over their rows' pages, straight from the
  block table: a C kernel (one OpenMP task per (row, KV head); per block: scores ``scale_t * (q . code_t) +
  min_t * sum(q)`` for the G query heads of the KV head, an online softmax with a vectorised exp, values
  accumulated as ``sum_t (p_t scale_t) code_t + sum_t p_t min_t``; codes unpacked in registers, never
  written back as floats). :func:`decode_ref` is the plain-torch reference (dequantise, softmax, matmul).

The C source is compiled on first use by :func:`kvkit.kernels.cbuild.build`; without a compiler
:func:`available` is False and :func:`decode` runs the reference. ``KVKIT_PAGED_QUANT_CPU=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import VEC_C, Kernel, c_source

BITS = (4, 8)

_SRC = VEC_C + c_source("paged_quant_cpu.c")


# --- page format ------------------------------------------------------------------------------------------------
def code_bytes(D: int, bits: int) -> int:
    """Bytes of codes per token and head (keys or values)."""
    if bits not in BITS:
        raise ValueError(f"kvkit paged quant: bits must be one of {BITS}, got {bits!r}")
    if (D * bits) % 8:
        raise ValueError(f"kvkit paged quant: head size {D} does not pack into bytes at {bits} bits")
    return D * bits // 8


def state_bytes(D: int, bits: int, block_size: int = 128) -> int:
    """Bytes per token and KV head of a page (vLLM's ``state_content_bytes``): K codes + V codes + 4 fp16
    statistics per token, plus the block's key channel scale (``D`` fp16 per page) spread over its tokens."""
    return 2 * code_bytes(D, bits) + 8 + -(-2 * D // block_size)


def as_pages(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[blocks, H, bs, C / elem]`` (any dtype, last dim contiguous) as bytes ``[blocks, H, bs * C]``."""
    u8 = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return u8.view(*u8.shape[:2], -1)  # a view or an error, never a copy (writes must land in the cache)


def page_fields(pages: torch.Tensor, block_size: int, D: int, bits: int):
    """Views of the page fields: K codes ``[blocks, H, DB, bs]`` (channel-major: the decode kernel loads one byte
    column of 16 tokens at a time), V codes ``[blocks, H, bs, DB]`` uint8, token statistics ``[blocks, H, 4, bs]``
    fp16 (K scale, K min, V scale, V min), key channel scale ``[blocks, H, D]`` fp16."""
    DB, bs = code_bytes(D, bits), block_size
    if pages.shape[-1] != bs * state_bytes(D, bits, bs):
        raise ValueError(f"kvkit paged quant: page of {pages.shape[-1]} bytes, expected {bs} x "
                         f"{state_bytes(D, bits, bs)}")
    a = 2 * bs * DB
    kc = pages[:, :, : bs * DB].unflatten(2, (DB, bs))
    vc = pages[:, :, bs * DB: a].unflatten(2, (bs, DB))
    st = pages[:, :, a: a + 8 * bs].view(torch.float16).unflatten(2, (4, bs))
    cs = pages[:, :, a + 8 * bs: a + 8 * bs + 2 * D].view(torch.float16)
    return kc, vc, st, cs


def quantize_tokens(x: torch.Tensor, bits: int):
    """Per-token asymmetric quantisation of ``x [..., D]``: (codes packed ``[..., DB]`` uint8, scale, min fp16 ``[...]``)."""
    D = x.shape[-1]
    code_bytes(D, bits)
    qmax = (1 << bits) - 1
    xf = x.float().clamp(-6.0e4, 6.0e4)
    mn = xf.amin(dim=-1)
    zero = mn.to(torch.float16)
    scale = ((xf.amax(dim=-1) - zero.float()) / qmax).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        q = q.unflatten(-1, (2, D // 2))
        q = q[..., 0, :] | (q[..., 1, :] << 4)
    return q, scale, zero


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes ``[..., DB]`` -> integer codes ``[..., D]`` (uint8)."""
    if bits == 8:
        return codes
    return torch.cat([codes & 15, codes >> 4], dim=-1)


def write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, block_size: int,
          bits: int) -> None:
    """Quantise ``key, value [T, H, D]`` into the slots ``slots [T]`` (block * bs + offset; < 0: skipped).

    A block whose first slot is written in this call gets its key channel scale ``c = sqrt(max(m_d, mean_d m_d))``
    with ``m_d = max |k_d|`` over the tokens of that block written in this call (per KV head; ZipCache's channel
    normalisation, floored at the channel mean so that a block begun by a single decode token does not inflate the
    channels that token happened to have near zero); every key
    is stored as the per-token quantisation of ``k / c`` with its block's ``c``. Blocks are filled in order (vLLM
    appends; prefix-cache hits are whole blocks), so a block's first slot is written before any other."""
    T = min(key.shape[0], slots.shape[0])
    slots = slots[:T].long()
    key, value = key[:T], value[:T]
    if T == 0:
        return
    D = key.shape[-1]
    pages = as_pages(cache)
    if (available() and key.dtype == value.dtype and key.dtype in (torch.bfloat16, torch.float16)
            and key.stride(-1) == 1 and value.stride(-1) == 1):  # the C kernel skips slots < 0 itself
        if pages.shape[-1] != block_size * state_bytes(D, bits, block_size):
            page_fields(pages, block_size, D, bits)  # raises, naming the sizes
        sl = slots.contiguous()
        rc = _load().kvkit_paged_quant_write(
            key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            int(key.dtype == torch.bfloat16), sl.data_ptr(), sl.numel(), pages.data_ptr(), pages.stride(0),
            pages.stride(1), key.shape[1], D, block_size, bits, max(1, torch.get_num_threads()))
        if rc != 0:
            raise RuntimeError(f"kvkit paged_quant_cpu write refused D={D} bits={bits}")
        return
    write_ref(pages, key, value, slots, block_size, bits)


def write_ref(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, block_size: int,
              bits: int) -> None:
    """The torch path of :func:`write`."""
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if slots.numel() == 0:
        return
    D = key.shape[-1]
    kc, vc, st, cs = page_fields(as_pages(cache), block_size, D, bits)
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    kf = key.float()
    fresh = off == 0
    if bool(fresh.any()):
        ub, inv = torch.unique(blk, return_inverse=True)
        amax = torch.zeros(ub.numel(), kf.shape[1], D).scatter_reduce_(
            0, inv.view(-1, 1, 1).expand_as(kf), kf.abs(), "amax", include_self=False)
        is_new = torch.zeros(ub.numel(), dtype=torch.bool)
        is_new[inv[fresh]] = True
        a = amax[is_new]
        floor = a.mean(dim=-1, keepdim=True).clamp_min(1e-4)  # a block begun by one token: no near-zero channels
        c = torch.maximum(a, floor).sqrt().to(torch.float16)
        cs[ub[is_new]] = c
    c = cs[blk].float()  # [T, H, D]: this call's scale for fresh blocks, the stored one for continued blocks
    qk, sk, zk = quantize_tokens(kf / c, bits)
    qv, sv, zv = quantize_tokens(value, bits)
    kc[blk, :, :, off] = qk
    vc[blk, :, off] = qv
    st[blk, :, 0, off] = sk
    st[blk, :, 1, off] = zk
    st[blk, :, 2, off] = sv
    st[blk, :, 3, off] = zv


def gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int, D: int, bits: int,
           dtype: torch.dtype = torch.float32):
    """Dequantised K, V ``[n, H, D]`` of the slots ``slots [n]``."""
    kc, vc, st, cs = page_fields(as_pages(cache), block_size, D, bits)
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    s = st[blk, :, :, off].float()  # [n, H, 4]
    k = (unpack(kc[blk, :, :, off], bits).float() * s[..., 0:1] + s[..., 1:2]) * cs[blk].float()
    v = unpack(vc[blk, :, off], bits).float() * s[..., 2:3] + s[..., 3:4]
    return k.to(dtype), v.to(dtype)


def row_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(row of each token, slot of each token) of the first ``seq_lens[i]`` tokens of each row, row-major."""
    seq = seq_lens.long()
    rows = torch.repeat_interleave(torch.arange(seq.numel()), seq)
    start = torch.cumsum(seq, 0) - seq
    pos = torch.arange(int(seq.sum())) - start[rows]
    slots = block_table.long()[rows, pos // block_size] * block_size + pos % block_size
    return rows, slots


# --- reference --------------------------------------------------------------------------------------------------
def decode_ref(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, bits: int, scale: float) -> torch.Tensor:
    """Plain torch: each row's query ``q [n, H*G, D]`` over its dequantised tokens; fp32 ``[n, H*G, D]``."""
    n, Hq, D = q.shape
    out = torch.zeros(n, Hq, D, dtype=torch.float32)
    for i in range(n):
        L = int(seq_lens[i])
        if L <= 0:
            continue
        pos = torch.arange(L)
        slots = block_table[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = gather(cache, slots, block_size, D, bits)  # [L, H, D]
        H = k.shape[1]
        G = Hq // H
        qi = q[i].float().view(H, G, D)
        s = torch.einsum("hgd,lhd->hgl", qi, k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hgl,lhd->hgd", p, v).reshape(Hq, D)
    return out


# --- C kernel ---------------------------------------------------------------------------------------------------
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("paged_quant_cpu", _SRC, {
    "kvkit_paged_quant_decode": ([_P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F, _P, _I], _I),
    "kvkit_paged_quant_write": ([_P, _P, _I64, _I64, _I64, _I64, _I, _P, _I64, _P, _I64, _I64, _I, _I, _I, _I, _I],
                                _I),
}, "KVKIT_PAGED_QUANT_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_PAGED_QUANT_CPU=0``."""
    return _KERNEL.available()


def decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           block_size: int, bits: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of single-token queries ``q [n, H*G, D]`` over the packed pages of their rows (block ids
    ``block_table [n, >= max blocks]``, tokens ``seq_lens [n]``); returns fp32 ``[n, H*G, D]`` (into ``out`` if
    given, fp32 contiguous). The C kernel when available, else :func:`decode_ref`."""
    n, Hq, D = q.shape
    pages = as_pages(cache)
    H = pages.shape[1]
    if Hq % H:
        raise ValueError(f"kvkit paged quant: {Hq} query heads do not group over {H} KV heads")
    if pages.shape[-1] != block_size * state_bytes(D, bits, block_size):
        raise ValueError(f"kvkit paged quant: page of {pages.shape[-1]} bytes, expected {block_size} x "
                         f"{state_bytes(D, bits, block_size)}")
    if not available() or pages.stride(2) != 1:
        r = decode_ref(q, cache, block_table, seq_lens, block_size, bits, scale)
        if out is not None:
            out.copy_(r)
            return out
        return r
    qf = q.to(torch.float32).contiguous()
    bt = block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous()
    if n == 0:
        return out
    esz = 1  # pages are uint8: strides in bytes
    with torch.profiler.record_function("kvkit::paged_quant_decode_cpu"):
        rc = _load().kvkit_paged_quant_decode(
            qf.data_ptr(), pages.data_ptr(), pages.stride(0) * esz, pages.stride(1) * esz, bt.data_ptr(), bt.shape[1],
            sl.data_ptr(), n, H, Hq // H, D, block_size, bits, float(scale), out.data_ptr(),
            max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_quant_cpu kernel refused shapes H={H} G={Hq // H} D={D} bs={block_size} "
                           f"bits={bits}")
    return out
