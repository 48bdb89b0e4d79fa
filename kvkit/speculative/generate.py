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

The call's checks and the settings read from its arguments are in :mod:`.request`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, make_dataclass

import torch
from transformers.generation import LogitsProcessorList
from transformers.utils import ModelOutput

from kvkit.cache import KVCache
from kvkit.compat import CACHE_ARG, cache_kw, get_cache
from kvkit.model_info import context_limit
from kvkit.patch import is_patched, patch, patch_state, unpatch
from kvkit.speculative.draft import DraftCache
from kvkit.speculative.forward import logits as forward_logits
from kvkit.speculative.hierarchy import HierarchicalDraft
from kvkit.speculative.request import (
    adaptive_threshold,
    check_assistant,
    drafting_setup,
    eos_and_pad,
    logits_processors,
    prompt_mask,
    real_token_counts,
    request_generation_config,
    request_max_new_tokens,
    target_cache,
)
from kvkit.speculative.rows import Rows, layer_windows
from kvkit.speculative.verify import accept_greedy, accept_sample, pick

#: the assistant's cache: TriForce's StreamingLLM draft cache, 16 sinks + recent, 256 in all
ASSISTANT_CACHE = {"policy": "streaming", "budget": 256, "sink": 16}


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
    """What every round of one call reads: the logits processors, greedy or sampling, the adaptive-drafting
    threshold (None: off) and the stats it fills."""

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
    view, gamma, assistant_gamma = drafting_setup(draft, draft_policy, draft_options, gamma, assistant_gamma)
    mask = prompt_mask(input_ids, model_kwargs.pop("attention_mask", None), streamer)
    gc = request_generation_config(model, generation_config, model_kwargs)
    do_sample = bool(gc.do_sample)
    if logits_processor is None:
        logits_processor = logits_processors(gc, do_sample)
    threshold = adaptive_threshold(adaptive)
    max_new_tokens = request_max_new_tokens(gc, input_ids.shape[1])
    if max_new_tokens < 1:
        return input_ids
    if assistant is not None:
        check_assistant(model, assistant, model_kwargs.get("tokenizer"), model_kwargs.get("assistant_tokenizer"))
    eos, pad_id = eos_and_pad(gc)
    prompt, mask = real_token_counts(input_ids, mask)
    run = _Run(logits_processor, do_sample, threshold, stats if stats is not None else SpeculativeStats())
    # token positions the hierarchy keeps room for (its prefill's width): the prompt, the new tokens, a draft margin
    room = prompt.shape[1] + max_new_tokens + 2 * (gamma + assistant_gamma) + 4 if assistant is not None else None

    patched_here = []
    try:
        _patch_for_call(model, assistant, patched_here)
        cache, held = target_cache(model, get_cache(model_kwargs), input_ids.shape[0], prompt.shape[1])
        limit = None if patch_state(model).allow_beyond_context else context_limit(model)
        rows = Rows(prompt, mask, max_new_tokens, set(eos), stopping_criteria)
        drafter = _drafter(model, cache, view, assistant, assistant_cache, assistant_gamma)
        t1 = _prefill(model, cache, held, drafter, rows, prompt, mask, run, room)
        _decode_timed(model, cache, drafter, rows, prompt, gamma, limit, run, t1)
    finally:
        for m in patched_here:
            unpatch(m)
    return _output(rows, input_ids, pad_id, cache, gc, run.stats, streamer)


def _patch_for_call(model, assistant, patched: list) -> None:
    """Patch ``model`` and ``assistant`` (None: none) with ``full`` where they are not patched, appending each model
    patched here to ``patched`` as it goes (the caller unpatches them afterwards, also when a later step fails)."""
    if not is_patched(model):
        patch(model, "full")
        patched.append(model)
    if assistant is not None and not is_patched(assistant):
        patch(assistant, "full")  # routing only: the assistant reads its own cache below
        patched.append(assistant)


