"""One shaped-model bench run (:class:`Bench`): every planned row at one batch and length, measured in turn.

Set-up (:meth:`Bench.setup`): the random-weight model (:func:`~kvkit.evals.gpu.shapes.build_model`), ``B`` rows of
``L`` random token ids (seeded), the weights a step reads and the copy bandwidth.

A row (:meth:`Bench._measure`): its prefill (all ``B`` rows together, in chunks of ``C`` tokens per forward,
``--prefill-chunk``; default ``min(L, max(256, 16384 // B))``), then ``--warmup`` untimed steps, then ``--steps``
timed steps in ``--rounds`` rounds. With interleaving (the default where memory allows) the kvkit ``full`` cache
stays alive and decodes as many steps right after each round of a row, so each row is compared with ``full`` steps
taken under the same conditions. A row whose timed steps pass a per-row cap (``max(5 s, time limit / 20)``) stops
early (at least 3 steps). Then one more step counted by a :class:`~kvkit.evals.gpu.timing.StepWatch` (host
synchronisations, the fused attention ops).

Compiled rows: their first step compiles (dynamo + the backend), and under CUDA graphs the next two warm the
cudagraph tree up and record it; those steps are the row's ``compile_s`` (``cudagraph_record_s`` the recording
part), never timed steps; the other warm-up steps follow. ``graphs_compiled``: dynamo graphs compiled in the
warm-up; ``recompiles``: graphs compiled during the timed and counted steps (should be 0; noted otherwise);
``cudagraph_skips``: inductor's CUDA-graph fall-backs (noted).

A row that fails (out of memory, an error) is a row with the error message; memory is freed between rows. After the
time limit (counted from the start of the command) the remaining rows are skipped and marked so; a row is also
skipped when its expected duration would carry it past the limit (:meth:`Bench._estimate`: the median eager row so
far; a compiling row: the median compiling row so far, else the median eager row + the compile estimate,
:data:`~kvkit.evals.gpu.compiled.COMPILE_ESTIMATE_S` -- compile time counts against the limit). ``on_row(rows)`` is
called after every row (the files are rewritten then).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

import kvkit
from kvkit.cache import static_policies
from kvkit.evals.gpu.bound import add_ratios, weight_read_bytes
from kvkit.evals.gpu.compiled import (
    COMPILE_ESTIMATE_S,
    compile_config,
    compile_label,
    cudagraph_skips,
    graph_count,
)
from kvkit.evals.gpu.kvkit_rows import KvkitCompiled, KvkitRow
from kvkit.evals.gpu.plan import HF_ROWS, default_options, plan_rows, static_refusal
from kvkit.evals.gpu.report import mib
from kvkit.evals.gpu.rows import HFDynamic, HFStatic, Row
from kvkit.evals.gpu.shapes import build_model, shape_config
from kvkit.evals.gpu.timing import StepWatch, free_memory, measure_bandwidth, step_stats, sync, time_block
from kvkit.registry import policy_class


class Bench:
    """One shaped-model run: every row of ``rows`` at batch ``batch`` and ``length`` tokens (see the module
    docstring). ``run()`` returns the row dicts; ``on_row(rows)`` is called after each row."""

    def __init__(self, shape: str, device: str, dtype, rows: list[tuple[str, dict]], batch: int, length: int,
                 steps: int = 20, warmup: int = 3, rounds: int = 3, prefill_chunk: int | None = None,
                 compile_mode: str | None = "auto", interleave: bool = True, time_limit: float = 420.0,
                 seed: int = 0, t0: float | None = None, model=None, log=None, on_row=None, compiled: bool = True,
                 compile_backend: str = "inductor", compile_estimate: float | None = None):
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
        self.log(f"weights read/step {mib(self.weights)}; copy bandwidth {self.bandwidth / 1e9:.1f} GB/s "
                 f"(read + write); prefill in chunks of {self.chunk} tokens x {self.batch} rows")
        return self.info

    def _make(self, name: str, user: dict, compiled: bool = False) -> Row:
        opts, label = default_options(name, self.shape, self.length, self.config, self.seed)
        opts.update(user)
        label.update(user)
        if name == "hf-dynamic":
            return HFDynamic(self.model, name, {}, {})
        if name == "hf-static":
            return HFStatic(self.model, name, {}, {}, self.length + self._extra(), self.compile_mode,
                            self.compile_backend)
        if compiled:  # what a static cache needs (shadowkv: values on the device), unless the user said otherwise
            need = {k: v for k, v in policy_class(name).static_options.items() if k not in user}
            opts.update(need)
            label.update(need)
            return KvkitCompiled(self.model, name, opts, label, self.length + self._extra(), self.cuda,
                                 self.compile_backend)
        return KvkitRow(self.model, name, opts, label)

    def refusals(self) -> dict[str, str]:
        """``{row label: reason}`` of the kvkit rows whose policy has no static store (no compiled row), the reason
        being ``KVCache.compile_refusal`` (empty when compiled rows are off)."""
        if not self.compiled:
            return {}
        out = {}
        for name, user, _ in self.plan:
            if name in HF_ROWS or name in static_policies():
                continue
            opts, label = default_options(name, self.shape, self.length, self.config, self.seed)
            opts.update(user)
            label.update(user)
            out[Row(self.model, name, opts, label).label] = static_refusal(self.model, name, opts)
        return out

    # -- one row ----------------------------------------------------------------------------------------------
    def _measure(self, row: Row, ref: Row | None) -> dict:
        res = self._head(row)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._prefill(row, res)
        g0, skips0 = graph_count(), cudagraph_skips()
        self._warm_up(row, res, g0)
        g1 = graph_count()
        self._time(row, ref, res)
        res.update(kv_held=row.kv_held(), kv_read_step=row.kv_read(), kv_offloaded=row.kv_offloaded())
        self._count(row, res)
        if row.compiles:
            self._compiled_fields(row, res, g1, skips0)
        if self.cuda:
            res["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
        return res

    def _prefill(self, row: Row, res: dict) -> None:
        t = time.perf_counter()
        row.prefill(self.ids, self.chunk)
        sync(self.cuda)
        res["prefill_s"] = round(time.perf_counter() - t, 3)
        res["prefill"] = row.prefill_how.format(chunk=self.chunk, batch=self.batch)
        if self.chunk >= self.length:
            res["prefill"] += " (one forward)"

    def _warm_up(self, row: Row, res: dict, g0: int) -> None:
        """The untimed steps: a compiled row's first step compiles, under CUDA graphs the next two warm the
        cudagraph tree up and record it; those are its compile time (never a timed step), the other warm-up steps
        follow."""
        first = 1 + (2 if row.cudagraphs else 0) if row.compiles else 1
        warm = max(self.warmup + (2 if row.cudagraphs else 0), first if row.compiles else 0)
        with row.active():
            t = time.perf_counter()
            if warm:
                row.step()
                sync(self.cuda)
            res["first_step_s"] = round(time.perf_counter() - t, 3)  # includes the compile of a compiled row
            if row.compiles:
                t = time.perf_counter()
                for _ in range(first - 1):
                    row.step()
                sync(self.cuda)
                if row.cudagraphs:
                    res["cudagraph_record_s"] = round(time.perf_counter() - t, 3)
                res["compile_s"] = round(res["first_step_s"] + res.get("cudagraph_record_s", 0.0), 3)
                res["graphs_compiled"] = graph_count() - g0
            for _ in range(max(0, warm - (first if row.compiles else 1))):
                row.step()
        sync(self.cuda)

    def _time(self, row: Row, ref: Row | None, res: dict) -> None:
        """The timed steps, in rounds; with ``ref`` (kvkit ``full``, kept alive) as many of its steps after each."""
        times, paired = [], []
        interleave = ref is not None and ref is not row and row.interleave
        per_round = [self.steps // self.rounds + (i < self.steps % self.rounds) for i in range(self.rounds)]
        t_timed = time.perf_counter()
        for k in per_round:
            with row.active():
                times += time_block(row.step, k, self.cuda)
            if interleave:
                with ref.active():
                    paired += time_block(ref.step, k, self.cuda)
            if time.perf_counter() - t_timed > self.row_cap and len(times) >= 3:
                res["note"] = f"timing stopped after {len(times)} steps (per-row cap {self.row_cap:.0f} s)"
                break
        res.update(step_stats(times, "step"))
        if paired:
            res["full_ms_paired"] = round(statistics.median(paired) * 1e3, 4)

    def _count(self, row: Row, res: dict) -> None:
        """One more step under a :class:`StepWatch`: its host synchronisations and the attention that ran."""
        w = row.count_step()
        if w is None:
            w = StepWatch()
            res["syncs_note"] = "not counted: model.get_compiled_call is not kvkit's step wrapper"
            res.update(syncs_per_step=None, sync_sites={}, attn_ops={})
        else:
            res.update(syncs_per_step=w.count, sync_sites=dict(w.where().most_common(8)), attn_ops=dict(w.attn_ops))
        ops = ",".join(sorted(w.attn_ops)) or ("ops inside the graph not seen" if isinstance(row, KvkitCompiled)
                                                else "no fused sdpa op")
        res["attention"] = f"{row.attention(w.attn_ops)} [{ops}]"
        res["compile"] = row.compile_mode

    @staticmethod
    def _compiled_fields(row: Row, res: dict, g1: int, skips0: int) -> None:
        res["kv_allocated"] = int(sum(layer.allocated_nbytes() for layer in row.cache.layers)) \
            if row.name != "hf-static" else res["kv_held"]
        res["recompiles"] = graph_count() - g1  # graphs compiled during the timed and the counted steps
        res["cudagraph_skips"] = cudagraph_skips() - skips0
        notes = [res["note"]] if res.get("note") else []
        if res["recompiles"]:
            notes.append(f"{res['recompiles']} recompile(s) after warm-up")
        if row.cudagraphs and res["cudagraph_skips"]:
            notes.append("CUDA graphs skipped by inductor (see the log)")
        if notes:
            res["note"] = "; ".join(notes)

    def _head(self, row: Row) -> dict:
        return dict(row=row.label, name=row.name, policy=row.policy, compiled=isinstance(row, KvkitCompiled),
                    options=row.label_options, batch=self.batch, length=self.length)

    def _attempt(self, row: Row, ref: Row | None) -> dict:
        """:meth:`_measure`, an error (an OOM, a policy's refusal) caught as a row with its message."""
        try:
            res = self._measure(row, ref)
            res["status"] = "ok"
        except Exception as e:  # noqa: BLE001 -- an OOM / a policy error is a row, not the end of the run
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            res = self._head(row)
            res.update(status="error", error=msg[:500])
            with contextlib.suppress(Exception):
                if kvkit.patched_policy(self.model) is not None:
                    kvkit.unpatch(self.model)
        return res

    def _skipped(self, row: Row, el: float, est: float) -> dict:
        res = self._head(row)
        res.update(status="skipped",
                   error=f"skipped: time limit {self.time_limit:.0f} s (elapsed {el:.0f} s, this row takes "
                         f"~{est:.0f} s{', its compile included' if row.compiles else ''})")
        return res

    # -- all rows ---------------------------------------------------------------------------------------------
    def _interleave(self) -> bool:
        """Interleaving as asked, unless keeping the full cache alive would not leave room for another row."""
        full_bytes = 2 * self.config.num_hidden_layers * self.config.num_key_value_heads * self.config.head_dim * \
            self.batch * (self.length + self._extra()) * torch.empty((), dtype=self.dtype).element_size()
        interleave = self.interleave_wanted
        if interleave and self.cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.weights + 3.5 * full_bytes > 0.85 * total:  # reference + a full-size row + its prefill
                interleave = False
                self.info["interleave_note"] = "off: the full cache kept alive would not leave room for another"
        self.info["interleave"] = interleave
        return interleave

    def run(self) -> list[dict]:
        if self.model is None or not self.info:
            self.setup()
        rows: list[dict] = []
        ref: Row | None = None
        durations: list[float] = []  # of the eager rows
        compiled_durations: list[float] = []  # of the rows that compiled (compile time included)
        refusals = self.refusals()
        self.info["no_static_store"] = refusals
        interleave = self._interleave()
        for name, user, compiled in self.plan:
            row = self._make(name, user, compiled)
            el = self.elapsed()
            est = self._estimate(row.compiles, durations, compiled_durations)
            if el > self.time_limit or (est and el + est > self.time_limit):
                res = self._skipped(row, el, est)
                if row.label in refusals:
                    res["compile_refusal"] = refusals[row.label]
                rows.append(res)
                self.log(f"[{el:6.1f}s] {row.label}: skipped (time limit)")
                self._emit(rows)
                continue
            self.log(f"[{el:6.1f}s] {row.label} ...")
            t = time.perf_counter()
            res = self._attempt(row, ref)
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
            free_memory(self.cuda)
            add_ratios(rows, self.weights, self.bandwidth)
            self._emit(rows)
        if ref is not None:
            ref.close()
        free_memory(self.cuda)
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
