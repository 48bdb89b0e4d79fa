"""``tidal``: TidalDecode (Yang et al., arXiv:2410.05076) -- position-persistent sparse decode attention.

No KV is evicted (memory stays that of ``full``); what is saved is the KV *read* per decoded token.
At each decode step and for each query token:

* layers 0 and 1 read every held token (full attention);
* layer 2 (a *selection layer*) reads every held token, and picks the ``budget`` tokens with the
  highest pre-softmax scores ``q . k`` among the tokens before the current one;
* layers 3 .. r-1 read only those tokens plus the current one (a gather of ``budget + 1`` K/V rows,
  never a full ``QK^T``);
* the re-selection layer ``r`` (``reselect_layer``, default ``round(0.4 * num_layers)``: the paper uses
  13 of 32 for Llama-3-8B) reads everything and selects again; layers after it reuse that selection.

The selection travels from layer to layer through ``info.shared`` (one dict per ``KVCache``). All
tidal stores hold every token in the same slot order, so a slot index means the same token in every
layer. Selection is redone at every step. Prefill is exact full attention.

Selection modes
    ``selection="q_head"`` (the paper): top-k per query head; with GQA a KV head may then read up to
    ``group x budget`` distinct rows. ``selection="kv_head"`` (the paper's future work): one top-k per
    KV head from the softmax probabilities of its query group, combined by ``kv_reduce`` ("max" or
    "sum"); each KV head reads ``budget`` rows. Within one head, ranking by softmax probability equals
    ranking by pre-softmax score; across the heads of a group probabilities are comparable, raw
    scores are not, hence the softmax for the group reduction.

Several query tokens in one forward (speculative verification): every query token selects its own
top-k among the tokens before it and reads its own rows plus itself, so a T-token forward equals T
single-token forwards (causal by construction). Forwards of more than ``MAX_SPARSE_CHUNK`` tokens
(chunked prefill) run exact full attention in every layer, as the prefill does.

A budget that covers every candidate (``budget >= held tokens - 1``) reads everything: exactly full
attention. Read accounting: each store records the K/V bytes its last decode forward read
(``read_nbytes()``), and :func:`decode_read_bytes` sums them over a cache next to the bytes a full
cache would have read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvkit.kernels import sparse_decode
from kvkit.policies.base import Policy, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore, attend_slots

FULL_LAYERS = 2  # TidalDecode: layers 0 and 1 use full attention
SELECT_LAYER = 2  # TidalDecode: the first token-selection layer
RESELECT_FRACTION = 0.4  # TidalDecode: re-selection at layer 13 of 32 (Llama-3-8B), about 0.4 of depth
MAX_SPARSE_CHUNK = 16  # longer multi-token forwards (chunked prefill) run exact full attention
SELECTIONS = ("q_head", "kv_head")
REDUCTIONS = ("max", "sum")


@register("tidal")
@dataclass(frozen=True)
class Tidal(Policy):
    """TidalDecode: full attention at layers 0-1, top-k token selection at layer 2 and a middle
    re-selection layer, the other layers read only the selected tokens.

    Parameters
    ----------
    budget : int
        Tokens read per head at the sparse layers (k); 2048 default, 128 for needle tests, 4096 for
        LongBench in the paper.
    reselect_layer : int or None
        The re-selection layer r (3 <= r < num_layers); None: ``round(0.4 * num_layers)`` (paper: 13 of 32),
        and no re-selection for models with fewer than 5 layers.
    selection : str
        "q_head" (top-k per query head, the paper) or "kv_head" (one top-k per KV head, GQA-friendly).
    kv_reduce : str
        How "kv_head" combines the softmax probabilities of a query group: "max" or "sum".
    """

    budget: int = 2048  # TidalDecode default token budget (128 for needle tests, 4096 for LongBench)
    reselect_layer: int | None = None  # TidalDecode: layer 13 of 32 for Llama-3-8B; None = round(0.4 * L)
    selection: str = "q_head"  # TidalDecode selects per query head; "kv_head" is the GQA variant
    kv_reduce: str = "max"  # kvkit: group reduction for selection="kv_head"

    description = "TidalDecode: top-k tokens picked at 2 selection layers, other layers read only those (2410.05076)"
    saves = "reads"

    def __post_init__(self):
        check_positive_int("tidal", "budget", self.budget)
        check_positive_int("tidal", "reselect_layer", self.reselect_layer, allow_none=True)
        if self.selection not in SELECTIONS:
            raise ValueError(f"tidal: selection must be one of {', '.join(SELECTIONS)}; got {self.selection!r}")
        if self.kv_reduce not in REDUCTIONS:
            raise ValueError(f"tidal: kv_reduce must be one of {', '.join(REDUCTIONS)}; got {self.kv_reduce!r}")

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

    def validate(self, config) -> None:
        n = config.num_hidden_layers
        if n <= SELECT_LAYER:
            raise ValueError(
                f"tidal needs more than {SELECT_LAYER} layers (layers 0-1 full, layer 2 selects); "
                f"this model has {n}"
            )
        self.reselect_for(n)

    def new_shared(self, infos):
        return TidalSelection()

    def new_layer(self, info: LayerInfo):
        return TidalStore(info, self)


@dataclass
class TidalSelection:
    """The selection one cache's layers share: made at a selection layer, read by the reuse layers after it."""

    seen: int = -1  # the store length it was made at
    T: int = 0  # query tokens of that forward
    idx: torch.Tensor | None = None  # [B, Hs, T, k] selected slot indices
    valid: torch.Tensor | None = None  # [B, Hs, T, k]
    on: dict = field(default_factory=dict)  # device -> (idx, valid) copies (device_map)

    def clear(self) -> None:
        self.seen, self.idx, self.valid, self.on = -1, None, None, {}


