"""Reports of the batched decode bench (:func:`kvkit.evals.bench.batched.decode_bench`): its markdown / CSV tables,
a profile summary, the "decode throughput vs batch" figure, and the files of a run's output folder
(``summary.json``, ``summary.md``, one CSV per table, ``throughput_vs_batch.png``; ``partial.json`` while it runs).

A table is ``(header, rows)``: a list of column names and a list of rows of the same length.
"""

from __future__ import annotations

from pathlib import Path

from kvkit.evals.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from kvkit.evals.report import agg_pyplot, csv_text, markdown_table, png_bytes


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def decode_tables(result: dict) -> dict[str, tuple[list[str], list[list]]]:
    """The markdown/CSV tables of a :func:`decode_bench` result: ``{"decode": (header, rows), "memory": ...,
    "fits": ..., "profile": ...}`` (the last three when measured)."""
    tables = {}
    h = ["policy", "threads", "batch x length", "step ms (median)", "full's step ms (same rounds)", "tok/s",
         "speed-up vs full", "CPU ms/step", "speed-up in CPU time", "fraction (CPU time)", "byte bound",
         "fraction of bound", "KV held", "held vs full", "KV read/step", "read vs full", "offloaded", "step ms mean",
         "steps"]
    rows = [[r["label"], r["threads"], f"{r['batch']} x {r['length']}", r["step_ms"], r.get("full_step_ms"),
             r["tok_s"], r.get("speedup"), r.get("cpu_ms"), r.get("cpu_speedup"), r.get("cpu_fraction"),
             r.get("bound"), r.get("fraction"), _mib(r["kv_held"]), r.get("kv_held_vs_full"), _mib(r["kv_read_step"]),
             r.get("kv_read_vs_full"), _mib(r["kv_offloaded"]) if r["kv_offloaded"] else "-", r["step_ms_mean"],
             r["steps"]] for r in result["rows"]]
    tables["decode"] = (h, rows)
    if result.get("partial"):
        return tables
    if result.get("fits"):
        h = ["policy", "KV held / seq", "+ headroom", "fits in memory", "vs full", "full/policy bytes",
             "fits counting offloaded", "measured at"]
        tables["fits"] = (h, [[f["label"], _mib(f["kv_held_per_seq"]), _mib(f["headroom_per_seq"]), f["fit_batch"],
                               f.get("fit_vs_full"), f.get("held_ratio"), f["fit_batch_with_offloaded"],
                               f["measured_batch"]] for f in result["fits"]])
    if result.get("memory"):
        h = ["policy", "threads", "fits", "measured batch", "step ms (median)", "tok/s", "full's batch",
             "full's tok/s (same rounds)", "throughput vs full", "batch vs full", "KV held", "step ms mean"]
        full = {(r["paired_with"], r["threads"]): r for r in result["memory"] if r.get("paired_with")}
        tables["memory"] = (h, [[r["label"], r["threads"], r["fit_batch"], r["batch"], r["step_ms"], r["tok_s"],
                                 full[(r["label"], r["threads"])]["batch"], full[(r["label"], r["threads"])]["tok_s"],
                                 r.get("throughput_vs_full"), r.get("batch_vs_full"), _mib(r["kv_held"]),
                                 r["step_ms_mean"]] for r in result["memory"] if not r.get("paired_with")])
    if result.get("profile"):
        h = ["policy", "step ms (profiled)", "op", "self ms / step", "% of self CPU", "calls / step"]
        prows = []
        for label, p in result["profile"].items():
            for i, op in enumerate(p["ops"]):
                prows.append([label if i == 0 else "", p["step_ms"] if i == 0 else "", op["name"], op["self_ms"],
                              op["pct"], op["calls"]])
        tables["profile"] = (h, prows)
    return tables


