"""``shadowkv``: ShadowKV (Sun et al., arXiv:2410.21465) -- low-rank pre-RoPE keys + offloaded values.

At the end of the prefill of a long prompt (more than ``min_prompt`` tokens; shorter prompts run
exactly as ``full``), each layer splits the prompt into chunks of ``chunk_size`` tokens and keeps

* **keys** as a truncated SVD of the prompt's *pre-RoPE* keys, heads concatenated (``[S, Hkv*D]``,
  fp32 SVD per batch row): ``U[:, :r]`` ``[B, S, r]`` shared by the heads and ``S*V^T`` split per KV
  head ``[B, Hkv, r, D]``;
* **landmarks**: the mean post-RoPE key of every chunk, per KV head ``[B, Hkv, C, D]`` (``landmark="mean"``, the
  paper); or its channel-wise max and min ``[B, Hkv, C, 2D]`` (``landmark="minmax"``, kvkit's, as Quest bounds a
  page), whose score is the largest ``q . k`` any key of the chunk can have;
* **outliers**: per KV head the ``outliers`` chunks whose keys are least similar to their chunk mean
  (lowest min-cosine-similarity) stay exact on the device (keys and values) and leave the landmark set;
* **local window**: the last ``local_chunks`` chunks plus ``S mod chunk_size`` tokens, exact; every
  generated token is appended exactly after it (so ``crop`` of generated tokens is exact);
* **values** of the chunks go to an offload store (``offload=True``, the paper): CPU pinned memory when the
  model is on CUDA; on CPU-only runs a separate tensor. ``nbytes()`` reports only device-resident bytes (U,
  S*V^T, landmarks, outlier/local/generated K/V, index metadata); ``offloaded_nbytes()`` the value store.
  ``offload=False`` keeps the chunk values on the device (counted in ``nbytes()``): the same reads, no
  transfer per step, and what a CUDA graph needs.

Decode (per layer): :func:`kvkit.kernels.chunk_scores` -- per KV head and query token,
``softmax(q . landmark / sqrt(D))`` in fp32 (min-max: the bound ``relu(q) . max + min(q, 0) . min`` in place of ``q .
landmark``), max over the query heads of the group -- and
:func:`kvkit.kernels.topk_indices` pick the top ``budget // chunk_size`` chunks; the selected chunks' keys are
rebuilt (``U[rows] @ (S*V^T)[head]``, RoPE at the original positions) and attended with their values together
with the exact outliers and the local + generated slots, one softmax over the union:

* CUDA: :func:`kvkit.kernels.lowrank_decode` (Triton, fused) for the chunks, :func:`kvkit.stores.attend_slots`
  for the exact slots, combined by their log-sum-exp (:func:`kvkit.kernels.merge_attn`);
* CPU, one token (decode): :func:`kvkit.kernels.lowrank_token_decode` (the C kernel), one call per layer that rebuilds
  each key in registers and never stores it, exact slots in the same softmax (where the C kernel does not
  serve the inputs -- no C compiler, ``KVKIT_DECODE_CPU=0``, not fp32 -- the keys are rebuilt in torch with
  half-width RoPE tables and the parts merged by LSE once they are large);
* several query tokens in one forward (speculative verification, chunked prefill): the general path, each
  token picking its own chunks (``lowrank_decode``'s torch reference with a RoPE table shared by the cache's
  layers), so a T-token forward equals T single-token forwards.

Why inverse RoPE instead of a hook: the cache only ever receives post-RoPE keys, and for the
rotate_half convention of transformers ``k = a*R(theta) k_pre`` (``a`` = the rope attention scaling,
1 for plain RoPE), so ``k_pre = (k*cos - rotate_half(k)*sin) / (cos^2 + sin^2)`` recovers the pre-RoPE
key exactly from the model's own ``(cos, sin)`` (``info.rope`` at the positions the model used, read
from the ``position_ids`` the attention function receives). No modeling code is hooked or copied and
any RoPE variant the model's rotary module implements (linear, dynamic, YaRN, llama3) is inverted.

Rank: the paper uses 160 for Llama-3-8B (``Hkv*D = 1024``); ``rank=None`` keeps that fraction,
``round(160 / 1024 * Hkv*D)`` (30 for SmolLM2-135M, ``Hkv*D = 192``). The rank is a per-model knob:
the relative error of the rebuilt keys falls as the rank grows (``rank = Hkv*D`` is exact) and how fast
depends on the model's key spectrum, so a small model may need a larger fraction than the paper's;
one more rank holds ``S`` more U entries per layer and batch row and reads one more per selected token
and KV head. ``outliers=None`` scales the paper's 48 chunks at budget 2048 with the budget.

Batches: rows share one stored length (left padding). Chunks are laid out from each row's first real
token, so padding never enters a chunk, the SVD (padding rows are zero, which leaves the singular
vectors of the real rows unchanged) or a landmark, and a padded row compresses as it would alone.
Whether to compress is decided once per batch on the stored prompt length.

Chunked prefill (``kvkit.prefill``): the prompt is compressed at the first single-token decode step
(or at the end of the first forward when that forward alone exceeds ``min_prompt``; later chunks of
such a prompt then stay exact). Value chunks fetched at one step are not reused at the next.

Static (``KVCache(..., static=True)``, ``static_store(ShadowKVStore)``): the exact local window and the generated
tokens are the static slots (written in place at index tensors; the prompt's compression rewrites their prefix),
the factors, landmarks, outliers and values are fixed at the compression. A compiled step selects its chunks with
``torch.topk`` and reads them through ``torch.ops.kvkit.lowrank_decode`` (the Triton kernel on CUDA, the reference
elsewhere), the outliers and slots through the decode seam, merged by log-sum-exp; no host read. The values must be
on the device: on CUDA a static cache needs ``offload=False`` (a CUDA graph cannot gather from host memory; the
cache says so at its first forward). Eager steps over a static store take the same paths as the ordinary store.

The compression and decode steps are plain functions in :mod:`kvkit.stores.lowrank`; this module holds the options,
the state of a layer (:class:`ShadowKVStore`) and the glue between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvkit.calibration import resolve
from kvkit.kernels import lowrank_decode, lowrank_token_decode, merge_attn
from kvkit.policies.base import Policy, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore, attend_slots, hf_sdpa
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.lowrank import (
    LANDMARKS,
    RopeTables,
    attend_parts,
    chunk_layout,
    factorize_keys,
    gather_value_chunks,
    landmarks_and_outliers,
    outlier_slots,
    rebuild_keys,
    rope_layout,
    select_chunks,
    top_chunks,
)
from kvkit.stores.static import static_store

PAPER_RANK, PAPER_WIDTH = 160, 1024  # ShadowKV: rank 160 for Llama-3-8B (8 KV heads x 128)
PAPER_OUTLIERS, PAPER_BUDGET = 48, 2048  # ShadowKV: 48 outlier chunks at a 2048-token budget


@register("shadowkv")
@dataclass(frozen=True)
class ShadowKV(Policy):
    """ShadowKV: low-rank pre-RoPE keys + chunk landmarks on device, values offloaded, sparse decode.

    Parameters
    ----------
    budget : int
        Tokens selected per KV head at each decode step (``budget // chunk_size`` chunks); 2048 in the paper.
    rank : int or None
        SVD rank of the pre-RoPE keys (per model: higher = smaller key error, more bytes); None: the model's
        calibrated rank when it has one (``kvkit calibrate shadowkv``: smallest rank whose rebuilt keys stay
        within a relative error bound in every layer; shipped for the bundled models), else
        ``round(160 / 1024 * Hkv*D)`` (paper: 160 at ``Hkv*D = 1024``).
    chunk_size : int
        Tokens per chunk / landmark; 8 in the paper.
    outliers : int or None
        Outlier chunks per KV head kept exact; None: ``round(48 * budget / 2048)`` (paper: 48 at 2048).
    local_chunks : int
        Last chunks of the prompt kept exact (paper: 4 chunks = 32 tokens), plus ``S mod chunk_size``.
    min_prompt : int
        Only prompts longer than this are compressed (paper: 4096); shorter ones run as ``full``.
    calibrated : bool
        True (default): ``rank=None`` takes the model's calibrated rank if one is found from its config
        (:mod:`kvkit.calibration`). False: the paper's rank ``round(160 / 1024 * Hkv*D)``.
    landmark : str
        How a chunk is ranked. ``"mean"`` (the paper): by its mean key, ``q . mean``. ``"minmax"`` (kvkit): by the
        channel-wise max and min of its keys, ``relu(q) . max + min(q, 0) . min`` -- the largest ``q . k`` any of its
        keys can have, so one key that a head attends to (a needle's token, a copy head's target) is not averaged
        away by its chunk's other keys; twice the landmark bytes (``2D`` per chunk and KV head).
    offload : bool
        True (default, the paper): the chunks' values live in host memory (pinned, when the model is on CUDA) and
        each step fetches the selected ones. False: they stay on the device (more device memory, no transfer per
        step; a static cache on CUDA needs it).
    """

    budget: int = PAPER_BUDGET  # ShadowKV sparse budget, 2048 tokens
    rank: int | None = None  # ShadowKV rank 160 at Hkv*D = 1024; None scales it to the model
    chunk_size: int = 8  # ShadowKV chunk size
    outliers: int | None = None  # ShadowKV: 48 outlier chunks at budget 2048; None scales with budget
    local_chunks: int = 4  # ShadowKV local window: 4 chunks (32 tokens)
    min_prompt: int = 4096  # ShadowKV applies to long contexts; shorter prompts behave as full
    calibrated: bool = True  # kvkit: rank=None uses the model's calibrated rank; False = paper's 160/1024 scaling
    offload: bool = True  # ShadowKV offloads the values to the CPU; False keeps them on the device (kvkit)
    landmark: str = "mean"  # ShadowKV ranks chunks by their mean key; "minmax" by the bound of their keys (kvkit)

    description = "ShadowKV: low-rank pre-RoPE keys + landmarks on device, values offloaded, top-k chunks (2410.21465)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("rank",)
    static_capable: ClassVar[bool] = True
    static_options: ClassVar[dict] = dict(offload=False)  # a CUDA graph reads no host memory
    covering_options: ClassVar[dict | None] = dict(min_prompt=100_000)

    def __post_init__(self):
        check_positive_int("shadowkv", "budget", self.budget)
        check_positive_int("shadowkv", "chunk_size", self.chunk_size)
        check_positive_int("shadowkv", "rank", self.rank, allow_none=True)
        for name in ("outliers", "local_chunks", "min_prompt"):
            v = getattr(self, name)
            if v is None and name == "outliers":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"shadowkv: {name} must be an integer >= 0, got {v!r}")
        if self.landmark not in LANDMARKS:
            raise ValueError(f"shadowkv: landmark must be one of {LANDMARKS} ('mean': the paper's mean key per chunk; "
                             f"'minmax': the channel-wise max and min of its keys), got {self.landmark!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"shadowkv: offload must be True or False, got {self.offload!r}")
        if self.budget < self.chunk_size:
            raise ValueError(
                f"shadowkv: budget ({self.budget}) must be at least chunk_size ({self.chunk_size}) so that one "
                "chunk can be selected"
            )

    # ---- derived settings --------------------------------------------------------------------
    def rank_for(self, width: int) -> int:
        """SVD rank for a layer whose keys are ``width = Hkv*D`` wide (raises if the rank cannot fit)."""
        if self.rank is None:
            return max(1, round(PAPER_RANK / PAPER_WIDTH * width))
        if self.rank > width:
            raise ValueError(
                f"shadowkv: rank={self.rank} is larger than the key width num_key_value_heads*head_dim = {width}; "
                f"use rank <= {width} (or rank=None for {max(1, round(PAPER_RANK / PAPER_WIDTH * width))})"
            )
        return self.rank

    def num_outliers(self) -> int:
        if self.outliers is not None:
            return self.outliers
        return round(PAPER_OUTLIERS * self.budget / PAPER_BUDGET)

    def validate(self, config) -> None:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

        resolve(self, config).rank_for(kv * head_dim)

    def new_shared(self, infos):
        """Once per KVCache: the RoPE tables its layers share (:class:`~kvkit.stores.lowrank.RopeTables`)."""
        return RopeTables()

    def new_layer(self, info: LayerInfo):

        rank = resolve(self, info.config).rank_for(info.num_kv_heads * info.head_dim)
        cls = static_store(ShadowKVStore) if info.static else ShadowKVStore
        return cls(info, self, rank)


class ShadowKVStore(SlotStore):
    """One layer of ShadowKV. Before compression it is a plain exact store (attention is transformers'
    own sdpa, as ``full``); after it, ``keys/values/pos`` hold only the exact local window + generated
    tokens and the compressed prompt lives in the tensors listed in ``_batch_tensors``."""

    concat_below: ClassVar[int] = 1 << 17  # read K elements under which _decode_one_cpu concatenates the parts
    fused_cpu_step: ClassVar[bool] = True  # False: every step through the general path (tests compare the two)

    _batch_tensors = SlotStore._batch_tensors + (
        "rpos", "U", "SV", "landmarks", "lm_ids", "n_chunks", "out_k", "out_v", "out_pos", "rope_base",
        "rope_pos", "v_off",
    )

    def __init__(self, info: LayerInfo, policy: ShadowKV, rank: int):
        super().__init__(info)
        self.budget, self.chunk = policy.budget, policy.chunk_size
        self.rank, self.n_out = rank, policy.num_outliers()
        self.local_chunks, self.min_prompt = policy.local_chunks, policy.min_prompt
        self.offload, self.landmark = policy.offload, policy.landmark
        self._clear()

    def _clear(self) -> None:
        self._rope_params = None  # (inv_freq on the device or None, attention_scaling) of the rotary module
        self._rope_hi = 0  # 1 + the largest RoPE position of a chunk token
        self._lm_all_valid = False  # every landmark belongs to a real chunk (no row has fewer chunks)
        self.compressed = False
        self.decoding = False
        self.rpos = None  # [B, n] int32 RoPE positions of the held tokens (only before compression)
        self.U = self.SV = self.landmarks = self.lm_ids = self.n_chunks = None
        self.out_k = self.out_v = self.out_pos = self.rope_base = self.rope_pos = self.v_off = None
        self._fused = None  # constants of _decode_one_cpu, tied to the landmarks tensor they were made for

    def reset(self) -> None:
        super().reset()
        self._clear()

    # ---- transformers Cache API -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.check_values_device(key_states.device)
        super().lazy_initialization(key_states, value_states)

    def check_values_device(self, device: torch.device) -> None:
        """A static store on CUDA needs its values on the device (``offload=False``): raise ValueError otherwise."""
        if self.static and self.offload and torch.device(device).type == "cuda":
            raise ValueError("shadowkv static=True on CUDA needs offload=False: a compiled decode step (a CUDA graph) "
                             "cannot gather values from host memory. Pass offload=False (values on the device) or "
                             "drop static=True (eager steps fetch the selected values from the host)")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            self.compress_if_due()
        self.append(key_states, value_states)
        return key_states, value_states

    def compress_if_due(self) -> None:
        """At the first single-token step (an eager one, or before a compiled one): everything held so far is the
        prompt (covers chunked prefill), compressed when longer than ``min_prompt``."""
        if self.decoding:
            return
        self.decoding = True
        if not self.compressed and self.keys is not None and self.seen > self.min_prompt:
            self.compress()
            self.committed = self.seen

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        if self.rpos is not None:
            self.rpos = self.rpos[:, :-n]

    def nbytes(self) -> int:
        return super().nbytes() + self.off_slot_nbytes() + _tensor_bytes(self.first_pos)

    def off_slot_nbytes(self) -> int:
        """Device bytes outside the slots: the factors, landmarks, outliers, RoPE layout (and the values when not
        offloaded)."""
        return _tensor_bytes(self.rpos, self.U, self.SV, self.landmarks, self.lm_ids, self.n_chunks, self.out_k,
                             self.out_v, self.out_pos, self.rope_base, self.rope_pos,
                             None if self.offload else self.v_off)

    def offloaded_nbytes(self) -> int:
        return _tensor_bytes(self.v_off) if self.offload else 0

    def read_nbytes(self) -> int:
        """Bytes one decode step reads once compressed: all landmarks, the selected chunks' rows of U
        (gathered per KV head) and SV, their values from the offload store, outliers and the exact
        local/generated slots. Before compression: everything held, as full attention."""
        if not self.compressed:
            return self.nbytes()
        B, H = self.keys.shape[:2]
        D = self.keys.shape[-1]
        k_tok = min(self.budget // self.chunk, self.lm_ids.shape[-1]) * self.chunk
        gathered = B * H * k_tok * (self.U.shape[-1] * self.U.element_size() + D * self.v_off.element_size())
        return gathered + _tensor_bytes(self.landmarks, self.lm_ids, self.SV, self.out_k, self.out_v, self.out_pos,
                                        self.keys, self.values, self.pos)

    def num_slots(self) -> int:
        n = super().num_slots()
        if self.compressed:
            n += min(self.budget // self.chunk, self.lm_ids.shape[-1]) * self.chunk + self.out_k.shape[-2]
        return n

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        if not self.compressed:
            self._record_positions(kwargs.get("position_ids"), T)
            if self.static and T == 1:  # a static step's mask has one column, not read (StaticSlots): by position
                return self.decode(query, torch.arange(self.seen - 1, self.seen, device=query.device,
                                                       dtype=torch.int32), scaling)
            # exact, and bit-identical to `full`: the held tokens are all tokens, in position order
            out = hf_sdpa(module, query, self.keys, self.values, attention_mask, scaling, dropout, **kwargs)
            if self.seen == T and self.seen > self.min_prompt:
                self.compress()
                self.committed = self.seen
            return out
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        return self.decode(query, qpos, scaling)

    def _record_positions(self, position_ids, T: int) -> None:
        B = self.keys.shape[0]
        if position_ids is None:
            p = torch.arange(self.seen - T, self.seen, device=self.keys.device)[None]
        else:
            p = position_ids[..., -T:].to(self.keys.device)
        p = p.to(torch.int32).expand(B, T)
        self.rpos = p.contiguous() if self.rpos is None else torch.cat([self.rpos, p], dim=1)

    # ---- compression -------------------------------------------------------------------------
    @torch.no_grad()
    def compress(self) -> None:
        """Factorize the held prompt (all held tokens) into the ShadowKV layout."""
        if self.info.rope is None:
            raise ValueError("shadowkv needs the model's rotary embedding (info.rope) to invert RoPE; none was found")
        keys, values, dev = self.keys, self.values, self.keys.device
        B, H, S, D = keys.shape
        first = self.first_pos.to(dev).long()  # [B]
        n_chunks, tok, tok_valid = chunk_layout(first, S, self.chunk, self.local_chunks)
        N = tok.shape[1]
        if N == 0:  # too short to have chunks: stay exact
            return
        gidx = tok[:, None, :, None].expand(B, H, N, D)
        kc = keys.gather(2, gidx)  # [B, H, N, D] post-RoPE
        vc = values.gather(2, gidx)
        rp = self.rpos.gather(1, tok)  # [B, N] RoPE positions

        # pre-RoPE keys, exact inverse rotation, factored
        cos, sin = self.info.rope(rp)
        cos, sin = cos.to(dev, torch.float32)[:, None], sin.to(dev, torch.float32)[:, None]
        self.U, self.SV = factorize_keys(kc, cos, sin, tok_valid, self.rank)
        self.rope_base, self.rope_pos, self._rope_hi = rope_layout(rp, tok_valid)
        if self.info.rope is not None:  # the table and its layout check now (a compression event), not at decode
            self.info.shared.rope_half(self.info.rope, self._rope_hi, dev)

        # landmarks and outliers (post-RoPE keys, per KV head)
        self.landmarks, self.lm_ids, out_ids, chunk_valid = landmarks_and_outliers(kc, n_chunks, self.chunk,
                                                                                   self.n_out, self.landmark)
        self.n_chunks = n_chunks.to(torch.int32)
        self._lm_all_valid = bool((self.lm_ids < self.n_chunks.view(B, 1, 1)).all())
        self.out_k, self.out_v, self.out_pos = outlier_slots(kc, vc, out_ids, chunk_valid, tok, self.chunk)

        # values: offload store (pinned CPU memory on CUDA, a separate tensor on CPU), or on the device
        self.v_off = vc.to("cpu").pin_memory() if vc.is_cuda and self.offload else vc
        params = getattr(self.info.rope, "params", None)
        params = params() if params is not None else None
        self._rope_params = ((params[0].to(dev, torch.float32), params[1]) if params is not None else (None, 1.0))
        self._keep_local(first + n_chunks * self.chunk)
        self.rpos = None
        self.compressed = True

    def _keep_local(self, local_start) -> None:
        """Keep only the exact local window: the last stored tokens from the earliest ``local_start [B]`` (each row's
        first token after its chunks); a row's slots before its own start are masked (position -1)."""
        S, dev = self.keys.shape[2], self.keys.device
        Tt = int((S - local_start).max())
        pos = self.pos[..., S - Tt :]
        spos = torch.arange(S - Tt, S, device=dev)
        pos = torch.where(spos[None, None] >= local_start[:, None, None], pos, torch.full_like(pos, -1))
        self.keys = self.keys[..., S - Tt :, :].contiguous()
        self.values = self.values[..., S - Tt :, :].contiguous()
        self.pos = pos.contiguous()

    # ---- decode ------------------------------------------------------------------------------
    def _rope_kw(self) -> dict:
        """The chunk tokens' RoPE positions as the kernels take them: one offset per row, or one per token."""
        if self.rope_base is not None:
            return dict(position_offset=self.rope_base.view(self.rope_base.shape[0]))
        return dict(positions=self.rope_pos)

    def _lowrank(self, query: torch.Tensor, ids: torch.Tensor, scaling: float):
        """``lowrank_decode`` over the chunks ``ids``: (out ``[B, Hq, T, D]``, lse ``[B, Hq, T]``)."""
        dev = query.device
        inv, a = self._rope_params  # made at the compression, on the store's device
        # built only where lowrank_decode takes its torch path (the kernels package picks)
        table = lambda: self.info.shared.rope_table(self.info.rope, self._rope_hi, dev)  # noqa: E731
        v, gathered = self.v_off, False
        if v.device != dev:  # offloaded values: fetch the selected chunks' rows (in list order)
            v, gathered = gather_value_chunks(v, ids, self.chunk, self.U.shape[1], dev), True
        return lowrank_decode(query, self.U, self.SV, v, ids, self.chunk, inv, attention_scaling=a,
                              v_gathered=gathered, scale=scaling, return_lse=True, rope_table=table,
                              **self._rope_kw())

    def _fused_constants(self, device) -> tuple:
        """Per compression (or batch reorder) constants of :meth:`_decode_one_cpu`: ``(landmarks, fp32 landmarks,
        lm_valid [B, H, Cl] or None, arange(chunk), U row base [B, 1, 1, chunk], value row base [B, H, 1, chunk],
        RoPE position base [B, 1, 1, chunk] or None)``, kept while the landmarks tensor is the same."""
        fc = self._fused
        if fc is None or fc[0] is not self.landmarks:
            B, H, N = self.lm_ids.shape[0], self.lm_ids.shape[1], self.U.shape[1]
            lm_valid = None if self._lm_all_valid else self.lm_ids < self.n_chunks.view(B, 1, 1)  # [B, H, Cl]
            ar = torch.arange(self.chunk, device=device)
            vbase = (torch.arange(B * H, device=device) * N).view(B, H, 1, 1) + ar
            off = self.rope_base.view(B, 1, 1, 1).long() + ar if self.rope_base is not None else None
            fc = self._fused = (self.landmarks, self.landmarks.float(), lm_valid, ar,
                                (torch.arange(B, device=device) * N).view(B, 1, 1, 1) + ar, vbase, off)
        return fc

    def _decode_one_cpu(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode token on the CPU. Same selection as :func:`~kvkit.stores.lowrank.select_chunks` (unsorted, as
        the order of the read slots does not matter to a softmax: :func:`~kvkit.stores.lowrank.top_chunks`) and the
        same keys as :func:`lowrank_decode` (``U[rows] @ (S*V^T)[head]``, RoPE from the shared table, fp32). The
        selected chunks are attended by the C kernel behind :func:`kvkit.kernels.lowrank_token_decode` (keys rebuilt
        in registers, never stored) when it is available, together with the exact outliers and local + generated
        slots; else the keys are rebuilt in torch with half-width RoPE tables
        (:func:`~kvkit.stores.lowrank.rebuild_keys`) and the parts attended by
        :func:`~kvkit.stores.lowrank.attend_parts`. Returns ``[B, 1, Hq, D]``."""
        B = query.shape[0]
        H, D = self.SV.shape[1], self.SV.shape[-1]
        # the exact outliers and local + generated slots join the same softmax (every slot a decode query sees is
        # before it: only dead slots, pos < 0, are skipped)
        exact = [(self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)]
        parts = []  # (keys, values, slot positions) to attend
        if self.lm_ids.shape[-1] > 0:
            _, lm, lm_valid, ar, ubase, vbase, off = self._fused_constants(query.device)
            top = top_chunks(query, lm, lm_valid, self.budget // self.chunk)
            ids = self.lm_ids.gather(-1, top.indices).long()[..., None] * self.chunk  # [B, H, k, 1] first tokens
            K = ids.shape[2] * self.chunk
            ok = None  # chunks not selected (a row with fewer than k chunks): not read
            if lm_valid is not None:
                ok = (top.values > float("-inf"))[..., None].expand(B, H, top.values.shape[-1], self.chunk)
                ok = ok.reshape(B, H, K)
            half = self.info.shared.rope_half(self.info.rope, self._rope_hi, query.device)
            tok = (ids + ar).view(B, H, K)
            if ok is not None:
                tok = tok.masked_fill(~ok, -1)
            r = lowrank_token_decode(query, self.U, self.SV, self.v_off, tok, half, scale=scaling, exact=exact,
                                     **self._rope_kw())
            if r is not None:  # the kernels package's fused CPU kernel took the whole step
                return r[0].transpose(1, 2).to(query.dtype)
            rows = (ubase + ids).view(-1)
            pos = (off + ids).view(-1) if off is not None else self.rope_pos.long().view(-1).index_select(0, rows)
            table = lambda: self.info.shared.rope_table(self.info.rope, self._rope_hi, query.device)  # noqa: E731
            k_sel = rebuild_keys(self.U, self.SV, rows, pos, half, table, (B, H, K), query.dtype)
            v_sel = self.v_off.reshape(-1, D).index_select(0, (vbase + ids).view(-1)).view(B, H, K, D)
            p_sel = (torch.where(ok, 0, -1).to(torch.int32) if ok is not None
                     else torch.zeros((), dtype=torch.int32, device=query.device).expand(B, H, K))
            parts.append((k_sel, v_sel, p_sel))
        parts += [(k, v, pos.expand(B, H, -1)) for k, v, pos in exact if k.shape[-2] > 0]
        return attend_parts(query, parts, qpos, scaling, self.concat_below)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Sparse attention for ``query [B, Hq, T, D]`` at positions ``qpos [T]``; returns ``[B, T, Hq, D]``:
        the selected low-rank chunks, the exact outliers and the exact local + generated slots, merged by LSE.
        A single token on the CPU (values in the same memory) takes :meth:`_decode_one_cpu` (eager only). A compiled
        step before any compression (a prompt of at most ``min_prompt`` tokens) reads the exact slots."""
        if not self.compressed:
            return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling)
        if (query.shape[2] == 1 and query.device.type == "cpu" and self.v_off.device == query.device
                and self.fused_cpu_step and not torch.compiler.is_compiling()):
            return self._decode_one_cpu(query, qpos, scaling).to(query.dtype)
        out = lse = None
        if self.lm_ids.shape[-1] > 0:
            k = min(self.budget // self.chunk, self.lm_ids.shape[-1])
            ids = select_chunks(query, self.landmarks, self.lm_ids, self.n_chunks, k, self._lm_all_valid)
            out, lse = self._lowrank(query, ids, scaling)
        # outliers (prompt tokens, always before the queries) and the local + generated slots (causal)
        for k, v, pos in ((self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)):
            if k.shape[-2] == 0:
                continue
            o, l_ = attend_slots(query, k, v, pos, qpos, scaling, return_lse=True)
            o = o.transpose(1, 2)  # [B, Hq, T, D]
            out, lse = (o, l_) if out is None else merge_attn(out, lse, o, l_)
        return out.transpose(1, 2).to(query.dtype)
