"""Lossless self-speculative decoding (MagicDec / TriForce) as a ``generate`` loop.

Three *levels* share one interface (a model, a cache, the token ids the cache holds):

* the **target**: the model with its real cache (``full`` unless the model is patched otherwise);
* the **self-draft**: the same model reading a sparse view of that same cache (:mod:`.draft`);
* optionally the **assistant**: a tiny model sharing the tokenizer, with its own StreamingLLM cache,
  which drafts for the self-draft (TriForce's hierarchy: tiny -> sparse-KV target -> full target).

One round (gpt-fast's loop, applied recursively)::

    drafts, q = propose(drafter, seq, gamma)          # gamma tokens + the drafter's distributions
    p = verifier(seq + drafts)                        # ONE forward over gamma + 1 positions
    n, nxt = accept(drafts, q, p)                     # greedy or the standard rejection rule
    verifier.crop_to(len(seq) + n); seq += drafts[:n] + [nxt]

The self-draft "proposes" either autoregressively or, with an assistant, by running the same round
with the assistant as its drafter; every level uses the standard rule, so every level is lossless
and the output follows the target's distribution (greedy: token for token the target's greedy
output). The draft tokens' K/V never enter the real cache (see :mod:`.draft`): they were computed
with sparse attention, so the verification forward computes the true K/V and the rejected ones are
cropped (exact rollback).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.utils import ModelOutput

from kvkit.cache import KVCache
from kvkit.speculative.draft import DraftCache, make_view
from kvkit.speculative.verify import accept_greedy, accept_sample, pick, process
from kvkit.stores import FullStore, SlotStore

#: adaptive=True stops drafting when the draft's top probability falls below this
#: (transformers' default ``assistant_confidence_threshold``)
ADAPTIVE_THRESHOLD = 0.4
#: the assistant's cache: TriForce's StreamingLLM draft cache, 16 sinks + recent, 256 in all
ASSISTANT_CACHE = {"policy": "streaming", "budget": 256, "sink": 16}
#: keyword arguments read into the generation config on direct calls
GENERATION_KEYS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                   "return_dict_in_generate")


@dataclass
class SpeculativeStats:
    """Counts of one generation: drafted/accepted at the target level (and the assistant level)."""

    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    assistant_drafted: int = 0
    assistant_accepted: int = 0
    decode_tokens: int = 0  # tokens emitted by the rounds (new_tokens minus the prefill's first token)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # top-level drafting (self-draft steps, assistant included) within decode_seconds
    verify_seconds: float = 0.0  # top-level verification forwards within decode_seconds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def assistant_acceptance_rate(self) -> float:
        return self.assistant_accepted / self.assistant_drafted if self.assistant_drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.decode_tokens / self.rounds if self.rounds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode rounds emitted per decode second (the prefill's first token is not counted)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_round=self.tokens_per_round,
                 assistant_acceptance_rate=self.assistant_acceptance_rate,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d


@dataclass
class SpeculativeOutput(ModelOutput):
    """``return_dict_in_generate=True``: the sequences, the target's cache and the stats."""

    sequences: torch.LongTensor | None = None
    past_key_values: object = None
    stats: SpeculativeStats | None = None


# ---- levels -------------------------------------------------------------------------------------
@contextmanager
def suffix_attention(cache, on: bool):
    """Verification forwards on CPU: ``FullStore`` layers attend as prefix + causal suffix (see
    :func:`kvkit.stores.attend.causal_suffix_attention`) instead of the masked kernel, for the duration."""
    layers = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, FullStore)] if on else []
    for layer in layers:
        layer.suffix_attention = True
    try:
        yield
    finally:
        for layer in layers:
            layer.suffix_attention = False


