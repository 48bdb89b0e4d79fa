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
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvkit.calibration import resolve
from kvkit.kernels import gather_attend
from kvkit.policies.base import Policy, check_choice, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore, attend_slots
from kvkit.stores.static import static_store

FULL_LAYERS = 2  # TidalDecode: layers 0 and 1 use full attention
SELECT_LAYER = 2  # TidalDecode: the first token-selection layer
RESELECT_FRACTION = 0.4  # TidalDecode: re-selection at layer 13 of 32 (Llama-3-8B), about 0.4 of depth
MAX_SPARSE_CHUNK = 16  # longer multi-token forwards (chunked prefill) run exact full attention
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
    covering_options: ClassVar[dict | None] = dict(budget=4096)

    def __post_init__(self):
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

    def new_shared(self, infos):
        return TidalSelection()

    def new_layer(self, info: LayerInfo):

        cls = static_store(TidalStore) if info.static else TidalStore
        return cls(info, resolve(self, info.config))


@dataclass
class TidalSelection:
    """The selection one cache's layers share: made at a selection layer, read by the reuse layers after it.

    ``idx [B, Hs, T, k+1]`` int64: per list (Hs = KV heads or query heads) and query token, the selected
    slots in increasing order (in score order with ``layer_shares``) followed by the token's own slot; ``valid`` the same shape (bool) or None
    when every entry is a real token. ``ranked [B, Hs, T, k]``: the same selection in decreasing score order
    (``ranked_ok`` its real entries, None: all), from which :meth:`view` cuts a smaller top-k for a reuse layer with a
    smaller budget (``layer_shares``). ``bufs``: gather buffers shared by the reuse layers (torch path).
    """

    seen: int = -1  # the store length it was made at
    T: int = 0  # query tokens of that forward
    idx: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    ranked_ok: torch.Tensor | None = None
    cur: tuple = ()  # (the query tokens' own slots [B, Hs, T, 1], their validity or None)
    n: int = 0  # slots held when it was made
    slot_order: bool = True  # the whole selection in slot order (uniform budgets); False: score order (layer_shares)
    views: dict = field(default_factory=dict)  # (k, device) -> (idx, valid)
    bufs: dict = field(default_factory=dict)  # (device, dtype, rows, D) -> (K rows, V rows) gather buffers

    def clear(self) -> None:
        self.seen, self.idx, self.valid, self.ranked, self.ranked_ok, self.cur, self.views = -1, None, None, None, None, (), {}

    def set(self, seen: int, T: int, ranked, ranked_ok, n: int, cur, cur_ok, slot_order: bool = True) -> None:
        """A new selection: ``ranked`` top-k slots (decreasing score), ``ranked_ok`` their validity (None: all real),
        ``n`` the held slots, ``cur [B, Hs, T, 1]`` the query tokens' own slots and ``cur_ok`` their validity."""
        self.seen, self.T, self.ranked, self.ranked_ok, self.cur, self.views = seen, T, ranked, ranked_ok, (cur, cur_ok), {}
        self.n, self.slot_order = n, slot_order
        self.idx, self.valid = self._cut(ranked.shape[-1])

    def _cut(self, k: int):
        """The top ``k`` plus the query tokens' own slots. The whole selection (``k`` = all of it, what every layer
        reads with uniform budgets) is put in slot order; with ``layer_shares`` every cut keeps the score order:
        sorting the cuts costs more than the gathers they would speed up (they read whole rows in any order)."""
        r = self.ranked[..., :k]
        cur, cur_ok = self.cur
        whole = k == self.ranked.shape[-1] and self.slot_order
        if self.ranked_ok is None:
            idx, valid = (r.sort(dim=-1).values if whole else r), None
        elif whole:
            key = torch.where(self.ranked_ok, r, self.n).sort(dim=-1).values  # selected first, slot order
            valid = key < self.n
            idx = torch.where(valid, key, 0)
        else:
            valid = self.ranked_ok[..., :k]
            idx = torch.where(valid, r, 0)
        idx = torch.cat([idx, cur], dim=-1)
        if valid is not None or cur_ok is not None:
            v0 = valid if valid is not None else torch.ones_like(r, dtype=torch.bool)
            c0 = cur_ok if cur_ok is not None else torch.ones_like(cur, dtype=torch.bool)
            valid = torch.cat([v0, c0], dim=-1)
        return idx, valid

    def view(self, k: int, device) -> tuple:
        """``(idx, valid)`` of the top-``k`` of this selection (all of it when ``k`` covers it), on ``device``."""
        key = (min(k, self.ranked.shape[-1]), device)
        v = self.views.get(key)
        if v is None:
            v = (self.idx, self.valid) if key[0] == self.ranked.shape[-1] else self._cut(key[0])
            if v[0].device != device:  # the selection layer sits on another device (device_map): copy once
                v = (v[0].to(device), None if v[1] is None else v[1].to(device))
            self.views[key] = v
        return v


