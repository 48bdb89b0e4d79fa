"""``kvzip``: KVzip (Kim et al., arXiv:2505.23416) -- question-agnostic eviction scored by context reconstruction.

SnapKV and CAKE score the prompt with the attention of its last queries: with the question at the end of the
prompt that is the question's attention, without it (a context compressed once and then asked several
questions, kvkit's question-agnostic protocol) it is whatever the context's last sentence looks at. KVzip asks
the model itself which KV pairs it needs to *reproduce* the context: after the exact prefill the context is fed
again, chunk by chunk, on top of the cache (the model "repeats" it), and a pair's score is the largest attention
any reconstruction query of its KV head's group pays it. The pairs nobody needs to repeat the context go first.

How it runs here (a :class:`~kvkit.stores.scored.ScoredStore`): the prefill is exact and compresses nothing; when
a multi-token forward leaves a layer above its ``budget``, kvkit's forward hook on the patched model
(``Policy.after_forward``) feeds the tokens not yet scored again in chunks of ``chunk`` (each chunk preceded by the
last ``overlap`` tokens of the previous one, as the reference does), each chunk a forward whose layers only record
scores and which is rolled back exactly afterwards; then every layer keeps its ``budget`` best slots per KV head
(the first ``sink`` tokens and the ``window`` newest always kept; with ``adaptive`` each layer its share). Decoding appends; every ``tail`` tokens above
the budget the same bound is restored, the slots added after the last reconstruction scored by the last
``window`` decode queries' maximum attention (kvkit's extension; the reference compresses the context only).

Departures from the reference, each a kvkit choice: the reference ranks all heads of all layers together; kvkit
ranks all layers together (``adaptive``, the default: each layer keeps, per KV head, its slots above the global
threshold) but keeps the heads of a layer uniform (kvkit's rectangular store; ``adaptive=False``: every layer keeps
``budget``, SnapKV's layout at the same bytes); by default the reconstruction has no instruction prompt: the repeated tokens follow
the context directly and the model's copying (induction) heads attend to the pairs they repeat, which needs no
tokenizer (``instruct=True`` adds the reference's "Repeat the previous context exactly." and the chat template's
answer header); a slot's score is its probability in the model's own softmax over every held slot (the reference
renormalises over the sinks, the chunk's own tokens and the repeat). Cost: about two prefills more (each chunk's
queries attend to every held slot), paid once per compressed context.
Memory: the reconstruction's attention and scores, and the decode queries' scores (:meth:`KVzipStore.score`), are
computed in blocks of at most ``max(E, G x n)`` ``[query rows x held slots]`` elements (``E =``
:data:`~kvkit.stores.reconstruct.SCORE_BLOCK_ELEMENTS`, ``G`` query heads per KV head, ``n`` held slots) and reduced
by maxima, never as one ``[B, Hq, queries, n]`` tensor (:mod:`kvkit.stores.reconstruct` has the formula).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvkit.policies.base import Policy, check_positive_int
from kvkit.policies.knobs import budget_for, build_slot_cost, protected_share, slot_cost, static_prompt
from kvkit.policies.protect_heads import ProtectHeads, check_protect, evicting_parts, split_or_plain
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.base import SlotStore, tensor_bytes
from kvkit.stores.reconstruct import (
    ReconstructionScoring,
    block_part,
    forward_to_repeat,
    reconstruct,
    score_blocks,
)
from kvkit.stores.scored import ScoredStore, window_attention
from kvkit.stores.static import static_store


@dataclass
class Pending:
    """A cache's tokens not yet scored by a reconstruction (``KVzip.new_shared``)."""

    ids: list = field(default_factory=list)  # [B, T] input ids of the multi-token forwards since the last one
    masks: list = field(default_factory=list)  # [B, T] their attention-mask columns (1 = real token)
    prompt: tuple | None = None  # instruct=True: the instruction / answer-header token ids, tokenized once
    protected: torch.Tensor | None = None  # [L, H] bool: the KV heads kept whole (``protect_heads``), or None


