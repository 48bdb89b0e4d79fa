"""The batch being decoded: a rectangular target KV in which rejected drafts leave masked holes.

Every row of a batch accepts its own number of drafts per round, so after a verification the rows
hold different numbers of real tokens. kvkit keeps the KV rectangular (one slot per batch column,
as transformers' caches do) and records each slot's *token position* in its row:

    token_pos [B, S]   position of the token in slot s of row b (RoPE's position); -1: left padding or
                       a hole, i.e. a draft that row rejected while another row accepted it

Slots the *every* row rejected are cropped (``cache.rollback``); the rest become holes, masked in
every later forward by a 4-D attention mask built from ``token_pos`` (causal over slots, holes and
padding hidden, a model's sliding window applied in token positions). Position ids are per row. So
every row attends to exactly its own tokens at their own positions, as plain batched decoding does:
the holes cost only their slots (at most ``gamma`` per round, next to thousands of prompt slots),
no KV is moved. With one row (or rows that always accept alike) nothing is ever a hole and no mask
is passed, which keeps the CPU prefix + causal-suffix verification path.

Finished rows leave the batch (``batch_select_indices`` on the cache: one copy of the KV) once the
work they would still cost outweighs that copy.

Such a KV keeps every slot: :func:`batch_cache` builds one (``full`` stores on every layer, sliding-window
layers included), and :func:`layer_windows` gives the sliding windows its masks apply.
"""

from __future__ import annotations

import torch

from kvkit.cache import KVCache
from kvkit.speculative.verify import process
from kvkit.stores import FullStore, SlidingStore


def batch_cache(model) -> KVCache:
    """A ``full`` cache for batched speculation (to prefill a prompt once and speculate from copies): the model's
    sliding-window layers keep every slot too (the window is applied by the attention mask in token positions, which
    holes make differ from slot positions)."""
    cache = KVCache(model, "full")
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, SlidingStore):
            cache.layers[i] = FullStore(layer.info)
    return cache


def layer_windows(cache: KVCache) -> dict[str, int | None]:
    """Layer type -> sliding window (None for full attention): the ``windows`` of :func:`hole_mask` and
    :meth:`Rows.mask` for a model whose cache is ``cache``."""
    return {info.layer_type: (info.sliding_window if info.layer_type == "sliding_attention" else None)
            for info in cache.infos}