class TidalStore(SlotStore):
    """All tokens held (never evicts) in preallocated buffers; decode reads all of them or only the shared
    selection.

    Static (``static_store(TidalStore)``, a compiled step): the buffers hold ``cap`` slots (free ones at position
    -1), so the step selects among all ``cap`` slots with the masked path (free slots are no candidates), the token's
    own slot is ``nslots - T + arange(T)``, a reuse layer trusts the selection of the same forward (no host check)
    and reads its rows with :func:`kvkit.kernels.gather_attend` (a compiled step: one torch gather, fixed shapes)."""

    def __init__(self, info: LayerInfo, policy: Tidal):
        super().__init__(info)
        L, i = info.num_layers, info.layer_idx
        self.budget = policy.layer_budgets(L)[i]  # tokens this layer reads from a selection (reuse layers)
        self.per_kv_head = policy.selection == "kv_head"
        self.shared = policy.selection == "shared"
        self.kv_reduce = policy.kv_reduce
        layers = policy.selection_layers(L)
        self.role = "full" if i < layers[0] else "select" if i in layers else "reuse"
        # tokens ranked when this layer selects: the largest budget of the layers that read the selection
        self.select_k = policy.select_budget(L, i) if self.role == "select" else self.budget
        self.shared_budgets = policy.layer_shares is not None  # per-layer cuts of one selection (score order)
        self.last_read = 0  # K/V bytes read by the last decode forward
        self.last_full_read = 0  # K/V bytes full attention would have read in that forward

    def reset(self) -> None:
        super().reset()
        self.last_read = self.last_full_read = 0
        self.info.shared.clear()

    def read_nbytes(self) -> int:
        """K/V bytes read by this layer's last decode forward (0 before any decode)."""
        return self.last_read

    def _row_bytes(self) -> int:
        return 2 * self.keys.shape[-1] * self.keys.element_size()  # one K row + one V row

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        self.last_full_read = B * H * n * self._row_bytes()
        sel = self.info.shared
        k = self.select_k if self.role == "select" else self.budget
        if T > MAX_SPARSE_CHUNK or k >= n - 1 or self.role == "full":
            if T > MAX_SPARSE_CHUNK:
                sel.clear()
            self.last_read = self.last_full_read
            return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, dense=self.dense_decode(T))
        if self.role == "select":
            return self._select(query, qpos, scaling)
        if torch.compiler.is_compiling():  # a selection layer ran earlier in this same forward: no host check
            return self._reuse(query, sel, scaling)
        if sel.idx is None or sel.seen != self.seen or sel.T != T:
            return self._select(query, qpos, scaling)
        return self._reuse(query, sel, scaling)

    def _select(self, query, qpos, scaling):
        """Full attention and the top-k selection of every query token; returns ``[B, T, Hq, D]``.

        One ``q K^T`` gives both: the output (softmax times V) and the ranking. With one query token and no
        padding every slot but the last (the token itself) is a candidate and nothing is masked.

        Precision is that of transformers' eager attention and of the paper's code: both matmuls run in the
        cache's dtype, the softmax (and the ranking) in fp32 on the ``[B, H, G*T, n]`` scores. No fp32 copy of
        K or V is made: in bf16 such a copy reads the layer's K/V once and writes and reads twice its bytes."""
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        k = min(self.select_k, n)
        q = query.to(self.keys.dtype).reshape(B, H, G * T, D)  # row g*T + t of KV head h is query head h*G + g
        s = torch.matmul(q, self.keys.transpose(-1, -2)).float().mul_(scaling)  # [B, H, G*T, n]
        s5 = s.view(B, H, G, T, n)
        pos = self.pos[:, :1, None, None, :]  # [B, 1, 1, 1, n]: all heads hold the same tokens
        plain = self.dense_decode(T)  # one query, every held slot a real token (no host read)
        if not plain:
            q5 = qpos.view(1, 1, 1, T, 1)
            s5.masked_fill_(~((pos <= q5) & (pos >= 0)), float("-inf"))
        p = torch.softmax(s, dim=-1)
        if not plain:
            p = torch.nan_to_num(p, nan=0.0)
        p5 = p.view(B, H, G, T, n)
        if plain:  # candidates: every slot before the current token's (the last one)
            if self.per_kv_head:
                score = group_score(p5[..., : n - 1], self.kv_reduce)  # [B, H, 1, n-1]
            else:
                score = s5[..., : n - 1].reshape(B, Hq, T, n - 1)
            top = score.topk(min(k, n - 1), dim=-1)  # decreasing score
            ranked, ranked_ok, m = top.indices, None, n - 1  # every list holds real tokens only
        else:  # candidates: real tokens before each query's own position
            cand = (pos < qpos.view(1, 1, 1, T, 1)) & (pos >= 0)  # [B, 1, 1, T, n]
            if self.per_kv_head:
                score = group_score(p5.masked_fill(~cand, 0.0), self.kv_reduce)  # [B, H, T, n]
                score = score.masked_fill(~cand[:, :, 0], float("-inf"))
            else:
                score = s5.masked_fill(~cand, float("-inf")).view(B, Hq, T, n)
            top = score.topk(k, dim=-1)
            ranked, ranked_ok, m = top.indices, top.values > float("-inf"), n
        if self.shared:  # the query heads' lists merged into one, repeated for every KV head
            ranked, ranked_ok = union_ranks(ranked, ranked_ok, m, H)
        Hs = ranked.shape[1]
        if torch.compiler.is_compiling():  # static buffers: the tokens sit at the device count, not at the end
            cur_slot = self.nslots - T + torch.arange(T, device=query.device)
        else:
            cur_slot = torch.arange(n - T, n, device=query.device)
        cur = cur_slot.view(1, 1, T, 1).expand(B, Hs, T, 1)
        cur_ok = None if plain else (self.pos[:, 0].index_select(-1, cur_slot) >= 0).view(B, 1, T, 1).expand(B, Hs, T, 1)
        sel = self.info.shared
        sel.set(self.seen, T, ranked, ranked_ok, n, cur, cur_ok, slot_order=not self.shared_budgets)
        self.last_read = self.last_full_read
        out = torch.matmul(p.to(self.values.dtype), self.values)  # [B, H, G*T, Dv]
        return out.view(B, H, G, T, -1).reshape(B, Hq, T, -1).transpose(1, 2).to(query.dtype)

    def _reuse(self, query, sel, scaling):
        """Attention over the selected rows plus the current token only; returns ``[B, T, Hq, D]``."""
        idx, valid = sel.view(self.budget, query.device)  # [B, Hs, T, k+1]: this layer's top-k of the selection
        out = gather_attend(query, self.keys, self.values, idx, valid, scaling, bufs=sel.bufs)
        self.last_read = idx.numel() * self._row_bytes()
        return out


