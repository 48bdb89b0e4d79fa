"""``tidal``: TidalDecode (Yang et al., arXiv:2410.05076) -- position-persistent sparse decode attention.

No KV is evicted (memory stays that of ``full``); what is saved is the KV *read* per decoded token.
At each decode step and for each query token:

* the layers before the first selection layer read every held token (full attention; layers 0 and 1
  in the paper);
* a *selection layer* (layer 2 and the re-selection layer ``r`` in the paper) reads every held token
  and picks the ``budget`` tokens with the highest pre-softmax scores ``q . k`` among the tokens before
  the current one;
* every other layer (a *reuse layer*) reads only the selection of the nearest selection layer before
  it, plus the current token (a gather of ``budget + 1`` K/V rows, never a full ``QK^T``).

The paper's layout: selection at layer 2 and at ``reselect_layer`` (default ``round(0.4 * num_layers)``:
the paper uses 13 of 32 for Llama-3-8B, tuned per model). ``select_layers`` replaces it with any
increasing list of selection layers (e.g. ``(2, 12, 15, 18, 21)``); the layers before its first entry
read everything.

Per-layer budgets (kvkit, beyond the paper: ``layer_shares``): the paper gives every reuse layer the same
``budget``, but reuse layers differ in how much of their attention the same top-k catches, and a needle lost
in the layers that catch the least is not recovered by re-selecting there (the per-layer figures of the
default model: the tidal evidence in kvkit/data/calibration/smollm2-135m-instruct.json). With
``layer_shares`` the selection layer ranks once, at the largest budget of the layers reading its selection, and
each reuse layer takes its own top-k of that ranking; the budgets' mean over the reuse layers stays ``budget``, so
the reads do too. ``kvkit calibrate tidal`` picks the shares that equalise the captured attention mass
(:func:`kvkit.calibrate.tidal.calibrate_tidal_shares`).

The selection travels from layer to layer through the cache's :class:`TidalSelection`. All tidal
stores hold every token in the same slot order, so a slot index means the same token in every layer.
Selection is redone at every step. Prefill is exact full attention.

Selection modes
    ``selection="shared"`` (kvkit's default): one list per query token for every head, the union of the query
    heads' rankings taken rank by rank (every head's first choice, then every head's second, ...; duplicates
    dropped, the first ``budget``: :func:`union_ranks`); each KV head reads ``budget`` rows. Why not per head: a
    head index names no particular head from one layer to the next, so a per-head list hands a reuse layer's
    head the tokens an unrelated head of the selection layer wanted. On the default model at half the reads a
    reuse layer's copy head put 0.9-1.0 of its attention on the needle token its namesake in the selection layer
    had not selected (and previous-token heads their last tokens), and the per-head modes lost 5-6 of 7 held-out
    needles the shared list keeps (results/needles/README.md).
    ``selection="q_head"`` (the paper's code): top-k per query head; with GQA a KV head then reads
    ``group x budget`` rows (one list per query head). ``selection="kv_head"`` (the paper's future
    work): one top-k per KV head from the softmax probabilities of its query group, combined by
    ``kv_reduce`` ("max" or "sum"); each KV head reads ``budget`` rows. Within one head, ranking by
    softmax probability equals ranking by pre-softmax score; across the heads of a group probabilities
    are comparable, raw scores are not, hence the softmax for the group reduction.

Several query tokens in one forward (speculative verification): every query token selects its own
top-k among the tokens before it and reads its own rows plus itself, so a T-token forward equals T
single-token forwards (causal by construction). Forwards of more than ``MAX_SPARSE_CHUNK`` tokens
(chunked prefill) run exact full attention in every layer, as the prefill does.

A budget that covers every candidate (``budget >= held tokens - 1``) reads everything: exactly full
attention. Read accounting: each store records the K/V bytes its last decode forward read
(``read_nbytes()``), and :func:`decode_read_bytes` sums them over a cache next to the bytes a full
cache would have read.

Decode cost. K/V live in the SlotStore's preallocated append buffers (a decode step writes its token in
place instead of concatenating the layer). A selection layer computes ``q K^T`` once (fp32),
takes the attention output and the top-k from the same scores, and stores the selected slot lists
(sorted, current token appended) once for the reuse layers. A reuse layer gathers the listed rows of
its K/V into buffers shared by the layers of the cache (``index_select``, a few batch rows at a time so the
copy is read back from cache) and attends over them with batched matmuls (the torch path, CPU); on CUDA it
calls :func:`kvkit.kernels.sparse_decode` (Triton: the rows are read in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_choice, check_positive_int
from kvkit.policies.knobs import static_prompt, unreachable
from kvkit.policies.tidal_store import (  # noqa: F401  (re-exported: kvkit.policies.tidal.<name> as before)
    MAX_SPARSE_CHUNK,
    TidalSelection,
    TidalStore,
    decode_read_bytes,
    group_score,
    union_ranks,
)
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.static import static_store

FULL_LAYERS = 2  # TidalDecode: layers 0 and 1 use full attention
SELECT_LAYER = 2  # TidalDecode: the first token-selection layer
RESELECT_FRACTION = 0.4  # TidalDecode: re-selection at layer 13 of 32 (Llama-3-8B), about 0.4 of depth
SELECTIONS = ("q_head", "kv_head", "shared")
REDUCTIONS = ("max", "sum")


@register("tidal")
@dataclass(frozen=True)
class Tidal(Policy):
    """TidalDecode: full attention before the first selection layer, top-k token selection at the
    selection layers (2 and a middle re-selection layer), the other layers read only the selected tokens.

    Parameters
    ----------
    budget : int
        Tokens read per list at the sparse layers (k); 2048 default, 128 for needle tests, 4096 for
        LongBench in the paper.
    reselect_layer : int or None
        The re-selection layer r (3 <= r < num_layers); None: ``round(0.4 * num_layers)`` (paper: 13 of 32),
        and no re-selection for models with fewer than 5 layers.
    selection : str
        "shared" (default: one list for all heads, the round-robin union of the query heads' rankings), "q_head"
        (top-k per query head, the paper) or "kv_head" (one top-k per KV head, GQA-friendly).
    kv_reduce : str
        How "kv_head" combines the softmax probabilities of a query group: "max" or "sum".
    select_layers : sequence of int or None
        All selection layers, strictly increasing (e.g. ``[2, 12, 15, 18, 21]``); replaces layer 2 +
        ``reselect_layer`` (give one or the other). Layers before the first one read everything.
    layer_shares : sequence of float or None
        kvkit, beyond the paper: one positive weight per model layer; the reuse layers' budgets become
        ``budget * share / mean share of the reuse layers`` (rounded), so their mean -- and the decode reads -- stay
        those of a uniform ``budget``, but layers whose attention is spread over more tokens read more of the
        selection (the selection layer ranks once, each reuse layer takes its own top-k of the same ranking).
        None: uniform (the paper). Calibrated per model with the selection layers (``kvkit calibrate tidal``: the
        shares that equalise the attention mass the reuse layers' reads capture on calibration text).
    calibrated : bool
        True (default): when neither ``reselect_layer`` nor ``select_layers`` is given, use the model's
        calibrated selection layers (``kvkit calibrate tidal``; shipped for the bundled models, found from
        the config by :mod:`kvkit.calibration`). False: the paper's layout (layer 2 + round(0.4 L)).
    """

    budget: int = 2048  # TidalDecode default token budget (128 for needle tests, 4096 for LongBench)
    reselect_layer: int | None = None  # TidalDecode: layer 13 of 32 for Llama-3-8B; None = round(0.4 * L)
    selection: str = "shared"  # kvkit: one list for all heads; "q_head" is the paper's, "kv_head" its GQA variant
    kv_reduce: str = "max"  # kvkit: group reduction for selection="kv_head"
    select_layers: tuple | None = None  # kvkit: explicit selection layers (per-model tuning)
    layer_shares: tuple | None = None  # kvkit: per-layer budget weights of the reuse layers (None: uniform, the paper)
    calibrated: bool = True  # kvkit: the model's calibrated select_layers when none given; False = paper layout

    static_capable: ClassVar[bool] = True
    description = "TidalDecode: top-k tokens picked at 2 selection layers, other layers read only those (2410.05076)"
    saves = "reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("select_layers", "reselect_layer", "layer_shares")
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    #: the paper: per-query-head lists, its selection layout (layer 2 and round(0.4 L)), uniform budgets
    paper: ClassVar[dict] = dict(selection="q_head", calibrated=False)
    covering_options: ClassVar[dict | None] = dict(budget=4096)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("tidal", "budget", self.budget)
        check_positive_int("tidal", "reselect_layer", self.reselect_layer, allow_none=True)
        check_choice("tidal", "selection", self.selection, SELECTIONS, allow_none=False)
        check_choice("tidal", "kv_reduce", self.kv_reduce, REDUCTIONS, allow_none=False)
        if self.select_layers is not None:
            layers = self.select_layers
            ok = isinstance(layers, (list, tuple)) and len(layers) > 0 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
            if not ok or any(b <= a for a, b in zip(layers, layers[1:])):
                raise ValueError(
                    "tidal: select_layers must be a non-empty, strictly increasing list of layer indices >= 0, "
                    f"e.g. [2, 12, 15]; got {layers!r}"
                )
            if self.reselect_layer is not None:
                raise ValueError("tidal: give reselect_layer or select_layers, not both "
                                 "(select_layers lists every selection layer)")
            object.__setattr__(self, "select_layers", tuple(layers))
        if self.layer_shares is not None:
            sh = self.layer_shares
            ok = isinstance(sh, (list, tuple)) and len(sh) > 0 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in sh)
            if not ok:
                raise ValueError("tidal: layer_shares must be a list of positive numbers, one per model layer "
                                 f"(e.g. [1, 1, 1, 0.5, 2, ...]); got {sh!r}")
            object.__setattr__(self, "layer_shares", tuple(float(x) for x in sh))

    def reselect_for(self, num_layers: int) -> int | None:
        """The re-selection layer for a model of ``num_layers`` layers (None: no re-selection)."""
        if self.reselect_layer is not None:
            if not SELECT_LAYER < self.reselect_layer < num_layers:
                raise ValueError(
                    f"tidal: reselect_layer must be in [{SELECT_LAYER + 1}, {num_layers - 1}] for a model with "
                    f"{num_layers} layers (layer {SELECT_LAYER} is the first selection layer); "
                    f"got {self.reselect_layer}"
                )
            return self.reselect_layer
        r = round(RESELECT_FRACTION * num_layers)
        r = min(max(r, SELECT_LAYER + 2), num_layers - 1)  # keep at least one reuse layer before r
        return r if r > SELECT_LAYER + 1 else None

    def selection_layers(self, num_layers: int) -> tuple[int, ...]:
        """The selection layers for a model of ``num_layers`` layers (raises if one does not exist)."""
        if self.select_layers is not None:
            if self.select_layers[-1] >= num_layers:
                raise ValueError(
                    f"tidal: select_layers must be < {num_layers} (the model's layers); got {list(self.select_layers)}"
                )
            return self.select_layers
        r = self.reselect_for(num_layers)
        return (SELECT_LAYER,) if r is None else (SELECT_LAYER, r)

    def layer_budgets(self, num_layers: int) -> list[int]:
        """Tokens each layer reads from a selection (its top-k): ``budget`` everywhere without ``layer_shares``;
        with them, the reuse layers' ``budget * share / mean reuse share`` (at least 1; other layers ``budget``)."""
        if self.layer_shares is None:
            return [self.budget] * num_layers
        if len(self.layer_shares) != num_layers:
            raise ValueError(f"tidal: layer_shares must give one share per model layer ({num_layers}); "
                             f"got {len(self.layer_shares)}")
        layers = self.selection_layers(num_layers)
        reuse = [i for i in range(layers[0], num_layers) if i not in layers]
        if not reuse:
            return [self.budget] * num_layers
        top = max(self.layer_shares[i] for i in reuse)  # shares scaled by the largest first: no overflow to inf
        if not top > 0:
            raise ValueError(f"tidal: layer_shares of the reuse layers must have a positive largest value, got {top!r}")
        scaled = {i: self.layer_shares[i] / top for i in reuse}
        mean = sum(scaled.values()) / len(reuse)
        return [max(1, round(self.budget * scaled[i] / mean)) if i in reuse else self.budget
                for i in range(num_layers)]

    def select_budget(self, num_layers: int, layer: int) -> int:
        """How many tokens selection layer ``layer`` ranks: the largest budget of the layers reading its selection."""
        layers = self.selection_layers(num_layers)
        ks = self.layer_budgets(num_layers)
        nxt = min([x for x in layers if x > layer] + [num_layers])
        own = [ks[layer]] if nxt == layer + 1 else []
        return max(own + ks[layer + 1: nxt])

    def full_read_layers(self, num_layers: int) -> int:
        """Layers whose decode reads every held token: those before the first selection layer and the selection
        layers themselves."""
        layers = self.selection_layers(num_layers)
        return layers[0] + len(layers)

    def budget_for(self, num_layers: int, groups: int, context: int) -> int:
        """``budget`` whose decode reads are ``1 - compression_ratio`` of full's over a ``context``-token cache: ``F``
        layers read all of it, the others ``m (budget + 1)`` rows per KV head (``m`` = the query group with
        ``selection="q_head"``, else 1): ``(F S + (L - F) m (b + 1)) / (L S) = 1 - r``."""
        L, F = num_layers, self.full_read_layers(num_layers)
        m = groups if self.selection == "q_head" else 1
        b = ((1.0 - self.compression_ratio) * L * context - F * context) / ((L - F) * m) - 1
        return min(max(int(round(b)), 1), context)

    def validate(self, config) -> None:

        self = resolve(self, config)
        n = config.num_hidden_layers
        if n <= SELECT_LAYER and self.select_layers is None:
            raise ValueError(
                f"tidal needs more than {SELECT_LAYER} layers (layers 0-1 full, layer 2 selects); "
                f"this model has {n}"
            )
        self.selection_layers(n)
        self.layer_budgets(n)
        r = self.compression_ratio
        if r is not None and r >= 1 - self.full_read_layers(n) / n:
            F = self.full_read_layers(n)
            raise unreachable("tidal", r, 0.0, 1 - F / n, f"{F} of the {n} layers read every token (the layers before "
                              "the first selection layer and the selection layers)")

    def new_shared(self, infos):
        return TidalSelection()

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)
        cls = static_store(TidalStore) if info.static else TidalStore
        store = cls(info, resolve(self, info.config))
        if prompt is not None:  # a static store: the budget for the declared prompt, now (its prefill, as a growing
            store.configure_for(prompt)  # store's, resolves it again for the tokens seen)
        return store
