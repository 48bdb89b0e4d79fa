"""Summaries (json / markdown / csv), the NIAH heatmap and ``kvkit eval compare``.

Every eval's ``summary.json`` carries ``"schema": SCHEMA`` (the version of its layout) and ``commit`` (the kvkit
commit that made it) besides what the eval writes: model, policy and options (``policy_spec``: the setting as
``--policy`` writes it), ``compression_ratio`` when given, ``mean_kv_bytes`` / ``mean_kv_read`` (KV bytes held at the
end of a sample / read per decode step), ``scores`` per task and ``average``.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import subprocess
from pathlib import Path

from kvkit import env
from kvkit.evals.files import atomic_write_bytes, atomic_write_json, atomic_write_text, read_rows
from kvkit.options import fmt_bytes as fmt

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


#: the version of summary.json's layout (readers check it; a layout change bumps it)
SCHEMA = 1


@functools.lru_cache(maxsize=1)
def commit() -> str | None:
    """The commit kvkit runs from: ``KVKIT_GIT_COMMIT`` when set, else ``git rev-parse HEAD`` of the checkout holding
    this package (None outside a git checkout)."""
    if env.git_commit():
        return env.git_commit()
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def write_summary(out: Path, summary: dict, header: list[str], rows: list[list], title: str = "") -> None:
    """``summary.json`` (with ``schema`` and ``commit``) + ``summary.md`` + ``summary.csv`` under ``out`` (each written
    atomically)."""
    out = Path(out)
    summary = {"schema": SCHEMA, **summary}
    summary.setdefault("commit", commit())
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
    """A run's ``summary.json``, its fields checked (ValueError naming the file and the field): ``benchmark`` and
    ``policy`` text, ``scores`` an object of task -> number (or null), ``average`` a number or null, ``options`` an
    object, ``schema`` at most :data:`SCHEMA`."""
    p = Path(d)
    p = p / "summary.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"{p}: no summary.json (is {d} a finished `kvkit eval` output folder?)")
    try:
        s = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(s, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(s).__name__}; not a kvkit eval summary")
    for k in ("benchmark", "policy", "scores", "average"):
        if k not in s:
            raise ValueError(f"{p}: missing field {k!r}; not a kvkit eval summary")
    if isinstance(s.get("schema"), int) and s["schema"] > SCHEMA:
        raise ValueError(f"{p}: summary schema {s['schema']} is newer than this kvkit reads ({SCHEMA}); update kvkit")
    if not isinstance(s["benchmark"], str) or not isinstance(s["policy"], str):
        raise ValueError(f"{p}: 'benchmark' and 'policy' must be text; not a kvkit eval summary")
    if not isinstance(s["scores"], dict) or not all(_number(v) or v is None for v in s["scores"].values()):
        raise ValueError(f"{p}: 'scores' must be an object of task -> score, got {_short(s['scores'])}")
    if not (_number(s["average"]) or s["average"] is None):
        raise ValueError(f"{p}: 'average' must be a number or null, got {_short(s['average'])}")
    if not isinstance(s.get("options", {}), dict):
        raise ValueError(f"{p}: 'options' must be an object, got {_short(s['options'])}")
    for k in ("mean_kv_bytes", "mean_kv_read"):
        if s.get(k) is not None and not _number(s[k]):
            raise ValueError(f"{p}: {k!r} must be a number, got {_short(s[k])}")
    return s


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v) -> str:
    t = json.dumps(v)
    return t if len(t) <= 60 else t[:57] + "..."


def expand_dirs(dirs: list) -> list:
    """``dirs`` with each ``kvkit eval needles --out`` folder (a ``summary.json`` of benchmark ``needles`` that lists
    its ``runs``, or a folder of run folders without a summary of its own) replaced by its run folders."""
    out = []
    for d in dirs:
        p = Path(d)
        root = p / "summary.json" if p.is_dir() else p
        listed = None
        if root.is_file():
            try:
                s = json.loads(root.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                s = None
            if isinstance(s, dict) and isinstance(s.get("runs"), list) and "scores" not in s:
                listed = [root.parent / str(r.get("folder")) for r in s["runs"] if isinstance(r, dict)]
        elif p.is_dir():
            subs = sorted(x for x in p.iterdir() if (x / "config.json").is_file() and (x / "samples.jsonl").is_file())
            listed = subs or None
        out.extend(listed if listed else [d])
    return out


def budget_of(options: dict) -> str:
    for k in ("budget", "budget_tokens", "keep", "compression_ratio", "ratio"):
        if k in options:
            return str(options[k])
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "-"


def task_scores(rows: list[dict], tasks: list[str]) -> dict:
    """Mean score x 100 per task (2 decimals) and their average."""
    per = {}
    for t in tasks:
        xs = [r["score"] for r in rows if r.get("task") == t]
        if xs:
            per[t] = round(100 * sum(xs) / len(xs), 2)
    avg = round(sum(per.values()) / len(per), 2) if per else None
    return {"scores": per, "average": avg}


def _load_run(d) -> tuple[dict, list[dict]]:
    """``config.json`` and the rows of ``samples.jsonl`` of the run folder ``d``."""
    p = Path(d)
    cfg_path, rows_path = p / "config.json", p / "samples.jsonl"
    if not cfg_path.is_file() or not rows_path.is_file():
        raise ValueError(f"{d}: --matched needs run folders with config.json and samples.jsonl")
    return json.loads(cfg_path.read_text(encoding="utf-8")), read_rows(rows_path, required=("id", "task", "score"))


def _score(rows: list[dict], keep: set) -> dict:
    """Task scores, average, per-task counts and mean KV bytes of the rows whose id is in ``keep``."""
    rows = [r for r in rows if r["id"] in keep]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    kv = [r["kv_bytes"] for r in rows if "kv_bytes" in r]
    return dict(task_scores(rows, tasks), samples=len(rows),
                per_task={t: sum(r["task"] == t for r in rows) for t in tasks},
                kv=round(sum(kv) / len(kv)) if kv else None)


#: the settings under which two runs' rows are the same samples, generated and computed alike: a run's retention is
#: only taken against a baseline that agrees on every one (another seed: other prompts; another dtype: other
#: numerics; another --max-new-tokens: other generations). Policy, options and full_prompt_prefill are what a
#: comparison compares.
SAMPLE_SETTINGS = ("benchmark", "model", "length", "lengths", "depths", "task", "seed", "chat", "max_new_tokens", "dtype")
#: the fields of a row that name its sample beyond the id (kvkit.evals.rundir.sample_digest, the seed)
ROW_IDENTITY = ("sample_sha", "seed")


def _settings(cfg: dict) -> tuple:
    return tuple(json.dumps(cfg.get(k), sort_keys=True) for k in SAMPLE_SETTINGS)


def _settings_text(cfg: dict) -> str:
    return ", ".join(f"{k} {cfg[k]}" for k in SAMPLE_SETTINGS if cfg.get(k) is not None)


def _differs(cfg: dict, base: dict) -> str:
    return ", ".join(f"{k} {cfg.get(k)!r} (baseline {base.get(k)!r})" for k in SAMPLE_SETTINGS
                     if json.dumps(cfg.get(k), sort_keys=True) != json.dumps(base.get(k), sort_keys=True))


def _folder(d) -> Path:
    """The run folder of ``d`` (a folder, or its summary.json), resolved: how runs and --baseline are told apart."""
    p = Path(d)
    return (p.parent if p.is_file() else p).resolve()


def _with_baselines(dirs: list, baselines: list | None) -> list:
    """``dirs`` then the ``baselines`` not among them, each folder once."""
    out, seen = [], set()
    for d in [*dirs, *(baselines or [])]:
        if _folder(d) not in seen:
            seen.add(_folder(d))
            out.append(d)
    return out


def _pick_baselines(runs: list, baselines: list | None) -> dict:
    """``{settings: index into runs}``: the run retention is relative to, for each setting (:data:`SAMPLE_SETTINGS`)
    among ``runs`` (``[(folder, config)]``). A ``--baseline`` folder is the baseline of its settings; a setting
    without one takes its one ``full`` run; several full runs of one setting and no ``--baseline`` are refused
    (picking one of them would make the retention depend on the argument order)."""
    folders = [_folder(d) for d, _ in runs]
    picked: dict = {}
    for b in baselines or []:
        i = folders.index(_folder(b))
        key = _settings(runs[i][1])
        if key in picked and picked[key] != i:
            raise ValueError(f"--baseline {runs[picked[key]][0]} and --baseline {b} have the same settings "
                             f"({_settings_text(runs[i][1])}): name one baseline per setting")
        picked[key] = i
    fulls: dict = {}
    for i, (_, cfg) in enumerate(runs):
        if cfg.get("policy") == "full":
            fulls.setdefault(_settings(cfg), []).append(i)
    for key, idx in fulls.items():
        if key in picked:
            continue
        if len(idx) > 1:
            raise ValueError(f"compare: {len(idx)} full runs have the same settings ({_settings_text(runs[idx[0]][1])}): "
                             f"{', '.join(str(runs[i][0]) for i in idx)}; retention is relative to one baseline: "
                             f"name it with --baseline DIR")
        picked[key] = idx[0]
    return picked


def _nearest(cfg: dict, runs: list, picked: dict) -> int:
    return min(picked.values(), key=lambda j: sum(a != b for a, b in zip(_settings(cfg), _settings(runs[j][1]))))


def _baseline_lines(runs: list, picked: dict) -> str:
    lines = []
    for j in sorted(set(picked.values())):
        d, cfg = runs[j]
        opts = ",".join(f"{k}={v}" for k, v in sorted(cfg.get("options", {}).items()))
        lines.append(f"- {d}: {cfg.get('policy')}{' ' + opts if opts else ''} ({_settings_text(cfg)})")
    return "\nRetention is relative to:\n" + "\n".join(lines) + "\n"


def _matched_ids(d, rows: list[dict], bd, base_rows: list[dict]) -> set:
    """The ids of ``rows`` that are the same sample as a row of the baseline: same id and, where both rows record
    them, the same :data:`ROW_IDENTITY`. A row with the baseline's id but another sample is refused."""
    base = {r["id"]: r for r in base_rows}
    same, other = set(), []
    for r in rows:
        b = base.get(r["id"])
        if b is None:
            continue
        diff = [k for k in ROW_IDENTITY if k in r and k in b and r[k] != b[k]]
        if diff:
            other.append((r["id"], diff))
        else:
            same.add(r["id"])
    if other:
        fields = ", ".join(dict.fromkeys(k for _, ks in other for k in ks))
        raise ValueError(f"--matched: {len(other)} row(s) of {d} have the id of a row of the baseline {bd} but another "
                         f"sample ({fields} differ; first: {other[0][0]!r}): they were made from other prompts and "
                         f"cannot be matched")
    return same