@contextmanager
def tall_lm_head(model, rows: int):
    """On CPU, compute a few-row logits projection as ``(W @ h.T).T`` for the duration.

    The verification forward needs the logits of gamma + 1 positions. MKL runs ``h @ W.T`` with 2-16
    rows of ``h`` against SmolLM2's 49152 x 576 head at a fraction of its memory bandwidth, while the
    tall-skinny ``W @ h.T`` streams ``W`` once (with the suffix attention: a 5-token forward at 8K in
    1.27 instead of 1.60 decode steps, ``results/speculative/profile_verify.py``).
    Same math, different summation order (~5e-5 on the logits, like any multi-token forward vs
    one-token decoding). No-op on other devices, for one row, or when the head is not an ``nn.Linear``.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if rows < 2 or not isinstance(head, torch.nn.Linear) or head.weight.device.type != "cpu" or "forward" in vars(head):
        yield
        return

    def forward(x):
        y = (head.weight @ x.reshape(-1, x.shape[-1]).T).T
        if head.bias is not None:
            y = y + head.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _crop(cache, n: int) -> None:
    """Remove the last ``n`` tokens from every layer of ``cache`` (sliding layers re-trim to their window)."""
    for layer in cache.layers:
        if n > 0:
            layer.crop(-n)
        elif isinstance(layer, DynamicSlidingWindowLayer):
            layer.crop(0)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


class Level:
    """A model with a cache and the token ids the cache holds (in order)."""

    def __init__(self, model, cache, drafter: Level | None = None):
        self.model, self.cache, self.drafter = model, cache, drafter
        self.tokens = torch.empty(0, dtype=torch.long)

    def sync(self, seq: torch.Tensor) -> None:
        """Roll back to the longest prefix shared with ``seq``, keeping its last token to feed."""
        self.crop_to(min(_common_prefix(self.tokens, seq), seq.shape[0] - 1))

    def crop_to(self, n: int) -> None:
        if n < self.tokens.shape[0]:
            _crop(self.cache, self.tokens.shape[0] - n)
            self.tokens = self.tokens[:n]

    def feed(self, seq: torch.Tensor, keep: int) -> torch.Tensor:
        """Run the tokens of ``seq`` the cache lacks; returns the logits of the last ``keep`` of them ``[keep, V]``."""
        new = seq[self.tokens.shape[0] :]
        dev = self.model.device
        with tall_lm_head(self.model, keep), suffix_attention(self.cache, keep > 1):
            out = self.model(input_ids=new[None].to(dev), past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.tokens = seq.clone()
        return out.logits[0, -keep:].to(seq.device)


class ViewLevel(Level):
    """The self-draft: the target model over a :class:`DraftCache` view of the target's cache."""

    def begin_round(self, target: Level) -> None:
        self.cache.begin_round()
        self.tokens = target.tokens.clone()


class AssistantLevel(Level):
    """The tiny assistant with its StreamingLLM cache."""

    def crop_to(self, n: int) -> None:
        super().crop_to(n)
        # Rollbacks *inside* a top-level round (after each assistant round the self-draft keeps a prefix)
        # must not trigger a store's "compress at the next update after a rollback" rule (meant for HF's
        # assisted decoding): it would commit assistant tokens that the top-level verification may still
        # reject. make_room already evicted for the whole round at its start.
        for layer in self.cache.layers:
            if getattr(layer, "rolled_back", False):
                layer.rolled_back = False

    def make_room(self, headroom: int) -> None:
        """Evict now so no eviction happens during the next round: its tokens stay exactly croppable."""
        for layer in self.cache.layers:
            if isinstance(layer, SlotStore) and layer.keys is not None:
                if layer.keys.shape[-2] + headroom >= layer.budget + layer.tail:
                    layer.compress()
                    layer.committed = layer.seen


