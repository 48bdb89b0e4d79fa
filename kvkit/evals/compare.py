"""``kvkit eval compare``'s tables: runs side by side (:func:`compare`: scores, KV bytes held and read, their ratios to
the matching ``full`` run) and each run scored only on the samples it shares with its baseline
(:func:`compare_matched`); :func:`expand_dirs` turns a needles output folder into its run folders."""

from __future__ import annotations

import json
from pathlib import Path

from kvkit.evals.files import atomic_write_text, read_rows
from kvkit.evals.report import (
    _ratio,
    csv_text,
    fmt_bytes,
    load_summary,
    markdown_table,
    options_text,
    task_scores,
)


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
        opts = options_text(cfg.get("options") or {})
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
    """One table of runs (a row per policy and its options) over several eval summaries, with retention = score /
    baseline score beside the KV bytes held (and read per decode step) and their fraction of the baseline's.

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
    header = ["benchmark", "model", "length", "policy", "options", *tasks, "average", "KV bytes", "KV vs baseline",
              "KV read/step", "reads vs baseline", "retention"]
    rows, notes = [], []
    order = sorted(range(len(runs)), key=lambda i: (sums[i]["benchmark"], str(sums[i].get("length")),
                                                    sums[i]["policy"] != "full", sums[i]["policy"],
                                                    options_text(sums[i].get("options") or {})))
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
        rows.append([s["benchmark"], s.get("model"), s.get("length"), s["policy"],
                     options_text(s.get("options") or {}),
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
