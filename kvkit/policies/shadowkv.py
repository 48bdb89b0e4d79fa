"""``shadowkv``: ShadowKV (Sun et al., arXiv:2410.21465) -- low-rank pre-RoPE keys + offloaded values.

At the end of the prefill of a long prompt (more than ``min_prompt`` tokens; shorter prompts run
exactly as ``full``), each layer splits the prompt into chunks of ``chunk_size`` tokens (the paper's 8; under
``compression_ratio`` 2 at r <= 0.5, 4 at 0.75: :meth:`ShadowKV.chunk`) and keeps

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
and KV head. Under ``compression_ratio`` (fixed bytes) the default rank is at most ``head_dim``, so a selected
token's ``U`` row costs no more than its exact key and the bytes go to selecting more tokens
(:meth:`ShadowKV.rank_at`). ``outliers=None`` scales the paper's 48 chunks at budget 2048 with the budget.

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
Under ``compression_ratio`` a static store is built with the budget for its cache's ``prompt_length`` (no padding
assumed); the compression resolves it again from the prompt it holds, as the ordinary store does.

The compression and decode steps are plain functions in :mod:`kvkit.stores.lowrank`; this module holds the options,
the state of a layer (:class:`ShadowKVStore`) and the glue between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_positive_int
from kvkit.policies.knobs import static_prompt, unreachable
from kvkit.policies.shadowkv_store import (  # noqa: F401  (re-exported: kvkit.policies.shadowkv.<name> as before)
    PAPER_BUDGET,
    PAPER_OUTLIERS,
    ShadowKVStore,
)
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.lowrank import (
    LANDMARKS,
    RopeTables,
)
from kvkit.stores.static import static_store

PAPER_RANK, PAPER_WIDTH = 160, 1024  # ShadowKV: rank 160 for Llama-3-8B (8 KV heads x 128)
PAPER_CHUNK = 8  # ShadowKV: 8 tokens per chunk / landmark
MIN_CHUNK = 2  # kvkit: the smallest chunk compression_ratio picks (a chunk of one token is its own landmark)
PAPER_MIN_PROMPT = 4096  # ShadowKV compresses long contexts; kvkit runs shorter prompts as full


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
        ``round(160 / 1024 * Hkv*D)`` (paper: 160 at ``Hkv*D = 1024``); under ``compression_ratio`` at most
        ``head_dim`` (:meth:`rank_at`).
    chunk_size : int or None
        Tokens per chunk / landmark; None (default): the paper's 8, or under ``compression_ratio`` the smallest
        whose landmarks take at most half of the reads (2 at r <= 0.5, 4 at 0.75; :meth:`chunk`). A chunk is ranked by
        its mean key, and a smaller chunk averages a needle's keys with fewer others (measured:
        results/needles/README.md).
    outliers : int or None
        Outlier chunks per KV head kept exact; None: ``round(48 * budget / 2048)`` (paper: 48 at 2048).
    local_chunks : int
        Last chunks of the prompt kept exact (paper: 4 chunks = 32 tokens), plus ``S mod chunk_size``.
    min_prompt : int or None
        Only prompts longer than this are compressed; shorter ones run as ``full``. None (default): 4096 (the
        paper's long-context setting), or 0 with ``compression_ratio`` (the ratio is a promise on every prompt long
        enough to hold a chunk beyond the local window; :meth:`prompt_floor`).
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
    chunk_size: int | None = None  # ShadowKV chunk size 8; None: 8, or its landmarks half the reads under a ratio (kvkit)
    outliers: int | None = None  # ShadowKV: 48 outlier chunks at budget 2048; None scales with budget
    local_chunks: int = 4  # ShadowKV local window: 4 chunks (32 tokens)
    min_prompt: int | None = None  # ShadowKV applies to long contexts (4096); None: 4096, or 0 with compression_ratio
    calibrated: bool = True  # kvkit: rank=None uses the model's calibrated rank; False = paper's 160/1024 scaling
    offload: bool = True  # ShadowKV offloads the values to the CPU; False keeps them on the device (kvkit)
    landmark: str = "mean"  # ShadowKV ranks chunks by their mean key; "minmax" by the bound of their keys (kvkit)

    description = "ShadowKV: low-rank pre-RoPE keys + landmarks on device, values offloaded, top-k chunks (2410.21465)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("rank",)
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    #: the paper's rank (160 per 1024 key channels) and chunk size at every ratio
    paper: ClassVar[dict] = dict(calibrated=False, chunk_size=PAPER_CHUNK)
    static_capable: ClassVar[bool] = True
    static_options: ClassVar[dict] = dict(offload=False)  # a CUDA graph reads no host memory
    covering_options: ClassVar[dict | None] = dict(min_prompt=100_000)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("shadowkv", "budget", self.budget)
        check_positive_int("shadowkv", "chunk_size", self.chunk_size, allow_none=True)
        check_positive_int("shadowkv", "rank", self.rank, allow_none=True)
        for name in ("outliers", "local_chunks", "min_prompt"):
            v = getattr(self, name)
            if v is None and name in ("outliers", "min_prompt"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"shadowkv: {name} must be an integer >= 0, got {v!r}")
        if self.landmark not in LANDMARKS:
            raise ValueError(f"shadowkv: landmark must be one of {LANDMARKS} ('mean': the paper's mean key per chunk; "
                             f"'minmax': the channel-wise max and min of its keys), got {self.landmark!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"shadowkv: offload must be True or False, got {self.offload!r}")
        if self.budget < self.chunk():
            raise ValueError(
                f"shadowkv: budget ({self.budget}) must be at least chunk_size ({self.chunk()}) so that one "
                "chunk can be selected"
            )

    # ---- derived settings --------------------------------------------------------------------
    def chunk(self) -> int:
        """Tokens per chunk in effect: ``chunk_size`` when given; else the paper's :data:`PAPER_CHUNK` (8), and under
        ``compression_ratio`` r the smallest power of two (at least :data:`MIN_CHUNK`) whose landmarks take at most
        half of the bytes a step may read: a chunk of ``c`` tokens has landmarks of ``w / (2c)`` of full's bytes
        (``w`` = 1 for the mean key, 2 for min-max), so ``c >= w / (1 - r)``: 2 tokens at r <= 0.5, 4 at 0.75, 8 at
        0.875 (min-max: 4 at 0.5, 8 at 0.75). A smaller chunk's mean dilutes a needle's key with fewer others, and
        the other half of the reads still selects tokens (measured at 2, 4, 8 and 16 tokens:
        results/needles/README.md); every ratio stays reachable."""
        if self.chunk_size is not None:
            return self.chunk_size
        if self.compression_ratio is None:
            return PAPER_CHUNK
        w = 2 if self.landmark == "minmax" else 1
        need = w / (1 - self.compression_ratio) - 1e-9  # 1 / (1 - 0.75) is 4, not 4.000001
        c = MIN_CHUNK
        while c < need:
            c *= 2
        return c

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

    def rank_at(self, config, width: int, head_dim: int) -> int:
        """The rank a layer of keys ``width = Hkv*D`` wide uses: :meth:`rank_for` of the policy with its calibrated
        options filled in, except that under ``compression_ratio`` with ``rank`` unset and ``calibrated=True`` it is
        at most ``head_dim``. The ratio fixes the bytes a step reads, and each KV head reads a rank-long row of ``U``
        per selected token: above ``head_dim`` that row costs more than the exact key it rebuilds, so the selection
        budget shrinks (a model whose calibrated rank is 120 on 64-wide heads selects 1,072 of 4,160 tokens per KV
        head at r = 0.5; capped at 64, 1,488). A given ``rank`` and the paper's preset (``calibrated=False``) are
        kept."""
        rank = resolve(self, config).rank_for(width)
        if self.rank is None and self.calibrated and self.compression_ratio is not None:
            return min(rank, head_dim)
        return rank

    def prompt_floor(self) -> int:
        """The prompt length a prompt must pass to be compressed: ``min_prompt``; when None, the paper's
        :data:`PAPER_MIN_PROMPT`, or 0 under ``compression_ratio`` (whose read fraction then holds from short prompts
        on instead of silently reading all of full's bytes below 4096 tokens)."""
        if self.min_prompt is not None:
            return self.min_prompt
        return 0 if self.compression_ratio is not None else PAPER_MIN_PROMPT

    def num_outliers(self) -> int:
        if self.outliers is not None:
            return self.outliers
        return round(PAPER_OUTLIERS * self.budget / PAPER_BUDGET)

    def validate(self, config) -> None:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

        self.rank_at(config, kv * head_dim, head_dim)
        r, lm = self.compression_ratio, (2 if self.landmark == "minmax" else 1) / (2 * self.chunk())
        if r is not None and r >= 1 - lm:
            raise unreachable("shadowkv", r, 0.0, 1 - lm, f"a decode step reads every chunk's landmark, {lm:.4f} of "
                              "full's bytes, besides the chunks it selects")

    def new_shared(self, infos):
        """Once per KVCache: the RoPE tables its layers share (:class:`~kvkit.stores.lowrank.RopeTables`)."""
        return RopeTables()

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)
        rank = self.rank_at(info.config, info.num_kv_heads * info.head_dim, info.head_dim)
        cls = static_store(ShadowKVStore) if info.static else ShadowKVStore
        store = cls(info, self, rank)
        if prompt is not None:  # a static store: the budget for the declared prompt (no padding), now; the
            # compression resolves it again from what it holds, as a growing store's does
            store.budget, store.n_out = store.budget_for(prompt, 0, info.element_size or 2)
        return store
