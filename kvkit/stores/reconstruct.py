"""Context-reconstruction scores (KVzip, arXiv:2505.23416), shared by the policies that use them.

After an exact prefill, the context is fed again, chunk by chunk, on top of the cache (the model "repeats" it); a held
slot's score is the largest attention probability any repeat query of its KV head's group pays it, in the model's own
softmax over every held slot. Each repeat forward is rolled back exactly afterwards, so the pass leaves only scores.

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
"""

from __future__ import annotations

import copy

import torch

from kvkit.compat import cache_kw
from kvkit.model_info import context_limit
from kvkit.stores.attend import attend_slots, prefix_suffix_attention


class ReconstructionScoring:
    """Mixin for slot stores scored by a reconstruction pass (see the module docstring)."""

    scoring = False  # inside a reconstruction forward: record scores, never compress
    acc: torch.Tensor | None = None  # [B, H, n] this pass's maximum attention per held slot (-1: not scored)
    score_range = (0, 0)  # positions of the tokens the running reconstruction chunk repeats
    verifying = False  # inside speculative verification: the pass is skipped (one-token decoding never runs it)
    last_forward_tokens = 0  # tokens of the newest forward (set by the store's ``attend``; read by the pass)

    def set_verifying(self, on: bool) -> None:
        self.verifying = on

    def scoring_attend(self, query, attention_mask, scaling, log_weight=None):
        """The repeat forward's attention (the repeat's K/V were appended by ``update``): exact over every held slot
        and causal over the repeat (``log_weight [B, H, n]``: added to the held slots' scores, e.g. Chelsea's
        ``log(cluster size)``); records the chunk's scores."""
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        n = self.keys.shape[2]
        if (log_weight is None and query.device.type == "cpu" and n > T and query.shape[1] % self.keys.shape[1] == 0
                and not bool((self.pos < 0).any())):  # no padding: unmasked prefix + causal repeat
            out, lse = prefix_suffix_attention(query, self.keys, self.values, scaling)
        else:
            out, lse = attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, log_weight=log_weight,
                                    return_lse=True)
        self._score_chunk(query.detach(), lse, T, scaling)
        return out

    def _score_chunk(self, query, lse, T, scaling) -> None:
        """Each slot of the chunk being repeated (positions ``score_range``) takes the largest attention
        probability a repeat query of its KV head's group pays it (the model's own softmax, over every held slot:
        ``exp(q.k * scaling - lse)``); padding queries score nothing."""
        lo, hi = self.score_range
        B, Hq, _, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        C = min(hi - lo, n)
        pos = self.pos  # [B, Hp, n], ascending per row and head before the repeat: the range is <= C consecutive slots
        held = pos[..., : n - T].contiguous()  # the slots before the repeat (the repeat's padding is -1, unsorted)
        start = torch.searchsorted(held, torch.full((*pos.shape[:2], 1), lo, dtype=pos.dtype, device=pos.device))
        idx = (start + torch.arange(C, device=pos.device)).clamp(max=n - 1).expand(B, H, C)  # [B, H, C]
        p_idx = pos.expand(B, H, n).gather(2, idx)
        inside = (p_idx >= lo) & (p_idx < hi)
        k = self.keys.gather(2, idx.unsqueeze(-1).expand(B, H, C, D)).float()
        q = query.float().view(B, H, Hq // H, T, D)
        logit = torch.einsum("bhgtd,bhcd->bhgtc", q, k) * scaling - lse.view(B, H, Hq // H, T, 1)
        real_q = (self.pos[:, :1, -T:] >= 0).view(B, 1, 1, T, 1)  # padding queries of the repeat score nothing
        prob = logit.exp().masked_fill(~real_q, 0.0).nan_to_num(0.0)
        best = prob.amax(dim=(2, 3)).masked_fill(~inside, -1.0)  # [B, H, C]
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
    ok = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    return T, attention_mask if ok and attention_mask.shape[1] == layers[0].seen else None


def reconstruct(base_model, cache, layers, ids, mask, ctx_mask, chunk: int, overlap: int, instruction=None) -> None:
    """Feed ``ids [B, N]`` (the newest ``N`` tokens the cache holds; ``mask`` their attention-mask columns) again on
    top of ``cache`` in chunks of ``chunk`` tokens, each rolled back exactly after its forward; the ``layers``
    (:class:`ReconstructionScoring` stores of the cache) record scores (``acc``; read them with ``finish_scoring``).

    ``ctx_mask [B, seen]``: the attention mask of everything the cache holds (1 = real token). ``instruction``:
    None, or the token ids ``(first, next, suffix)`` put before each chunk (KVzip's "Repeat the previous context
    exactly." for the first chunk, "... starting with" + the overlap for the others, then the chat's answer header).
    """
    seen = layers[0].seen
    real = ctx_mask.long().sum(-1, keepdim=True)  # [B, 1] real tokens of each row
    limit = context_limit(base_model)
    N = ids.shape[1]
    # chunks cut from the end: a left-padded row is cut at the same real tokens as the row alone
    ends = list(range(N, 0, -chunk))[::-1]
    scored = {id(layer) for layer in layers}
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
            for layer in layers:
                layer.rollback(c_ids.shape[1], ends_round=False)
            for i, layer in others.items():
                cache.layers[i] = copy.deepcopy(layer)
    finally:
        for layer in layers:
            layer.scoring = False
        cache.scoring_pass = False