def union_ranks(indices: torch.Tensor, ok: torch.Tensor | None, m: int, H: int) -> tuple:
    """``selection="shared"``: one list per query token, the union of the query heads' rankings taken rank by rank.

    ``indices [B, Hq, T, k]`` each query head's top-k candidates (decreasing score), ``ok`` their validity (None:
    all real), ``m`` the candidates. A token's key is ``rank * Hq + head`` of its best place in any head's list; the
    ``k`` smallest keys are every head's first choice, then every head's second, ... (the order a round-robin
    merge of the lists with duplicates dropped gives). Returns ``(ranked, ranked_ok)``: ``ranked [B, H, T, k]``
    the shared list repeated for the ``H`` KV heads (so the reuse layers read it as one list per KV
    head), ``ranked_ok`` its validity or None when ``ok`` is None (the union of ``Hq`` lists of ``k`` real tokens
    holds at least ``k``)."""
    B, Hq, T, k = indices.shape
    big = Hq * (k + 1)
    key = (torch.arange(k, device=indices.device) * Hq).view(1, 1, 1, k) + torch.arange(
        Hq, device=indices.device).view(1, Hq, 1, 1)
    key = key.expand(B, Hq, T, k)
    if ok is not None:
        key = torch.where(ok, key, big)
    best = torch.full((B, T, m), big, dtype=torch.long, device=indices.device)
    best.scatter_reduce_(-1, indices.transpose(1, 2).reshape(B, T, Hq * k), key.transpose(1, 2).reshape(B, T, Hq * k),
                         reduce="amin")
    r = best.topk(k, dim=-1, largest=False)  # increasing key: round-robin order
    ranked = r.indices.view(B, 1, T, k).expand(B, H, T, k).contiguous()
    if ok is None:
        return ranked, None
    return ranked, (r.values < big).view(B, 1, T, k).expand(B, H, T, k).contiguous()


def group_score(p: torch.Tensor, kv_reduce: str) -> torch.Tensor:
    """``selection="kv_head"``: one score per KV head from its query group's softmax probabilities ``p [B, H, G, ...]``
    (dim 2 the group), reduced by ``kv_reduce`` ("max" or "sum")."""
    return p.amax(dim=2) if kv_reduce == "max" else p.sum(dim=2)


def decode_read_bytes(cache) -> dict:
    """K/V bytes read by the last decode forward of ``cache``: ``{"read", "full", "ratio"}`` (full / read).

    Layers that are not tidal stores count as reading everything they hold (``nbytes`` of K/V).
    """
    read = full = 0
    for layer in cache.layers:
        if isinstance(layer, TidalStore):
            read += layer.last_read
            full += layer.last_full_read
        else:
            b = layer.nbytes()
            read += b
            full += b
    return {"read": read, "full": full, "ratio": (full / read) if read else None}
