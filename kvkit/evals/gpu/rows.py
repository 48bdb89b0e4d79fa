"""A row of a shaped-model bench: one cache prefilled, then stepped one token at a time, with its byte counts;
and the transformers baselines.

:class:`Row` holds the model, the cache and the next input token ``[B, 1]`` (the previous step's greedy token fed
back). :meth:`Row.prefill` feeds ``ids [B, L]`` in chunks of ``C`` tokens per forward (all ``B`` rows together,
``logits_to_keep=1``); :meth:`Row.step` runs one decode step (``input_ids [B, 1]``) through ``fn`` (a compiled
forward) or the model itself; :meth:`Row.count_step` runs one more under a :class:`~kvkit.evals.gpu.timing.
StepWatch`. ``KV held`` = the cache's key/value tensors; a ``DynamicCache`` step reads all it holds.

Baselines on the unpatched model: :class:`HFDynamic` (eager, transformers' ``DynamicCache``) and :class:`HFStatic`
(``StaticCache`` with ``max_cache_len`` = L + the steps run, prefilled eager, then the decode forward compiled by
``torch.compile(fullgraph=True)``, ``mode="reduce-overhead"`` (CUDA graphs) on CUDA; eager with ``--no-compile``).
A ``StaticCache`` step reads its whole ``max_cache_len`` buffer, masked. ``hf-static`` is never interleaved with
``full``'s steps; its host synchronisations are counted on its eager forward (the graph the compiled one replays).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from transformers import DynamicCache, StaticCache

from kvkit.compat import cache_kw
from kvkit.evals.gpu.compiled import compile_kwargs, compile_label, reset_compiled
from kvkit.evals.gpu.timing import StepWatch


class Row:
    """One cache being measured: prefill, a decode step, its byte counts."""

    interleave = True
    compile_mode = "eager"  # what the ``compile`` field says
    compiles = False  # its decode steps run compiled code (compile time reported apart, warm-up triggers it)
    cudagraphs = False  # ... recorded as CUDA graphs (two more warm-up steps: cudagraph-tree warm-up, recording)

    def __init__(self, model, name: str, options: dict, label_options: dict):
        self.model, self.name, self.options = model, name, options
        self.policy = name
        self.label = name + (" " + ",".join(f"{k}={v}" for k, v in label_options.items()) if label_options else "")
        self.label_options = label_options
        self.cache = None
        self.nxt = None

    @contextlib.contextmanager
    def active(self):
        yield

    fn = None  # the forward decode steps call (a compiled one); None: the model itself

    def _forward(self, ids, **kw):
        fwd = self.model if self.fn is None else self.fn
        return fwd(input_ids=ids, **cache_kw(self.cache), use_cache=True, **kw)

    def prefill(self, ids, chunk: int) -> None:
        """Feed ``ids [B, L]`` in chunks of ``chunk`` tokens; keep the greedy next token."""
        with torch.no_grad(), self.active():
            last = None
            for s in range(0, ids.shape[1], chunk):
                last = self._forward(ids[:, s:s + chunk], logits_to_keep=1).logits[:, -1]
            self.nxt = last.argmax(-1, keepdim=True)

    def step(self) -> None:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            self.nxt = self._forward(self.nxt).logits[:, -1].argmax(-1, keepdim=True)

    def count_step(self) -> StepWatch:
        with self.active(), StepWatch() as w:
            self.step()
        return w

    def attention(self, ops: Counter) -> str:
        return "sdpa"

    def kv_held(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def kv_read(self) -> int:
        return self.kv_held()

    def kv_offloaded(self) -> int:
        return 0

    def close(self) -> None:
        self.cache = self.nxt = None


class HFDynamic(Row):
    prefill_how = "chunks of {chunk} tokens x {batch} rows per forward into transformers' DynamicCache"

    def prefill(self, ids, chunk):
        self.cache = DynamicCache(config=self.model.config)
        super().prefill(ids, chunk)


class HFStatic(Row):
    interleave = False
    prefill_how = "chunks of {chunk} tokens x {batch} rows per forward into transformers' StaticCache (eager)"

    def __init__(self, model, name, options, label_options, max_cache_len: int, compile_mode: str | None,
                 backend: str = "inductor"):
        super().__init__(model, name, options, label_options)
        self.max_cache_len = max_cache_len
        self.backend, self.mode = backend, compile_mode
        self.compile_mode = "eager" if compile_mode is None else compile_label(compile_mode, backend)
        self.compiles = compile_mode is not None
        self.fn = None
        self.cuda = next(model.parameters()).is_cuda
        self.cudagraphs = self.cuda and self.compile_mode == "reduce-overhead"

    def prefill(self, ids, chunk):
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        super().prefill(ids, chunk)
        self.fn = self.model.forward
        if self.compiles:
            self.fn = torch.compile(self.model.forward, fullgraph=True, **compile_kwargs(self.mode, self.backend))

    def count_step(self) -> StepWatch:
        """One step of the *eager* forward (the graph the compiled one replays; a dispatch mode cannot look
        inside a CUDA graph replay)."""
        fn, self.fn = self.fn, self.model.forward
        cg, self.cudagraphs = self.cudagraphs, False
        try:
            return super().count_step()
        finally:
            self.fn, self.cudagraphs = fn, cg

    def close(self) -> None:
        super().close()
        self.fn = None
        if self.compiles:
            reset_compiled(self.model)
