"""``kvkit bench --shape NAME``: one decode step of a real architecture's shape, timed for every cache in one run.

What it measures. A ``LlamaForCausalLM`` with random weights of a named shape (:data:`SHAPES`; built directly on
the device, ``with torch.device(dev): LlamaForCausalLM(config)``, then ``.to(dtype)``: bf16 on CUDA, fp32 on the
CPU; nothing is downloaded) gets a batch of ``B`` rows of ``L`` random token ids, and one decode step (one query
token per row, ``input_ids [B, 1]``, the previous step's greedy token fed back) is timed for each row of the table:

* ``hf-dynamic``: transformers unpatched, eager, its ``DynamicCache``;
* ``hf-static``: transformers' ``StaticCache`` (``max_cache_len = L`` + the steps run) with the decode forward
  compiled by ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs; ``mode="default"`` on the
  CPU; eager with ``--no-compile``);
* ``full``: kvkit's ``full`` policy (the reference of the ratios below);
* every compressed kvkit policy with settings that make sense at this length (:func:`default_options`; e.g.
  streaming keeps ``L/4``, snapkv 4096 tokens, shadowkv a 2048-token budget), each prefilled, then timed;
* ``<policy> static+compile`` (``--compiled``, the default; :class:`_KvkitCompiled`), right after each kvkit policy
  with a static store (:func:`kvkit.cache.static_policies`: the policies whose class is ``static_capable``), same
  options: ``kvkit.patch(model, policy, static=True, max_length=L + the steps run + margin)``, the prefill eager
  and chunked as the eager rows', then every step through ``model.get_compiled_call(CompileConfig(fullgraph=True,
  dynamic=False, mode="reduce-overhead"))`` on CUDA (CUDA graphs; inductor's default mode on the CPU): kvkit's
  step wrapper, which runs the due compression events eagerly between compiled steps, as ``generate`` does. A
  policy without a static store gets no such row; the summary's first line names it with
  ``KVCache.compile_refusal``'s reason (also ``compile_refusal`` in its row). ``--compile-backend`` (default
  inductor) applies to these and to ``hf-static``; ``aot_eager`` makes the CPU tests' compiles short.

Run order (:func:`plan_rows`): ``full`` first (the reference), then each row as given with a policy's compiled row
right after its eager one; the default set runs full, full static+compile, hf-dynamic, hf-static, streaming,
streaming static+compile, then the others, so a time limit cuts the least wanted rows.

Prefill: all ``B`` rows together, in chunks of ``C`` tokens per forward (``--prefill-chunk``; default
``min(L, max(256, 16384 // B))``): :func:`kvkit.prefill` for kvkit's policies (compressing policies compress
between chunks, see its docstring), the same chunked loop into transformers' caches for the ``hf-*`` rows. Every
row's output says how it was prefilled.

Timing. After ``--warmup`` untimed steps, ``--steps`` timed steps in ``--rounds`` rounds; with interleaving (the
default where memory allows) the kvkit ``full`` cache stays alive and decodes as many steps right after each
round of a row, so each row is compared with ``full`` steps taken under the same conditions. On CUDA each step
sits between two CUDA events (``torch.cuda.synchronize()`` before and after each block of steps, none between
steps: a step that keeps the device busy is timed as its device time, one that waits on the host as the wall
time between its launches); on the CPU ``time.perf_counter`` around each step. Reported: the median step and its
10th / 90th percentiles. A row whose timed steps pass a per-row cap (``max(5 s, time limit / 20)``) stops
early (at least 3 steps). ``hf-static`` and the compiled kvkit rows are not interleaved (switching kvkit's patch
on and off between compiled calls could invalidate the compiled graph).

Compiled rows (``hf-static``, ``static+compile``): their first step compiles (dynamo + the backend), and under CUDA
graphs the next two warm the cudagraph tree up and record it; those steps are the row's ``compile_s`` (``compile s``
column; ``cudagraph_record_s`` the recording part), never timed steps; the other warm-up steps follow. Every row
compiles afresh (dynamo, CUDA-graph trees and transformers' cached ``_compiled_call`` are reset between rows).
``graphs_compiled``: dynamo graphs compiled in the warm-up; ``recompiles``: graphs compiled during the timed and
counted steps (should be 0; noted otherwise); ``cudagraph_skips``: inductor's CUDA-graph fall-backs (noted).

Columns. ``KV held`` = ``KVCache.nbytes()`` (transformers' caches: their key/value tensors); ``KV read/step`` =
``KVCache.read_nbytes()`` (a ``DynamicCache`` step reads all it holds; a ``StaticCache`` step reads its whole
``max_cache_len`` buffer, masked; a compiled kvkit step its whole static buffers, :func:`compiled_read_bytes`);
``weights`` = the parameter bytes a decode step reads (each tensor once; the
input embedding table only when it is tied to the output head, else only ``B`` of its rows are read, not counted);
``bandwidth`` = a large device-to-device copy, (bytes read + bytes written) / time, measured in the same run;
``byte bound ms`` = (weights + KV read/step) / bandwidth; ``speed-up`` = ``t_full / t_row``;
``fraction`` = ``(t_full - t_row) / (t_full - t_bound_row)`` with no clamping (1: the row runs at its byte bound;
0: as fast as kvkit ``full``; negative: slower than ``full``; None when ``t_full`` is at or under the row's bound).
``t_full`` is the median of the ``full`` steps interleaved with that row when there are any, else ``full``'s own
median. ``vs full compiled`` / ``fraction (vs full compiled)``: the same with ``t_full`` = the median step of
``full static+compile``. ``syncs/step``: host synchronisations of one extra step, counted by
:class:`kvkit.hostsync.HostSyncCounter` (``hf-static``: its eager forward, the graph that the compiled one replays;
a ``static+compile`` row: one more compiled step, the eager work around the graph counted -- kvkit's step wrapper,
the argmax -- the graph itself run with the counter paused, see :meth:`_KvkitCompiled.count_step`); ``attention``:
which attention ran (transformers' sdpa or a kvkit store, the fused sdpa ops that step dispatched, and the compile
mode).

A row that fails (out of memory, an error) is a row with the error message; memory is freed between rows.
After ``--time-limit`` seconds (counted from the start of the command) the remaining rows are skipped and marked
so; a row is also skipped when its expected duration would carry it past the limit (:meth:`Bench._estimate`: the
median eager row so far; a compiling row: the median compiling row so far, else the median eager row +
:data:`COMPILE_ESTIMATE_S`, 30 s on CUDA -- compile time counts against the limit).

Output: ``results/bench/gpu/<shape>-b<B>-<L>/`` (or ``--out``): ``config.json`` (command, versions, device,
git commit, shape, settings, bandwidth), ``rows.jsonl`` (one object per row), ``summary.md`` (the table and the
command); rewritten after every row, so a run stopped early keeps its rows. The table is printed at the end.
"""

