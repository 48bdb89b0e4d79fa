"""TriForce's hierarchy, for batches: a tiny assistant drafts for the self-draft, which drafts for the target.

Three levels, every batch row on its own (each accepts its own number of drafts at each level):

* the target verifies ``k`` tokens per row proposed by the middle level (:func:`kvkit.speculative.generate`);
* the middle level is the target model over a :class:`~kvkit.speculative.draft.DraftCache` (a sparse view of the
  target's cache plus a private tail). It produces its ``k`` tokens by verifying the assistant's proposals, round
  by round, under the same rule as the top level, so every level is lossless::

      while some row has fewer than k tokens:
          drafts, q = assistant.propose(rows, assistant_gamma)     # [B, ka]
          p = middle(last + drafts)                                # one forward of ka + 1 tokens per row
          n, nxt = accept(drafts, q, p)                            # per row
          rejected slots of the tail become holes (or are cropped when every row rejected them)

* the assistant is a tiny model sharing the tokenizer, with its own cache in which every slot carries its row's
  token position (-1: a hole, a rejected draft). TriForce gives it a StreamingLLM cache; here the cache is
  compacted to each row's ``sink`` first + most recent tokens (``budget`` in all) whenever it holds ``budget + slack``
  slots, so an assistant step reads a bounded number of slots at any context length. Rows that need to catch up
  (tokens the middle or the target emitted that the assistant never fed) feed them in one right-aligned block, the
  missing columns of the other rows fed as fillers hidden from every query (:func:`~kvkit.speculative.rows.hole_mask`).

Rows that already hold ``k`` tokens ride along the middle level's last rounds (their extra tokens are dropped).
"""

from __future__ import annotations

import torch

from kvkit.compat import cache_kw
from kvkit.policies.base import check_positive_int
from kvkit.speculative.draft import DraftCache, mask_to_index
from kvkit.speculative.forward import logits as forward_logits
from kvkit.speculative.rows import batch_cache, hole_mask, layer_windows, process_rows
from kvkit.speculative.verify import accept_greedy, accept_sample, pick


def _process(run, logits: torch.Tensor, prefixes: list[torch.Tensor] | None) -> torch.Tensor:
    """``logits [B, T, V]`` through the run's processors; row b's column t follows ``prefixes[b][: len - T + 1 + t]``."""
    if not run.logits_processor:
        return logits.float()
    return process_rows(run.logits_processor, prefixes, logits)


