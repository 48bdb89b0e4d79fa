"""Production-shape decode on one card: a batch x length grid per shape, memory computed up front, and the
largest batch each policy fits at 32K.

``python -m kvkit.evals.gpu.production --shape llama-3.1-8b --device cuda --out DIR`` (``--shape tiny`` on the
CPU is its dry run).

**Cells** (:data:`CELLS`, in the order they run, the most wanted first): batch 8 x 32K, 1 x 128K (the context limit
less the decode steps: :data:`LONG`), 32 x 32K, 1 x 8K, 8 x 8K, 32 x 8K, 1 x 32K; ``tiny``: :data:`TINY_CELLS`.
Before a cell runs, its memory is computed from the shape (:func:`cell_bytes`: weights + the largest row's KV
at capacity + the prefill's activations + a workspace reserve) and compared with the card's memory; a cell that
does not fit is skipped and says by how much.

**Rows of a cell**: transformers' ``StaticCache`` + ``torch.compile`` (``hf-static``) and each policy's
``static+compile`` row (kvkit ``full`` first), measured by a :class:`~kvkit.evals.gpu.runner.Bench` without the
eager rows (host-bound, measured before) and without interleaving (its memory goes to the cells). Per row: decode ms
per step (median), tokens/s (``batch / step``), the fraction of the byte bound (``byte bound ms / step ms``: 1 =
at the bound), the speed-up over ``hf-static``, prefill seconds and peak memory (CUDA) against ``hf-static``'s.

**Largest batch at 32K** (:func:`max_batch`): per policy, its static cache is prefilled with 32K tokens at batch 1
and 2 (eager, chunked as the bench does) and stepped twice; ``per row`` = the difference of the two peaks (CUDA's
``max_memory_allocated``; on the CPU the cache's allocated bytes), ``fixed`` = the batch-1 peak less one row; the
largest batch is ``floor((usable - fixed) / per row)`` with ``usable`` = :data:`USABLE` of the card. Also the KV
bytes per token per row the cache allocates (``allocated / length``). Compared with ``full``'s.

The probes run first (eager, no compile: seconds), then the cells. A time limit (``--time-limit``, from the start)
bounds the run: a :class:`Bench` skips the rows that would pass it, and a cell or probe that starts past it is
skipped and marked so. Files: ``grid.json`` (every row, cell and probe)
and ``grid.md`` (the tables), rewritten after every cell.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.files import atomic_write_json, atomic_write_text
from kvkit.evals.gpu.plan import default_options, parse_rows
from kvkit.evals.gpu.report import environment
from kvkit.evals.gpu.runner import Bench
from kvkit.evals.gpu.shapes import SHAPES, build_model, shape_config
from kvkit.evals.gpu.timing import free_memory
from kvkit.options import fmt_bytes
from kvkit.registry import policy_class

GIB = 1 << 30
#: decode steps a cell's rows take beyond the prompt (warm-up, CUDA-graph recording, timed, counted) + slack: the
#: longest prompt is the context limit less this
STEP_ROOM = 256
#: 1 x 128K: the 131,072-token context limit of the Llama 3 shapes less :data:`STEP_ROOM`
LONG = 131072 - STEP_ROOM
#: (batch, length) of the real shapes, in run order
CELLS = ((8, 32768), (1, LONG), (32, 32768), (1, 8192), (8, 8192), (32, 8192), (1, 32768))
#: the dry run's cells
TINY_CELLS = ((1, 64), (4, 64), (1, 256))
#: the length of the largest-batch probe (``tiny``: :data:`TINY_PROBE`)
PROBE_LENGTH = 32768
TINY_PROBE = 128
#: the share of the card's memory a run may plan to use (the allocator, CUDA graphs and the context keep the rest)
USABLE = 0.90
#: memory kept for workspaces (cuBLAS, inductor, CUDA graphs' pools) on top of the computed bytes
RESERVE = 2 * GIB
DEFAULT_POLICIES = ("full", "streaming", "snapkv")


def dtype_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config, dtype) -> int:
    """K + V bytes of one token in every layer (one batch row): ``2 * layers * kv_heads * head_dim * bytes``."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * hd * dtype_bytes(dtype)