from __future__ import annotations

import contextlib
import gc
import math
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kvkit import env
from kvkit.hostsync import HostSyncCounter


def _llama3_rope(factor: float) -> dict:
    return dict(rope_type="llama3", rope_theta=500000.0, factor=factor, high_freq_factor=4.0, low_freq_factor=1.0,
                original_max_position_embeddings=8192)


#: model shapes (transformers ``LlamaConfig`` fields); random weights of these are built on the device
SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters=_llama3_rope(32.0)),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters=_llama3_rope(8.0)),
}

#: the transformers rows (unpatched model)
HF_ROWS = ("hf-dynamic", "hf-static")
#: the rows run when ``--policies`` is not given, in this order (``full`` always runs first: it is the reference)
DEFAULT_ROWS = ("hf-dynamic", "hf-static", "full", "streaming", "snapkv", "tidal", "duo", "cake", "chelsea",
                "zipcache", "shadowkv", "kvzip")
#: the suffix of a kvkit policy's compiled row (``static=True`` caches, decode steps through
#: ``model.get_compiled_call``): ``"full static+compile"``, ``"streaming static+compile"``, ...
COMPILED_SUFFIX = "static+compile"
#: seconds a compiled row is expected to spend compiling before any of its rows has been measured (the time limit's
#: estimate; afterwards the measured compiled rows' durations are used): inductor on CUDA (CUDA graphs recorded
#: too), inductor on the CPU, any other backend (e.g. ``aot_eager``: tracing only). Compile times of an H100
#: run: the ``compile_s`` of results/bench/gpu/h100-b16-16k-2026-11-26.
COMPILE_ESTIMATE_S = {"cuda": 30.0, "cpu": 20.0, "other": 5.0}
#: the length the default budgets below were chosen for (the reference workload: 16 rows x 16,384 tokens)
REFERENCE_LENGTH = 16384
#: GPU-sensible options per policy at long context (streaming: a quarter of the length, see :func:`default_options`)
GPU_OPTIONS: dict[str, dict] = {
    "snapkv": dict(budget=4096), "tidal": dict(budget=4096), "duo": dict(sparsity=0.5), "cake": dict(budget=4096),
    "chelsea": dict(ratio=0.25), "zipcache": {}, "shadowkv": dict(budget=2048), "kvzip": dict(budget=4096),
}


# ------------------------------------------------------------------------------------------- set-up


def known_rows() -> list[str]:
    from kvkit.registry import available_policies

    return list(HF_ROWS) + available_policies()


def shape_config(name: str):
    """The ``LlamaConfig`` of shape ``name`` (ValueError naming the known shapes otherwise)."""
    from transformers import LlamaConfig

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return LlamaConfig(**SHAPES[name])


def parse_rows(specs: list[str] | None) -> list[tuple[str, dict]]:
    """``["full", "streaming:budget=512,sink=4", ...]`` -> ``[(name, user options)]``, ``full`` first (added when
    missing), duplicates dropped. Unknown rows / options raise ValueError naming the known ones."""
    from kvkit.evals.common import resolve_policy_options
    from kvkit.options import parse_options

    items = [s for spec in (specs or DEFAULT_ROWS) for s in ([spec] if ":" in spec else spec.split(",")) if s.strip()]
    out: list[tuple[str, dict]] = []
    known = known_rows()
    for item in items:
        name, _, opts = item.strip().partition(":")
        name = name.strip()
        if name not in known:
            raise ValueError(f"unknown row {name!r} in --policies; known: {', '.join(known)}")
        if name in HF_ROWS:
            if opts.strip():
                raise ValueError(f"--policies {item!r}: the transformers row {name!r} takes no options")
            user = {}
        else:
            user = resolve_policy_options(name, parse_options([opts] if opts else None))
        if (name, user) not in out:
            out.append((name, user))
    if ("full", {}) not in out:
        out.insert(0, ("full", {}))
    else:
        out.remove(("full", {}))
        out.insert(0, ("full", {}))
    return out


def compiled_name(policy: str) -> str:
    """The name of ``policy``'s compiled row: ``"<policy> static+compile"``."""
    return f"{policy} {COMPILED_SUFFIX}"


def plan_rows(rows: list[tuple[str, dict]], compiled: bool = True) -> list[tuple[str, dict, bool]]:
    """The rows in run order, ``[(name, options, compiled)]``: each row of ``rows`` (:func:`parse_rows`: ``full``
    first), and with ``compiled`` each kvkit policy with a static store (:data:`kvkit.cache.STATIC_POLICIES`) followed
    at once by its compiled row (same options). The default rows thus run as full, full static+compile, hf-dynamic,
    hf-static, streaming, streaming static+compile, snapkv, snapkv static+compile, ...: the most wanted rows first
    (a time limit skips the last ones)."""
    from kvkit.cache import static_policies

    out: list[tuple[str, dict, bool]] = []
    for name, user in rows:
        out.append((name, user, False))
        if compiled and name not in HF_ROWS and name in static_policies():
            out.append((name, user, True))
    return out