class Assistant:
    """The tiny assistant at batch: its cache (kvkit ``full`` stores) with each slot's token position per row.

    options: ``{"policy": "streaming", "budget": 256, "sink": 16}`` (TriForce) or ``{"policy": "full"}``."""

    SLACK = 0.25  # compact once the cache holds budget * (1 + SLACK) slots: one gather of the small cache per
    #               budget / 4 new slots (at least 8)

    def __init__(self, model, options: dict):
        opts = dict(options)
        policy = opts.pop("policy", "streaming")
        if policy not in ("streaming", "full"):
            raise ValueError(f"the assistant's cache policy must be 'streaming' or 'full', got {policy!r}")
        self.budget = opts.pop("budget", 256) if policy == "streaming" else None
        self.sink = opts.pop("sink", 16) if policy == "streaming" else 0
        if opts:
            hint = (" (the assistant compacts its cache itself, every budget / 4 new slots: it takes no tail)"
                    if "tail" in opts else "")
            raise ValueError(f"unknown assistant_cache option(s) {sorted(opts)} for {policy!r}; known: budget, "
                             f"sink{hint}")
        if self.budget is not None:
            check_positive_int("assistant_cache", "budget", self.budget)
            if isinstance(self.sink, bool) or not isinstance(self.sink, int) or not 0 <= self.sink < self.budget:
                raise ValueError(f"assistant_cache: sink must be an integer in [0, budget), got {self.sink!r}")
        self.model, self.cache = model, batch_cache(model)
        self.windows = layer_windows(self.cache)  # the assistant's own layer types
        self.pos = None  # [B, S] token position of every slot (-1: hole / padding / filler)
        self.next = None  # [B] first token position the assistant has not fed

    def prefill(self, prompt: torch.Tensor, mask: torch.Tensor, prompt_pos: torch.Tensor, token_pos: torch.Tensor,
                aligned: bool) -> None:
        forward_logits(self.model, 1, input_ids=prompt.to(self.model.device),
                       attention_mask=None if aligned else mask.to(self.model.device),
                       position_ids=prompt_pos.to(self.model.device), **cache_kw(self.cache))
        self.pos = token_pos.clone()
        self.next = token_pos.amax(dim=1) + 1
        self.compact()

    def forget_from(self, nxt: torch.Tensor) -> None:
        """Row b keeps only the tokens before position ``nxt[b]`` (the rest were rejected above)."""
        self.pos = self.pos.masked_fill(self.pos >= nxt[:, None], -1)
        self.next = torch.minimum(self.next, nxt)
        held = (self.pos >= 0).any(dim=0)
        drop = self.pos.shape[1] - (int(held.nonzero()[-1, 0]) + 1 if bool(held.any()) else 0)
        if drop:  # trailing slots no row holds any more
            self.cache.rollback(drop)
            self.pos = self.pos[:, : self.pos.shape[1] - drop]

    def compact(self) -> None:
        """Keep each row's ``sink`` first and most recent tokens, ``budget`` in all (StreamingLLM), when over budget."""
        if self.budget is None or self.pos.shape[1] < self.budget + max(8, int(self.budget * self.SLACK)):
            return
        valid = self.pos >= 0
        last = torch.where(valid, self.pos, -1).amax(dim=1, keepdim=True)
        keep = valid & ((self.pos < self.sink) | (self.pos > last - (self.budget - self.sink)))
        idx, ok = mask_to_index(keep[:, None])  # [B, 1, k]
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            g = idx.expand(B, H, -1)[..., None]
            layer.keys = layer.keys.gather(2, g.expand(-1, -1, -1, D))
            layer.values = layer.values.gather(2, g.expand(-1, -1, -1, layer.values.shape[-1]))
        self.pos = torch.where(ok[:, 0], self.pos.gather(1, idx[:, 0]), -1)

    def propose(self, hist: torch.Tensor, cur: torch.Tensor, k: int, run, prefixes):
        """Up to ``k`` drafts per row continuing each row's tokens up to position ``cur[b]`` (``hist[b, p]`` = token at
        position p): (drafts ``[B, k']``, probabilities ``[B, k', V]`` or None)."""
        self.compact()
        dev = self.pos.device
        m = int((cur - self.next).max()) + 1  # tokens to feed: the missing ones and the current last token
        j = torch.arange(m, device=dev)
        qpos = cur[:, None] - (m - 1) + j  # right-aligned: [B, m]
        qpos = torch.where(qpos >= self.next[:, None], qpos, -1)  # columns a row already fed: fillers
        x = hist.gather(1, qpos.clamp(min=0))
        toks, dists = [], []
        for step in range(k):
            lg = forward_logits(self.model, 1, input_ids=x.to(self.model.device),
                                position_ids=qpos.clamp(min=0).to(self.model.device),
                                attention_mask=hole_mask(self.pos, qpos, self.windows), **cache_kw(self.cache))
            self.pos = torch.cat([self.pos, qpos], dim=1)
            drafted = torch.stack(toks, 1) if toks else None
            lg = _process(run, lg, None if prefixes is None else [
                torch.cat([p, drafted[b].cpu()]) if drafted is not None else p for b, p in enumerate(prefixes)])[:, 0]
            probs = lg.softmax(-1) if (run.do_sample or run.threshold is not None) else None
            t = pick(probs if run.do_sample else lg, run.do_sample).to(dev)
            toks.append(t)
            if run.do_sample:
                dists.append(probs)
            if run.threshold is not None and bool((probs.amax(-1) < run.threshold).all()):
                break
            if step + 1 < k:
                qpos = cur[:, None] + step + 1
                x = t[:, None]
        self.next = cur + len(toks)  # fed: everything up to the last draft but one
        return torch.stack(toks, 1), (torch.stack(dists, 1) if run.do_sample else None)

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows.to(self.pos.device))
        self.pos, self.next = self.pos[rows], self.next[rows]