def compare_matched(dirs: list, out: Path | None = None, baselines: list | None = None) -> str:
    """Like :func:`compare`, but every run is scored only on the samples it shares with its baseline (the ``full``
    run of its settings, or ``--baseline``): retention on identical prompts, with per-run sample counts and KV bytes.
    Runs stopped early, or made from different sample counts, are then compared fairly. A run of other settings
    than every baseline (another seed, dtype, length, ...), or whose rows have a baseline row's id but another
    sample, is refused: its rows cannot be matched."""
    paths = _with_baselines(expand_dirs(dirs), baselines)
    loaded = [_load_run(d) for d in paths]
    runs = [(d, cfg) for d, (cfg, _) in zip(paths, loaded)]
    picked = _pick_baselines(runs, baselines)
    if not picked:
        raise ValueError("--matched needs a `full` run among the folders (the baseline the samples are matched to), "
                         "or --baseline DIR")
    tasks = list(dict.fromkeys(r["task"] for _, rows in loaded for r in rows))
    header = ["length", "policy", "options", "samples", "min/task", *tasks, "average", "baseline (same samples)",
              "retention", "KV bytes", "KV vs baseline"]
    table = []
    for d, (cfg, rows) in zip(paths, loaded):
        b = picked.get(_settings(cfg))
        if b is None:
            j = _nearest(cfg, runs, picked)
            raise ValueError(f"--matched: {d} has no baseline of its settings ({_differs(cfg, runs[j][1])} against "
                             f"{runs[j][0]}): its rows are other samples or other numerics than the baseline's; "
                             f"compare it with a baseline of its settings (--baseline DIR)")
        base_rows = loaded[b][1]
        common = _matched_ids(d, rows, paths[b], base_rows)
        ms, fm = _score(rows, common), _score(base_rows, common)
        ret = round(ms["average"] / fm["average"], 4) if ms["average"] is not None and fm["average"] else None
        kvr = round(ms["kv"] / fm["kv"], 3) if ms["kv"] and fm["kv"] else None
        opts = ",".join(f"{k}={v}" for k, v in sorted((cfg.get("options") or {}).items())) or "-"
        if cfg.get("full_prompt_prefill"):
            opts += " (question in prefill)"
        counts = ms["per_task"]
        table.append([cfg.get("length"), cfg["policy"], opts, ms["samples"],
                      min(counts.values()) if len(counts) == len(tasks) else 0,
                      *[ms["scores"].get(t) for t in tasks], ms["average"], fm["average"], ret, ms["kv"], kvr])
    table.sort(key=lambda r: (str(r[0]), r[1] != "full", r[1], r[2]))
    md = markdown_table(header, table) + _baseline_lines(runs, picked)
    if out is not None:
        out = Path(out)
        atomic_write_text(out / "compare.md", md)
        atomic_write_text(out / "compare.csv", csv_text(header, table))
    return md


