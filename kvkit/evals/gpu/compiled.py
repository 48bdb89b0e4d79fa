"""The compiled rows' settings and bookkeeping: how ``hf-static`` and the ``<policy> static+compile`` rows compile,
what a compiled step reads, and the dynamo / inductor counters a row is checked with.

``hf-static`` compiles its decode forward with ``torch.compile(fullgraph=True, mode=...)``
(:func:`compile_kwargs`); a kvkit compiled row steps through ``model.get_compiled_call(``:func:`compile_config```)``:
``fullgraph=True``, static shapes, ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, inductor's default mode on the
CPU. ``--compile-backend`` (default inductor) applies to both; a mode goes to inductor only (:func:`compile_label`
says which ran). Every compiled row compiles afresh (:func:`reset_compiled`: dynamo's caches, CUDA-graph trees and
the compiled ``__call__`` transformers keeps on the model). :func:`graph_count` (dynamo graphs compiled so far: a
rise during timed steps is a recompile) and :func:`cudagraph_skips` (inductor's CUDA-graph fall-backs) are read
before and after a row's steps.

A compiled step has fixed shapes, so it reads its whole static buffers (:func:`compiled_read_bytes`), as
transformers' ``StaticCache`` reads its whole ``max_cache_len``.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import CompileConfig

from kvkit.stores.layer import StoreMixin

#: seconds a compiled row is expected to spend compiling before any of its rows has been measured (the time limit's
#: estimate; afterwards the measured compiled rows' durations are used): inductor on CUDA (CUDA graphs recorded
#: too), inductor on the CPU, any other backend (e.g. ``aot_eager``: tracing only). Compile times of an H100
#: run: the ``compile_s`` of results/speed-gpu/h100-llama-3.2-1b-b16-16k-2026-11-26.
COMPILE_ESTIMATE_S = {"cuda": 30.0, "cpu": 20.0, "other": 5.0}


def compile_kwargs(mode: str | None, backend: str) -> dict:
    """``torch.compile`` keyword arguments: ``mode`` goes to inductor only (other backends take none)."""
    return dict(backend=backend, mode=mode if backend == "inductor" else None)


def compile_label(mode: str | None, backend: str) -> str:
    """What the ``compile`` field says: inductor's mode (``reduce-overhead`` = CUDA graphs), else the backend."""
    return (mode or "default") if backend == "inductor" else backend


def compile_config(cuda: bool, backend: str = "inductor") -> CompileConfig:
    """The ``CompileConfig`` of a compiled kvkit row's decode step: ``fullgraph=True``, static shapes, transformers'
    default ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, inductor's default mode on the CPU (where
    ``_compile_all_devices`` is set, as transformers wants off CUDA; ``get_compiled_call`` itself ignores it)."""
    cc = CompileConfig(fullgraph=True, dynamic=False,
                       **compile_kwargs("reduce-overhead" if cuda else "default", backend))
    if not cuda:
        cc._compile_all_devices = True
    return cc


def compiled_read_bytes(cache) -> int:
    """K/V bytes one *compiled* single-token step reads from a static ``KVCache``: a compiled step has fixed shapes,
    so every store reads its whole buffers (``allocated_nbytes``: the capacity, free slots masked) -- as
    transformers' ``StaticCache`` reads its whole ``max_cache_len``; a store that counts its own reads (TidalDecode's
    selection, ShadowKV's chunks; ``read_nbytes`` overridden) keeps its count plus its free slots
    (``free_slot_nbytes``); duo's two halves are summed."""

    def one(store) -> int:
        parts = getattr(store, "parts", None)  # duo: a list of (store, ...) halves; zipcache's parts() is a method
        if isinstance(parts, (list, tuple)) and parts:
            return sum(one(p[0]) for p in parts)
        if type(store).read_nbytes is not StoreMixin.read_nbytes:  # its own count + the free slots it reads
            return int(store.read_nbytes()) + int(getattr(store, "free_slot_nbytes", lambda: 0)())
        return int(store.allocated_nbytes())

    return sum(one(layer) for layer in cache.layers)


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (a rise during timed steps = a recompile)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def cudagraph_skips() -> int:
    """Times inductor fell back from CUDA graphs (``mode="reduce-overhead"`` that did not capture)."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def reset_compiled(model) -> None:
    """Forget every compiled graph: dynamo's caches, CUDA-graph trees and the compiled ``__call__`` transformers keeps
    on the model (``get_compiled_call``), so the next compiled row compiles (and is timed compiling) afresh."""
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
