"""Context-reconstruction scores (KVzip, arXiv:2505.23416), shared by the policies that use them.

After an exact prefill, the context is fed again, chunk by chunk, on top of the cache (the model "repeats" it); a held
slot's score is the largest attention probability any repeat query of its KV head's group pays it, in the model's own
softmax over every held slot (``score_norm="held"``) or renormalised, as KVzip's reference does, over the first
``score_sinks`` tokens, the chunk's own tokens and the repeat (``"chunk"``). Each repeat forward is rolled back exactly afterwards, so the pass leaves only scores.

Two pieces:

* :class:`ReconstructionScoring`, a mixin for :class:`~kvkit.stores.SlotStore` subclasses: while ``scoring`` is set,
  ``scoring_attend`` serves the repeat forward (exact attention over every held slot plus the repeat, causally) and
  records per slot the best probability a repeat query of the chunk pays it (``acc``); ``finish_scoring`` returns the
  pass's scores ``[B, H, n]`` (-1 where nothing was scored).
* :func:`reconstruct`, the pass itself: runs the chunks (cut from the end, each preceded by the last ``overlap``
  tokens of the previous one, as the reference does) through the patched base model and rolls each back; layers
  that cannot roll back (sliding windows) are restored from a copy.

Users: ``kvzip`` (eviction by these scores) and ``chelsea`` with ``protect_score="reconstruct"`` (the slots kept
exact from merging).

Memory (``B`` rows, ``Hq`` query heads over ``H`` KV heads, ``G = Hq / H``, head size ``D``): a repeat forward of
``T`` queries (``chunk`` + ``overlap``) over ``n = S + T`` held slots has ``B x Hq x T x n`` attention logits, and
the chunk's scores come from ``B x Hq x T x C`` probabilities (its ``C <= chunk`` own slots). Neither is held
whole: :func:`score_blocks` cuts both into blocks of at most ``max(E, G x n)`` elements, ``E =``
:data:`SCORE_BLOCK_ELEMENTS`, by whole (row, KV head) pairs or, when one pair is larger than ``E``, by runs of query
positions. A query row always lies whole in one block (its softmax over all ``n`` slots: the exact normaliser, so
the block's probabilities are final), and a slot's score is a maximum over blocks (exact), so the blocked pass does
the unblocked arithmetic row by row; only the matrix shapes handed to the matmul kernels shrink (a kernel chosen
for another shape may round a dot product differently in the last bit).

Extra memory, per block: the attention ``17 x max(E, G x n)`` bytes (at most four ``[rows x n]`` tensors of at most
4 bytes and a bool mask alive at once, :meth:`ReconstructionScoring.scoring_attend`) plus the block's K/V in fp32
(``8 x p x n x D`` bytes for its ``p`` (row, KV head) pairs; ``p = 1`` whenever query positions are cut); the
scoring ``12 x max(E, G x C)`` bytes plus the chunk's keys in fp32 (``4 x B x H x C x D``). Neither grows with
``B x S`` (a block grows with ``n`` only once ``n > E / G``). The whole call keeps its output, its ``[B, Hq, T]``
log-sum-exp and the ``[B, H, n]`` score accumulator.
"""

from __future__ import annotations

import copy

import torch

from kvkit.compat import cache_kw
from kvkit.model_info import context_limit
from kvkit.stores.attend import attend_slots, prefix_suffix_attention

#: ``E``: the most elements of one block of the scoring's ``[query rows x slots]`` tensors (:func:`score_blocks`),
#: unless one query position of a KV head's group is larger (``G x n``); 2**24 = 64 MiB per fp32 tensor, so a
#: block's tensors stay under ``17 x E`` bytes = 272 MiB. Read at each call (tests lower it to force blocks).
SCORE_BLOCK_ELEMENTS = 1 << 24