def weight_bytes(config, dtype) -> int:
    """Parameter bytes of the shape's Llama (embedding + head once when tied)."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    attn = h * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    layer = attn + 3 * h * i + 2 * h
    emb = v * h * (1 if config.tie_word_embeddings else 2)
    return (config.num_hidden_layers * layer + emb + h) * dtype_bytes(dtype)


def prefill_chunk(batch: int, length: int) -> int:
    """Tokens per row per prefill forward: the bench's rule, ``min(L, max(256, 16384 // B))``."""
    return min(length, max(256, 16384 // batch))


def cell_bytes(config, dtype, batch: int, length: int) -> dict:
    """Memory one cell needs at its largest row (``full`` / ``hf-static``: every token kept, at capacity):
    ``weights``, ``kv`` (``B x (L + STEP_ROOM)`` tokens), ``prefill`` (one chunk's activations: hidden states,
    the MLP's two intermediates, q/k/v, the causal mask ``[B, 1, C, L]`` as bytes, fp32 logits of the last token),
    ``reserve`` (:data:`RESERVE`) and their ``total``."""
    b = dtype_bytes(dtype)
    c = prefill_chunk(batch, length)
    tokens = batch * c
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    act = tokens * (4 * config.hidden_size + 3 * config.intermediate_size
                    + (config.num_attention_heads + 2 * config.num_key_value_heads) * hd) * b
    act += batch * c * (length + STEP_ROOM)  # the bool mask
    act += batch * config.vocab_size * 4
    out = dict(weights=weight_bytes(config, dtype), kv=batch * (length + STEP_ROOM) * kv_bytes_per_token(config, dtype),
               prefill=act, reserve=RESERVE)
    out["total"] = sum(out.values())
    return out


def plan_cells(config, dtype, cells, total_memory: int | None) -> list[dict]:
    """Each cell with its computed bytes and whether it fits ``USABLE * total_memory`` (None: no limit known, e.g.
    the CPU: every cell is planned)."""
    out = []
    for batch, length in cells:
        need = cell_bytes(config, dtype, batch, length)
        fits = total_memory is None or need["total"] <= USABLE * total_memory
        why = None if fits else (f"needs {need['total'] / GIB:.1f} GiB (KV {need['kv'] / GIB:.1f} GiB, weights "
                                 f"{need['weights'] / GIB:.1f} GiB) > {USABLE:.0%} of the card's "
                                 f"{total_memory / GIB:.1f} GiB")
        out.append(dict(batch=batch, length=length, need_bytes=need, fits=fits, skip_reason=why))
    return out


def _compiled_plan(rows_spec) -> list[tuple[str, dict, bool]]:
    """``hf-static``, then each policy's compiled row (``full`` first): no eager rows."""
    return [("hf-static", {}, False)] + [(n, u, True) for n, u in rows_spec if n not in ("hf-static", "hf-dynamic")]


def _vs_hf(rows: list[dict]) -> None:
    """Tokens/s, fraction of the byte bound and the ratios to ``hf-static`` of every measured row, in place."""
    hf = next((r for r in rows if r["name"] == "hf-static" and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["tokens_per_s"] = round(r["batch"] / r["step_ms"] * 1e3, 1)
        r["of_byte_bound"] = round(r["byte_bound_ms"] / r["step_ms"], 3)
        if hf is not None:
            r["speedup_vs_hf_static"] = round(hf["step_ms"] / r["step_ms"], 3)
            r["prefill_vs_hf_static"] = round(r["prefill_s"] / hf["prefill_s"], 3) if hf["prefill_s"] else None
            if r.get("peak_mem_bytes") and hf.get("peak_mem_bytes"):
                r["peak_vs_hf_static"] = round(r["peak_mem_bytes"] / hf["peak_mem_bytes"], 3)


@torch.no_grad()
def _probe_once(model, policy: str, options: dict, batch: int, length: int, cuda: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)
    free_memory(cuda)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    kvkit.patch(model, policy, static=True, max_length=length + STEP_ROOM, **options)
    try:
        cache, last = kvkit.prefill(model, ids, chunk_size=prefill_chunk(batch, length))
        cache.ensure_capacity(length + STEP_ROOM)
        nxt = last.argmax(-1, keepdim=True)
        for _ in range(2):
            nxt = model(input_ids=nxt, **cache_kw(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        alloc = int(sum(layer.allocated_nbytes() for layer in cache.layers))
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else alloc
    finally:
        kvkit.unpatch(model)
        cache = last = nxt = None
        free_memory(cuda)
    return dict(peak=int(peak), allocated=alloc)


def max_batch(model, policy: str, options: dict, length: int, usable: int | None, cuda: bool, seed: int = 0) -> dict:
    """The largest batch ``policy``'s static cache fits at ``length`` (see the module docstring): the probe at
    batch 1 and 2, ``per_row_bytes``, ``fixed_bytes``, ``kv_bytes_per_token`` (allocated, one row) and
    ``max_batch`` (None without ``usable``: the CPU)."""
    one = _probe_once(model, policy, options, 1, length, cuda, seed)
    two = _probe_once(model, policy, options, 2, length, cuda, seed)
    per_row = max(1, two["peak"] - one["peak"])
    fixed = one["peak"] - per_row
    out = dict(policy=policy, length=length, peak_b1=one["peak"], peak_b2=two["peak"], per_row_bytes=per_row,
               fixed_bytes=fixed, kv_bytes_per_token=round(one["allocated"] / (length + STEP_ROOM), 1),
               measured="CUDA max_memory_allocated" if cuda else "cache allocated bytes (no device peak)")
    out["max_batch"] = None if usable is None else max(0, math.floor((usable - fixed) / per_row))
    return out


def grid_md(shape: str, info: dict, cells: list[dict], rows: list[dict], probes: list[dict]) -> str:
    """The tables: one per run (every cell's rows), the skipped cells, the largest batch per policy."""
    lines = [f"# Decode grid: {shape} on {info.get('device_name')}, {info.get('dtype')}", "",
             f"command: `{info.get('command', '')}`", f"git {info.get('git_commit')}; torch {info.get('torch')}; "
             f"transformers {info.get('transformers')}; copy bandwidth "
             f"{(info.get('bandwidth_bytes_s') or 0) / 1e9:.0f} GB/s", "",
             "| batch | length | row | decode ms | tokens/s | of byte bound | vs hf-static | prefill s | "
             "prefill vs hf | peak memory | peak vs hf | compile s | status |", "|---" * 13 + "|"]
    for r in rows:
        if r.get("status") == "ok":
            lines.append(f"| {r['batch']} | {r['length']} | {r['row']} | {r['step_ms']:.3f} | {r['tokens_per_s']:g} | "
                         f"{r['of_byte_bound']:.2f} | {r.get('speedup_vs_hf_static', '')} | {r['prefill_s']} | "
                         f"{r.get('prefill_vs_hf_static', '')} | {fmt_bytes(r['peak_mem_bytes']) if r.get('peak_mem_bytes') else ''} | "
                         f"{r.get('peak_vs_hf_static', '')} | {r.get('compile_s', '')} | {r.get('note') or 'ok'} |")
        else:
            lines.append(f"| {r['batch']} | {r['length']} | {r['row']} | | | | | | | | | | {r.get('error', '')[:160]} |")
    skipped = [c for c in cells if c.get("skip_reason")]
    if skipped:
        lines += ["", "Cells not run:", ""] + [f"- {c['batch']} x {c['length']}: {c['skip_reason']}" for c in skipped]
    if probes:
        full = next((p for p in probes if p["policy"] == "full" and p.get("max_batch") is not None), None)
        lines += ["", f"Largest batch at {probes[0]['length']} tokens ({probes[0]['measured']}; usable "
                  f"{USABLE:.0%} of the card):", "",
                  "| policy | KV bytes/token/row (allocated) | per-row bytes (probe) | fixed bytes | largest batch | "
                  "vs full |", "|---" * 6 + "|"]
        for p in probes:
            if "error" in p:
                lines.append(f"| {p['policy']} | | | | | {p['error'][:160]} |")
                continue
            vs = (f"{p['max_batch'] / full['max_batch']:.2f}x" if full and p.get("max_batch") is not None
                  and full["max_batch"] else "")
            lines.append(f"| {p['policy']} | {p['kv_bytes_per_token']:g} | {fmt_bytes(p['per_row_bytes'])} | "
                         f"{fmt_bytes(p['fixed_bytes'])} | {p['max_batch'] if p['max_batch'] is not None else 'n/a'} | "
                         f"{vs} |")
    return "\n".join(lines) + "\n"


def run_grid(shape: str, device: str = "cuda", dtype=None, policies=DEFAULT_POLICIES, cells=None,
             steps: int = 10, warmup: int = 2, time_limit: float = 300.0, out: Path | None = None,
             probe_length: int | None = None, probe: bool = True, command: str = "", log=None,
             compile_backend: str = "inductor") -> dict:
    """The grid of one shape (see the module docstring); returns ``{"info", "cells", "rows", "probes"}`` and
    writes ``grid.json`` / ``grid.md`` under ``out`` after every cell and probe. ``compile_backend``: the
    compiled rows' ``torch.compile`` backend (``aot_eager``: tracing only, the tests' quick compile)."""
    t0 = time.perf_counter()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    config = shape_config(shape)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    rows_spec = parse_rows(list(policies))
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else None
    cells = plan_cells(config, dtype, cells or (TINY_CELLS if shape == "tiny" else CELLS), total)
    probe_length = probe_length or (TINY_PROBE if shape == "tiny" else PROBE_LENGTH)
    info = dict(benchmark="decode grid", shape=shape, shape_config=SHAPES[shape], dtype=str(dtype).split(".")[-1],
                device=str(dev), steps=steps, warmup=warmup, time_limit_s=time_limit, command=command,
                compile_backend=compile_backend,
                policies=[n for n, _ in rows_spec], total_memory=total, usable_share=USABLE,
                computed_weights_bytes=weight_bytes(config, dtype),
                kv_bytes_per_token_full=kv_bytes_per_token(config, dtype), **environment(dev))
    result = dict(info=info, cells=cells, rows=[], probes=[])

    def emit():
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "grid.json", result)
            atomic_write_text(out / "grid.md", grid_md(shape, info, cells, result["rows"], result["probes"]))

    log(f"building {shape} (random weights) on {dev} in {dtype} ...")
    model = build_model(shape, dev, dtype)
    if probe:
        usable = int(USABLE * total) if total else None
        for name, user in rows_spec:
            el = time.perf_counter() - t0
            if el > time_limit:
                result["probes"].append(dict(policy=name, length=probe_length,
                                             error=f"skipped: time limit {time_limit:.0f} s reached",
                                             measured=""))
                continue
            opts, _ = default_options(name, shape, probe_length, config)
            opts.update({k: v for k, v in policy_class(name).static_options.items() if k not in user})
            opts.update(user)
            log(f"[{el:6.1f}s] largest batch at {probe_length}: {name} ...")
            try:
                result["probes"].append(max_batch(model, name, opts, probe_length, usable, cuda))
            except Exception as e:  # noqa: BLE001 -- an OOM at batch 2 is a probe result, not the end of the run
                result["probes"].append(dict(policy=name, length=probe_length, measured="",
                                             error=f"{type(e).__name__}: {e}".replace("\n", " ")[:300]))
            emit()
    for c in cells:
        el = time.perf_counter() - t0
        if not c["fits"]:
            log(f"[{el:6.1f}s] {c['batch']} x {c['length']}: skipped ({c['skip_reason']})")
            continue
        if el > time_limit:
            c["skip_reason"] = f"time limit {time_limit:.0f} s reached (elapsed {el:.0f} s)"
            log(f"[{el:6.1f}s] {c['batch']} x {c['length']}: skipped (time limit)")
            continue
        log(f"[{el:6.1f}s] cell {c['batch']} x {c['length']} ...")
        bench = Bench(shape, str(dev), dtype, rows_spec, c["batch"], c["length"], steps=steps, warmup=warmup,
                      rounds=1, interleave=False, time_limit=time_limit, t0=t0, model=model, log=log,
                      compile_backend=compile_backend)
        bench.plan = _compiled_plan(rows_spec)
        c["bench_info"] = bench.setup()
        info.setdefault("bandwidth_bytes_s", bench.bandwidth)
        cell_rows = bench.run()
        _vs_hf(cell_rows)
        result["rows"] += cell_rows
        free_memory(cuda)
        emit()
    info["elapsed_s"] = round(time.perf_counter() - t0, 1)
    emit()
    return result


def parse_cells(text: str | None):
    """``"8x32768,1x130816"`` -> ``((8, 32768), (1, 130816))``; None -> None (the shape's cells)."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        b, sep, length = item.strip().lower().partition("x")
        if not (sep and b.isdigit() and length.isdigit() and int(b) > 0 and int(length) > 0):
            raise ValueError(f"--cells {item!r}: give BATCHxLENGTH, e.g. 8x32768")
        out.append((int(b), int(length)))
    return tuple(out)


def run_bench_args(args, command: str = "") -> int:
    """``kvkit bench --shape NAME --grid ...``: the grid from the bench's own arguments (``--device``,
    ``--policy``, ``--steps``, ``--warmup``, ``--time-limit``, ``--out``, ``--compile-backend``; ``--batch`` and
    ``--lengths``, when given, make the cells ``batch x each length``), its tables printed."""
    cells = None
    if getattr(args, "lengths", None):
        lengths = args.lengths if isinstance(args.lengths, list) else \
            [int(x) for x in str(args.lengths).split(",") if x.strip()]
        cells = tuple((args.batch or 1, L) for L in lengths)
    given = [str(s) for s in [*(getattr(args, "policy", None) or []), *(getattr(args, "shape_rows", None) or [])]]
    res = run_grid(args.shape, args.device, policies=given or list(DEFAULT_POLICIES), cells=cells,
                   steps=args.steps or 10, warmup=args.warmup, time_limit=args.time_limit,
                   out=Path(args.out) if args.out else None, command=command,
                   compile_backend=getattr(args, "compile_backend", None) or "inductor")
    print(grid_md(args.shape, res["info"], res["cells"], res["rows"], res["probes"]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvkit.evals.gpu.production", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                    help="ROW[:KEY=VALUE,...] ... (as kvkit bench --policies; kvkit full always runs)")
    ap.add_argument("--cells", default=None, help="BATCHxLENGTH,... (default: the shape's grid)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--probe-length", type=int, default=None)
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--compile-backend", default="inductor", help="inductor (default) or aot_eager (a dry run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        cells = parse_cells(a.cells)
        res = run_grid(a.shape, a.device, policies=a.policies,
                       cells=cells, steps=a.steps, warmup=a.warmup, time_limit=a.time_limit,
                       out=Path(a.out) if a.out else None, probe_length=a.probe_length, probe=not a.no_probe,
                       compile_backend=a.compile_backend, command="python -m kvkit.evals.gpu.production " + " ".join(argv or sys.argv[1:]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(grid_md(a.shape, res["info"], res["cells"], res["rows"], res["probes"]))
    if a.out:
        print(f"wrote {a.out}/grid.json, grid.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
