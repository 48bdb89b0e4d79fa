"""TriForce's hierarchy (batch 1): a tiny assistant drafts for the self-draft, which drafts for the target.

Two *levels* below the target share one interface (a model, a cache, the token ids the cache holds):
the self-draft (the target over a :class:`~kvkit.speculative.draft.DraftCache`) and the assistant (a
tiny model sharing the tokenizer, with its own StreamingLLM cache). The self-draft "proposes" its
``k`` tokens by running speculative rounds with the assistant as *its* drafter, under the same rule
as the top level, so every level is lossless::

    drafts, q = propose(assistant, seq, assistant_gamma)
    p = self_draft(seq + drafts)                        # one forward over the drafts
    n, nxt = accept(drafts, q, p); self_draft.rollback(rejected); seq += drafts[:n] + [nxt]
"""

from __future__ import annotations

import torch

from kvkit.speculative.forward import logits as forward_logits
from kvkit.speculative.verify import accept_greedy, accept_sample_row, pick, process


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


class Level:
    """A model with a cache and the token ids ``[n]`` the cache holds (in order)."""

    ends_round = True  # a rollback of this level closes its round

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.tokens = torch.empty(0, dtype=torch.long)

    def sync(self, seq: torch.Tensor) -> None:
        """Roll back to the longest prefix shared with ``seq``, keeping its last token to feed."""
        self.crop_to(min(_common_prefix(self.tokens, seq), seq.shape[0] - 1))

    def crop_to(self, n: int) -> None:
        if n < self.tokens.shape[0]:
            self.cache.rollback(self.tokens.shape[0] - n, ends_round=self.ends_round)
            self.tokens = self.tokens[:n]

    def feed(self, seq: torch.Tensor, keep: int) -> torch.Tensor:
        """Run the tokens of ``seq`` the cache lacks; returns the logits of the last ``keep`` of them ``[keep, V]``."""
        new = seq[self.tokens.shape[0] :][None].to(self.model.device)
        out = forward_logits(self.model, keep, input_ids=new, past_key_values=self.cache)
        self.tokens = seq.clone()
        return out[0].to(seq.device)


class AssistantLevel(Level):
    """The tiny assistant with its StreamingLLM cache. Its rollbacks after each of its rounds happen inside a
    top-level round, whose verification may still reject what it keeps: they do not end a round, and
    :meth:`reserve` evicts for the whole top-level round at its start."""

    ends_round = False

    def reserve(self, headroom: int) -> None:
        self.cache.reserve(headroom)


def propose(level: Level, drafter: Level | None, seq: torch.Tensor, k: int, run, assistant_gamma: int):
    """``level`` continues ``seq [n]`` by up to ``k`` tokens: (tokens ``[k']``, distributions ``[k', V]`` or None).

    With a ``drafter``, ``level`` is itself sped up: it verifies the drafter's proposals round by round."""
    level.sync(seq)
    if drafter is not None:
        out, dists = [], []
        cur = seq
        while sum(t.shape[0] for t in out) < k:
            emitted, p = step(level, drafter, cur, assistant_gamma, run)
            out.append(emitted)
            dists.append(p)
            cur = torch.cat([cur, emitted])
        toks = torch.cat(out)[:k]
        return toks, (torch.cat(dists)[:k] if run.do_sample else None)
    toks, dists = [], []
    cur = seq
    for _ in range(k):
        logits = process(run.logits_processor, cur, level.feed(cur, keep=1))
        probs = logits.softmax(-1) if (run.do_sample or run.threshold is not None) else None
        t = int(pick(probs if run.do_sample else logits, run.do_sample)[0])
        toks.append(t)
        if run.do_sample:
            dists.append(probs[0])
        cur = torch.cat([cur, cur.new_tensor([t])])
        if run.threshold is not None and float(probs.max()) < run.threshold:
            break
    return torch.tensor(toks, dtype=torch.long), (torch.stack(dists) if run.do_sample else None)


def step(verifier: Level, drafter: Level, seq: torch.Tensor, k: int, run):
    """One round of ``drafter`` under ``verifier``: the emitted tokens ``[n + 1]`` and the verifier's distributions."""
    drafts, q = propose(drafter, None, seq, k, run, k)
    verifier.sync(seq)
    full = torch.cat([seq, drafts])
    k = drafts.shape[0]
    logits = process(run.logits_processor, full, verifier.feed(full, keep=k + 1))  # [k + 1, V]
    if run.do_sample:
        p = logits.softmax(-1)
        n, nxt = accept_sample_row(drafts, q, p)
    else:
        p = None
        n, nxt = (int(x) for x in accept_greedy(drafts[None], logits[None]))
    verifier.crop_to(seq.shape[0] + n)
    run.stats.assistant_drafted += k
    run.stats.assistant_accepted += n
    emitted = torch.cat([drafts[:n], drafts.new_tensor([nxt])])
    return emitted, (p[: n + 1] if p is not None else None)


class HierarchicalDraft:
    """The self-draft (target model over ``draft_cache``) sped up by ``assistant``; batch 1."""

    def __init__(self, model, draft_cache, assistant, assistant_cache, assistant_gamma: int, headroom: int):
        self.selfdraft = Level(model, draft_cache)
        self.selfdraft.ends_round = False  # its rollbacks are inside a top-level round
        self.assistant = AssistantLevel(assistant, assistant_cache)
        self.assistant_gamma, self.headroom = assistant_gamma, headroom

    def prefill(self, prompt: torch.Tensor) -> None:
        """The assistant reads the prompt ``[n]`` (part of the prefill)."""
        self.assistant.feed(prompt, keep=1)

    def propose(self, rows, k: int, run):
        seq = rows.sequence(0)  # batch 1: the prompt without padding and the new tokens
        self.assistant.sync(seq)
        self.assistant.reserve(self.headroom)
        self.selfdraft.cache.begin_round()
        self.selfdraft.tokens = seq[:-1].clone()
        toks, q = propose(self.selfdraft, self.assistant, seq, k, run, self.assistant_gamma)
        dev = rows.last.device
        return toks[None].to(dev), (q[None].to(dev) if q is not None else None)