def score_blocks(B: int, H: int, G: int, T: int, n: int, split_queries: bool = True):
    """The blocks of a ``[B, H, G x T, n]`` scoring computation (``B`` rows, ``H`` KV heads of ``G`` query heads
    each, ``T`` query positions, ``n`` columns), as ``(rows, h0, h1, positions)``: ``rows`` and ``positions`` slices
    of the batch and of the query positions, ``h0:h1`` KV heads (query heads ``h0 x G : h1 x G``).

    With ``E = SCORE_BLOCK_ELEMENTS`` (read at each call), a block holds at most ``max(E, G x n)`` of the
    ``[rows x n]`` elements: whole (row, KV head) pairs while one pair (``G x T x n`` elements) fits ``E`` (as many
    heads of a row as fit, then as many rows), else one pair cut into the fewest runs of query positions of at most
    ``max(1, E // (G x n))`` positions each, evened out. ``split_queries=False``: positions are never cut (a block
    is then at least one pair, ``G x T x n``). From the shapes alone: no synchronisation."""
    E = SCORE_BLOCK_ELEMENTS
    pair = max(G * T * n, 1)
    hb = bb = pieces = 1
    if pair <= E or not split_queries:
        hb = max(1, min(H, E // pair))
        if hb == H:
            bb = max(1, min(B, E // (pair * H)))
    else:
        per = max(1, E // max(G * n, 1))  # query positions per run
        pieces = -(-T // per)
    cuts = [i * T // pieces for i in range(pieces + 1)]  # runs of T // pieces or T // pieces + 1 positions
    for b0 in range(0, B, bb):
        for h0 in range(0, H, hb):
            for t0, t1 in zip(cuts[:-1], cuts[1:]):
                yield slice(b0, min(b0 + bb, B)), h0, min(h0 + hb, H), slice(t0, t1)


def block_part(x: torch.Tensor, rows: slice, h0: int, h1: int) -> torch.Tensor:
    """Rows ``rows`` and heads ``h0:h1`` of ``x [B|1, H|1, ...]`` (a dimension of size 1 is broadcast: kept)."""
    x = x if x.shape[0] == 1 else x[rows]
    return x if x.shape[1] == 1 else x[:, h0:h1]


class ReconstructionScoring:
    """Mixin for slot stores scored by a reconstruction pass (see the module docstring)."""

    scoring = False  # inside a reconstruction forward: record scores, never compress
    acc: torch.Tensor | None = None  # [B, H, n] this pass's maximum attention per held slot (-1: not scored)
    score_range = (0, 0)  # positions of the tokens the running reconstruction chunk repeats
    verifying = False  # inside speculative verification: the pass is skipped (one-token decoding never runs it)
    last_forward_tokens = 0  # tokens of the newest forward (set by the store's ``attend``; read by the pass)
    score_norm = "held"  # "held": the model's softmax over every held slot; "chunk": the reference's (see _score_chunk)
    score_sinks = 4  # "chunk": the first real slots counted in the normaliser (the reference's system prompt)

    def set_verifying(self, on: bool) -> None:
        self.verifying = on

    def scoring_attend(self, query, attention_mask, scaling, log_weight=None):
        """The repeat forward's attention (the repeat's K/V were appended by ``update``): exact over every held slot
        and causal over the repeat (``log_weight [B, H, n]``: added to the held slots' scores, e.g. Chelsea's
        ``log(cluster size)``); records the chunk's scores.

        Runs block by block (:func:`score_blocks` over the ``[B, H, G x T, n]`` logits): each block is one call of
        :func:`~kvkit.stores.attend.attend_slots` on its rows, KV heads (with their query heads) and query positions
        over all ``n`` held slots, so every query row gets the output and log-sum-exp the whole call would give it.
        Extra memory per block: ``attend_slots``' masked path (the fp32 math every non-CPU device runs, as written)
        keeps at most four ``[rows x n]`` tensors of at most 4 bytes alive at once (the bool or ``log_weight`` mask,
        the logits, the shifted logits and their exponentials) besides the bool causal mask they come from (at
        most 1 byte per element): ``17 x max(E, G x n)`` bytes, ``E =`` :data:`SCORE_BLOCK_ELEMENTS`; plus its K/V
        in fp32, ``8 x p x n x D`` bytes for ``p`` (row, KV head) pairs. The CPU path without padding
        (:func:`~kvkit.stores.attend.prefix_suffix_attention`: flash kernel over the prefix, a ``[G x T, T]`` causal
        suffix per pair) is cut by whole pairs only, at most ``max(E, G x T x T)`` suffix elements per block. The
        whole call keeps its output ``[B, Hq, T, D]`` and fp32 log-sum-exp ``[B, Hq, T]``. No synchronisation
        beyond the padding check."""
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        B, Hq = query.shape[:2]
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        # CPU without padding: unmasked prefix + causal repeat (its suffix is [G x T, T] per pair: cut by pairs)
        split = not (log_weight is None and query.device.type == "cpu" and n > T and Hq % H == 0
                     and not bool((self.pos < 0).any()))
        out = query.new_empty(B, Hq, T, self.values.shape[-1])
        lse = torch.empty(B, Hq, T, dtype=torch.float32, device=query.device)
        for rows, h0, h1, ts in score_blocks(B, H, G, T, n if split else T, split_queries=split):
            q, k, v = query[rows, h0 * G : h1 * G], self.keys[rows, h0:h1], self.values[rows, h0:h1]
            if split:
                lw = None if log_weight is None else block_part(log_weight, rows, h0, h1)
                o, l_ = attend_slots(q[:, :, ts], k, v, block_part(self.pos, rows, h0, h1), qpos[ts], scaling,
                                     log_weight=lw, return_lse=True)
            else:
                o, l_ = prefix_suffix_attention(q, k, v, scaling)
            out[rows, h0 * G : h1 * G, ts] = o.transpose(1, 2)
            lse[rows, h0 * G : h1 * G, ts] = l_
        self._score_chunk(query.detach(), lse, T, scaling)
        return out.transpose(1, 2)  # [B, T, Hq, D], the layout attend_slots returns

    def _score_chunk(self, query, lse, T, scaling) -> None:
        """Each slot of the chunk being repeated (positions ``score_range``) takes the largest attention
        probability a repeat query of its KV head's group pays it (the model's own softmax, over every held slot:
        ``exp(q.k * scaling - lse)``); padding queries score nothing.

        The ``[B, H, G, T, C]`` probabilities (``C <= T`` slots of the chunk) are computed in the blocks of
        :func:`score_blocks` (at most ``max(E, G x C)`` elements each; the row's ``lse`` is the whole softmax's,
        so a block's probabilities are final) and reduced by a running maximum, which is exact: the same scores
        as one ``[B, H, G, T, C]`` tensor. Extra memory: at most three fp32 block tensors alive at once
        (``12 x max(E, G x C)`` bytes) and the chunk's keys in fp32 (``4 x B x H x C x D`` bytes)."""
        lo, hi = self.score_range
        B, Hq, _, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        C = min(hi - lo, n)
        pos = self.pos  # [B, Hp, n], ascending per row and head before the repeat: the range is <= C consecutive slots
        held = pos[..., : n - T].contiguous()  # the slots before the repeat (the repeat's padding is -1, unsorted)
        start = torch.searchsorted(held, torch.full((*pos.shape[:2], 1), lo, dtype=pos.dtype, device=pos.device))
        idx = (start + torch.arange(C, device=pos.device)).clamp(max=n - 1).expand(B, H, C)  # [B, H, C]
        p_idx = pos.expand(B, H, n).gather(2, idx)
        inside = (p_idx >= lo) & (p_idx < hi)
        k = self.keys.gather(2, idx.unsqueeze(-1).expand(B, H, C, D)).float()
        real_q = self.pos[:, :1, -T:] >= 0  # [B, 1, T] padding queries of the repeat score nothing
        local = self.score_norm == "chunk"
        if local:  # the reference's normaliser: the first sinks, the chunk's own slots and the repeat (causal)
            S0 = min(self.score_sinks, n - T)
            first = torch.searchsorted(held, torch.zeros((*pos.shape[:2], 1), dtype=pos.dtype, device=pos.device))
            sidx = (first + torch.arange(S0, device=pos.device)).clamp(max=n - T - 1).expand(B, H, S0)
            p_s = pos.expand(B, H, n).gather(2, sidx)
            sink_ok = (p_s >= 0) & (p_s < lo)  # [B, H, S0] sinks before the chunk (inside it they count once)
            ks = self.keys.gather(2, sidx.unsqueeze(-1).expand(B, H, S0, D)).float()
            kr = self.keys[:, :, n - T :].float()  # [B, H, T, D] the repeat's own keys
            causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
            rep_ok = causal & (self.pos[:, :, None, n - T :] >= 0)  # [B, Hp, T, T]
        best = torch.zeros(B, H, C, device=self.keys.device)  # probabilities are >= 0: max(0, p) = p
        for rows, h0, h1, ts in score_blocks(B, H, G, T, C + (T + S0 if local else 0)):
            q = query[rows, h0 * G : h1 * G, ts].float()
            b, t = q.shape[0], q.shape[2]
            q = q.reshape(b, h1 - h0, G, t, D)
            logit = torch.einsum("bhgtd,bhcd->bhgtc", q, k[rows, h0:h1]) * scaling
            if local:
                neg = float("-inf")
                ls = (torch.einsum("bhgtd,bhcd->bhgtc", q, ks[rows, h0:h1]) * scaling).masked_fill(
                    ~sink_ok[rows, h0:h1, None, None, :], neg)
                lr = (torch.einsum("bhgtd,bhcd->bhgtc", q, kr[rows, h0:h1]) * scaling).masked_fill(
                    ~block_part(rep_ok, rows, h0, h1)[:, :, None, ts, :], neg)
                lc = logit.masked_fill(~inside[rows, h0:h1, None, None, :], neg)
                norm = torch.logsumexp(torch.cat([ls, lc, lr], dim=-1), dim=-1, keepdim=True)
                del ls, lr, lc
            else:  # the model's own softmax over every held slot
                norm = lse[rows, h0 * G : h1 * G, ts].reshape(b, h1 - h0, G, t, 1)
            logit = logit - norm
            prob = logit.exp().masked_fill(~real_q[rows, :, ts].view(b, 1, 1, t, 1), 0.0).nan_to_num(0.0)
            part = best[rows, h0:h1]
            torch.maximum(part, prob.amax(dim=(2, 3)), out=part)
            del logit, prob  # not alive while the next block is computed
        best = best.masked_fill(~inside, -1.0)  # [B, H, C]
        if self.acc is None:
            self.acc = torch.full((B, H, n - T), -1.0, device=self.keys.device)
        self.acc.scatter_reduce_(2, idx.clamp(max=n - T - 1), best, reduce="amax")

    def finish_scoring(self) -> torch.Tensor | None:
        """The pass is over: its scores ``[B, H, n]`` (-1: a slot it did not score), or None when it scored nothing."""
        acc, self.acc = self.acc, None
        return acc


def forward_to_repeat(layers, input_ids, attention_mask, who: str, hint: str = ""):
    """After a forward: ``(T, mask)``, its token count and the 2-D attention mask of everything the cache holds (None
    when the forward's mask does not cover it), or ``(0, None)`` after a one-token forward (nothing to repeat).
    A multi-token forward without ``input_ids`` is refused: embeddings cannot be repeated (``who`` / ``hint`` name
    the policy and its alternative in the message)."""
    T = layers[0].last_forward_tokens
    if T <= 1:
        return 0, None
    if input_ids is None:
        raise ValueError(f"{who} repeats the context from its token ids: call the model with input_ids "
                         f"(inputs_embeds cannot be repeated){hint}")
    return T, context_mask(attention_mask, layers[0].seen)


def context_mask(attention_mask, seen: int) -> torch.Tensor | None:
    """The 2-D mask ``[B, seen]`` (1 = real token) of a forward's ``attention_mask`` that covers all ``seen``
    tokens, or None when it covers none of them (no mask: no padding).

    The mask comes as the caller gave it (2-D) or as transformers prepared it before the forward (``generate`` over
    a static cache builds the 4-D mask ``[B, 1, T, seen]`` outside the model: bool, True = attend; or additive
    float, 0 = attend; or a dict of them per layer type). The last query of a 4-D causal mask attends every real
    token before it, so its row is the padding mask of the whole context (a left-padded row then repeats its
    chunks at its own positions, as it would alone)."""
    m = attention_mask
    if isinstance(m, dict):
        m = m.get("full_attention")
    if not isinstance(m, torch.Tensor) or m.shape[-1] != seen:
        return None
    if m.dim() == 2:
        return m
    if m.dim() != 4:
        return None
    last = m[:, 0, -1, :]  # [B, seen]
    return (last if last.dtype == torch.bool else last == 0).long()


def reconstruct(base_model, cache, layers, ids, mask, ctx_mask, chunk: int, overlap: int, instruction=None,
                roll=None) -> None:
    """Feed ``ids [B, N]`` (the newest ``N`` tokens the cache holds; ``mask`` their attention-mask columns) again on
    top of ``cache`` in chunks of ``chunk`` tokens, each rolled back exactly after its forward; the ``layers``
    (:class:`ReconstructionScoring` stores of the cache) record scores (``acc``; read them with ``finish_scoring``).

    ``ctx_mask [B, seen]``: the attention mask of everything the cache holds (1 = real token). ``instruction``:
    None, or the token ids ``(first, next, suffix)`` put before each chunk (KVzip's "Repeat the previous context
    exactly." for the first chunk, "... starting with" + the overlap for the others, then the chat's answer header).
    ``roll``: the cache layers rolled back after each chunk, one per scored store (default ``layers``; a head-split
    layer whose evicted part is the scored store rolls back both its parts).
    """
    roll = layers if roll is None else roll
    seen = layers[0].seen
    real = ctx_mask.long().sum(-1, keepdim=True)  # [B, 1] real tokens of each row
    limit = context_limit(base_model)
    N = ids.shape[1]
    # chunks cut from the end: a left-padded row is cut at the same real tokens as the row alone
    ends = list(range(N, 0, -chunk))[::-1]
    scored = {id(layer) for layer in roll}
    # other layers (sliding windows) cannot always roll back: they are restored from a copy after each chunk
    others = {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers) if id(layer) not in scored}
    cache.scoring_pass = True
    for layer in layers:
        layer.scoring, layer.acc = True, None
    try:
        for e in ends:
            s = max(e - chunk - overlap, 0)
            for layer in layers:  # the positions of the chunk's own tokens (the overlap is scored with its own)
                layer.score_range = (seen - N + max(e - chunk, 0), seen - N + e)
            c_ids, c_mask = ids[:, s:e], mask[:, s:e].to(ctx_mask.dtype)
            if instruction is not None:  # instruction (+ the overlap it starts with) + the chat's answer header + chunk
                first, nxt, suffix = instruction
                lo = max(e - chunk, 0) - s  # own tokens start here
                parts = [(first if e == ends[0] else nxt), None, suffix, None]
                cols, masks = [], []
                for part, (a, b) in zip(parts, [(0, 0), (0, lo), (0, 0), (lo, e - s)]):
                    if part is not None:
                        cols.append(part.to(ids.device).expand(ids.shape[0], -1))
                        masks.append(torch.ones_like(cols[-1], dtype=c_mask.dtype))
                    else:
                        cols.append(c_ids[:, a:b])
                        masks.append(c_mask[:, a:b])
                c_ids, c_mask = torch.cat(cols, dim=1), torch.cat(masks, dim=1)
            # padding to the end of the chunk: the real tokens of every row follow the context directly (a
            # sliding-window layer would otherwise see padding instead of the context's last tokens)
            order = torch.sort((c_mask == 0).to(torch.int8), dim=1, stable=True).indices
            c_ids, c_mask = c_ids.gather(1, order), c_mask.gather(1, order)
            pos = real + c_mask.long().cumsum(-1) - 1
            if limit is not None:  # stay inside the trained positions (only the scores' RoPE shifts)
                pos = pos - (pos.amax(-1, keepdim=True) - (limit - 1)).clamp(min=0)
            base_model(input_ids=c_ids, attention_mask=torch.cat([ctx_mask, c_mask], dim=1),
                       position_ids=pos.clamp(min=0), use_cache=True, **cache_kw(cache))
            for layer in roll:
                layer.rollback(c_ids.shape[1], ends_round=False)
            for i, layer in others.items():
                cache.layers[i] = copy.deepcopy(layer)
    finally:
        for layer in layers:
            layer.scoring = False
        cache.scoring_pass = False
