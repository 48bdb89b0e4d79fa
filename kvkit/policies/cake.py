"""``cake``: CAKE, cascading and adaptive KV cache eviction (Qin et al., arXiv:2503.12491).

Prefill of layer ``m`` is exact attention over the prompt; then, from the last ``window`` prompt
queries only (``A = softmax(q_window K^T)`` in fp32, causal inside the window, ``[B, Hq, w, S]`` --
never the full ``S x S`` matrix):

* **layer preference** ``P_m = H^(1/tau1) * V^(1/tau2)`` with the entropy ``H = -sum A log(A + 1e-10)``
  and ``V`` = the variance across window queries summed over heads and keys, both on the non-window
  keys;
* **eviction indicator** per key: mean over window queries of ``A`` + ``gamma`` x their variance,
  avg-pooled along the keys (kernel 5 in the paper, centered; per model, see ``pool_kernel``; kvkit's
  ``pool_window="trailing"`` pools a key with the ``kernel - 1`` keys before it instead), averaged over the
  query heads of each KV group;
  the window's own keys always stay;
* **cascading allocation**: the total evictable budget ``B = (budget - window) * L`` is shared among
  the layers ``l <= m`` whose prefill has run, ``P_l / sum_{k<=m} P_k`` each (integers, capped at the
  prompt's non-window length, the excess and the rounding remainder spread equally over the uncapped
  layers, as the reference's ``adjust_budgets``), and every layer ``l <= m`` is re-evicted to its new
  budget by top-k per KV head on its stored indicator. Evicted tokens are gone, so a layer's budget
  only shrinks (``min`` with its previous budget) and the KV held after layer ``m`` never exceeds
  ``B + (m + 1) * window``. Nothing is evicted from a prompt of at most ``budget + window`` tokens.

Decode: each layer keeps ``prefill budget + window`` live tokens (``max(prompt, budget)`` for prompts
that were not evicted). New tokens are appended uncompressed; once ``tail`` extra tokens have arrived
the layer evicts in bulk at the start of ``update``: the last ``tail`` decode queries' softmax over the
held tokens (mean over those queries, pooled, group-averaged, as the reference scores with the current
query) ranks the non-window tokens and the top ones are kept; the last ``window`` tokens always stay.
The buffered decode queries (at most ``tail + 64``) are cropped with the tokens, so ``crop`` is exact.

Batches: every row gets its own preference, allocation and decode trigger, exactly as if it ran
alone; rows are kept rectangular by *dead* slots (position -1, never read) placed before a row's live
slots, so pooling sees the same zeros a lone row sees at its left edge. ``nbytes`` counts the dead
slots too (they are held).

Per-model ``tau1``/``tau2`` (the paper's values at cache size 1024) are chosen by the model's name or
shape; other models, including the bundled SmolLM2-135M, get (1.0, 1.0) (the reference's value for
unknown models). Options ``tau1``/``tau2`` override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_choice, check_odd_kernel, check_positive_int
from kvkit.policies.protect_heads import check_protect, protected_heads, split_or_plain
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.base import new_ring, ring_last, ring_write
from kvkit.stores.scored import POOL_WINDOWS, pool_group, window_attention
from kvkit.stores.static import static_store

#: CAKE's tau1/tau2 at cache size 1024 (paper / reference config): name fragment -> (tau1, tau2)
TAU_TABLE = {
    "llama-3.1-8b": (1.6, 0.4),
    "mistral-7b-v0.3": (0.8, 0.5),
    "qwen2.5-7b": (1.5, 0.6),
    "llama-2-7b": (1.9, 1.8),
}
DEFAULT_TAU = (1.0, 1.0)  # CAKE reference: unknown models
#: (model_type, layers, hidden, kv_heads, vocab) of each table entry, for models loaded under another name
_SHAPES = {
    ("llama", 32, 4096, 8, 128256): "llama-3.1-8b",
    ("mistral", 32, 4096, 8, 32768): "mistral-7b-v0.3",
    ("qwen2", 28, 3584, 4, 152064): "qwen2.5-7b",
    ("llama", 32, 4096, 32, 32000): "llama-2-7b",
}
QUERY_SLACK = 64  # decode queries kept beyond `tail`, so crop of up to 64 tokens keeps the scoring exact
EPS = 1e-10  # CAKE entropy epsilon


def model_taus(config) -> tuple[tuple[float, float], str]:
    """CAKE's (tau1, tau2) for a model config and where it came from (a table entry or "default")."""
    name = str(getattr(config, "_name_or_path", "") or "").lower().replace("_", "-")
    for key, taus in TAU_TABLE.items():
        if key in name:
            return taus, key
    shape = (
        getattr(config, "model_type", None), getattr(config, "num_hidden_layers", None),
        getattr(config, "hidden_size", None),
        getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None),
        getattr(config, "vocab_size", None),
    )
    key = _SHAPES.get(shape)
    if key == "llama-3.1-8b":  # Llama-3-8B has the same shape; 3.1 is told apart by its llama3 RoPE scaling
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "llama3"):
            key = None
    return (TAU_TABLE[key], key) if key else (DEFAULT_TAU, "default")