@register("kvzip")
@dataclass(frozen=True)
class KVzip(ProtectHeads, Policy):
    """KVzip context-reconstruction eviction, per KV head.

    Parameters
    ----------
    budget : int
        Slots kept per KV head (sinks and window included).
    sink : int
        First tokens always kept (reference: 4).
    window : int
        Newest tokens always kept; also the decode queries that score the tokens added after a reconstruction.
    chunk : int
        Tokens per reconstruction forward (reference: 2048). The forward's attention and scores run in blocks of
        at most :data:`~kvkit.stores.reconstruct.SCORE_BLOCK_ELEMENTS` ``[query rows x held slots]`` elements
        (:mod:`kvkit.stores.reconstruct`), so the scoring memory grows with neither ``chunk`` nor ``batch x
        context``; ``chunk`` sizes the forward's own activations (``batch x chunk`` tokens).
    overlap : int
        Tokens of the previous chunk repeated before each chunk (reference: 8).
    tail : int
        Decode tokens allowed above the budget before a bulk eviction (kvkit).
    instruct : bool
        Precede each repeated chunk with the reference's instruction ("Repeat the previous context exactly.", later
        chunks "Repeat the part of the previous context exactly, starting with" + the overlap) and the chat
        template's answer header, tokenized with the model's tokenizer (loaded offline from the config's path).
        False (default): the chunk follows the context directly.
    adaptive : bool
        Rank the scores of all layers together, as the reference does: each layer keeps per KV head the number of
        its slots above the global threshold, so layers share ``budget x layers`` (heads within a layer stay
        uniform, kvkit's rectangular store). Default True (results/ruler/README.md compares the two). False:
        every layer keeps ``budget``.
    normalize : str
        The softmax a slot's score is a probability of: ``"held"`` (default, kvkit) the model's own, over every held
        slot; ``"chunk"`` the reference's, renormalised over the first ``sink`` tokens, the chunk's own tokens and
        the repeat (causal).
    protect_heads : float
        Fraction of the KV heads kept whole, the ones the model's DuoAttention pattern ranks highest (kvkit,
        :mod:`kvkit.policies.protect_heads`: the fix for the question-agnostic needle losses, whose answer heads are
        not the heads that copy the context); ``budget`` is then per evicted head, and the reconstruction scores
        only those. None (default), where a pattern ships for the model: with ``compression_ratio`` the share that
        leaves each evicted head a sixth of the context (0.4 at 0.5, 0.1 at 0.75;
        :func:`~kvkit.policies.protect_heads.default_protect`), with a ``budget`` 0.2; else 0 (warned once). 0: the
        paper, every head evicted.
    protect_pattern : str, path, values or None
        The pattern ``protect_heads`` ranks by (as duo's ``pattern``); None: the one shipped for the model.
    """

    budget: int = 1024  # the eviction policies' common default (SnapKV's, CAKE's cache size 1024)
    sink: int = 4  # KVzip n_sink
    window: int = 64  # SnapKV's observation window: the decode queries that score tokens added after a repeat
    chunk: int = 512  # kvkit: 512-token repeats (reference: 2048) bound the reconstruction's activations
    overlap: int = 8  # KVzip prev_postfix_size
    tail: int = 32  # kvkit: bulk eviction every 32 tokens keeps crop() exact
    instruct: bool = False  # the reference's "Repeat the previous context exactly." (needs the tokenizer)
    adaptive: bool = True  # the reference ranks all layers together: per-layer budgets (mean = budget)
    normalize: str = "held"  # "held": softmax over every held slot; "chunk": the reference's local softmax
    protect_heads: float | None = None  # kvkit: default_protect(ratio) if a pattern ships (0 = paper)
    protect_pattern: object = None  # kvkit: the pattern `protect_heads` ranks by; None = the model's shipped one

    static_capable: ClassVar[bool] = True
    description = "KVzip: question-agnostic eviction scored by context reconstruction (2505.23416)"
    saves = "memory+reads"
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    #: the reference: its instruction prompt, its local softmax, every head evicted
    paper: ClassVar[dict] = dict(instruct=True, normalize="chunk", protect_heads=0.0)
    covering_options: ClassVar[dict | None] = dict(budget=4096)
    #: the reconstruction is a model forward run from kvkit's hook after the prefill: a replayed prefill skips it
    speculative_refusal: ClassVar[str | None] = (
        "kvzip re-scores after every multi-token forward (a reconstruction pass), so a verification forward "
        "would compress differently from one-token decoding")

    def __post_init__(self):
        super().__post_init__()
        for name in ("budget", "window", "chunk", "tail"):
            check_positive_int("kvzip", name, getattr(self, name))
        for name in ("sink", "overlap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kvzip: {name} must be an integer >= 0, got {v!r}")
        for name in ("instruct", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kvzip: {name} must be true or false, got {getattr(self, name)!r}")
        if self.normalize not in ("held", "chunk"):
            raise ValueError(f"kvzip: normalize must be 'held' or 'chunk', got {self.normalize!r}")
        if self.window + self.sink >= self.budget:
            raise ValueError(f"kvzip: budget ({self.budget}) must exceed window + sink ({self.window + self.sink})")
        check_protect(self)

    def shared_state(self, mask):
        return Pending(protected=mask)

    def budget_for_context(self, cache, seen: int, cost: float = 1.0) -> int:
        """The per-head budget: ``budget``, or with ``compression_ratio`` the one that reads ``1 - r`` of a
        ``seen``-token context (the protected heads counted)."""
        return self._budget(cache.shared.protected, cache.infos[0].config, seen, cost)

    def _budget(self, protected, config, seen: int, cost: float) -> int:
        if self.compression_ratio is None:
            return self.budget
        share = protected_share(protected, config)
        return budget_for(self.name, self.compression_ratio, seen, share, floor=self.window + self.sink + 1,
                          cost=cost)

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)  # a static store: the budget for the declared prompt, now
        cls = static_store(KVzipStore) if info.static else KVzipStore

        def store(n):
            s = cls(info, self, num_heads=n)
            if prompt is not None:  # the reconstruction after the prefill resolves it again, as a growing one does
                s.budget = self._budget(info.shared.protected, info.config, prompt, build_slot_cost(info))
            return s

        return split_or_plain(info, store, info.shared.protected)

    # ---- the reconstruction pass (kvkit's forward hook on the patched base model) --------------------------
    @torch.no_grad()
    def after_forward(self, base_model, cache, input_ids, attention_mask) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled step (static cache) decodes one token: nothing to repeat
        st: Pending = cache.shared
        layers, roll = evicting_parts(cache, KVzipStore)  # the stores a repeat scores, the cache layers it rolls back
        if cache.scoring_pass or not layers or any(layer.verifying for layer in layers):
            return
        T, full_mask = forward_to_repeat(layers, input_ids, attention_mask, "kvzip")
        if T == 0:  # decoding: scored by the decode queries at the next bulk eviction
            return
        seen = layers[0].seen
        if st.ids and st.ids[0].shape[0] != input_ids.shape[0]:  # the batch was expanded (beams): those tokens
            st.ids.clear()  # are no longer repeatable row for row; they keep the decode queries' scores
            st.masks.clear()
        st.ids.append(input_ids[:, -T:])
        st.masks.append(full_mask[:, -T:] if full_mask is not None else torch.ones_like(input_ids[:, -T:]))
        budget = self.budget_for_context(cache, seen, slot_cost(layers[0].keys))
        for layer in layers:
            layer.budget = budget
        if max(layer.num_slots() for layer in layers) <= budget:
            return
        ids, m = torch.cat(st.ids, dim=1), torch.cat(st.masks, dim=1)
        st.ids.clear()
        st.masks.clear()
        ctx_mask = full_mask if full_mask is not None else torch.ones(ids.shape[0], seen, dtype=m.dtype,
                                                                      device=ids.device)
        reconstruct(base_model, cache, layers, ids, m, ctx_mask, self.chunk, self.overlap,
                    self._instruction(base_model, st) if self.instruct else None, roll=roll)
        for layer in layers:
            layer.finish_scoring()
        if self.adaptive:
            self._layer_budgets(layers, budget)
        for layer in layers:
            layer.compress()
            layer.committed = layer.seen

    def _layer_budgets(self, layers, budget: int) -> None:
        """``adaptive``: the reference ranks the scores of all layers together; here, per row, the slots above its
        global threshold (its ``budget x KV heads x layers`` best, protected slots first) are counted per layer and
        the layer keeps that many per KV head (the mean over its heads; at least sink + window + 1), so a row holds
        about as many slots as with a uniform budget, distributed where its reconstruction needs them. Rows of a
        batch share a layer's slot count (the largest share); a row's slots beyond its own share are retired
        (never read, evicted first), so every row keeps exactly what it keeps alone."""
        scores = [layer.priority() for layer in layers]
        B = scores[0].shape[0]
        total = sum(budget * sc.shape[1] for sc in scores)  # per row
        home = scores[0].device  # layers may sit on several devices (device_map): rank on the first layer's
        flat = torch.cat([sc.reshape(B, -1).to(home) for sc in scores], dim=1)  # [B, all slots of all layers]
        if flat.shape[1] <= total:
            return
        threshold = flat.topk(total, dim=1).values[:, -1:]  # [B, 1] each row's own
        for layer, sc in zip(layers, scores):
            share = (sc >= threshold.view(B, 1, 1).to(sc.device)).sum(-1).float().mean(-1).round().long()  # [B]
            share = share.clamp(min=self.sink + self.window + 1, max=layer.num_slots())
            layer.row_budget = share
            layer.budget = int(share.max())

    def _instruction(self, base_model, st: Pending):
        """The reference's instruction token ids (first chunk, later chunks) and the chat template's answer header,
        tokenized once per cache with the model's own tokenizer (from its config's path, offline)."""
        if st.prompt is None:
            from transformers import AutoTokenizer

            path = getattr(base_model.config, "_name_or_path", "") or ""
            try:
                tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
                raise ValueError(f"kvzip: instruct=True needs the model's tokenizer, which could not be loaded from "
                                 f"{path!r} ({type(e).__name__}); use instruct=False (no instruction)") from e
            suffix = "\n"
            if getattr(tok, "chat_template", None):
                sep = "\n" + "#" * 12
                text = tok.apply_chat_template([{"role": "user", "content": "context" + sep}], tokenize=False,
                                               add_generation_prompt=True)
                suffix = text.split(sep, 1)[1]
            enc = lambda t: torch.tensor(tok.encode(t, add_special_tokens=False), dtype=torch.long)[None]  # noqa: E731
            st.prompt = (enc(INSTRUCTION_FIRST), enc(INSTRUCTION_NEXT), enc(suffix))
        return st.prompt