class TidalStore(SlotStore):
    """All tokens held (never evicts); decode reads all of them or only the shared selection."""

    def __init__(self, info: LayerInfo, policy: Tidal):
        super().__init__(info)
        self.budget = policy.budget
        self.per_kv_head = policy.selection == "kv_head"
        self.kv_reduce = policy.kv_reduce
        r = policy.reselect_for(info.num_layers)
        i = info.layer_idx
        self.role = "full" if i < FULL_LAYERS else "select" if i in (SELECT_LAYER, r) else "reuse"
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
        if T > MAX_SPARSE_CHUNK or self.budget >= n - 1 or self.role == "full":
            if T > MAX_SPARSE_CHUNK:
                sel.clear()
            self.last_read = self.last_full_read
            return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling)
        if self.role == "select" or sel.idx is None or sel.seen != self.seen or sel.T != T:
            return self._select(query, qpos, scaling)
        return self._reuse(query, sel, scaling)

    def _select(self, query, qpos, scaling):
        """Full attention (fp32) and the top-k selection of every query token; returns ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        qf = query.float().view(B, H, G, T, D)
        s = torch.einsum("bhgtd,bhnd->bhgtn", qf, self.keys.float()) * scaling
        pos = self.pos[:, :1, None, None, :]  # [B, 1, 1, 1, n]: all heads hold the same tokens
        q = qpos.view(1, 1, 1, T, 1)
        s = s.masked_fill(~((pos <= q) & (pos >= 0)), float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        out = torch.einsum("bhgtn,bhnd->bhgtd", p, self.values.float())
        # candidates: real tokens before the query's own position (the current token is always read)
        cand = (pos < q) & (pos >= 0)  # [B, 1, 1, T, n]
        k = min(self.budget, n)
        if self.per_kv_head:
            pc = p.masked_fill(~cand, 0.0)
            score = pc.amax(dim=2) if self.kv_reduce == "max" else pc.sum(dim=2)  # [B, H, T, n]
            score = score.masked_fill(~cand[:, :, 0], float("-inf"))
        else:
            score = s.masked_fill(~cand, float("-inf")).view(B, Hq, T, n)
        top = score.topk(k, dim=-1)
        sel = self.info.shared
        sel.seen, sel.T, sel.idx, sel.valid, sel.on = self.seen, T, top.indices, top.values > float("-inf"), {}
        self.last_read = self.last_full_read
        return out.view(B, Hq, T, D).transpose(1, 2).to(query.dtype)

    def _reuse(self, query, sel, scaling):
        """Attention over the selected rows plus the current token only; returns ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        n = self.keys.shape[2]
        idx, valid = sel.idx, sel.valid  # [B, Hs, T, k]
        Hs = idx.shape[1]
        dev = query.device
        if idx.device != dev:  # the selection layer sits on another device (device_map): copy once per device
            if dev not in sel.on:
                sel.on[dev] = (idx.to(dev), valid.to(dev))
            idx, valid = sel.on[dev]
        cur = torch.arange(n - T, n, device=dev).view(1, 1, T, 1).expand(B, Hs, T, 1)
        cur_ok = (self.pos[:, 0, n - T :] >= 0).view(B, 1, T, 1).expand(B, Hs, T, 1)
        idx = torch.cat([idx, cur], dim=-1)
        valid = torch.cat([valid, cur_ok], dim=-1)
        out = gather_attend(query, self.keys, self.values, idx, valid, scaling)
        self.last_read = idx.numel() * self._row_bytes()
        return out


def gather_attend(query, keys, values, idx, valid, scaling):
    """Attention of each query token over its own gathered rows (``kvkit.kernels.sparse_decode``: Triton on
    CUDA, the torch reference elsewhere).

    query ``[B, Hq, T, D]``; keys/values ``[B, H, n, D]``; idx/valid ``[B, Hs, T, k]`` with Hs = Hq (one
    list per query head, read from KV head ``h // G``) or Hs = H (one list per KV head, shared by its
    query group). Only the indexed rows are read. Returns ``[B, T, Hq, D]``.
    """
    mode = "kv_head" if idx.shape[1] == keys.shape[1] else "q_head"
    indices = torch.where(valid, idx, -1).to(torch.int32)
    out = sparse_decode(query, keys, values, indices, scale=scaling, index_mode=mode)
    return out.transpose(1, 2)


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
