"""What a shaped-model bench writes: ``config.json`` (the command, versions, device, git commit, shape, settings,
bandwidth), ``rows.jsonl`` (one object per row) and ``summary.md`` (the table and the command), rewritten after
every row (:func:`write`), so a run stopped early keeps its rows.

The table (:func:`table`): per row the attention that ran and the compile mode, prefill seconds, compile seconds,
the median step (p10-p90), ``KV held``, ``KV read/step``, ``weights``, ``byte bound ms``, the speed-up and fraction
against kvkit ``full`` and against ``full static+compile`` (:mod:`kvkit.evals.gpu.bound`), ``syncs/step`` and the
status. The summary's first line (:func:`compiled_summary`) names the compiled rows and their compile time, and the
kvkit rows without a static store with ``KVCache.compile_refusal``'s reason. :func:`environment`: the versions,
the device, the sdpa backends enabled and the git commit (``git status`` of kvkit/ when run from a checkout).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch
import transformers

import kvkit
from kvkit import env
from kvkit.evals.files import atomic_write_json, atomic_write_jsonl, atomic_write_text
from kvkit.evals.report import markdown_table
from kvkit.kernels import backend
from kvkit.options import fmt_bytes


def mib(n) -> str | None:
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
                    f"{r['step_ms']:.3f} ({r['step_ms_p10']:.3f}-{r['step_ms_p90']:.3f})", mib(r["kv_held"]),
                    mib(r["kv_read_step"]), mib(r["weights_bytes"]), f"{r['byte_bound_ms']:.4g}",
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
    h, t = table(rows)
    bw = config.get("bandwidth_bytes_s")
    lines = [f"# kvkit bench --shape {config['shape']} - {config['batch']} x {config['length']} tokens - "
             f"{config['device_name']}", "", compiled_summary(config, rows), "",
             f"Random weights, {config['dtype']}; one decode step (B x 1 token) timed: median of the timed steps "
             f"(p10-p90) after {config['warmup']} warm-up steps; interleaved with kvkit full: "
             f"{config.get('interleave')}. Prefill: chunks of {config.get('prefill_chunk')} tokens x "
             f"{config['batch']} rows per forward (kvkit.prefill for kvkit rows).",
             f"Copy bandwidth {bw / 1e9:.1f} GB/s (read + write, measured in this run); "
             f"weights read/step {mib(config.get('weights_read_bytes', 0))}; kvkit kernels: "
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


def git_state(where: Path | None = None) -> tuple[str | None, list | None]:
    """The commit kvkit runs from (``KVKIT_GIT_COMMIT`` when set, else ``git rev-parse HEAD`` of the checkout holding
    ``where``, default this file) and the uncommitted changes under the checkout's top-level ``kvkit/`` (``git status
    --porcelain`` lines; None outside a git checkout)."""
    here = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=here).stdout.strip() or None
        # ":/kvkit": the pathspec from the checkout's top (a plain "kvkit" would be relative to ``here``)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/kvkit"], capture_output=True, text=True,
                               timeout=10, cwd=here).stdout.split("\n") if head else None
    except (OSError, subprocess.SubprocessError):
        head, dirty = None, None
    return env.git_commit() or head, None if dirty is None else [x.strip() for x in dirty if x.strip()]


def device_name(device) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def environment(device) -> dict:
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    commit, dirty = git_state()
    out = dict(torch=torch.__version__, transformers=transformers.__version__, triton=triton_v,
               kvkit=kvkit.__version__, python=platform.python_version(), device_name=device_name(device),
               git_commit=commit, git_dirty_kvkit=dirty, kvkit_kernels=backend(device),
               threads=torch.get_num_threads())
    if torch.device(device).type == "cuda":
        b = torch.backends.cuda
        out.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   sdpa_enabled=dict(cudnn=b.cudnn_sdp_enabled(), flash=b.flash_sdp_enabled(),
                                     mem_efficient=b.mem_efficient_sdp_enabled(), math=b.math_sdp_enabled()),
                   total_memory=torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return out


def write(out: Path, config: dict, rows: list[dict]) -> str:
    atomic_write_json(out / "config.json", config)
    atomic_write_jsonl(out / "rows.jsonl", rows)
    md = summary_md(config, rows)
    atomic_write_text(out / "summary.md", md)
    return md