def static_refusal(model, policy: str, options: dict) -> str:
    """Why ``policy`` gets no compiled row: ``KVCache.compile_refusal`` of its cache on ``model`` (its first layer
    that is not compileable and that store's reason); the error when such a cache cannot even be built."""
    from kvkit.cache import KVCache

    try:
        why = KVCache(model, policy, **options).compile_refusal
    except Exception as e:  # noqa: BLE001 -- a policy that refuses this model says so in its eager row too
        why = f"{type(e).__name__}: {e}"
    return why or "no static variant"


def compile_kwargs(mode: str | None, backend: str) -> dict:
    """``torch.compile`` keyword arguments: ``mode`` goes to inductor only (other backends take none)."""
    return dict(backend=backend, mode=mode if backend == "inductor" else None)


def compile_label(mode: str | None, backend: str) -> str:
    """What the ``compile`` field says: inductor's mode (``reduce-overhead`` = CUDA graphs), else the backend."""
    return (mode or "default") if backend == "inductor" else backend


def compile_config(cuda: bool, backend: str = "inductor"):
    """The ``CompileConfig`` of a compiled kvkit row's decode step: ``fullgraph=True``, static shapes, transformers'
    default ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, inductor's default mode on the CPU (where
    ``_compile_all_devices`` is set, as transformers wants off CUDA; ``get_compiled_call`` itself ignores it)."""
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=True, dynamic=False,
                       **compile_kwargs("reduce-overhead" if cuda else "default", backend))
    if not cuda:
        cc._compile_all_devices = True
    return cc


def compiled_read_bytes(cache) -> int:
    """K/V bytes one *compiled* single-token step reads from a static ``KVCache``: a compiled step has fixed shapes,
    so every store reads its whole buffers (``allocated_nbytes``: the capacity, free slots masked) -- as
    transformers' ``StaticCache`` reads its whole ``max_cache_len``; a store that counts its own reads (TidalDecode's
    selection; ``read_nbytes`` overridden) keeps its count; duo's two halves are summed."""
    from kvkit.stores.base import StoreMixin

    def one(store) -> int:
        parts = getattr(store, "parts", None)
        if parts:
            return sum(one(p[0]) for p in parts)
        if type(store).read_nbytes is not StoreMixin.read_nbytes:
            return int(store.read_nbytes())
        return int(store.allocated_nbytes())

    return sum(one(layer) for layer in cache.layers)


def _graph_count() -> int:
    """Graphs dynamo has compiled in this process (a rise during timed steps = a recompile)."""
    import torch

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _cudagraph_skips() -> int:
    """Times inductor fell back from CUDA graphs (``mode="reduce-overhead"`` that did not capture)."""
    import torch

    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def _reset_compiled(model) -> None:
    """Forget every compiled graph: dynamo's caches, CUDA-graph trees and the compiled ``__call__`` transformers keeps
    on the model (``get_compiled_call``), so the next compiled row compiles (and is timed compiling) afresh."""
    import torch

    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()


def default_options(policy: str, shape: str, length: int, config, seed: int = 0) -> tuple[dict, dict]:
    """``(options, label options)`` for ``policy`` on this shape and length, before the user's own.

    Real shapes: :data:`GPU_OPTIONS` (streaming keeps ``length // 4``). ``tiny``: the policy's ``test_options``
    (budgets of a few tokens) with streaming at ``length // 4``, chelsea ratio 0.25, duo sparsity 0.5. duo always
    gets a random gate pattern ``[layers, kv_heads]`` (seeded; random weights have no calibrated one), shown as
    ``pattern=random`` in labels."""
    import torch

    from kvkit.registry import policy_class

    if policy in ("full", *HF_ROWS):
        return {}, {}
    opts = dict(policy_class(policy).test_options) if shape == "tiny" else dict(GPU_OPTIONS.get(policy, {}))
    if policy == "streaming":
        opts["budget"] = max(8, length // 4)
    if shape == "tiny" and policy == "chelsea":
        opts["ratio"] = 0.25
    label = dict(opts)
    if policy == "duo":
        g = torch.Generator().manual_seed(seed)
        alpha = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=g)
        opts.update(pattern=[[round(float(a), 4) for a in r] for r in alpha], sparsity=opts.get("sparsity", 0.5))
        label.update(pattern=f"random(seed {seed})", sparsity=opts["sparsity"])
    return opts, label


def build_model(shape: str, device, dtype, seed: int = 0):
    """Random-weight ``LlamaForCausalLM`` of ``shape`` built on ``device`` in ``dtype``, eval mode, sdpa attention."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = shape_config(shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def weight_read_bytes(model) -> int:
    """Parameter bytes one decode step reads: every tensor once (tied tensors once); the input embedding table
    is left out unless it is tied to the output head (a step then reads it whole as the head)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key in seen or (p is emb and not tied):
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total


def byte_bound_ms(weights: int, kv_read: int, bandwidth: float) -> float:
    """Milliseconds to move ``weights + kv_read`` bytes at ``bandwidth`` bytes/s (the step's byte floor)."""
    return (weights + kv_read) / bandwidth * 1e3


def fraction_to_bound(t_full: float | None, t_row: float | None, t_bound: float | None) -> float | None:
    """``(t_full - t_row) / (t_full - t_bound)``, not clamped: 1 = the row runs at its byte bound, 0 = as fast as
    kvkit ``full``, < 0 = slower than ``full``; None when a time is missing or ``t_full <= t_bound``."""
    if t_full is None or t_row is None or t_bound is None or t_full <= t_bound:
        return None
    return (t_full - t_row) / (t_full - t_bound)