@register("cake")
@dataclass(frozen=True)
class Cake(Policy):
    """CAKE: per-layer budgets from attention entropy/variance, cascading eviction during prefill.

    Parameters
    ----------
    budget : int
        Average tokens kept per layer *including* the window (the paper's cache_size); 1024 default.
    window : int
        Last prompt queries used for scoring, their tokens always kept (S_w = 32 in the paper).
    gamma : float
        Weight of the variance in the eviction indicator (200 in the paper).
    pool_kernel : int or None
        Average-pooling kernel of the indicator along the keys (5 in the paper; padding kernel // 2). None: the
        model's calibrated kernel (``kvkit calibrate cake``, question-aware: with one token per digit a 7-digit
        value outgrows the paper's kernel), else 5.
    pool_window : str or None
        ``"centered"`` (the paper: ``kernel // 2`` tokens on each side) or ``"trailing"`` (kvkit: the token and
        the ``kernel - 1`` before it, so the tokens after an attended one inherit its score). None: calibrated,
        else centered.
    tau1, tau2 : float or None
        Temperatures of the layer preference ``H^(1/tau1) * V^(1/tau2)``; None: the paper's per-model
        values (``TAU_TABLE``), (1.0, 1.0) for other models.
    tail : int or None
        Decode tokens allowed above a layer's size before a bulk eviction (kvkit; at most ``window``);
        None: ``window``.
    calibrated : bool
        True (default): with tau1/tau2/pool_kernel left at None, the model's calibrated taus and kernel
        (``kvkit calibrate cake``; found from the config by :mod:`kvkit.calibration`) before the paper's
        table and kernel 5. False: the paper's table / (1.0, 1.0) and kernel 5.
    protect_heads : float
        Fraction of the KV heads kept whole, the ones the model's DuoAttention pattern ranks highest (kvkit,
        :mod:`kvkit.policies.protect_heads`); the cascade then shares ``budget`` per layer among the evicted heads'
        layers, and a layer's preference is computed over its evicted heads. 0 (default): the paper.
    protect_pattern : str, path, values or None
        The pattern ``protect_heads`` ranks by (as duo's ``pattern``); None: the one shipped for the model.
    """

    budget: int = 1024  # CAKE cache_size (per-layer average, window included)
    window: int = 32  # CAKE S_w
    gamma: float = 200.0  # CAKE gamma
    pool_kernel: int | None = None  # None: calibrated, else CAKE's avg-pool kernel size 5
    pool_window: str | None = None  # None: calibrated, else CAKE's centered window (kvkit: "trailing")
    tau1: float | None = None  # CAKE Table: per-model; None = by model, (1.0, 1.0) if unknown
    tau2: float | None = None  # CAKE Table: per-model; None = by model, (1.0, 1.0) if unknown
    tail: int | None = None  # kvkit: bulk decode eviction every `tail` tokens; None = window
    calibrated: bool = True  # kvkit: the model's calibrated taus when none given; False = the paper's table
    protect_heads: float = 0.0  # kvkit: fraction of KV heads kept whole (DuoAttention's top heads); 0 = the paper
    protect_pattern: object = None  # kvkit: the pattern `protect_heads` ranks by; None = the model's shipped one

    static_capable: ClassVar[bool] = True
    description = "CAKE: layer budgets from attention entropy+variance, cascading eviction, mean+var indicator (2503.12491)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("tau1", "tau2", "pool_kernel", "pool_window")
    covering_options: ClassVar[dict | None] = dict(budget=4096)
    speculative_refusal: ClassVar[str | None] = (
        "CAKE evicts in bulk when its tail fills, ranking tokens by the attention of the buffered decode "
        "queries; a speculative round feeds gamma + 1 tokens at once and must keep them croppable, so the "
        "eviction runs at another token count and sees other queries than in one-token decoding"
    )

    def __post_init__(self):
        for name in ("budget", "window"):
            check_positive_int("cake", name, getattr(self, name))
        check_odd_kernel("cake", "pool_kernel", self.pool_kernel)
        check_positive_int("cake", "tail", self.tail, allow_none=True)
        if self.budget <= self.window:
            raise ValueError(
                f"cake: budget ({self.budget}) must be larger than window ({self.window}): budget is the average "
                "cache size per layer including the window"
            )
        check_choice("cake", "pool_window", self.pool_window, POOL_WINDOWS)
        if self.tail is not None and self.tail > self.window:
            raise ValueError(
                f"cake: tail ({self.tail}) must be at most window ({self.window}) so every scored token was seen by "
                "all the decode queries that score it"
            )
        for name in ("gamma", "tau1", "tau2"):
            v = getattr(self, name)
            if v is None and name != "gamma":
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
            if not ok or v < 0 or (name != "gamma" and v == 0):
                raise ValueError(f"cake: {name} must be a {'non-negative' if name == 'gamma' else 'positive'} number, got {v!r}")
        check_protect(self)

    def taus(self, config) -> tuple[float, float]:
        (t1, t2), _ = model_taus(config) if config is not None else (DEFAULT_TAU, "default")
        return (self.tau1 if self.tau1 is not None else t1, self.tau2 if self.tau2 is not None else t2)

    def new_shared(self, infos):
        return CakeCascade(protected=protected_heads("cake", infos[0].config, self.protect_heads, self.protect_pattern))

    def validate(self, config) -> None:
        protected_heads("cake", config, self.protect_heads, self.protect_pattern)

    def new_layer(self, info: LayerInfo):
        p = resolve(self, info.config)
        cls = static_store(CakeStore) if info.static else CakeStore
        taus = p.taus(info.config)
        return split_or_plain(info, lambda n: cls(info, p, *taus, num_heads=n), info.shared.protected)


