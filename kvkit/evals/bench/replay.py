"""One exact prefill of the bench's padded batch, recorded once, spilled to a memory-mapped file and replayed into
each policy's cache (:mod:`kvkit.workloads.shared_prefill`), at the recorded batch or at another batch size whose rows
repeat the recorded ones.

The recording holds every layer's keys, values and queries (``3 x`` a full cache); memory-mapped, it stays out of
the process's memory except while a replay reads it. A replay skips the prompt's own attention
(``replay_prefill(..., skip_prompt_attention=True)``): it discards the attention output, since the stores keep K/V
and their statistics from the query, never the output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path

import torch

from kvkit.evals.bench.fit import weight_bytes
from kvkit.evals.bench.prompts import positions
from kvkit.workloads.shared_prefill import LayerCall, PrefillRecording, record_prefill, replay_prefill


def _prompt_key(model, ids, mask) -> str:
    h = hashlib.sha256()
    h.update(repr((getattr(model.config, "_name_or_path", ""), type(model).__name__, str(model.dtype),
                   weight_bytes(model), torch.__version__)).encode())
    h.update(ids.numpy().tobytes())
    h.update(mask.numpy().tobytes())
    return h.hexdigest()[:16]


def record_prefill_spilled(model, ids, mask, spill_dir=None, reuse: bool = False):
    """One exact prefill of the padded batch through the kvkit-patched ``model``, recorded
    (:func:`kvkit.workloads.shared_prefill.record_prefill` with the left-padding mask and positions) and written to a
    file, then memory-mapped back: the recorded keys, values and queries (``3 x`` a full cache) stay out of the
    process's memory except while a replay reads them.

    ``spill_dir``: where the file goes (default: a temp file, deleted at once). With ``reuse``, the file is kept
    as ``spill_dir/prefill-<key>.pt`` (key: model, dtype, torch version, prompt ids and mask) and a later call with
    the same key loads it instead of running the prefill: the recorded tensors are the model's exact prefill,
    which depends on the model and the prompt, not on any policy."""
    names = {id(m): n for n, m in model.named_modules()}
    path = Path(spill_dir or tempfile.gettempdir()) / f"prefill-{_prompt_key(model, ids, mask)}.pt" if reuse else None
    if path is None or not path.exists():
        rec = record_prefill(model, ids, attention_mask=mask, position_ids=positions(mask))
        data = dict(tokens=rec.tokens, batch=rec.batch, logits=rec.logits, seconds=rec.seconds, calls={
            i: dict(key=c.key, value=c.value, query=c.query, cache_kwargs=c.cache_kwargs, module=names[id(c.module)],
                    attention_mask=c.attention_mask, scaling=c.scaling, dropout=c.dropout, kwargs=c.kwargs)
            for i, c in rec.calls.items()})
        del rec
        if path is None:
            fd, tmp = tempfile.mkstemp(prefix="kvkit-bench-prefill-", suffix=".pt", dir=spill_dir)
            os.close(fd)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = str(path) + ".tmp"
        try:
            torch.save(data, tmp)
            del data
            if path is not None:
                os.replace(tmp, path)
                tmp = str(path)
            back = torch.load(tmp, mmap=True, weights_only=True)
        finally:
            if path is None:
                os.unlink(tmp)  # the mapping stays valid; the file goes with the tensors
        reused = False
    else:
        back = torch.load(path, mmap=True, weights_only=True)
        reused = True
    calls = {i: LayerCall(key=c["key"], value=c["value"], cache_kwargs=c["cache_kwargs"],
                          module=model.get_submodule(c["module"]), query=c["query"],
                          attention_mask=c["attention_mask"], scaling=c["scaling"], dropout=c["dropout"],
                          kwargs=c["kwargs"]) for i, c in back["calls"].items()}
    rec = PrefillRecording(calls=calls, tokens=back["tokens"], batch=back["batch"], logits=back["logits"],
                           seconds=back["seconds"])
    rec.reused = reused
    return rec


def _take_rows(x, rows, b0):
    if isinstance(x, torch.Tensor):
        return x.index_select(0, rows.to(x.device)) if x.dim() > 0 and x.shape[0] == b0 else x
    if isinstance(x, tuple):
        return tuple(_take_rows(y, rows, b0) for y in x)
    if isinstance(x, list):
        return [_take_rows(y, rows, b0) for y in x]
    if isinstance(x, dict):
        return {k: _take_rows(v, rows, b0) for k, v in x.items()}
    return x


class _RowCalls(dict):
    """The recorded layer calls with the batch rows ``rows`` (a batch of another size: rows repeat), built one
    layer at a time when the replay asks for it (never the whole tiled recording at once)."""

    def __init__(self, calls, rows, b0):
        super().__init__((k, None) for k in calls)
        self._calls, self._rows, self._b0 = calls, rows, b0

    def __getitem__(self, i):
        c = self._calls[i]
        t = lambda x: _take_rows(x, self._rows, self._b0)  # noqa: E731
        return dataclasses.replace(c, key=t(c.key), value=t(c.value), query=t(c.query),
                                   attention_mask=t(c.attention_mask), cache_kwargs=t(c.cache_kwargs),
                                   kwargs=t(c.kwargs))


def replay_rows(model, rec, rows, b0: int):
    """Replay ``rec`` (recorded at batch ``b0``) into a fresh cache of the policy ``model`` is patched with, at the
    batch rows ``rows [batch]`` (indices into the recorded rows; the recording itself when ``batch == b0``),
    skipping the prompt's own attention. Returns ``(cache, last-token logits [batch, V])``.
    ``tests/evals/test_bench_batch.py`` checks, for every policy, that the replayed cache decodes the same greedy tokens
    as the policy's own prefill."""
    batch = rows.shape[0]
    sub = rec if batch == b0 else PrefillRecording(
        calls=_RowCalls(rec.calls, rows, b0), tokens=rec.tokens, batch=batch,
        logits=rec.logits.index_select(0, rows), seconds=rec.seconds)
    cache = replay_prefill(model, sub, skip_prompt_attention=True)
    return cache, sub.logits