@dataclass
class _Run:
    logits_processor: LogitsProcessorList
    do_sample: bool
    gamma: int
    assistant_gamma: int
    threshold: float | None
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def propose(level: Level, seq: torch.Tensor, k: int, run: _Run):
    """``level`` continues ``seq`` by up to ``k`` tokens: (tokens ``[k']``, distributions ``[k', V]`` or None)."""
    level.sync(seq)
    if level.drafter is not None:  # hierarchical: this level is itself sped up by its drafter
        out, dists = [], []
        cur = seq
        while sum(t.shape[0] for t in out) < k:
            emitted, p = step(level, level.drafter, cur, run.assistant_gamma, run, assistant=True)
            out.append(emitted)
            dists.append(p)
            cur = torch.cat([cur, emitted])
        toks = torch.cat(out)[:k]
        return toks, (torch.cat(dists)[:k] if run.do_sample else None)
    toks, dists = [], []
    cur = seq
    for _ in range(k):
        logits = process(run.logits_processor, cur, level.feed(cur, keep=1))[0]
        probs = logits.softmax(-1) if (run.do_sample or run.threshold is not None) else None
        t = pick(probs if run.do_sample else logits, run.do_sample)
        toks.append(t)
        if run.do_sample:
            dists.append(probs)
        cur = torch.cat([cur, cur.new_tensor([t])])
        if run.threshold is not None and float(probs.max()) < run.threshold:
            break
    return torch.tensor(toks, dtype=torch.long), (torch.stack(dists) if run.do_sample else None)


def step(verifier: Level, drafter: Level, seq: torch.Tensor, k: int, run: _Run, assistant: bool = False):
    """One speculative round: returns the emitted tokens ``[n + 1]`` and the verifier's distributions for them."""
    t0 = time.perf_counter()
    drafts, q = propose(drafter, seq, k, run)
    if not assistant:
        _sync(verifier.model)
        t1 = time.perf_counter()
        run.stats.draft_seconds += t1 - t0
    verifier.sync(seq)
    full = torch.cat([seq, drafts])
    k = drafts.shape[0]
    logits = process(run.logits_processor, full, verifier.feed(full, keep=k + 1))  # [k + 1, V]
    if not assistant:  # (the logits are on the CPU here: the forward has finished)
        run.stats.verify_seconds += time.perf_counter() - t1
    if run.do_sample:
        p = logits.softmax(-1)
        n, nxt = accept_sample(drafts, q, p)
    else:
        p = None
        n, nxt = accept_greedy(drafts, logits)
    verifier.crop_to(seq.shape[0] + n)
    if assistant:
        run.stats.assistant_drafted += k
        run.stats.assistant_accepted += n
    else:
        run.stats.drafted += k
        run.stats.accepted += n
    emitted = torch.cat([drafts[:n], drafts.new_tensor([nxt])])
    return emitted, (p[: n + 1] if p is not None else None)


# ---- checks -------------------------------------------------------------------------------------
def _vocab_size(model) -> int:
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return emb.weight.shape[0]
    return model.config.get_text_config(decoder=True).vocab_size