#: KVzip's reconstruction instructions (``instruct=True``): the first chunk, and the later ones (followed by the
#: last ``overlap`` tokens of the previous chunk)
INSTRUCTION_FIRST = "\n\nRepeat the previous context exactly."
INSTRUCTION_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"


class KVzipStore(ReconstructionScoring, ScoredStore):
    _batch_tensors = ScoredStore._batch_tensors + ("rscore", "row_budget")

    def __init__(self, info: LayerInfo, p: KVzip, num_heads: int | None = None):
        super().__init__(info, p.budget, p.sink, p.window, p.tail, observe=p.window, num_heads=num_heads)
        self.rscore: torch.Tensor | None = None  # [B, H, n] reconstruction score per slot, -1 = not scored yet
        self.row_budget: torch.Tensor | None = None  # [B] adaptive: each row's share of this layer (budget = max)
        self.score_norm, self.score_sinks = p.normalize, p.sink

    # ---- scores --------------------------------------------------------------------------------------------
    def score(self) -> torch.Tensor:
        s = self.rscore
        unscored = s < 0
        if self.obs is not None and bool(unscored.any()):  # added after the last reconstruction
            q, qpos = self.observed()
            s = torch.where(unscored, self._window_scores(q, qpos), s)
        return s

    def _window_scores(self, q: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """The observed queries' score of every held slot ``[B, H, n]``: the largest attention probability
        (:func:`~kvkit.stores.scored.window_attention`, each query's softmax over every held slot) a query of the
        KV head's group pays it. ``q [B, Hq, w, D]``, ``qpos [w]``.

        Computed in the blocks of :func:`~kvkit.stores.reconstruct.score_blocks` (whole (row, KV head) pairs, or
        runs of the ``w`` queries) and reduced by a running maximum, exact: the same scores as one ``[B, Hq, w, n]``
        probability tensor, with at most ``max(E, G x n)`` of its elements (fp32) per block, ``E =``
        :data:`~kvkit.stores.reconstruct.SCORE_BLOCK_ELEMENTS`, ``G`` query heads per KV head. No synchronisation."""
        B, Hq, w, _ = q.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        best = torch.zeros(B, H, n, device=self.keys.device)  # probabilities are >= 0: max(0, p) = p
        for rows, h0, h1, ts in score_blocks(B, H, G, w, n):
            a = window_attention(q[rows, h0 * G : h1 * G, ts], self.keys[rows, h0:h1],
                                 block_part(self.pos, rows, h0, h1), qpos[ts], self.scaling)  # [b, hq, t, n]
            part = best[rows, h0:h1]
            torch.maximum(part, a.amax(dim=2).view(a.shape[0], h1 - h0, G, n).amax(dim=2), out=part)
        return best

    def compress(self) -> None:
        super().compress()
        rb = self.row_budget
        if rb is None or bool((rb >= self.keys.shape[-2]).all()):
            return
        # rows whose share is below the layer's slot count: their lowest-ranked slots are retired (position -1:
        # never read, evicted first), so the row reads exactly the slots it keeps alone
        sc = self.priority()
        pos = self.pos.expand_as(sc)
        rank = sc.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        dead = rank >= rb.view(-1, 1, 1)
        self.pos = torch.where(dead, torch.full_like(pos, -1), pos).contiguous()

    def should_compress(self) -> bool:
        return not self.scoring and super().should_compress()

    def on_prefill(self, query, module) -> None:
        pass  # compression waits for the reconstruction (KVzip.after_forward)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        self.last_forward_tokens = T
        if not self.scoring:
            return super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return self.scoring_attend(query, attention_mask, scaling)

    def finish_scoring(self) -> None:
        """The reconstruction is over: the slots it scored take their score (earlier scores stay)."""
        acc = super().finish_scoring()
        if acc is not None:
            self.rscore = torch.where((self.rscore < 0) & (acc >= 0), acc, self.rscore)

    # ---- the per-slot score follows the slots -----------------------------------------------------------------
    def appended(self, T: int) -> None:
        """``T`` tokens were appended (eagerly, or by a compiled step of the static variant, after it): they are
        not scored yet (-1). Eager host code only: a compiled step never touches ``rscore``."""
        super().appended(T)
        B, H = self.keys.shape[0], self.keys.shape[1]
        new = torch.full((B, H, T), -1.0, device=self.keys.device)
        self.rscore = new if self.rscore is None else self._grow("rscore", self.rscore, new)

    def keep_slots(self, idx: torch.Tensor) -> None:
        kv_idx = idx.expand(idx.shape[0], self.keys.shape[1], idx.shape[-1]) if idx.shape[1] == 1 else idx
        self.rscore = self.rscore.gather(2, kv_idx)
        super().keep_slots(idx)

    def _drop_last(self, n: int) -> None:
        if self.scoring:  # the repeat is rolled back: its queries never entered the observed window
            SlotStore._drop_last(self, n)
        else:
            super()._drop_last(n)
        self.rscore = self.rscore[..., :-n]

    def reset(self) -> None:
        super().reset()
        self.rscore = self.acc = self.row_budget = None

    def nbytes(self) -> int:
        return super().nbytes() + tensor_bytes(self.rscore)
