"""Decode-attention kernels for compressed KV caches, with plain-torch references.

Public API (shapes: B batch, Hq query heads, Hkv KV heads, Tq query tokens, N stored tokens, D head dim)

* :func:`decode` -- one query token over a :class:`DecodeView` (the decode seam: fixed capacity, no host sync).
* :func:`sparse_decode` -- attention over listed token indices (per KV head or per query head).
* :func:`merge_attn` -- combine two partial results through their log-sum-exp; :func:`merge_partials`, any number.
* :func:`weighted_decode` -- dense attention with an additive per-key log-weight.
* :func:`quantize` / :func:`dequantize` / :func:`packed_nbytes` / :func:`quant_decode` -- int8/4/2 KV.
* :func:`lowrank_decode` -- ShadowKV: keys rebuilt from low-rank factors + RoPE, attended with their values.
* :func:`lowrank_token_decode` -- ShadowKV's single-token CPU step through the C kernel (None where it cannot run).
* :func:`chunk_scores` / :func:`topk_indices` -- chunk selection helpers.

Callers: ``tidal`` (sparse_decode), ``chelsea`` (decode, through ``attend_slots``), ``zipcache`` (quantize,
decode with packed parts, quant_decode), ``shadowkv`` (chunk_scores, topk_indices, lowrank_decode, lowrank_token_decode, merge_attn).

Dispatch (:mod:`.dispatch`, the one place a path is picked): CUDA tensors with Triton importable -> Triton
kernels; anything else -> the torch reference (fp32 math) or a C kernel on the CPU. ``KVKIT_KERNELS=reference``
forces the reference, ``KVKIT_KERNELS=triton`` forces Triton (on CPU tensors that needs ``TRITON_INTERPRET=1``,
which the tests set). Triton is imported only when a Triton kernel is about to run. ``KVKIT_DEBUG=1`` checks index ranges on the host and raises a clear
IndexError (one device sync); without it, out-of-range entries are treated as padding and never read.

Modules: :mod:`.dispatch` (the path choice), :mod:`.seam` (:func:`decode`), :mod:`.selected` (sparse and weighted
reads), :mod:`.packed` (:func:`quant_decode`), :mod:`.lowrank_read` (ShadowKV's reads), :mod:`.quant` (packing),
:mod:`.reference` (the torch references), :mod:`.decode_op` (the compiled steps' operators), :mod:`.view` (the
seam's views); the Triton kernels and the C kernels in their own modules.
"""

from __future__ import annotations

from .dispatch import backend, use_triton
from .gather import gather_attend, gather_attend_torch
from .lowrank_read import lowrank_decode, lowrank_token_decode
from .packed import quant_decode
from .quant import Packed, dequantize, packed_nbytes, quantize
from .reference import merge_attn, merge_partials
from .scoring import chunk_scores, topk_indices
from .seam import decode
from .selected import sparse_decode, weighted_decode
from .view import DecodeView, PackedPart

__all__ = [
    "DecodeView", "PackedPart", "decode",
    "Packed", "backend", "chunk_scores", "dequantize", "gather_attend", "gather_attend_torch", "lowrank_decode",
    "merge_attn",
    "merge_partials",
    "lowrank_token_decode", "packed_nbytes", "quant_decode", "quantize", "sparse_decode",
    "topk_indices", "use_triton", "weighted_decode",
]