def compare(dirs: list, out: Path | None = None, baselines: list | None = None) -> str:
    """One policy x budget table over several eval summaries, with retention = score / baseline score beside the KV
    bytes held (and read per decode step) and their fraction of the baseline's.

    ``dirs``: run folders or their summary.json; a ``kvkit eval needles --out`` folder stands for its run folders
    (:func:`expand_dirs`). The baseline of a run is the run of the same settings (:data:`SAMPLE_SETTINGS`:
    benchmark, model, length, seed, dtype, ...) named by ``baselines`` (``--baseline``), else the one ``full`` run of
    those settings; several full runs of one setting without ``--baseline`` are refused. A run of other settings
    than every baseline gets no retention, and a note says what differs."""
    paths = _with_baselines(expand_dirs(dirs), baselines)
    sums = [load_summary(d) for d in paths]
    runs = list(zip(paths, sums))
    picked = _pick_baselines(runs, baselines)
    tasks = list(dict.fromkeys(t for s in sums for t in s["scores"]))
    header = ["benchmark", "model", "length", "policy", "budget", *tasks, "average", "KV bytes", "KV vs baseline",
              "KV read/step", "reads vs baseline", "retention"]
    rows, notes = [], []
    order = sorted(range(len(runs)), key=lambda i: (sums[i]["benchmark"], str(sums[i].get("length")),
                                                    sums[i]["policy"] != "full", sums[i]["policy"],
                                                    budget_of(sums[i].get("options") or {})))
    for i in order:
        d, s = runs[i]
        b = picked.get(_settings(s))
        ret = kv_frac = read_frac = None
        if b is not None:
            ref = sums[b]
            if ref["average"] and s["average"] is not None:
                ret = round(s["average"] / ref["average"], 4)
            kv_frac = _ratio(s.get("mean_kv_bytes"), ref.get("mean_kv_bytes"))
            # the full cache reads every byte it holds: a baseline without read counts stands in with its bytes
            read_frac = _ratio(s.get("mean_kv_read"), ref.get("mean_kv_read") or ref.get("mean_kv_bytes"))
        elif picked:
            j = _nearest(s, runs, picked)
            notes.append(f"- {d}: no retention: no baseline of its settings ({_differs(s, sums[j])} against {paths[j]})")
        kv, rd = s.get("mean_kv_bytes"), s.get("mean_kv_read")
        rows.append([s["benchmark"], s.get("model"), s.get("length"), s["policy"], budget_of(s.get("options") or {}),
                     *[s["scores"].get(t) for t in tasks], s["average"],
                     fmt_bytes(kv) if kv is not None else None, kv_frac,
                     fmt_bytes(rd) if rd is not None else None, read_frac, ret])
    md = markdown_table(header, rows)
    if not picked:
        md += "\n(no `full` run among these folders: retention needs the full-cache baseline, or --baseline DIR)\n"
    else:
        md += _baseline_lines(runs, picked)
    if notes:
        md += "\n" + "\n".join(notes) + "\n"
    if out is not None:
        out = Path(out)
        atomic_write_text(out / "compare.md", md)
        atomic_write_text(out / "compare.csv", csv_text(header, rows))
    return md


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if _number(a) and _number(b) and b else None


def fmt_bytes(n) -> str:
    return fmt(int(n))