def _drafter(model, cache: KVCache, view, assistant, assistant_cache, assistant_gamma: int):
    """The drafter of the rounds: the target over ``view`` of ``cache`` (:class:`SelfDraft`), or with an
    ``assistant`` the hierarchy (:class:`HierarchicalDraft`: the assistant drafts ``assistant_gamma`` tokens at a
    time for the self-draft, over its own cache, ``assistant_cache`` or :data:`ASSISTANT_CACHE`)."""
    if assistant is None:
        return SelfDraft(model, cache, view)
    return HierarchicalDraft(model, DraftCache(cache, view), assistant,
                             ASSISTANT_CACHE if assistant_cache is None else assistant_cache, assistant_gamma)


def _prefill(model, cache: KVCache, held: int, drafter, rows: Rows, prompt, mask, run: _Run, room: int | None) -> float:
    """The prefill: one forward of the prompt columns ``cache`` does not hold yet (``prompt[:, held:]``, ``prompt``
    ``[B, T]`` with ``mask``), each row's first new token picked from its logits (``rows.start``) and, with ``room``
    (the token positions the hierarchy keeps room for; None without an assistant), the hierarchy's own prefill.
    Adds its seconds to ``run.stats.prefill_seconds``; returns the ``time.perf_counter()`` at which it ended."""
    _sync(model)
    t0 = time.perf_counter()
    lg = forward_logits(model, 1, input_ids=prompt[:, held:], attention_mask=None if rows.aligned else mask,
                        position_ids=rows.prompt_pos[:, held:], **cache_kw(cache))
    lg = rows.process(run.logits_processor, lg)[:, 0]
    rows.start(pick(lg.softmax(-1) if run.do_sample else lg, run.do_sample))
    if room is not None:
        drafter.prefill(rows, prompt, mask, room)
    _sync(model)
    t1 = time.perf_counter()
    run.stats.prefill_seconds += t1 - t0
    return t1


def _decode_timed(model, cache: KVCache, drafter, rows: Rows, prompt, gamma: int, limit: int | None, run: _Run,
                  t1: float) -> None:
    """The speculative rounds (:func:`decode`) after a prefill that ended at ``t1``; at batch 1 the cache is then
    left as plain decoding leaves it (``prompt`` ``[1, T]`` and every new token but the last: the last round may
    have run past the end). Adds the decode seconds and the token counts to ``run.stats``."""
    B = prompt.shape[0]
    decode(model, cache, drafter, rows, gamma, limit, layer_windows(cache), run)
    if B == 1:
        # plain decoding's state: the prompt and every new token but the last (the round may have run past the end)
        cache.rollback(cache.get_seq_length() - (prompt.shape[1] + len(rows.new[0]) - 1))
    _sync(model)
    run.stats.decode_seconds += time.perf_counter() - t1
    new = sum(len(t) for t in rows.new)
    run.stats.new_tokens += new
    run.stats.decode_tokens += new - B


def _output(rows: Rows, input_ids, pad_id: int, cache: KVCache, gc, stats: SpeculativeStats, streamer):
    """What :func:`generate` returns: the sequences ``[B, T + new]`` (``input_ids`` and each row's new tokens, rows
    that stopped early padded with ``pad_id``), or with ``gc.return_dict_in_generate`` a :class:`SpeculativeOutput`
    (the target ``cache`` at batch 1, None at batch > 1, and ``stats``). A ``streamer`` gets the row's new tokens."""
    if streamer is not None:
        streamer.put(torch.tensor(rows.new[0]))
        streamer.end()
    sequences = rows.sequences(input_ids, pad_id)
    if getattr(gc, "return_dict_in_generate", False):
        return SpeculativeOutput(sequences=sequences, **cache_kw(cache if input_ids.shape[0] == 1 else None),
                                 stats=stats)
    return sequences


def _sync(model) -> None:
    """Wait for queued CUDA work so the stats' wall-clock timings are right."""
    dev = getattr(model, "device", None)
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