@dataclass
class CakeCascade:
    """One cache's cascade state: every layer's store, preference and budget ``[B]`` so far."""

    stores: dict = field(default_factory=dict)  # layer -> CakeStore
    pref: dict = field(default_factory=dict)  # layer -> [B] preference
    budgets: dict = field(default_factory=dict)  # layer -> [B] evictable budget
    history: list = field(default_factory=list)  # budgets after each layer's prefill
    protected: torch.Tensor | None = None  # [L, H] bool: the KV heads kept whole (``protect_heads``), or None


def allocate(pref: torch.Tensor, total: int, cap: torch.Tensor) -> torch.Tensor:
    """Integer budgets ``[B, m]`` from preferences ``pref [B, m]``: shares ``pref / sum`` of ``total``, capped at
    ``cap [B]``; the capped excess and the rounding remainder are spread equally over the uncapped layers
    (the first ones get the remainder), so each row sums to ``total`` unless every layer is capped."""
    B, m = pref.shape
    pref = pref.double().clamp(min=0).nan_to_num(0.0)
    s = pref.sum(-1, keepdim=True)
    share = torch.where(s > 0, pref / s.clamp(min=1e-300), torch.full_like(pref, 1.0 / m))
    capm = cap.view(B, 1).long().expand(B, m)
    b = torch.floor(share * total).long().minimum(capm)
    for _ in range(m + 1):
        amount = total - b.sum(-1)  # [B]
        free = b < capm
        nfree = free.sum(-1)
        if not bool(((amount > 0) & (nfree > 0)).any()):
            break
        per = amount.clamp(min=0) // nfree.clamp(min=1)
        rem = amount.clamp(min=0) % nfree.clamp(min=1)
        rank = free.long().cumsum(-1) - 1
        b = (b + torch.where(free, per[:, None] + (rank < rem[:, None]).long(), 0)).minimum(capm)
    return b