def profile_summary(result: dict, top: int = 5) -> tuple[list[str], list[list]]:
    """One line per policy: profiled step time and its ``top`` ops by self CPU time (``op pct%``)."""
    h = ["policy", "step ms (profiled)", f"top {top} ops by self CPU time (% of the step's self CPU time)"]
    return h, [[label, p["step_ms"], "; ".join(f"{o['name']} {o['pct']:.0f}%" for o in p["ops"][:top])]
               for label, p in (result.get("profile") or {}).items()]


def write_decode_results(out, result: dict, config: dict, title: str = "") -> str:
    """``summary.json`` (config + every row), ``summary.md`` (all tables), ``decode.csv`` and, when measured,
    ``memory.csv`` / ``fits.csv`` / ``profile.csv``, and ``throughput_vs_batch.png``. Returns the markdown."""
    out = Path(out)
    atomic_write_json(out / "summary.json", dict(config, **result))
    tables = decode_tables(result)
    md = f"# {title}\n\n" if title else ""
    md += (f"batch {result['batch']} x {result['length']} tokens (left-padded essay passages: {result['real_tokens']} "
           f"real + {result['padded_tokens']} padding tokens), weights {_mib(result['weights'])}; "
           f"{result['rounds']} interleaved rounds x {result['steps']} decode steps per policy and thread count; "
           "speed-up = full's median step / the policy's (wall clock; 'in CPU time': the process's CPU time per step, "
           "all threads, which a shared, oversubscribed CPU inflates less); byte bound = (weights + full's KV read per step) / "
           "(weights + the policy's); fraction = (speed-up - 1) / (bound - 1).\n\n")
    names = {"decode": "Decode at batch", "fits": f"Largest batch in --memory {result.get('memory_gib')} GiB",
             "memory": "Decode throughput at the memory-fit batch (capped at --max-batch "
                       f"{result.get('max_batch')})", "profile": "Profile: top ops by self CPU time per decode step"}
    for key, (h, rows) in tables.items():
        if key == "profile":
            ph, prow = profile_summary(result)
            md += f"## Profile summary ({result.get('profile_threads')} thread(s))\n\n" + markdown_table(ph, prow) + "\n"
        md += f"## {names[key]}\n\n" + markdown_table(h, rows) + "\n"
        atomic_write_text(out / f"{key}.csv", csv_text(h, rows))
    if config.get("command"):
        md += f"Command: `{config['command']}`\n"
    atomic_write_text(out / "summary.md", md)
    png = throughput_figure([result], title=title)
    if png:
        atomic_write_bytes(out / "throughput_vs_batch.png", png)
    (out / "partial.json").unlink(missing_ok=True)  # superseded by summary.json
    return md


def throughput_figure(results: list[dict], title: str = "", threads: int | None = None) -> bytes | None:
    """"Decode throughput vs batch" per policy (matplotlib, Agg): every (batch, tok/s) point of the given
    :func:`decode_bench` results at one context length and thread count (the first one by default), one line
    per policy. None when no policy has two batch sizes."""
    pts: dict[str, dict[int, float]] = {}
    length = None
    for res in results:
        t = threads or res["threads"][0]
        length = length or res["length"]
        for r in res.get("rows", []) + res.get("memory", []):
            if r["threads"] == t and r["length"] == length:
                pts.setdefault(r["label"], {})[r["batch"]] = r["tok_s"]
    if not any(len(v) > 1 for v in pts.values()):
        return None
    fig, ax = agg_pyplot().subplots(figsize=(7.5, 4.8))
    markers = "osD^v<>pPXh*"
    for i, (label, p) in enumerate(sorted(pts.items(), key=lambda kv: kv[0] != "full")):
        xs = sorted(p)
        ax.plot(xs, [p[x] for x in xs], marker=markers[i % len(markers)], lw=2.4 if label == "full" else 1.4,
                color="black" if label == "full" else None, label=label)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_title(title or f"decode throughput vs batch, context {length}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return png_bytes(fig, 120)


def write_partial(out, result: dict, config: dict) -> None:
    """``partial.json``: the rows measured so far by a running :func:`decode_bench` (removed when the final
    ``summary.json`` is written)."""
    atomic_write_json(Path(out) / "partial.json", dict(config, **result))
