"""The kvkit rows of a shaped-model bench: a policy patched in eagerly, and its ``static+compile`` variant.

:class:`KvkitRow`: ``kvkit.patch(model, policy, **options)`` around its prefill (:func:`kvkit.prefill`: all ``B``
rows in chunks of ``C`` tokens, compressing policies compressing between chunks) and around every block of its
steps, unpatched between them, so its steps can be interleaved with ``full``'s. ``KV held`` = ``KVCache.nbytes()``,
``KV read/step`` = ``KVCache.read_nbytes()``; ``attention`` names the stores that ran.

:class:`KvkitCompiled` (``<policy> static+compile``): ``kvkit.patch(model, policy, static=True, max_length=L + the
steps run + margin)``, the prefill eager and chunked as the eager rows', then every single-token step through
``model.get_compiled_call(CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead"))`` on CUDA (CUDA
graphs; inductor's default mode on the CPU): kvkit's step wrapper, which runs the due compression events eagerly
between compiled steps, as ``generate`` does. The patch stays on from the prefill to :meth:`KvkitCompiled.close`
(re-patching between compiled calls would change what the graph was guarded on), so the row is not interleaved.
Its ``KV read/step`` is its whole static buffers (:func:`~kvkit.evals.gpu.compiled.compiled_read_bytes`); its
``syncs/step`` count the eager work around the graph (the step wrapper, the argmax), the graph itself run with the
counter paused (:meth:`KvkitCompiled.count_step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
from torch.utils._python_dispatch import _disable_current_modes

import kvkit
from kvkit.evals.gpu.compiled import compile_config, compile_label, compiled_read_bytes, reset_compiled
from kvkit.evals.gpu.plan import compiled_name
from kvkit.evals.gpu.rows import Row
from kvkit.evals.gpu.timing import StepWatch


class KvkitRow(Row):
    prefill_how = "kvkit.prefill: chunks of {chunk} tokens x {batch} rows per forward"

    @contextlib.contextmanager
    def active(self):
        kvkit.patch(self.model, self.policy, static=False, **self.options)
        try:
            yield
        finally:
            kvkit.unpatch(self.model)

    def prefill(self, ids, chunk):
        with torch.no_grad(), self.active():
            self.cache, last = kvkit.prefill(self.model, ids, chunk_size=chunk)
            self.nxt = last.argmax(-1, keepdim=True)

    def attention(self, ops: Counter) -> str:
        stores = sorted({type(layer).__name__ for layer in self.cache.layers})
        return "kvkit " + "/".join(stores)

    def kv_held(self) -> int:
        return int(self.cache.nbytes())

    def kv_read(self) -> int:
        return int(self.cache.read_nbytes())

    def kv_offloaded(self) -> int:
        return int(self.cache.offloaded_nbytes())


class KvkitCompiled(KvkitRow):
    """``<policy> static+compile``: ``kvkit.patch(model, policy, static=True, max_length=N)``, the prefill eager
    (:func:`kvkit.prefill`, chunked as the eager rows), then every single-token step through
    ``model.get_compiled_call(CompileConfig(fullgraph=True, ...))`` -- kvkit's step wrapper, which runs the due
    compression events eagerly between compiled steps, as ``generate`` does. The patch stays on from the prefill to
    :meth:`close` (re-patching between compiled calls would change what the graph was guarded on), so the row is not
    interleaved with ``full``'s steps."""

    interleave = False
    compiles = True
    prefill_how = ("kvkit.prefill into a static cache (static=True, max_length {max_length}; eager): chunks of "
                   "{chunk} tokens x {batch} rows per forward")

    def __init__(self, model, name, options, label_options, max_length: int, cuda: bool, backend: str):
        super().__init__(model, name, options, label_options)
        self.name = compiled_name(name)
        self.label = self.name + (" " + ",".join(f"{k}={v}" for k, v in label_options.items())
                                  if label_options else "")
        self.max_length, self.backend, self.cuda = max_length, backend, cuda
        self.config = compile_config(cuda, backend)
        self.compile_mode = compile_label(self.config.mode, backend)
        self.cudagraphs = cuda and self.compile_mode == "reduce-overhead"
        self.prefill_how = self.prefill_how.replace("{max_length}", str(max_length))
        self.fn = None

    @contextlib.contextmanager
    def active(self):
        yield  # patched once, in prefill(), until close()

    def prefill(self, ids, chunk):
        kvkit.patch(self.model, self.policy, static=True, max_length=self.max_length, **self.options)
        with torch.no_grad():
            self.cache, last = kvkit.prefill(self.model, ids, chunk_size=chunk)
            self.cache.ensure_capacity(self.max_length)  # no compiled step may need to grow a buffer
            self.nxt = last.argmax(-1, keepdim=True)
        reset_compiled(self.model)  # compiled afresh by this row's first step (timed as its compile)
        self.fn = self.model.get_compiled_call(self.config)

    def count_step(self) -> StepWatch | None:
        """One more compiled step, its eager work counted: the step wrapper's (compression events, host copies),
        the argmax. A dispatch mode stops ``torch.compile`` from running compiled code at all ("non-infra torch
        dispatch mode present"), so the compiled call itself runs with the counter paused: it is one graph
        (``fullgraph=True``), whose kernels no dispatch mode sees anyway. None (not counted) when
        ``model.get_compiled_call`` is not kvkit's ``partial(_compiled_step, model_ref, compiled)``."""
        fn = self.fn
        if not (isinstance(fn, functools.partial) and len(fn.args) == 2 and callable(fn.args[1])):
            return None
        compiled = fn.args[1]

        def paused(*a, **k):
            with _disable_current_modes():
                return compiled(*a, **k)

        self.fn = functools.partial(fn.func, fn.args[0], paused, **fn.keywords)
        try:
            with StepWatch() as w:
                self.step()
        finally:
            self.fn = fn
        return w

    def attention(self, ops: Counter) -> str:
        return super().attention(ops) + " (one compiled graph)"

    def kv_read(self) -> int:
        return compiled_read_bytes(self.cache)

    def close(self) -> None:
        super().close()
        self.fn = None
        if kvkit.patched_policy(self.model) is not None:
            kvkit.unpatch(self.model)
        reset_compiled(self.model)