def process_rows(logits_processor, prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, T, V]`` through ``logits_processor`` row by row (processors see one sequence at a time); row b's
    column t follows ``prefixes[b][: len - T + 1 + t]``."""
    return torch.stack([process(logits_processor, prefixes[b], logits[b].cpu()) for b in range(logits.shape[0])]
                       ).to(logits.device)


def hole_mask(token_pos: torch.Tensor, q: torch.Tensor, windows: dict[str, int | None]):
    """The attention mask of a forward of ``q.shape[1]`` tokens per row appended after held slots with holes.

    token_pos ``[B, S]``: token position of every held slot (-1: padding / hole); q ``[B, T]``: the new tokens'
    positions (-1: a filler the row does not have, hidden from every later query). Causal over slots, holes
    hidden, a layer's sliding window applied in token positions. One layer type gives a ``[B, 1, T, S + T]`` bool
    tensor; several give a dict by layer type (what transformers' hybrid models accept)."""
    S, T = token_pos.shape[1], q.shape[1]
    kpos = torch.cat([token_pos, q], dim=1)  # [B, S + T]
    causal = torch.ones(T, S + T, dtype=torch.bool, device=kpos.device).tril(S)
    allowed = (kpos >= 0)[:, None, :] & causal  # [B, T, S + T]
    masks = {}
    for kind, window in windows.items():
        m = allowed if window is None else allowed & (q[:, :, None] - kpos[:, None, :] < window)
        masks[kind] = m[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


class Rows:
    """Per-row state of a batched generation over a rectangular KV with holes (see the module docstring).

    input_ids ``[B, T]``, attention_mask ``[B, T]`` (1 = token, 0 = left padding); ``held`` prompt columns
    are already in the cache.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new: int, eos: set,
                 stopping_criteria=None):
        self.input_ids, self.max_new, self.eos, self.stopping_criteria = input_ids, max_new, eos, stopping_criteria
        B = input_ids.shape[0]
        mask = attention_mask.bool()
        pos = mask.long().cumsum(-1) - 1
        self.prompt_pos = pos.masked_fill(~mask, 1)  # transformers' position ids for a padded prompt
        self.token_pos = pos.masked_fill(~mask, -1)  # [B, S] once the prompt is in the cache
        self.index = torch.arange(B)  # original row of every active row
        self.new: list[list[int]] = [[] for _ in range(B)]
        self.done = [False] * B
        self.last = None  # [B] the newest token of each active row, not yet in the cache
        self.next_pos = pos[:, -1] + 1  # [B] its token position

    # ---- what the forwards need --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.index.shape[0]

    @property
    def aligned(self) -> bool:
        """No padding and no holes: every row's slot s holds its token s (forwards need no mask)."""
        return bool((self.token_pos >= 0).all())

    def positions(self, T: int) -> torch.Tensor:
        """Position ids ``[B, T]`` of the next T tokens of every row."""
        return self.next_pos[:, None] + torch.arange(T, device=self.next_pos.device)

    def mask(self, T: int, windows: dict[str, int | None]):
        """The attention mask of a forward of T tokens per row appended after the held slots, or None when aligned.

        windows: layer type -> sliding window (None: full attention); see :func:`hole_mask`."""
        if self.aligned:
            return None
        return hole_mask(self.token_pos, self.positions(T), windows)

    def sequence(self, b: int) -> torch.Tensor:
        """Row b (active index) as plain decoding sees it: its prompt row (padding included) and its new tokens."""
        i = int(self.index[b])
        return torch.cat([self.input_ids[i].cpu(), torch.tensor(self.new[i], dtype=torch.long)])

    def process(self, logits_processor, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Apply ``logits_processor`` to ``logits [B, T, V]`` (row t follows the row's tokens + ``drafts[:, :t]``)."""
        if not logits_processor:
            return logits
        prefixes = [self.sequence(b) if drafts is None or not drafts.shape[1] else
                    torch.cat([self.sequence(b), drafts[b].cpu()]) for b in range(self.size)]
        return process_rows(logits_processor, prefixes, logits)

    # ---- after a forward ---------------------------------------------------------------------------
    def start(self, first: torch.Tensor) -> None:
        """The prompt is in the cache; ``first [B]`` is every row's first new token."""
        self.last = first
        self._emit([[t] for t in first.tolist()])

    def commit(self, cache, drafts: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor) -> None:
        """A verification appended ``[last, drafts]`` (k + 1 slots) for every row; row b keeps ``n[b] + 1`` of them.

        Slots no row keeps are cropped, the others become holes in the rows that rejected them."""
        k = drafts.shape[1]
        j = torch.arange(k + 1, device=n.device)
        new_pos = torch.where(j <= n[:, None], self.next_pos[:, None] + j, -1)
        drop = k - int(n.max())
        if drop:
            cache.rollback(drop)
        self.token_pos = torch.cat([self.token_pos, new_pos[:, : k + 1 - drop]], dim=1)
        self.next_pos = self.next_pos + n + 1
        self.last = nxt
        d = drafts.tolist()
        self._emit([d[b][: int(n[b])] + [int(nxt[b])] for b in range(self.size)])

    def _emit(self, tokens: list[list[int]]) -> None:
        for b, toks in enumerate(tokens):
            i = int(self.index[b])
            for t in toks:
                if self.done[i]:
                    break
                self.new[i].append(t)
                self.done[i] = t in self.eos or len(self.new[i]) >= self.max_new or self._stopped(i)

    def _stopped(self, i: int) -> bool:
        if not self.stopping_criteria:
            return False
        ids = torch.cat([self.input_ids[i].cpu(), torch.tensor(self.new[i], dtype=torch.long)])[None]
        return bool(self.stopping_criteria(ids.to(self.input_ids.device), None).all())

    # ---- finished rows -----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return all(self.done[int(i)] for i in self.index)

    def tokens_needed(self) -> int:
        """The most new tokens an active, unfinished row still needs."""
        return max((self.max_new - len(self.new[int(i)]) for i in self.index if not self.done[int(i)]), default=0)

    def retire(self, caches, tokens_per_round: float) -> None:
        """Drop finished rows from the batch (and from ``caches``) when the rounds they would still ride along
        cost more than the copy of the KV that dropping them takes (about two decode steps' reads)."""
        done = torch.tensor([self.done[int(i)] for i in self.index])
        if not done.any() or done.all():
            return
        rounds_left = self.tokens_needed() / max(tokens_per_round, 1.0)
        if int(done.sum()) * rounds_left < self.size:
            return
        keep = (~done).nonzero()[:, 0]
        for c in caches:
            c.batch_select_indices(keep.to(self._device(c)))
        self.index, self.token_pos = self.index[keep], self.token_pos[keep.to(self.token_pos.device)]
        self.next_pos, self.last = self.next_pos[keep.to(self.next_pos.device)], self.last[keep.to(self.last.device)]

    @staticmethod
    def _device(cache):
        for layer in getattr(cache, "layers", ()):
            k = getattr(layer, "keys", None)
            if isinstance(k, torch.Tensor):
                return k.device
        return torch.device("cpu")

    def sequences(self, prompt: torch.Tensor, pad_id: int) -> torch.Tensor:
        """``[B, T + longest]``: every row of ``prompt [B, T]`` followed by its new tokens, shorter rows padded."""
        width = max(len(t) for t in self.new)
        out = torch.full((len(self.new), width), pad_id, dtype=prompt.dtype)
        for i, toks in enumerate(self.new):
            out[i, : len(toks)] = torch.tensor(toks, dtype=prompt.dtype)
        return torch.cat([prompt, out.to(prompt.device)], dim=1)
