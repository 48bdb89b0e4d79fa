"""``duo``: DuoAttention (Xiao et al., arXiv:2410.10819) -- retrieval heads keep everything, streaming heads
keep attention sinks + a recent window.

A calibrated *pattern* gives one gate value alpha in [0, 1] per KV head per layer (how much the head
needs the full context). The policy binarises it by a global quantile: the ``sparsity`` fraction of
KV heads with the lowest alpha become *streaming heads*, the rest stay *retrieval heads*. Each layer
then holds two stores, per head for real (nothing is simulated by masking):

* a :class:`~kvkit.stores.SlotStore` over the retrieval KV heads (every token),
* a :class:`~kvkit.policies.streaming.StreamingStore` over the streaming KV heads
  (``sink`` first tokens + ``recent`` last tokens, bulk-evicted every ``tail`` tokens).

Prefill is exact on all heads; later chunks and decode steps of the streaming heads read only the
sinks and the recent window of each query. ``kvkit calibrate duo`` (``kvkit.calibrate.duo``) learns a
pattern; kvkit ships patterns for a few models (:data:`~kvkit.policies.duo_patterns.SHIPPED_PATTERNS`: its bundled
default model among them), loaded automatically (matched by the model's config).

Hybrid models (Gemma 2/3, Mistral): layers the model runs with its own sliding window keep that window
(``KVCache`` gives them a sliding store, never a duo store); the pattern has a row for them but only the
full-attention layers' gates are calibrated and binarised (the sparsity quantile is over those layers).

Pattern files (kvkit JSON or the reference's TSV) are read, checked and written by
:mod:`kvkit.policies.duo_patterns` (its names are importable from here too). A pattern file is read once, when the
policy is built, and the policy keeps its content and sha256 (``Duo.pattern_sha256``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvkit.model_info import layer_types as _layer_types
from kvkit.policies.base import Policy, check_positive_int
from kvkit.policies.duo_patterns import (
    MAX_PATTERN_BYTES,
    PATTERN_FORMAT,
    SHIPPED_PATTERNS,
    PatternFile,
    as_matrix,
    check_pattern_model,
    load_pattern,
    model_identity,
    read_pattern,
    read_tsv,
    save_pattern,
    shipped_pattern,
)
from kvkit.policies.knobs import EVICTED_SHARE, static_prompt
from kvkit.policies.streaming import StreamingStore
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.split import HeadSplitStore
from kvkit.stores.static import static_store

PAPER_RECENT = 256  # DuoAttention's deploy setting: a streaming head's recent window


# ---- pattern -> heads ----------------------------------------------------------------------------------
def binarize(alpha: torch.Tensor, sparsity: float, layers: list[int] | None = None) -> torch.Tensor:
    """Retrieval-head mask ``[L, H]`` bool: the ``round(sparsity * N)`` lowest-alpha heads (global over
    ``layers``, default all) become streaming heads, the rest (at or above that quantile) retrieval heads.

    Ties are broken deterministically by (layer, head) order; the reference adds 1e-6 random noise instead.
    """
    L, H = alpha.shape
    layers = list(range(L)) if layers is None else layers
    retrieval = torch.ones(L, H, dtype=torch.bool)
    if not layers:
        return retrieval
    vals = alpha[layers].reshape(-1)
    n_stream = int(round(sparsity * vals.numel()))
    order = torch.sort(vals, stable=True).indices[:n_stream]
    flat = torch.ones(vals.numel(), dtype=torch.bool)
    flat[order] = False
    retrieval[layers] = flat.view(len(layers), H)
    return retrieval


# ---- the policy ----------------------------------------------------------------------------------------
@register("duo")
@dataclass(frozen=True)
class Duo(Policy):
    """DuoAttention: retrieval heads keep the full KV, streaming heads keep sinks + a recent window.

    Paper: https://arxiv.org/abs/2410.10819

    Parameters
    ----------
    pattern : str, path, nested list/tensor [layers, kv_heads], or None
        Calibrated gate values alpha per KV head per layer (kvkit JSON or reference TSV file, or the
        values themselves). None: the pattern shipped for this model (``SHIPPED_PATTERNS``, the bundled
        default model among them); other models must be calibrated first (``kvkit calibrate duo``). A file is
        read and checked when the policy is built (``kvkit.patch`` / ``get_policy``) and its content kept
        (:class:`PatternFile`): later caches of a patched model never re-read it; :attr:`pattern_sha256`
        names the content.
    sparsity : float in [0, 1] or None
        Fraction of KV heads made streaming heads (global quantile of alpha). None: 0.5 for GQA models,
        0.75 for MHA models (paper's deploy settings).
    sink : int
        Attention-sink tokens kept by streaming heads (paper deploy: 64).
    recent : int or None
        Recent tokens kept by streaming heads. None (default): the paper's deploy setting, 256; under
        ``compression_ratio`` at least a sixth of the context less the sinks (:meth:`recent_for`).
    tail : int
        Extra uncompressed tokens a streaming head may hold before a bulk eviction (kvkit, not the paper).
    """

    pattern: object = None  # path / values; None = the pattern shipped for the model
    sparsity: float | None = None  # paper: 0.5 for GQA, 0.75 for MHA
    sink: int = 64  # paper deploy setting (training used 128)
    recent: int | None = None  # None: paper deploy setting 256; under compression_ratio >= a sixth of the context
    tail: int = 32  # kvkit: bulk eviction every `tail` tokens keeps crop() exact

    ratio_knobs: ClassVar[tuple[str, ...]] = ("sparsity",)
    paper: ClassVar[dict] = dict(recent=PAPER_RECENT)  # the deploy window at every ratio
    static_capable: ClassVar[bool] = True
    description = "DuoAttention: full KV for retrieval heads, sink+recent for streaming heads (2410.10819)"
    saves = "memory+reads"
    covering_options: ClassVar[dict | None] = dict(pattern=[[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], sparsity=0.5, sink=2, recent=4096)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("duo", "recent", self.recent, allow_none=True)
        check_positive_int("duo", "tail", self.tail)
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"duo: sink must be an integer >= 0, got {self.sink!r}")
        sp = self.sparsity
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 <= sp <= 1):
            raise ValueError(f"duo: sparsity must be a fraction in [0, 1] (or None for the paper default), got {sp!r}")
        p = self.pattern
        if p is None or isinstance(p, PatternFile):  # None: the shipped one; a PatternFile: read already (replace())
            return
        if isinstance(p, (str, os.PathLike)):
            # read and checked now, once: every KVCache of a patched model uses this content (rewriting the file
            # later changes nothing), and `pattern_sha256` says which content it is
            object.__setattr__(self, "pattern", read_pattern(p))
            return
        if isinstance(p, (list, tuple)) or hasattr(p, "tolist"):
            alpha = as_matrix(p, "<pattern values>").clamp(0.0, 1.0)
            object.__setattr__(self, "pattern", tuple(tuple(r) for r in alpha.tolist()))  # hashable, frozen
            return
        raise ValueError(
            f"duo: pattern must be a file path, a [layers][kv_heads] list/tensor of alphas, or None; got {type(p).__name__}"
        )

    # ---- the pattern's content ----
    def _shipped(self, path: Path) -> PatternFile:
        """The shipped pattern at ``path``, read once per policy (frozen like a given file)."""
        memo = self.__dict__.setdefault("_shipped_patterns", {})
        if str(path) not in memo:
            memo[str(path)] = read_pattern(path)
        return memo[str(path)]

    @property
    def pattern_sha256(self) -> str | None:
        """sha256 of the pattern this policy runs: of the file's bytes as read when the policy was built (a path;
        what ``kvkit.evals`` records as ``option_files``), of the JSON of the gate values (values), None for the
        shipped pattern (it depends on the model: :meth:`pattern_sha256_for`)."""
        p = self.pattern
        if p is None:
            return None
        if isinstance(p, PatternFile):
            return p.sha256
        return hashlib.sha256(json.dumps([list(r) for r in p]).encode("utf-8")).hexdigest()

    def pattern_sha256_for(self, config) -> str | None:
        """:attr:`pattern_sha256`, or for the shipped pattern the sha256 of the file used for this model."""
        if self.pattern is not None:
            return self.pattern_sha256
        path = shipped_pattern(config)
        return self._shipped(path).sha256 if path is not None and path.is_file() else None

    # ---- pattern -> per-layer retrieval heads ----
    def load_alpha(self, config) -> tuple[torch.Tensor, str]:
        """``(alpha [L, H], source description)`` for this model, with shape checks."""
        ident = model_identity(config)
        if self.pattern is None:
            path = shipped_pattern(config)
            if path is None:
                raise ValueError(
                    f"duo: no DuoAttention pattern ships for this model ({ident['model_type']}, "
                    f"{ident['num_layers']} layers x {ident['num_kv_heads']} KV heads); calibrate one with "
                    "`kvkit calibrate duo --model <model> --out pattern.json` and pass pattern='pattern.json'"
                )
            if not path.is_file():
                raise ValueError(
                    f"duo: the shipped pattern {str(path)!r} is missing from this kvkit install; run "
                    "`kvkit calibrate duo --out pattern.json` and pass pattern='pattern.json'"
                )
            pf = self._shipped(path)
            source, meta = str(path), pf.meta
            alpha = torch.tensor(pf.alpha, dtype=torch.float64)
        elif isinstance(self.pattern, PatternFile):  # read when the policy was built
            source, meta = str(self.pattern), self.pattern.meta
            alpha = torch.tensor(self.pattern.alpha, dtype=torch.float64)
        else:
            source, meta = "<pattern values>", {}
            alpha = torch.tensor(self.pattern, dtype=torch.float64)
        L, H = ident["num_layers"], ident["num_kv_heads"]
        if tuple(alpha.shape) != (L, H):
            who = f" (calibrated for {meta.get('name')!r})" if meta.get("name") else ""
            raise ValueError(
                f"duo: pattern {source!r}{who} has {alpha.shape[0]} layers x {alpha.shape[1]} KV heads, but this "
                f"model ({ident['model_type']}) has {L} layers x {H} KV heads: it belongs to another model; "
                "calibrate one for this model with `kvkit calibrate duo`"
            )
        check_pattern_model(meta, ident, source)
        return alpha, source

    def effective_sparsity(self, config) -> float:
        if self.sparsity is not None:
            return float(self.sparsity)
        ident = model_identity(config)
        return 0.75 if ident["num_kv_heads"] == ident["num_heads"] else 0.5  # paper: MHA 0.75, GQA 0.5

    def retrieval_heads(self, config, layer_types: list[str] | None = None) -> torch.Tensor:
        """``[L, H]`` bool: True = retrieval head (full KV), False = streaming head."""
        alpha, _ = self.load_alpha(config)
        layers = None
        if layer_types is not None:
            layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        return binarize(alpha, self.effective_sparsity(config), layers)

    def validate(self, config) -> None:
        self.retrieval_heads(config)

    def recent_for(self, context: int | None) -> int:
        """The recent window of a streaming head for a ``context``-token prompt: ``recent`` when given; else the
        paper's :data:`PAPER_RECENT` (256), and under ``compression_ratio`` (with a context) at least
        ``ceil(context x e) - sink``, ``e`` = :data:`~kvkit.policies.knobs.EVICTED_SHARE` (a sixth): a streaming head
        keeps a sixth of the context, sinks included, as each evicting head of snapkv / cake / kvzip / chelsea
        does. The paper's 256 was chosen for contexts of 100K+ tokens; at 4K it is 6% of the context, and with
        the window at a sixth the sparsity for ``r`` is the share of heads those policies protect,
        ``f + (1 - f) e = 1 - r`` (measured: results/needles/README.md)."""
        if self.recent is not None:
            return self.recent
        if self.compression_ratio is None or context is None:
            return PAPER_RECENT
        return max(PAPER_RECENT, math.ceil(context * EVICTED_SHARE) - self.sink)

    def sparsity_for(self, context: int) -> float:
        """``compression_ratio`` r as a sparsity for a ``context``-token cache: a streaming head keeps
        ``w = min(context, sink + recent_for(context))`` tokens, so ``1 - s + s w / context = 1 - r`` gives ``s = r /
        (1 - w / context)``; at most 1 (a short context cannot lose more than its streaming heads' share)."""
        w = min(context, self.sink + self.recent_for(context))
        if w >= context:
            return 1.0
        return min(1.0, self.compression_ratio / (1.0 - w / context))

    def new_shared(self, infos):
        """Once per KVCache: the pattern read and binarised, ``[L, H]`` bool (True = retrieval head); with
        ``compression_ratio`` a :class:`RatioSplit` that binarises it at the first forward (the prompt's length; a
        static cache's stores at build, for its declared ``prompt_length``)."""
        types = _layer_types(infos[0].config)
        if self.compression_ratio is not None:
            self.load_alpha(infos[0].config)  # a missing or mismatched pattern fails now, not at the first forward
            return RatioSplit(self, infos[0].config, types)
        return self.retrieval_heads(infos[0].config, types)

    def new_layer(self, info: LayerInfo):
        if isinstance(info.shared, RatioSplit):
            prompt = static_prompt(self, info)  # a static store: split now, for the declared prompt's length
            if prompt is not None:
                return DuoStore(info, info.shared.retrieval(info.layer_idx, prompt), self.sink,
                                self.recent_for(prompt), self.tail)
            return DuoStore(info, None, self.sink, None, self.tail)  # split and sized at the first forward
        retrieval = info.shared[info.layer_idx].tolist()
        return DuoStore(info, retrieval, self.sink, self.recent_for(None), self.tail)


class RatioSplit:
    """``compression_ratio``'s head split of one cache: the retrieval mask binarised for the first forward's length
    (:meth:`Duo.sparsity_for`), computed once and shared by the layers."""

    def __init__(self, policy: Duo, config, layer_types):
        self.policy, self.config, self.layer_types = policy, config, layer_types
        self.mask: torch.Tensor | None = None

    def retrieval(self, layer_idx: int, context: int) -> list[bool]:
        if self.mask is None:
            p = dataclasses.replace(self.policy, compression_ratio=None, sparsity=self.policy.sparsity_for(context))
            self.mask = p.retrieval_heads(self.config, self.layer_types)
        return self.mask[layer_idx].tolist()


# ---- the store -----------------------------------------------------------------------------------------
class DuoStore(HeadSplitStore):
    """Retrieval KV heads in a full store, streaming KV heads in a :class:`StreamingStore` (sinks + recent,
    bulk-evicted every ``tail`` tokens): a :class:`~kvkit.stores.split.HeadSplitStore`. In a static cache the
    streaming part's capacity is ``sink + recent + tail``."""

    def __init__(self, info: LayerInfo, retrieval: list[bool] | None, sink: int, recent: int | None, tail: int):
        self.sink, self.recent, self.tail = sink, recent, tail
        if retrieval is None:  # compression_ratio: the heads are split at the first forward (its length)
            super(HeadSplitStore, self).__init__()
            self.info, self.parts, self.deferred = info, [], True
            return
        self.deferred = False
        stream_cls = static_store(StreamingStore) if info.static else StreamingStore
        super().__init__(info, retrieval, lambda n: stream_cls(info, sink + recent, sink, tail, num_heads=n), "duo")

    def lazy_initialization(self, key_states, value_states) -> None:
        if self.deferred:  # the split and the window for this prompt's length, then the parts as any head-split layer
            context = key_states.shape[-2]
            retrieval = self.info.shared.retrieval(self.info.layer_idx, context)
            recent = self.info.shared.policy.recent_for(context) if self.recent is None else self.recent
            DuoStore.__init__(self, self.info, retrieval, self.sink, recent, self.tail)
        super().lazy_initialization(key_states, value_states)

    # before the first forward a deferred layer holds nothing
    def get_seq_length(self):
        return super().get_seq_length() if self.parts else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length) if self.parts else (query_length, 0)

    @property
    def seen(self) -> int:
        return self.parts[0][0].seen if self.parts else 0

    @property
    def keys(self):
        return self.parts[0][0].keys if self.parts else None

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        return self.parts[0][0].values if self.parts else None

    @values.setter
    def values(self, value):
        pass

    def num_slots(self) -> int:
        return super().num_slots() if self.parts else 0

    def head_slots(self) -> list[int]:
        return super().head_slots() if self.parts else [0] * self.info.num_kv_heads

    @property
    def retrieval(self) -> list[bool]:
        """Per KV head: True = retrieval head (in ``full``), False = streaming head (in ``stream``)."""
        return self.keep

    @property
    def full(self):
        """The retrieval heads' store (every token), or None."""
        return self.whole

    @property
    def stream(self):
        """The streaming heads' :class:`StreamingStore`, or None."""
        return self.rest


def kv_fraction_kept(context: int, retrieval_fraction: float, sink: int = 64, recent: int = 256) -> float:
    """Fraction of the full KV a duo cache holds after ``context`` tokens (ignoring the tail buffer)."""
    keep_stream = min(context, sink + recent)
    return retrieval_fraction + (1 - retrieval_fraction) * keep_stream / context if context else 1.0


__all__ = [
    "Duo",
    "DuoStore",
    "binarize",
    "kv_fraction_kept",
    # re-exported from kvkit.policies.duo_patterns
    "MAX_PATTERN_BYTES",
    "PATTERN_FORMAT",
    "SHIPPED_PATTERNS",
    "PatternFile",
    "load_pattern",
    "read_pattern",
    "read_tsv",
    "model_identity",
    "save_pattern",
    "shipped_pattern",
]
