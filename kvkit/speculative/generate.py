"""Lossless self-speculative decoding (MagicDec / TriForce) as a batched ``generate`` loop.

The target drafts from a sparse *view* of its own KV cache (:mod:`.draft`) and verifies the drafts
with its full cache, every batch row on its own (gpt-fast's loop, rows in parallel)::

    while rows unfinished:
        k = min(gamma, tokens still needed - 1, positions left - 1)
        drafts, q = draft.propose(rows, k)            # [B, k] tokens + the draft's distributions
        p = target(rows.last + drafts)                # ONE forward over k + 1 positions per row
        n, nxt = accept(drafts, q, p)                 # per row: greedy, or the standard rejection rule
        rows.commit(n, nxt)                           # row b keeps n[b] drafts + nxt[b]; see below
        rows.retire()                                 # finished rows leave the batch

Rows accept different numbers of drafts. The target KV stays rectangular: slots every row rejected
are cropped (``cache.rollback``), the others become masked holes in the rows that rejected them,
and every row keeps its own position ids (:mod:`.rows`). So each row attends to exactly its tokens
at their positions, as plain batched decoding does, and greedy output is token for token plain
batched greedy's (fp32; in low precision up to near-ties, because a (k + 1)-token forward rounds
differently from a one-token step). Sampling uses the standard rule per row, so the output follows
the target's distribution. The draft tokens' K/V never enter the real cache (:mod:`.draft`).

With ``assistant=`` a tiny model drafts for the self-draft (TriForce's hierarchy, every row on its own,
:mod:`.hierarchy`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, make_dataclass

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
from kvkit.compat import CACHE_ARG, cache_kw, get_cache
from kvkit.model_info import context_limit
from kvkit.patch import is_patched, patch, patch_state, unpatch
from kvkit.speculative.draft import DraftCache, make_view
from kvkit.speculative.forward import logits as forward_logits
from kvkit.speculative.hierarchy import HierarchicalDraft
from kvkit.speculative.rows import Rows, batch_cache, layer_windows
from kvkit.speculative.verify import accept_greedy, accept_sample, pick
from kvkit.stores import FullStore, SlotStore

#: adaptive=True stops drafting when the draft's top probability falls below this
#: (transformers' default ``assistant_confidence_threshold``)
ADAPTIVE_THRESHOLD = 0.4
#: the assistant's cache: TriForce's StreamingLLM draft cache, 16 sinks + recent, 256 in all
ASSISTANT_CACHE = {"policy": "streaming", "budget": 256, "sink": 16}
#: keyword arguments read into the generation config on direct calls
GENERATION_KEYS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                   "pad_token_id", "return_dict_in_generate")
@dataclass
class SpeculativeStats:
    """Counts of one generation, summed over the batch rows: drafted/accepted at the target level (and the
    assistant level)."""

    new_tokens: int = 0
    rounds: int = 0
    row_rounds: int = 0  # rounds x rows in the batch at each round
    drafted: int = 0  # drafts, summed over rows
    accepted: int = 0
    draft_steps: int = 0  # top-level draft forwards (each covers every row of the batch)
    assistant_drafted: int = 0
    assistant_accepted: int = 0
    decode_tokens: int = 0  # tokens emitted by the rounds (new_tokens minus each row's prefill token)
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
        """Tokens a row gets per round."""
        return self.decode_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode rounds emitted per decode second, all rows (the prefill's tokens are not counted)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_round=self.tokens_per_round,
                 assistant_acceptance_rate=self.assistant_acceptance_rate,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d


#: ``return_dict_in_generate=True``: the sequences, the target's cache (under the installed transformers' name for it:
#: ``cache`` from 5.24 on, where ``.past_key_values`` still reads it, ``past_key_values`` before) and the stats
SpeculativeOutput = make_dataclass(
    "SpeculativeOutput",
    [("sequences", "torch.LongTensor | None", None), (CACHE_ARG, object, None), ("stats", "SpeculativeStats | None", None)],
    bases=(ModelOutput,),
)
SpeculativeOutput.__module__ = __name__
SpeculativeOutput.__doc__ = "``return_dict_in_generate=True``: the sequences, the target's cache and the stats."


@dataclass
class _Run:
    logits_processor: LogitsProcessorList
    do_sample: bool
    threshold: float | None
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


# ---- the drafter, the verifier, the loop --------------------------------------------------------
class SelfDraft:
    """The target model drafting over a :class:`DraftCache` view of its own cache, all rows at once."""

    def __init__(self, model, cache: KVCache, view):
        self.model, self.cache = model, DraftCache(cache, view)

    def propose(self, rows: Rows, k: int, run: _Run):
        """Up to ``k`` tokens per row: (drafts ``[B, k']``, the draft's probabilities ``[B, k', V]`` or None)."""
        self.cache.begin_round(*((None, None) if rows.aligned else (rows.token_pos, rows.next_pos)))
        toks, dists = [], []
        cur = rows.last
        for j in range(k):
            lg = forward_logits(self.model, 1, input_ids=cur[:, None], position_ids=rows.positions(j + 1)[:, j:],
                                **cache_kw(self.cache))
            lg = rows.process(run.logits_processor, lg, torch.stack(toks, 1) if toks else None)[:, 0]  # [B, V]
            probs = lg.softmax(-1) if (run.do_sample or run.threshold is not None) else None
            cur = pick(probs if run.do_sample else lg, run.do_sample)
            toks.append(cur)
            if run.do_sample:
                dists.append(probs)
            if run.threshold is not None and bool((probs.amax(-1) < run.threshold).all()):
                break  # no row is confident
        drafts = torch.stack(toks, 1) if toks else rows.last.new_zeros(rows.size, 0)
        return drafts, (torch.stack(dists, 1) if run.do_sample and dists else None)


def verify(model, cache: KVCache, rows: Rows, drafts: torch.Tensor, windows, run: _Run) -> torch.Tensor:
    """The target's processed logits ``[B, k + 1, V]`` after each row's last token and each of its drafts."""
    x = torch.cat([rows.last[:, None], drafts], dim=1)
    T = x.shape[1]
    with cache.verification():
        lg = forward_logits(model, T, input_ids=x, position_ids=rows.positions(T),
                            attention_mask=rows.mask(T, windows), **cache_kw(cache))
    return rows.process(run.logits_processor, lg, drafts)


def accept(drafts, q, logits, do_sample: bool):
    if do_sample:
        return accept_sample(drafts, q, logits.softmax(-1))
    return accept_greedy(drafts, logits)


def decode(model, cache: KVCache, draft, rows: Rows, gamma: int, limit: int | None, windows, run: _Run) -> None:
    """Speculative rounds until every row is finished (the prompt is in ``cache``, ``rows`` has its first tokens)."""
    st = run.stats
    while not rows.finished:
        need = rows.tokens_needed()
        k = min(gamma, need - 1)  # the round emits up to k + 1 tokens
        if limit is not None:  # positions left: the drafts and the verification's k + 1 tokens fit the context
            # batch > 1: a round adds up to k + 1 slots (holes count) while the slowest row may advance by one
            # token; keeping slots + need <= limit lets it finish with one-token rounds, as plain decoding would
            k = max(min(k, limit - cache.get_seq_length() - (1 if rows.size == 1 else need)), 0)
        t0 = time.perf_counter()
        drafts, q = draft.propose(rows, k, run) if k > 0 else (rows.last.new_zeros(rows.size, 0), None)
        _sync(model)
        t1 = time.perf_counter()
        logits = verify(model, cache, rows, drafts, windows, run)
        n, nxt = accept(drafts, q, logits, run.do_sample)
        _sync(model)
        st.draft_seconds += t1 - t0
        st.verify_seconds += time.perf_counter() - t1
        st.rounds += 1
        st.row_rounds += rows.size
        st.drafted += drafts.numel()
        st.draft_steps += drafts.shape[1]
        st.accepted += int(n.sum())
        rows.commit(cache, drafts, n, nxt)
        rows.retire([cache, draft.cache] + ([draft] if isinstance(draft, HierarchicalDraft) else []),
                    (st.accepted + st.row_rounds) / st.row_rounds)


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


def check_target_policy(policy) -> None:
    """Refuse target policies under which speculation would not reproduce the patched model's own decoding."""
    reason = getattr(policy, "speculative_refusal", None)
    if reason is not None:
        raise ValueError(
            f"speculative decoding over a {policy.name!r} target is not lossless: {reason}. "
            f"Use the {policy.name!r} model's plain generate, or speculate over a full/streaming target (e.g. "
            "kvkit.patch(model, 'full'))"
        )


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


def _target_cache(model, cache, batch: int, held_ok) -> tuple[KVCache, int]:
    """The target's cache and how many prompt columns it already holds."""
    if isinstance(cache, KVCache):
        held = cache.get_seq_length()
        held_ok(held)
    elif cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
        cache, held = KVCache(model), 0  # the patched policy's
        if batch > 1 and not any(isinstance(layer, SlotStore) for layer in cache.layers):
            cache = batch_cache(model)
    else:
        raise ValueError("kvkit.speculative.generate needs a kvkit.KVCache (or no cache) as past_key_values")
    check_target_policy(cache.policy)
    if batch > 1:
        bad = [type(layer).__name__ for layer in cache.layers if not isinstance(layer, FullStore)]
        if bad:
            raise ValueError(
                f"at batch > 1 the target cache must keep every slot (FullStore layers; this one has {bad[0]}): rows "
                "accept different numbers of drafts and the rejected ones stay as masked holes, which a compressing or "
                "sliding-window store cannot hold. Pass no cache, or kvkit.speculative.batch_cache(model); or run "
                "the rows one at a time"
            )
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()  # keep rejected tokens croppable on sliding layers
    return cache, held


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
    """Lossless speculative decoding with the sparse-KV self-draft, for a batch of left-padded rows.

    Use directly (``kvkit.speculative.generate(model, ids, attention_mask=mask, gamma=4, max_new_tokens=64)``) or
    as ``model.generate(ids, attention_mask=mask, custom_generate=kvkit.speculative.generate, gamma=4, ...)``;
    works on an unpatched model (patched with ``full`` for the call) and after ``kvkit.patch`` (not after ``cake``
    or ``zipcache``: see ``Policy.speculative_refusal``).

    input_ids ``[B, T]`` with ``attention_mask [B, T]`` (0 = left padding). Every row accepts its own drafts
    and stops on its own (EOS, ``max_new_tokens``); finished rows leave the batch. draft: ``"self"`` (the
    only drafter; the assistant sits under it). draft_policy: ``"streaming"`` (sinks + recent window,
    MagicDec) or ``"retrieval"`` (TriForce chunks) or a ``DraftView``; draft_options: its options
    (``budget``, ``sink`` / ``chunk``, ``rebuild``). gamma: tokens drafted per verification (fewer near
    the requested length and the model's trained context). assistant: a tiny model sharing the tokenizer
    that drafts ``assistant_gamma`` (default gamma) tokens at a time for the self-draft, with its
    own cache (``assistant_cache``, default StreamingLLM 16 sinks / 256). adaptive: stop drafting when
    every row's draft top probability is below 0.4 (True) or the given threshold. stats: a
    :class:`SpeculativeStats` filled in place.

    Returns the sequences ``[B, T + new]`` (rows that stopped early padded with ``pad_token_id``, else the
    EOS token, as ``model.generate``), or a :class:`SpeculativeOutput` with ``return_dict_in_generate``;
    its ``past_key_values`` is the target cache in the state plain decoding leaves at batch 1, None at
    batch > 1 (its rows hold holes and finished rows left it).

    Generation settings (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``eos_token_id``, ``pad_token_id``, ``return_dict_in_generate``) are keyword arguments, as for
    ``model.generate`` (which puts them into ``generation_config`` before calling this function).
    """
    if draft != "self":
        raise ValueError(f"draft must be 'self' (the sparse-KV self-draft), got {draft!r}; pass a small model as assistant=")
    gamma = _int_arg("gamma", gamma)
    assistant_gamma = _int_arg("assistant_gamma", assistant_gamma if assistant_gamma is not None else gamma)
    view = make_view(draft_policy, draft_options)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    B = input_ids.shape[0]
    mask = model_kwargs.pop("attention_mask", None)
    if mask is None:
        mask = torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
    mask = mask.to(input_ids.device)
    if not bool((mask.long().diff(dim=1) >= 0).all()) or not bool(mask[:, -1].all()):
        raise ValueError("attention_mask must mark left padding only (0s then 1s in every row): pad on the left")
    if streamer is not None and B > 1:
        raise ValueError("a streamer takes batch size 1, as in model.generate")
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
    eos = [] if eos is None else list(eos if isinstance(eos, (list, tuple)) else [eos])
    pad_id = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)

    prompt = input_ids
    if B == 1 and not bool(mask.all()):  # one row: decode its real tokens only
        prompt, mask = input_ids[:, mask[0].bool()], torch.ones_like(input_ids[:, mask[0].bool()])

    def held_ok(held):
        if held >= prompt.shape[1]:
            raise ValueError(f"past_key_values already holds {held} tokens; input_ids must extend it")

    patched_here = []
    try:
        if not is_patched(model):
            patch(model, "full")
            patched_here.append(model)
        if assistant is not None and not is_patched(assistant):
            patch(assistant, "full")  # routing only: the assistant reads its own cache below
            patched_here.append(assistant)
        cache, held = _target_cache(model, get_cache(model_kwargs), B, held_ok)
        limit = None if patch_state(model).allow_beyond_context else context_limit(model)
        rows = Rows(prompt, mask, max_new_tokens, set(eos), stopping_criteria)
        run = _Run(logits_processor, do_sample, threshold, stats if stats is not None else SpeculativeStats())
        if assistant is None:
            drafter = SelfDraft(model, cache, view)
        else:
            drafter = HierarchicalDraft(model, DraftCache(cache, view), assistant,
                                        ASSISTANT_CACHE if assistant_cache is None else assistant_cache, assistant_gamma)

        _sync(model)
        t0 = time.perf_counter()
        lg = forward_logits(model, 1, input_ids=prompt[:, held:], attention_mask=None if rows.aligned else mask,
                            position_ids=rows.prompt_pos[:, held:], **cache_kw(cache))
        lg = rows.process(logits_processor, lg)[:, 0]
        rows.start(pick(lg.softmax(-1) if do_sample else lg, do_sample))
        if assistant is not None:
            drafter.prefill(rows, prompt, mask, prompt.shape[1] + max_new_tokens + 2 * (gamma + assistant_gamma) + 4)
        _sync(model)
        t1 = time.perf_counter()
        run.stats.prefill_seconds += t1 - t0
        decode(model, cache, drafter, rows, gamma, limit, layer_windows(cache), run)
        if B == 1:
            # plain decoding's state: the prompt and every new token but the last (the round may have run past the end)
            cache.rollback(cache.get_seq_length() - (prompt.shape[1] + len(rows.new[0]) - 1))
        _sync(model)
        run.stats.decode_seconds += time.perf_counter() - t1
        new = sum(len(t) for t in rows.new)
        run.stats.new_tokens += new
        run.stats.decode_tokens += new - B
    finally:
        for m in patched_here:
            unpatch(m)

    if streamer is not None:
        streamer.put(torch.tensor(rows.new[0]))
        streamer.end()
    sequences = rows.sequences(input_ids, pad_id)
    if getattr(gc, "return_dict_in_generate", False):
        return SpeculativeOutput(sequences=sequences, **cache_kw(cache if B == 1 else None), stats=run.stats)
    return sequences


def _sync(model) -> None:
    """Wait for queued CUDA work so the stats' wall-clock timings are right."""
    dev = getattr(model, "device", None)
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