def measure_bandwidth(device, nbytes: int | None = None, reps: int = 10) -> dict:
    """Copy bandwidth of ``device``: a ``nbytes`` buffer copied ``reps`` times after a warm-up, (bytes read +
    bytes written) / median copy time. Default size: 1 GiB on CUDA (less when memory is short), 64 MiB on the CPU."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if nbytes is None:
        nbytes = 64 << 20
        if cuda:
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            nbytes = int(min(1 << 30, free // 8)) // 4096 * 4096
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = statistics.median(_time_block(lambda: dst.copy_(src), reps, cuda))
    return dict(bandwidth=2 * nbytes / t, copy_bytes=nbytes, copy_ms=round(t * 1e3, 4), reps=reps)


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _time_block(step, n: int, cuda: bool) -> list[float]:
    """Run ``step`` ``n`` times; seconds of each (CUDA events around each step, one synchronisation before and
    after the block; on the CPU ``perf_counter``)."""
    import torch

    _sync(cuda)
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            step()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in ev]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def _pct(xs: list[float], q: float) -> float:
    """``q``-quantile (linear interpolation) of ``xs``."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _free(cuda: bool) -> None:
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- rows


class _StepWatch(HostSyncCounter):
    """:class:`HostSyncCounter` that also records the fused attention ops dispatched (which sdpa backend ran)."""

    ATTN = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")

    def __init__(self):
        super().__init__()
        self.attn_ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from kvkit.hostsync import _is_sync

        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if any(a in name for a in self.ATTN):
            self.attn_ops[name.lstrip("_")] += 1
        if _is_sync(func, args, kwargs):
            self.calls.append((str(func), _watch_caller()))
        return func(*args, **kwargs)


def _watch_caller() -> str:
    """file:line of the innermost frame outside torch and the counters (as :func:`kvkit.hostsync._caller`)."""
    import traceback

    for fr in reversed(traceback.extract_stack()[:-1]):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith("hostsync.py") or fr.name in ("__torch_dispatch__", "_watch_caller"):
            continue
        return f"{f.split('/site-packages/')[-1].split('/work/main/')[-1]}:{fr.lineno}"
    return "?"


class _Row:
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
        from kvkit.compat import cache_kw

        fwd = self.model if self.fn is None else self.fn
        return fwd(input_ids=ids, **cache_kw(self.cache), use_cache=True, **kw)

    def prefill(self, ids, chunk: int) -> None:
        """Feed ``ids [B, L]`` in chunks of ``chunk`` tokens; keep the greedy next token."""
        import torch

        with torch.no_grad(), self.active():
            last = None
            for s in range(0, ids.shape[1], chunk):
                last = self._forward(ids[:, s:s + chunk], logits_to_keep=1).logits[:, -1]
            self.nxt = last.argmax(-1, keepdim=True)

    def step(self) -> None:
        import torch

        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            self.nxt = self._forward(self.nxt).logits[:, -1].argmax(-1, keepdim=True)

    def count_step(self) -> _StepWatch:
        with self.active(), _StepWatch() as w:
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


class _HFDynamic(_Row):
    prefill_how = "chunks of {chunk} tokens x {batch} rows per forward into transformers' DynamicCache"

    def prefill(self, ids, chunk):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        super().prefill(ids, chunk)


class _HFStatic(_Row):
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
        import torch
        from transformers import StaticCache

        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        super().prefill(ids, chunk)
        self.fn = self.model.forward
        if self.compiles:
            self.fn = torch.compile(self.model.forward, fullgraph=True, **compile_kwargs(self.mode, self.backend))

    def count_step(self) -> _StepWatch:
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
            _reset_compiled(self.model)


class _Kvkit(_Row):
    prefill_how = "kvkit.prefill: chunks of {chunk} tokens x {batch} rows per forward"

    @contextlib.contextmanager
    def active(self):
        import kvkit

        kvkit.patch(self.model, self.policy, **self.options)
        try:
            yield
        finally:
            kvkit.unpatch(self.model)

    def prefill(self, ids, chunk):
        import torch

        import kvkit

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


class _KvkitCompiled(_Kvkit):
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
        import torch

        import kvkit

        kvkit.patch(self.model, self.policy, static=True, max_length=self.max_length, **self.options)
        with torch.no_grad():
            self.cache, last = kvkit.prefill(self.model, ids, chunk_size=chunk)
            self.cache.ensure_capacity(self.max_length)  # no compiled step may need to grow a buffer
            self.nxt = last.argmax(-1, keepdim=True)
        _reset_compiled(self.model)  # compiled afresh by this row's first step (timed as its compile)
        self.fn = self.model.get_compiled_call(self.config)

    def count_step(self) -> _StepWatch | None:
        """One more compiled step, its eager work counted: the step wrapper's (compression events, host copies),
        the argmax. A dispatch mode stops ``torch.compile`` from running compiled code at all ("non-infra torch
        dispatch mode present"), so the compiled call itself runs with the counter paused: it is one graph
        (``fullgraph=True``), whose kernels no dispatch mode sees anyway. None (not counted) when
        ``model.get_compiled_call`` is not kvkit's ``partial(_compiled_step, model_ref, compiled)``."""
        import functools

        from torch.utils._python_dispatch import _disable_current_modes

        fn = self.fn
        if not (isinstance(fn, functools.partial) and len(fn.args) == 2 and callable(fn.args[1])):
            return None
        compiled = fn.args[1]

        def paused(*a, **k):
            with _disable_current_modes():
                return compiled(*a, **k)

        self.fn = functools.partial(fn.func, fn.args[0], paused, **fn.keywords)
        try:
            with _StepWatch() as w:
                self.step()
        finally:
            self.fn = fn
        return w

    def attention(self, ops: Counter) -> str:
        return super().attention(ops) + " (one compiled graph)"

    def kv_read(self) -> int:
        return compiled_read_bytes(self.cache)

    def close(self) -> None:
        import kvkit

        super().close()
        self.fn = None
        if kvkit.patched_policy(self.model) is not None:
            kvkit.unpatch(self.model)
        _reset_compiled(self.model)


# ------------------------------------------------------------------------------------------- the run


