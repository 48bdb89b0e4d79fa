"""Summaries (json / markdown / csv), the NIAH heatmap and ``kvkit eval compare``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from kvkit.evals.common import atomic_write_bytes, atomic_write_json, atomic_write_text

NIAH_COLORS = ("#F0496E", "#EBB839", "#0CD79F")  # red -> yellow -> green


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.2f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_text(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def write_summary(out: Path, summary: dict, header: list[str], rows: list[list], title: str = "") -> None:
    """``summary.json`` + ``summary.md`` + ``summary.csv`` under ``out`` (each written atomically)."""
    out = Path(out)
    atomic_write_json(out / "summary.json", summary)
    md = (f"# {title}\n\n" if title else "") + markdown_table(header, rows)
    if summary.get("command"):
        md += f"\nCommand: `{summary['command']}`\n"
    atomic_write_text(out / "summary.md", md)
    atomic_write_text(out / "summary.csv", csv_text(header, rows))


def heatmap_png(grid: list[list[float | None]], lengths: list[int], depths: list[float], title: str) -> bytes:
    """NIAH heatmap: depth on y (0% at top), context length on x, score (0-100) in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("niah", list(NIAH_COLORS))
    data = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.45 * len(depths)))
    im = ax.imshow(data, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_heatmap(path: Path, *args, **kwargs) -> None:
    atomic_write_bytes(path, heatmap_png(*args, **kwargs))


# ------------------------------------------------------------------------------------------ compare


def load_summary(d) -> dict:
    p = Path(d)
    p = p / "summary.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"{p}: no summary.json (is {d} a finished `kvkit eval` output folder?)")
    try:
        s = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}, line {e.lineno}: not valid JSON ({e.msg})") from None
    for k in ("benchmark", "policy", "scores", "average"):
        if k not in s:
            raise ValueError(f"{p}: missing field {k!r}; not a kvkit eval summary")
    return s


def budget_of(options: dict) -> str:
    for k in ("budget", "budget_tokens", "keep", "compression_ratio", "ratio"):
        if k in options:
            return str(options[k])
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "-"


def _load_run(d) -> tuple[dict, list[dict]]:
    """``config.json`` and the rows of ``samples.jsonl`` of the run folder ``d``."""
    from kvkit.evals.common import read_rows

    p = Path(d)
    cfg_path, rows_path = p / "config.json", p / "samples.jsonl"
    if not cfg_path.is_file() or not rows_path.is_file():
        raise ValueError(f"{d}: --matched needs run folders with config.json and samples.jsonl")
    return json.loads(cfg_path.read_text(encoding="utf-8")), read_rows(rows_path, required=("id", "task", "score"))


def _score(rows: list[dict], keep: set) -> dict:
    """Task scores, average, per-task counts and mean KV bytes of the rows whose id is in ``keep``."""
    from kvkit.evals.common import task_scores

    rows = [r for r in rows if r["id"] in keep]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    kv = [r["kv_bytes"] for r in rows if "kv_bytes" in r]
    return dict(task_scores(rows, tasks), samples=len(rows),
                per_task={t: sum(r["task"] == t for r in rows) for t in tasks},
                kv=round(sum(kv) / len(kv)) if kv else None)


def compare_matched(dirs: list, out: Path | None = None) -> str:
    """Like :func:`compare`, but every run is scored only on the samples it shares with the ``full`` run
    of its benchmark/length (retention on identical prompts), with per-run sample counts and KV bytes.
    Runs stopped early, or made from different sample counts, are then compared fairly."""
    runs = [_load_run(d) for d in dirs]

    def key(cfg):
        return cfg["benchmark"], cfg.get("model"), cfg.get("length")

    fulls = {key(cfg): rows for cfg, rows in runs if cfg["policy"] == "full"}
    if not fulls:
        raise ValueError("--matched needs a `full` run among the folders (the baseline the samples are matched to)")
    tasks = list(dict.fromkeys(r["task"] for _, rows in runs for r in rows))
    header = ["length", "policy", "options", "samples", "min/task", *tasks, "average", "full (same samples)",
              "retention", "KV bytes", "KV vs full"]
    table = []
    for cfg, rows in runs:
        full_rows = fulls.get(key(cfg))
        if full_rows is None:
            continue
        common = {r["id"] for r in rows} & {r["id"] for r in full_rows}
        ms, fm = _score(rows, common), _score(full_rows, common)
        ret = round(ms["average"] / fm["average"], 4) if ms["average"] is not None and fm["average"] else None
        kvr = round(ms["kv"] / fm["kv"], 3) if ms["kv"] and fm["kv"] else None
        opts = ",".join(f"{k}={v}" for k, v in sorted(cfg.get("options", {}).items())) or "-"
        if cfg.get("full_prompt_prefill"):
            opts += " (question in prefill)"
        counts = ms["per_task"]
        table.append([cfg.get("length"), cfg["policy"], opts, ms["samples"],
                      min(counts.values()) if len(counts) == len(tasks) else 0,
                      *[ms["scores"].get(t) for t in tasks], ms["average"], fm["average"], ret, ms["kv"], kvr])
    table.sort(key=lambda r: (str(r[0]), r[1] != "full", r[1], r[2]))
    md = markdown_table(header, table)
    if out is not None:
        out = Path(out)
        atomic_write_text(out / "compare.md", md)
        atomic_write_text(out / "compare.csv", csv_text(header, table))
    return md


def compare(dirs: list, out: Path | None = None) -> str:
    """One policy x budget table over several eval summaries, with retention = score / full score."""
    sums = [load_summary(d) for d in dirs]
    tasks = list(dict.fromkeys(t for s in sums for t in s["scores"]))
    full = {}
    for s in sums:
        if s["policy"] == "full":
            full[(s["benchmark"], s.get("model"), s.get("length"))] = s
    header = ["benchmark", "model", "length", "policy", "budget", *tasks, "average", "retention"]
    rows = []
    for s in sorted(sums, key=lambda s: (s["benchmark"], str(s.get("length")), s["policy"] != "full", s["policy"],
                                         budget_of(s.get("options", {})))):
        ref = full.get((s["benchmark"], s.get("model"), s.get("length")))
        ret = None
        if ref is not None and ref["average"]:
            ret = round(s["average"] / ref["average"], 4)
        rows.append([s["benchmark"], s.get("model"), s.get("length"), s["policy"], budget_of(s.get("options", {})),
                     *[s["scores"].get(t) for t in tasks], s["average"], ret])
    md = markdown_table(header, rows)
    if not full:
        md += "\n(no `full` run among these folders: retention needs the full-cache baseline)\n"
    if out is not None:
        out = Path(out)
        atomic_write_text(out / "compare.md", md)
        atomic_write_text(out / "compare.csv", csv_text(header, rows))
    return md