class HierarchicalDraft:
    """The self-draft (target model over ``draft_cache``) sped up by ``assistant``, for a batch of rows."""

    def __init__(self, model, draft_cache: DraftCache, assistant, assistant_options: dict, assistant_gamma: int):
        self.model, self.cache = model, draft_cache
        self.assistant = Assistant(assistant, assistant_options)
        self.assistant_gamma = assistant_gamma
        self.hist = None  # [B, L] every row's token at each token position (what the levels feed from)

    def prefill(self, rows, prompt: torch.Tensor, mask: torch.Tensor, width: int) -> None:
        """The assistant reads the prompt ``[B, T]`` (part of the prefill); ``width``: token positions to keep room for."""
        tp = rows.token_pos
        self.hist = prompt.new_zeros(prompt.shape[0], width + 1)
        self.hist.scatter_(1, torch.where(tp >= 0, tp, width), prompt)
        self.assistant.prefill(prompt, mask, rows.prompt_pos, tp, rows.aligned)

    def _room(self, n: int) -> None:
        """Room in ``hist`` for token positions below ``n`` (its last column takes the writes of no position)."""
        if self.hist.shape[1] - 1 < n:
            grown = self.hist.new_zeros(self.hist.shape[0], 2 * n + 1)
            grown[:, : self.hist.shape[1] - 1] = self.hist[:, :-1]
            self.hist = grown

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.hist = self.hist[rows.to(self.hist.device)]
        self.assistant.batch_select_indices(rows)

    def propose(self, rows, k: int, run):
        """Up to ``k`` tokens per row from the middle level: (tokens ``[B, k]``, its probabilities ``[B, k, V]``)."""
        B, dev = rows.size, rows.last.device
        cur, last = rows.next_pos.clone(), rows.last
        self._room(int(cur.max()) + 1)
        self.hist.scatter_(1, cur[:, None], last[:, None])
        self.assistant.forget_from(cur)
        self.cache.begin_round(*((None, None) if rows.aligned else (rows.token_pos, rows.next_pos)))
        self.cache.tail_pos = cur.new_zeros(B, 0)
        out = last.new_zeros(B, k + 1)  # column k: where tokens past k go (dropped)
        q_out = None
        got = torch.zeros(B, dtype=torch.long, device=dev)
        base = [rows.sequence(b) for b in range(B)] if run.logits_processor else None
        st = run.stats
        while int(got.min()) < k:
            emitted = None if base is None else [torch.cat([base[b], out[b, : int(got[b])].cpu()]) for b in range(B)]
            drafts, qa = self.assistant.propose(self.hist, cur, self.assistant_gamma, run, emitted)
            ka = drafts.shape[1]
            x = torch.cat([last[:, None], drafts], dim=1)
            pos = cur[:, None] + torch.arange(ka + 1, device=dev)
            self.cache.tail_pos = torch.cat([self.cache.tail_pos, pos], dim=1)
            lg = forward_logits(self.model, ka + 1, input_ids=x, position_ids=pos, **cache_kw(self.cache))
            lg = _process(run, lg, None if emitted is None else [torch.cat([e, drafts[b].cpu()])
                                                                 for b, e in enumerate(emitted)])
            if run.do_sample:
                p = lg.softmax(-1)
                n, nxt = accept_sample(drafts, qa, p)
            else:
                p = None
                n, nxt = accept_greedy(drafts, lg)
            n, nxt = n.to(dev), nxt.to(dev)
            # the middle keeps last + n[b] drafts; slots no row keeps are cropped, the others become holes
            drop = ka - int(n.max())
            if drop:
                self.cache.rollback(drop, ends_round=False)
            j = torch.arange(ka + 1, device=dev)
            kept = (pos <= cur[:, None] + n[:, None])[:, : ka + 1 - drop]
            t = self.cache.tail_pos.shape[1]
            self.cache.tail_pos = torch.cat([self.cache.tail_pos[:, : t - (ka + 1)],
                                             torch.where(kept, pos[:, : ka + 1 - drop], -1)], dim=1)
            # the emitted tokens: drafts[:n] + nxt, at positions cur + 1 .. cur + n + 1
            em = torch.where(j[None] < n[:, None], torch.cat([drafts, drafts[:, :1]], 1), nxt[:, None])
            valid = j[None] <= n[:, None]
            col = torch.where(valid, (got[:, None] + j).clamp(max=k), k)
            out.scatter_(1, col, em)
            if run.do_sample:
                if q_out is None:
                    q_out = p.new_zeros(B, k + 1, p.shape[-1])
                q_out.scatter_(1, col[..., None].expand(-1, -1, p.shape[-1]), p)
            self._room(int(cur.max()) + ka + 2)
            self.hist.scatter_(1, torch.where(valid, cur[:, None] + 1 + j, self.hist.shape[1] - 1), em)
            got = got + n + 1
            cur, last = cur + n + 1, nxt
            self.assistant.forget_from(cur)
            st.assistant_drafted += drafts.numel()
            st.assistant_accepted += int(n.sum())
        return out[:, :k], (q_out[:, :k] if q_out is not None else None)