class Bench:
    """One shaped-model run: every row of ``rows`` at batch ``batch`` and ``length`` tokens (see the module
    docstring). ``run()`` returns the row dicts; ``on_row(rows)`` is called after each row."""

    def __init__(self, shape: str, device: str, dtype, rows: list[tuple[str, dict]], batch: int, length: int,
                 steps: int = 20, warmup: int = 3, rounds: int = 3, prefill_chunk: int | None = None,
                 compile_mode: str | None = "auto", interleave: bool = True, time_limit: float = 420.0,
                 seed: int = 0, t0: float | None = None, model=None, log=None, on_row=None, compiled: bool = True,
                 compile_backend: str = "inductor", compile_estimate: float | None = None):
        import torch

        for v, what in ((batch, "--batch"), (length, "--lengths"), (steps, "--steps"), (rounds, "--rounds")):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"--warmup must be an integer >= 0, got {warmup!r}")
        self.config = shape_config(shape)
        self.shape, self.device, self.rows_spec = shape, torch.device(device), rows
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype
        self.batch, self.length, self.steps, self.warmup, self.rounds = batch, length, steps, warmup, min(rounds, steps)
        self.chunk = prefill_chunk or min(length, max(256, 16384 // batch))
        if compile_mode == "auto":
            compile_mode = "reduce-overhead" if self.cuda else "default"
        self.compile_mode = compile_mode  # hf-static's (None: eager)
        self.compiled = compiled  # the kvkit static+compile rows
        self.compile_backend = compile_backend
        if compile_estimate is None:
            compile_estimate = COMPILE_ESTIMATE_S["other" if compile_backend != "inductor"
                                                  else "cuda" if self.cuda else "cpu"]
        self.compile_estimate = compile_estimate
        self.plan = plan_rows(rows, compiled)
        self.interleave_wanted = interleave
        self.time_limit, self.seed = time_limit, seed
        self.t0 = time.perf_counter() if t0 is None else t0
        self.row_cap = max(5.0, time_limit / 20)
        self.model = model
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.on_row = on_row
        limit = self.config.max_position_embeddings
        if length + self._extra() > limit:
            raise ValueError(f"--lengths {length} + {self._extra()} decode steps exceed the shape's "
                             f"max_position_embeddings {limit}")
        self.info: dict = {}

    def _extra(self) -> int:
        return self.warmup + 3 + self.steps + 8  # decode steps any row may take (warm-up, timed, counted) + slack

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # -- set-up -----------------------------------------------------------------------------------------------
    def setup(self) -> dict:
        import torch

        if self.model is None:
            self.log(f"building {self.shape} (random weights) on {self.device} in {self.dtype} ...")
            self.model = build_model(self.shape, self.device, self.dtype, self.seed)
        g = torch.Generator().manual_seed(self.seed)
        self.ids = torch.randint(0, self.config.vocab_size, (self.batch, self.length), generator=g).to(self.device)
        self.weights = weight_read_bytes(self.model)
        bw = measure_bandwidth(self.device)
        self.bandwidth = bw["bandwidth"]
        self.info = dict(weights_read_bytes=self.weights, param_bytes=sum(p.numel() * p.element_size()
                                                                           for p in self.model.parameters()),
                         bandwidth_bytes_s=self.bandwidth, bandwidth_copy=bw, prefill_chunk=self.chunk,
                         compile_mode=self.compile_mode, compiled_rows=self.compiled,
                         compile_backend=self.compile_backend,
                         compiled_mode=compile_label(compile_config(self.cuda, self.compile_backend).mode,
                                                     self.compile_backend),
                         compile_estimate_s=self.compile_estimate)
        self.log(f"weights read/step {_mib(self.weights)}; copy bandwidth {self.bandwidth / 1e9:.1f} GB/s "
                 f"(read + write); prefill in chunks of {self.chunk} tokens x {self.batch} rows")
        return self.info

    def _make(self, name: str, user: dict, compiled: bool = False) -> _Row:
        opts, label = default_options(name, self.shape, self.length, self.config, self.seed)
        opts.update(user)
        label.update(user)
        if name == "hf-dynamic":
            return _HFDynamic(self.model, name, {}, {})
        if name == "hf-static":
            return _HFStatic(self.model, name, {}, {}, self.length + self._extra(), self.compile_mode,
                             self.compile_backend)
        if compiled:
            return _KvkitCompiled(self.model, name, opts, label, self.length + self._extra(), self.cuda,
                                  self.compile_backend)
        return _Kvkit(self.model, name, opts, label)

    def refusals(self) -> dict[str, str]:
        """``{row label: reason}`` of the kvkit rows whose policy has no static store (no compiled row), the reason
        being ``KVCache.compile_refusal`` (empty when compiled rows are off)."""
        from kvkit.cache import static_policies

        if not self.compiled:
            return {}
        out = {}
        for name, user, _ in self.plan:
            if name in HF_ROWS or name in static_policies():
                continue
            opts, label = default_options(name, self.shape, self.length, self.config, self.seed)
            opts.update(user)
            label.update(user)
            out[_Row(self.model, name, opts, label).label] = static_refusal(self.model, name, opts)
        return out

    # -- one row ----------------------------------------------------------------------------------------------
    def _measure(self, row: _Row, ref: _Row | None) -> dict:
        import torch

        res = self._head(row)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        row.prefill(self.ids, self.chunk)
        _sync(self.cuda)
        res["prefill_s"] = round(time.perf_counter() - t, 3)
        res["prefill"] = row.prefill_how.format(chunk=self.chunk, batch=self.batch)
        if self.chunk >= self.length:
            res["prefill"] += " (one forward)"
        # warm-up: a compiled row's first step compiles, under CUDA graphs the next two warm the cudagraph tree up
        # and record it; those are its compile time (never a timed step), the other warm-up steps follow
        first = 1 + (2 if row.cudagraphs else 0) if row.compiles else 1
        warm = max(self.warmup + (2 if row.cudagraphs else 0), first if row.compiles else 0)
        g0, skips0 = _graph_count(), _cudagraph_skips()
        with row.active():
            t = time.perf_counter()
            if warm:
                row.step()
                _sync(self.cuda)
            res["first_step_s"] = round(time.perf_counter() - t, 3)  # includes the compile of a compiled row
            if row.compiles:
                t = time.perf_counter()
                for _ in range(first - 1):
                    row.step()
                _sync(self.cuda)
                if row.cudagraphs:
                    res["cudagraph_record_s"] = round(time.perf_counter() - t, 3)
                res["compile_s"] = round(res["first_step_s"] + res.get("cudagraph_record_s", 0.0), 3)
                res["graphs_compiled"] = _graph_count() - g0
            for _ in range(max(0, warm - (first if row.compiles else 1))):
                row.step()
        _sync(self.cuda)
        g1 = _graph_count()
        times, paired = [], []
        interleave = ref is not None and ref is not row and row.interleave
        per_round = [self.steps // self.rounds + (i < self.steps % self.rounds) for i in range(self.rounds)]
        t_timed = time.perf_counter()
        for k in per_round:
            with row.active():
                times += _time_block(row.step, k, self.cuda)
            if interleave:
                with ref.active():
                    paired += _time_block(ref.step, k, self.cuda)
            if time.perf_counter() - t_timed > self.row_cap and len(times) >= 3:
                res["note"] = f"timing stopped after {len(times)} steps (per-row cap {self.row_cap:.0f} s)"
                break
        res.update(self._stats(times, "step"))
        if paired:
            res["full_ms_paired"] = round(statistics.median(paired) * 1e3, 4)
        res.update(kv_held=row.kv_held(), kv_read_step=row.kv_read(), kv_offloaded=row.kv_offloaded())
        w = row.count_step()
        if w is None:
            w = _StepWatch()
            res["syncs_note"] = "not counted: model.get_compiled_call is not kvkit's step wrapper"
            res.update(syncs_per_step=None, sync_sites={}, attn_ops={})
        else:
            res.update(syncs_per_step=w.count, sync_sites=dict(w.where().most_common(8)), attn_ops=dict(w.attn_ops))
        ops = ",".join(sorted(w.attn_ops)) or ("ops inside the graph not seen" if isinstance(row, _KvkitCompiled)
                                                else "no fused sdpa op")
        res["attention"] = f"{row.attention(w.attn_ops)} [{ops}]"
        res["compile"] = row.compile_mode
        if row.compiles:
            res["kv_allocated"] = int(sum(layer.allocated_nbytes() for layer in row.cache.layers)) \
                if row.name != "hf-static" else res["kv_held"]
            res["recompiles"] = _graph_count() - g1  # graphs compiled during the timed and the counted steps
            res["cudagraph_skips"] = _cudagraph_skips() - skips0
            notes = [res["note"]] if res.get("note") else []
            if res["recompiles"]:
                notes.append(f"{res['recompiles']} recompile(s) after warm-up")
            if row.cudagraphs and res["cudagraph_skips"]:
                notes.append("CUDA graphs skipped by inductor (see the log)")
            if notes:
                res["note"] = "; ".join(notes)
        if self.cuda:
            res["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
        return res

    @staticmethod
    def _stats(times: list[float], key: str) -> dict:
        ms = [x * 1e3 for x in times]
        return {f"{key}_ms": round(statistics.median(ms), 4), f"{key}_ms_p10": round(_pct(ms, 0.1), 4),
                f"{key}_ms_p90": round(_pct(ms, 0.9), 4), f"{key}_ms_mean": round(sum(ms) / len(ms), 4),
                "steps": len(ms)}

    def _head(self, row: _Row) -> dict:
        return dict(row=row.label, name=row.name, policy=row.policy, compiled=isinstance(row, _KvkitCompiled),
                    options=row.label_options, batch=self.batch, length=self.length)

    def _finish(self, rows: list[dict]) -> None:
        """Byte bound, speed-up and fraction of every measured row, against kvkit ``full`` (eager) and against
        ``full static+compile`` (when measured)."""
        full = next((r for r in rows if r["name"] == "full" and r.get("status") == "ok"), None)
        fullc = next((r for r in rows if r["name"] == compiled_name("full") and r.get("status") == "ok"), None)
        for r in rows:
            if r.get("status") != "ok":
                continue
            r["weights_bytes"] = self.weights
            r["bandwidth_bytes_s"] = round(self.bandwidth)
            r["byte_bound_ms"] = _sig(byte_bound_ms(self.weights, r["kv_read_step"], self.bandwidth), 5)
            t_full = r.get("full_ms_paired") or (full["step_ms"] if full else None)
            r["t_full_ms"] = t_full
            r["speedup_vs_full"] = _sig(t_full / r["step_ms"]) if t_full else None
            f = fraction_to_bound(t_full, r["step_ms"], r["byte_bound_ms"])
            r["fraction_to_bound"] = None if f is None else _sig(f)
            t_fc = fullc["step_ms"] if fullc else None
            r["t_full_compiled_ms"] = t_fc
            r["speedup_vs_full_compiled"] = _sig(t_fc / r["step_ms"]) if t_fc else None
            f = fraction_to_bound(t_fc, r["step_ms"], r["byte_bound_ms"])
            r["fraction_to_bound_vs_full_compiled"] = None if f is None else _sig(f)

    # -- all rows ---------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        import torch

        if self.model is None or not self.info:
            self.setup()
        rows: list[dict] = []
        ref: _Row | None = None
        durations: list[float] = []  # of the eager rows
        compiled_durations: list[float] = []  # of the rows that compiled (compile time included)
        refusals = self.refusals()
        self.info["no_static_store"] = refusals
        full_bytes = 2 * self.config.num_hidden_layers * self.config.num_key_value_heads * self.config.head_dim * \
            self.batch * (self.length + self._extra()) * torch.empty((), dtype=self.dtype).element_size()
        interleave = self.interleave_wanted
        if interleave and self.cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.weights + 3.5 * full_bytes > 0.85 * total:  # reference + a full-size row + its prefill
                interleave = False
                self.info["interleave_note"] = "off: the full cache kept alive would not leave room for another"
        self.info["interleave"] = interleave
        for name, user, compiled in self.plan:
            row = self._make(name, user, compiled)
            el = self.elapsed()
            est = self._estimate(row.compiles, durations, compiled_durations)
            if el > self.time_limit or (est and el + est > self.time_limit):
                res = self._head(row)
                res.update(status="skipped",
                           error=f"skipped: time limit {self.time_limit:.0f} s (elapsed {el:.0f} s, this row takes "
                                 f"~{est:.0f} s{', its compile included' if row.compiles else ''})")
                if row.label in refusals:
                    res["compile_refusal"] = refusals[row.label]
                rows.append(res)
                self.log(f"[{el:6.1f}s] {row.label}: skipped (time limit)")
                self._emit(rows)
                continue
            self.log(f"[{el:6.1f}s] {row.label} ...")
            t = time.perf_counter()
            try:
                res = self._measure(row, ref)
                res["status"] = "ok"
            except Exception as e:  # noqa: BLE001 -- an OOM / a policy error is a row, not the end of the run
                msg = f"{type(e).__name__}: {e}".replace("\n", " ")
                res = self._head(row)
                res.update(status="error", error=msg[:500])
                with contextlib.suppress(Exception):
                    import kvkit

                    if kvkit.patched_policy(self.model) is not None:
                        kvkit.unpatch(self.model)
            if row.label in refusals:
                res["compile_refusal"] = refusals[row.label]
            res["row_s"] = round(time.perf_counter() - t, 2)
            (compiled_durations if row.compiles else durations).append(res["row_s"])
            rows.append(res)
            self.log(f"[{self.elapsed():6.1f}s] {row.label}: " + (
                f"{res['step_ms']:.3f} ms/step" + (f" (compile {res['compile_s']:.1f} s)" if "compile_s" in res
                                                   else "") if res["status"] == "ok" else res["error"][:200]))
            if row.name == "full" and res["status"] == "ok" and interleave:
                ref = row  # kept alive: the interleaved reference of every later row
            else:
                row.close()
            del row
            _free(self.cuda)
            self._finish(rows)
            self._emit(rows)
        if ref is not None:
            ref.close()
        _free(self.cuda)
        self.info["elapsed_s"] = round(self.elapsed(), 1)
        return rows

    def _estimate(self, compiles: bool, eager: list[float], compiled: list[float]) -> float:
        """Seconds the next row is expected to take (0: no estimate yet): the median eager row; a compiling row:
        the median compiling row measured so far, else the median eager row + :attr:`compile_estimate`."""
        e = statistics.median(eager) if eager else 0.0
        if not compiles:
            return e
        return statistics.median(compiled) if compiled else e + self.compile_estimate

    def _emit(self, rows):
        if self.on_row is not None:
            self.on_row(rows)


# ------------------------------------------------------------------------------------------- output


def _mib(n) -> str | None:
    from kvkit.options import fmt_bytes

    return None if n is None else fmt_bytes(n)


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    header = ["row", "attention / compile", "prefill s", "compile s", "step ms (p10-p90)", "KV held", "KV read/step",
              "weights", "byte bound ms", "speed-up vs full", "fraction to bound", "vs full compiled",
              "fraction (vs full compiled)", "syncs/step", "status"]
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append([r["row"]] + [None] * (len(header) - 2) + [r.get("error")])
            continue
        out.append([r["row"], f"{r['attention']} / {r['compile']}", r["prefill_s"], r.get("compile_s"),
                    f"{r['step_ms']:.3f} ({r['step_ms_p10']:.3f}-{r['step_ms_p90']:.3f})", _mib(r["kv_held"]),
                    _mib(r["kv_read_step"]), _mib(r["weights_bytes"]), f"{r['byte_bound_ms']:.4g}",
                    r["speedup_vs_full"], r["fraction_to_bound"], r.get("speedup_vs_full_compiled"),
                    r.get("fraction_to_bound_vs_full_compiled"), r["syncs_per_step"], r.get("note") or "ok"])
    return header, out


def compiled_summary(config: dict, rows: list[dict]) -> str:
    """The summary's first line: which rows ran compiled (and their compile time), which kvkit rows could not
    (no static store: ``KVCache.compile_refusal``), or that the compiled kvkit rows were off."""
    parts = []
    for r in rows:
        if not (r.get("compiled") or (r["name"] == "hf-static" and config.get("compile_mode") is not None)):
            continue
        what = "torch.compile(model.forward)" if r["name"] == "hf-static" else "model.get_compiled_call"
        if r.get("status") == "ok":
            parts.append(f"{r['row']} ({what}, {r['compile']}, compile {r.get('compile_s', 0):.1f} s)")
        else:
            parts.append(f"{r['row']} ({r.get('status')})")
    line = "Compiled rows: " + ("; ".join(parts) if parts else "none") + "."
    if not config.get("compiled_rows", True):
        line += " kvkit static+compile rows: off (--no-compiled)."
    else:
        line += (" Compile time (first compiled call + CUDA-graph warm-up/recording) is in `compile s`, never in "
                 "step ms.")
        refused = config.get("no_static_store") or {}
        if refused:
            line += " No static store, so no compiled row: " + "; ".join(
                f"{k} ({v})" for k, v in refused.items()) + "."
    return line


def summary_md(config: dict, rows: list[dict]) -> str:
    from kvkit.evals.report import markdown_table

    h, t = table(rows)
    bw = config.get("bandwidth_bytes_s")
    lines = [f"# kvkit bench --shape {config['shape']} - {config['batch']} x {config['length']} tokens - "
             f"{config['device_name']}", "", compiled_summary(config, rows), "",
             f"Random weights, {config['dtype']}; one decode step (B x 1 token) timed: median of the timed steps "
             f"(p10-p90) after {config['warmup']} warm-up steps; interleaved with kvkit full: "
             f"{config.get('interleave')}. Prefill: chunks of {config.get('prefill_chunk')} tokens x "
             f"{config['batch']} rows per forward (kvkit.prefill for kvkit rows).",
             f"Copy bandwidth {bw / 1e9:.1f} GB/s (read + write, measured in this run); "
             f"weights read/step {_mib(config.get('weights_read_bytes', 0))}; kvkit kernels: "
             f"{config.get('kvkit_kernels')}; torch {config.get('torch')}, transformers {config.get('transformers')}."
             if bw else "",
             "byte bound = (weights + KV read/step) / bandwidth; speed-up = t_full / t_row; fraction = "
             "(t_full - t_row) / (t_full - byte bound of the row), not clamped (1: at its byte bound, 0: as fast as "
             "kvkit full, < 0: slower); t_full = kvkit full's steps interleaved with the row (else its own median). "
             "vs full compiled / fraction (vs full compiled): the same with t_full = kvkit full static+compile's "
             "median. A compiled row's KV read/step is its whole static buffers (a compiled step has fixed shapes); "
             "its syncs/step count the eager work around its compiled graph (kvkit's step wrapper, the argmax).",
             "", markdown_table(h, t),
             f"Command: `{config.get('command') or '(called from Python: kvkit.cli.main)'}`", ""]
    return "\n".join(lines)


def _git() -> tuple[str | None, list | None]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=here).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvkit"], capture_output=True, text=True,
                               timeout=10, cwd=here).stdout.split("\n") if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    commit = commit or env.git_commit()
    return commit, None if dirty is None else [x.strip() for x in dirty if x.strip()]


def device_name(device) -> str:
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def environment(device) -> dict:
    import torch
    import transformers

    import kvkit
    from kvkit.kernels import backend

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    commit, dirty = _git()
    env = dict(torch=torch.__version__, transformers=transformers.__version__, triton=triton_v,
               kvkit=kvkit.__version__, python=platform.python_version(), device_name=device_name(device),
               git_commit=commit, git_dirty_kvkit=dirty, kvkit_kernels=backend(device),
               threads=torch.get_num_threads())
    if torch.device(device).type == "cuda":
        b = torch.backends.cuda
        env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   sdpa_enabled=dict(cudnn=b.cudnn_sdp_enabled(), flash=b.flash_sdp_enabled(),
                                     mem_efficient=b.mem_efficient_sdp_enabled(), math=b.math_sdp_enabled()),
                   total_memory=torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return env


def write(out: Path, config: dict, rows: list[dict]) -> str:
    from kvkit.evals.common import atomic_write_json, atomic_write_jsonl, atomic_write_text

    atomic_write_json(out / "config.json", config)
    atomic_write_jsonl(out / "rows.jsonl", rows)
    md = summary_md(config, rows)
    atomic_write_text(out / "summary.md", md)
    return md


def run_cli(args, command: str = "") -> int:
    """``kvkit bench --shape NAME ...`` (called by :func:`kvkit.evals.cli.cmd_bench`)."""
    import torch

    t0 = time.perf_counter()
    shape_config(args.shape)  # unknown shape: clear error before anything runs
    for flag, bad in (("--add", args.add), ("--budget", args.budget is not None), ("--opt", args.opt),
                      ("--policy-options", args.policy_options), ("--policy", args.policy != "full"),
                      ("--memory", args.memory is not None), ("--profile", args.profile),
                      ("--prefill-cache", args.prefill_cache), ("--model", args.model != "default")):
        if bad:
            raise ValueError(f"{flag} does not apply to --shape (random weights of a named shape); give the rows "
                             "and their options with --policies ROW[:KEY=VALUE,...] ...")
    rows_spec = parse_rows(args.policies)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype_name!r}")
    lengths = [int(x) for x in (args.lengths or str(REFERENCE_LENGTH)).split(",") if x.strip()]
    batch = args.batch or (16 if args.shape != "tiny" else 2)
    if args.threads:
        torch.set_num_threads(int(str(args.threads).split(",")[0]))
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    steps = 20 if args.steps is None else args.steps
    env = environment(device)
    model = None
    for L in lengths:
        label = f"{args.shape}-b{batch}-{L}"
        out = Path(args.out) / (label if len(lengths) > 1 else "") if args.out else Path("results/bench/gpu") / label
        bench = Bench(args.shape, str(device), dtype, rows_spec, batch, L, steps=steps,
                      warmup=args.warmup, rounds=args.rounds, prefill_chunk=args.prefill_chunk,
                      compile_mode=None if args.no_compile else "auto", interleave=not args.no_interleave,
                      time_limit=args.time_limit, seed=args.seed, t0=t0, model=model,
                      compiled=getattr(args, "compiled", True),
                      compile_backend=getattr(args, "compile_backend", None) or "inductor")
        config = dict(benchmark="bench --shape", command=command, shape=args.shape, shape_config=SHAPES[args.shape],
                      batch=batch, length=L, dtype=dtype_name, device=str(device), steps=steps,
                      warmup=args.warmup, rounds=bench.rounds, time_limit_s=args.time_limit, seed=args.seed,
                      no_cudnn_sdpa=bool(args.no_cudnn_sdpa),
                      rows_requested=[[n, o] for n, o in rows_spec],
                      rows_planned=[compiled_name(n) if c else n for n, _, c in bench.plan], **env)
        config.update(bench.setup())
        def on_row(rows, o=out, c=config, b=bench):
            c.update(b.info)  # what the run learnt so far (e.g. the policies without a static store)
            write(o, c, rows)

        bench.on_row = on_row
        rows = bench.run()
        config.update(bench.info)
        md = write(out, config, rows)
        print(md, flush=True)
        print(f"wrote {out}/config.json, rows.jsonl, summary.md", file=sys.stderr)
        model = bench.model
    return 0