class CakeStore(SlotStore):
    """One CAKE layer: per-KV-head positions (``pos [B, H, n]``), the prefill indicator while the cascade
    runs, the live-token size of each row for decode and the last decode queries for decode scoring."""

    _batch_tensors = SlotStore._batch_tensors + ("score", "size", "qbuf")

    def __init__(self, info: LayerInfo, policy: Cake, tau1: float, tau2: float, num_heads: int | None = None):
        super().__init__(info, num_heads)
        self.budget, self.window, self.gamma = policy.budget, policy.window, policy.gamma
        self.kernel = policy.pool_kernel if policy.pool_kernel is not None else 5
        self.pool_window = policy.pool_window or "centered"
        self.tail = policy.tail if policy.tail is not None else policy.window
        self.tau1, self.tau2 = tau1, tau2
        self.score: torch.Tensor | None = None  # [B, H, n] prefill indicator (+inf window, -inf dead)
        self.size: torch.Tensor | None = None  # [B] live tokens a row keeps at decode (budget + window)
        self.qbuf: torch.Tensor | None = None  # [B, Hq, nq, D] last decode queries (static: a ring, see below)
        self.qbuf_pos: torch.Tensor | None = None  # static: [tail + QUERY_SLACK] the ring's positions
        #: tokens still to append before some row reaches ``size + tail`` live slots (the compression trigger),
        #: counted on the host so a decode step reads nothing from the device; None: re-read at the next check
        self.countdown: int | None = None
        self.scaling = info.head_dim**-0.5
        info.shared.stores[info.layer_idx] = self

    def reset(self) -> None:
        super().reset()
        self.score = self.size = self.qbuf = self.qbuf_pos = self.countdown = None

    def arm(self) -> None:
        """Read how many tokens may be appended before the first row triggers a compression (one host read, at
        prefill or a compression event). Every appended token is counted off; a row whose new token is padding
        gains no live slot, so the countdown can only run out early, never late (an early check compresses no
        row: :meth:`compress` decides per row on the device)."""
        self.countdown = None if self.size is None else int((self.size + self.tail - self.live()[:, 0]).min())
        if self.static and self.size is not None:  # the capacity follows the decode size (a host read here too)
            self._bound = int(self.size.max()) + self.tail + 1
            self._fit()
            if self.qbuf is None:  # the decode-query ring exists before the first compiled step (fixed inputs)
                B, _, _, D = self.keys.shape
                self.qbuf, self.qbuf_pos = new_ring(B, self.num_store_heads * self.info.groups, self.tail + QUERY_SLACK, D,
                                                    self.keys.dtype, self.keys.device)

    def slots_bound(self) -> int | None:
        """Static capacity: the largest row's decode size + ``tail`` (known once the cascade ran)."""
        return getattr(self, "_bound", None)

    def appended(self, T: int) -> None:
        if self.countdown is not None:
            self.countdown -= T

    def _apply_batch(self, fn) -> None:
        super()._apply_batch(fn)
        self.countdown = None

    def nbytes(self) -> int:
        return super().nbytes() + _tensor_bytes(self.score, self.size, self.qbuf, self.first_pos)

    def live(self) -> torch.Tensor:
        """Live (readable) tokens per row and KV head ``[B, H]``."""
        return (self.pos >= 0).sum(-1)

    # ---- bookkeeping -------------------------------------------------------------------------
    def keep_slots(self, idx: torch.Tensor) -> None:
        super().keep_slots(idx)
        if self.score is not None:
            self.score = self.score.gather(2, idx.expand(-1, self.score.shape[1], -1))

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        self.countdown = None  # the dropped tokens may have been padding: re-read
        if self.score is not None:
            self.score = self.score[..., :-n]
        if self.qbuf is not None and self.static:
            self.qbuf_pos.masked_fill_(self.qbuf_pos >= self.seen - n, -1)
        elif self.qbuf is not None:
            self.qbuf = self.qbuf[:, :, : max(self.qbuf.shape[2] - n, 0)]

    def _evict_to(self, score: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the ``keep [B]`` best live slots of every (row, KV head) by ``score [B, H, n]``; the rest of a
        row's rectangle becomes dead slots (position -1), placed before its live slots in slot order."""
        n = self.keys.shape[-2]
        kmax = min(int(keep.max()), n)
        if kmax >= n and bool((self.live() <= keep[:, None]).all()):
            return
        score = score.masked_fill(self.pos < 0, float("-inf"))
        top = score.topk(kmax, dim=-1)
        ok = (torch.arange(kmax, device=score.device).view(1, 1, kmax) < keep.view(-1, 1, 1)) & (
            top.values > float("-inf")
        )
        order = torch.where(ok, top.indices + n, top.indices).argsort(dim=-1)  # dead first, live in slot order
        idx = top.indices.gather(-1, order)
        ok = ok.gather(-1, order)
        self.keep_slots(idx)
        self.pos = torch.where(ok, self.pos, -1).contiguous()
        if self.score is not None:
            self.score = self.score.masked_fill(~ok, float("-inf"))

    # ---- prefill: preference, indicator, cascade -------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        self.scaling = scaling
        out = super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        self.record_queries(query)
        return out

    def record_queries(self, query: torch.Tensor) -> None:
        """A decode forward's queries, for decode scoring: the last ``tail + QUERY_SLACK`` of them (a static store
        keeps them in a ring written in place, :func:`~kvkit.stores.base.ring_write`)."""
        T = query.shape[2]
        if self.static:
            if torch.compiler.is_compiling() or self.seen > T:
                self.qbuf, self.qbuf_pos = ring_write(self.qbuf, self.qbuf_pos, query.detach(), self.seen_t - T,
                                                      self.tail + QUERY_SLACK)
            return
        if self.seen > T:
            q = query.detach()
            self.qbuf = q if self.qbuf is None else torch.cat([self.qbuf, q], dim=2)
            self.qbuf = self.qbuf[:, :, -(self.tail + QUERY_SLACK) :]

    def _window_attention(self, qw: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        return window_attention(qw, self.keys, self.pos, qpos, self.scaling)

    def _pool_group(self, x: torch.Tensor) -> torch.Tensor:
        return pool_group(x, self.kernel, self.keys.shape[1], window=self.pool_window)

    def on_prefill(self, query, module) -> None:
        B, Hq, S, D = query.shape
        w = min(self.window, S)
        real = (self.pos[:, 0] >= 0).sum(-1)  # [B]
        qpos = torch.arange(S - w, S, device=query.device, dtype=torch.int32)
        A = self._window_attention(query[:, :, S - w :], qpos)  # [B, Hq, w, S]
        a_nw = A[..., : S - w]
        # layer preference (CAKE eq.: entropy and variance on the non-window keys), float64 for the powers
        ent = -(a_nw * torch.log(a_nw + EPS)).sum(dim=(1, 2, 3)).double()
        var_w = a_nw.var(dim=2) if w > 1 else torch.zeros_like(a_nw[:, :, 0])
        var = var_w.sum(dim=(1, 2)).double()
        pref = ent.clamp(min=0) ** (1.0 / self.tau1) * var.clamp(min=0) ** (1.0 / self.tau2)  # [B]
        # eviction indicator: mean + gamma * variance over window queries, pooled, group-averaged
        ind = A.mean(dim=2) + self.gamma * (A.var(dim=2) if w > 1 else 0.0)
        nw = self._pool_group(ind[..., : S - w])
        win = torch.full((B, nw.shape[1], w), float("inf"), device=nw.device)
        self.score = torch.cat([nw, win], dim=-1).masked_fill(self.pos < 0, float("-inf"))
        self._cascade(pref, real, w)

    def _cascade(self, pref: torch.Tensor, real: torch.Tensor, w: int) -> None:
        st = self.info.shared
        stores = st.stores
        m = self.info.layer_idx
        if m == min(stores):  # first layer of a new prompt
            st.pref.clear()
            st.budgets.clear()
            st.history.clear()
        st.pref[m] = pref
        layers = sorted(st.pref)
        total = (self.budget - self.window) * len(stores)
        evict = real > self.budget + self.window  # [B] rows long enough to evict anything
        cap = (real - w).clamp(min=0)
        # Layers may live on different devices (device_map="auto"): the allocation runs on this layer's
        # device, and each store's budget and size are kept on that store's own device.
        dev = real.device
        alloc = allocate(torch.stack([st.pref[i].to(dev) for i in layers], dim=-1), total, cap)
        for j, i in enumerate(layers):
            store = stores[i]
            b = torch.where(evict, alloc[:, j], cap)
            prev = st.budgets.get(i)
            if prev is not None:
                b = b.minimum(prev.to(dev))
            sdev = store.pos.device
            st.budgets[i] = b.to(sdev)
            if prev is None or bool((b < prev.to(dev)).any()):
                store._evict_to(store.score, (b + w).to(sdev))
            store.size = torch.where(evict, b + w, real.clamp(min=self.budget)).to(sdev)
        st.history.append({i: st.budgets[i] for i in layers})
        if m == max(stores):  # cascade done: the prefill indicators are no longer needed
            for store in stores.values():
                store.score = None
                store.arm()

    # ---- decode ------------------------------------------------------------------------------
    def should_compress(self) -> bool:
        if self.size is None:
            return False
        if self.countdown is None:
            self.arm()
        return self.countdown <= 0

    def compress(self) -> None:
        live = self.live()[:, 0]
        trig = live >= self.size + self.tail
        keep = torch.where(trig, self.size, live)
        self._evict_to(self._decode_score(), keep)
        self.arm()

    def _decode_score(self) -> torch.Tensor:
        """Indicator ``[B, H, n]`` from the last ``tail`` decode queries: mean softmax over held slots, the
        non-window part pooled and group-averaged; the last ``window`` slots +inf."""
        n = self.keys.shape[-2]
        w = min(self.window, n)
        B, H = self.keys.shape[:2]
        if self.qbuf is None or self.qbuf.shape[2] == 0 or (self.static and not bool((self.qbuf_pos >= 0).any())):
            return self.pos.float()  # no decode query yet: keep the newest
        if self.static:
            q, qpos = ring_last(self.qbuf, self.qbuf_pos, self.tail, self.seen)
        else:
            q = self.qbuf[:, :, -self.tail :]
            nq = q.shape[2]
            qpos = torch.arange(self.seen - nq, self.seen, device=q.device, dtype=torch.int32)
        A = self._window_attention(q, qpos).mean(dim=2)  # [B, Hq, n]
        nw = self._pool_group(A[..., : n - w])
        win = torch.full((B, H, w), float("inf"), device=nw.device)
        return torch.cat([nw, win], dim=-1)


def cascade_history(cache) -> list[dict[int, torch.Tensor]]:
    """Per-layer budgets ``[B]`` after each layer's prefill (the cascade), for inspection and tests."""
    return list(cache.shared.history)