def check_assistant(model, assistant, tokenizer=None, assistant_tokenizer=None) -> None:
    """Raise ValueError unless ``assistant`` shares ``model``'s tokenizer (vocabulary and special tokens)."""
    va, vt = _vocab_size(assistant), _vocab_size(model)
    name_a = getattr(assistant.config, "_name_or_path", "") or type(assistant).__name__
    if va != vt:
        raise ValueError(
            f"the assistant model ({name_a}) has a vocabulary of {va} tokens but the target has {vt}: the assistant "
            "must share the target's tokenizer (e.g. Qwen2.5-Coder 0.5B for 1.5B)"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        a = getattr(assistant.generation_config, attr, None)
        t = getattr(model.generation_config, attr, None)
        if a is not None and t is not None and a != t:
            raise ValueError(f"the assistant's {attr} ({a}) differs from the target's ({t}): different tokenizers")
    if tokenizer is not None and assistant_tokenizer is not None and tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
        raise ValueError("the assistant's tokenizer differs from the target's; speculative decoding needs the same one")


def _int_arg(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _processors(gc, do_sample) -> LogitsProcessorList:
    """Temperature / top-k / top-p warpers of ``gc`` (direct calls; ``model.generate`` passes its own list)."""
    lp = LogitsProcessorList()
    if not do_sample:
        return lp
    temperature, top_k, top_p = gc.temperature, gc.top_k, gc.top_p
    if temperature is not None and temperature != 1.0:
        lp.append(TemperatureLogitsWarper(temperature))
    if top_k:
        lp.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        lp.append(TopPLogitsWarper(top_p))
    return lp


# ---- the entry point ----------------------------------------------------------------------------
@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    draft: str = "self",
    draft_policy="streaming",
    draft_options: dict | None = None,
    gamma: int = 4,
    assistant=None,
    assistant_gamma: int | None = None,
    assistant_cache: dict | None = None,
    adaptive: bool | float = False,
    stats: SpeculativeStats | None = None,
    **model_kwargs,
):
    """Lossless speculative decoding with the sparse-KV self-draft; batch size 1.

    Use directly (``kvkit.speculative.generate(model, ids, gamma=4, max_new_tokens=64)``) or as
    ``model.generate(ids, custom_generate=kvkit.speculative.generate, gamma=4, ...)``; works on an
    unpatched model (patched with ``full`` for the call) and after ``kvkit.patch``.

    draft: ``"self"`` (the only drafter; the assistant sits under it). draft_policy: ``"streaming"``
    (sinks + recent window, MagicDec) or ``"retrieval"`` (TriForce chunks) or a ``DraftView``;
    draft_options: its options (``budget``, ``sink`` / ``chunk``, ``rebuild``). gamma: tokens drafted
    per verification. assistant: a tiny model sharing the tokenizer that drafts ``assistant_gamma``
    (default gamma) tokens at a time for the self-draft, with its own cache (``assistant_cache``,
    default StreamingLLM 16 sinks / 256). adaptive: stop drafting when the draft's top probability
    is below 0.4 (True) or the given threshold. stats: a :class:`SpeculativeStats` filled in place.
    Returns the sequences ``[1, prompt + new]`` (a :class:`SpeculativeOutput` with
    ``return_dict_in_generate``).

    Generation settings (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``eos_token_id``, ``return_dict_in_generate``) are keyword arguments, as for ``model.generate``
    (which puts them into ``generation_config`` before calling this function).
    """
    if draft != "self":
        raise ValueError(f"draft must be 'self' (the sparse-KV self-draft), got {draft!r}; pass a small model as assistant=")
    gamma = _int_arg("gamma", gamma)
    assistant_gamma = _int_arg("assistant_gamma", assistant_gamma if assistant_gamma is not None else gamma)
    view = make_view(draft_policy, draft_options)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"kvkit.speculative.generate supports batch size 1 (got {input_ids.shape[0]}): accepted lengths differ "
            "per sequence; run the prompts one at a time"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    via_hf = generation_config is not None
    gc = copy.deepcopy(generation_config if via_hf else model.generation_config)
    gc.update(**{k: model_kwargs.pop(k) for k in GENERATION_KEYS if k in model_kwargs})
    do_sample = bool(gc.do_sample)
    if logits_processor is None:
        logits_processor = _processors(gc, do_sample)
    if adaptive is True:
        threshold = ADAPTIVE_THRESHOLD
    elif adaptive is False or adaptive is None:
        threshold = None
    elif isinstance(adaptive, (int, float)) and 0 < adaptive < 1:
        threshold = float(adaptive)
    else:
        raise ValueError(f"adaptive must be a bool or a threshold in (0, 1), got {adaptive!r}")
    if gc.max_new_tokens is not None:
        max_new_tokens = gc.max_new_tokens
    else:  # transformers' default: max_length (20) counts the prompt
        max_new_tokens = gc.max_length - input_ids.shape[1]
    if max_new_tokens < 1:
        return input_ids
    if assistant is not None:
        check_assistant(model, assistant, model_kwargs.get("tokenizer"), model_kwargs.get("assistant_tokenizer"))
    eos = gc.eos_token_id
    eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])

    # a one-row attention mask may mark left padding: decode the real tokens only
    mask = model_kwargs.get("attention_mask")
    prompt = input_ids[0]
    if isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape and not bool(mask.all()):
        prompt = prompt[mask[0].bool()]
    prompt = prompt.cpu()

    import kvkit

    patched_here = []
    try:
        if getattr(model, "_kvkit_state", None) is None:
            kvkit.patch(model, "full")
            patched_here.append(model)
        if assistant is not None and getattr(assistant, "_kvkit_state", None) is None:
            kvkit.patch(assistant, "full")  # routing only: the assistant reads its own cache below
            patched_here.append(assistant)

        cache = model_kwargs.get("past_key_values")
        held = 0
        if isinstance(cache, KVCache):
            held = cache.get_seq_length()
            if held >= prompt.shape[0]:
                raise ValueError(f"past_key_values already holds {held} tokens; input_ids must extend it")
        elif cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
            cache = KVCache(model)
        else:
            raise ValueError("kvkit.speculative.generate needs a kvkit.KVCache (or no cache) as past_key_values")
        for layer in cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()  # keep rejected tokens croppable on sliding layers

        target = Level(model, cache)
        target.tokens = prompt[:held].clone()
        drafter_of_view = None
        if assistant is not None:
            opts = dict(ASSISTANT_CACHE if assistant_cache is None else assistant_cache)
            apol = opts.pop("policy", "streaming")
            if apol not in ("streaming", "full"):
                raise ValueError(f"the assistant's cache policy must be 'streaming' or 'full', got {apol!r}")
            headroom = 2 * (gamma + assistant_gamma) + 8
            if apol == "streaming":
                opts["tail"] = max(opts.get("tail", 32), headroom + 1)
            drafter_of_view = AssistantLevel(assistant, KVCache(assistant, apol, **opts))
        selfdraft = ViewLevel(model, DraftCache(cache, view), drafter=drafter_of_view)
        run = _Run(logits_processor, do_sample, gamma, assistant_gamma, threshold,
                   stats if stats is not None else SpeculativeStats())

        _sync(model)
        t0 = time.perf_counter()
        logits = process(logits_processor, prompt, target.feed(prompt, keep=1))[0]
        first = pick(logits.softmax(-1) if do_sample else logits, do_sample)
        seq = torch.cat([prompt, prompt.new_tensor([first])])
        if drafter_of_view is not None:  # the assistant reads the prompt here, as part of the prefill
            drafter_of_view.feed(prompt, keep=1)
        _sync(model)
        t1 = time.perf_counter()
        run.stats.prefill_seconds += t1 - t0
        new = [first]
        done = first in eos or len(new) >= max_new_tokens or _stop(stopping_criteria, input_ids, new)
        while not done:
            if drafter_of_view is not None:
                drafter_of_view.sync(seq)
                drafter_of_view.make_room(headroom)
            selfdraft.begin_round(target)
            emitted, _ = step(target, selfdraft, seq, gamma, run)
            run.stats.rounds += 1
            for t in emitted.tolist():
                new.append(t)
                if t in eos or len(new) >= max_new_tokens or _stop(stopping_criteria, input_ids, new):
                    done = True
                    break
            seq = torch.cat([prompt, torch.tensor(new, dtype=torch.long)])
        target.crop_to(seq.shape[0] - 1)  # the state plain decoding leaves: the last token not yet fed
        _sync(model)
        run.stats.decode_seconds += time.perf_counter() - t1
        run.stats.new_tokens += len(new)
        run.stats.decode_tokens += len(new) - 1
    finally:
        for m in patched_here:
            kvkit.unpatch(m)

    if streamer is not None:
        streamer.put(torch.tensor(new))
        streamer.end()
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if getattr(gc, "return_dict_in_generate", False):
        return SpeculativeOutput(sequences=sequences, past_key_values=cache, stats=run.stats)
    return sequences


def _sync(model) -> None:
    """Wait for queued CUDA work so the stats' wall-clock timings are right."""
    dev = getattr(model, "device", None)
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stop(stopping_criteria, input_ids, new) -> bool:
    if not stopping_criteria:
        return False
    ids = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    return bool(stopping_criteria(ids, None).all())
