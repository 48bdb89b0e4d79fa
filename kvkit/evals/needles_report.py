"""The fresh-needle table and figure: accuracy against the full cache's on the same samples, per run, vs KV bytes.

Reads run folders (``config.json`` + ``samples.jsonl`` of :class:`kvkit.evals.rundir.RunDir`) of one protocol and
sample set; the baseline is the run whose policy is ``full``. Per run: accuracy (mean ``string_match_all``),
accuracy on the samples full answers (``kept``: the needles the policy keeps of those the model can find at all),
``x full`` = accuracy / full's accuracy on the same samples, per-format accuracy, and the mean KV bytes held at the
end of generation as a fraction of full's. Rows are matched on (id, sample_sha): a run of other prompts is refused;
every run is scored on the samples all runs share (a run stopped early narrows the table).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvkit.evals.files import atomic_write_bytes, atomic_write_text, read_rows
from kvkit.evals.report import agg_pyplot, markdown_table, png_bytes


def load_runs(folders: list[Path]) -> list[tuple[str, dict, list[dict]]]:
    out = []
    for d in folders:
        cfg = json.loads((d / "config.json").read_text())
        out.append((d.name, cfg, read_rows(d / "samples.jsonl", required=("id", "task", "score"))))
    return out


def table(runs: list[tuple[str, dict, list[dict]]]) -> tuple[list[str], list[list], list[dict]]:
    """(header, rows, records) of the runs against their ``full`` run (ValueError without one, or on other
    samples)."""
    base = [r for r in runs if r[1].get("policy") == "full"]
    if len(base) != 1:
        raise ValueError(f"the needle table needs exactly one run of policy 'full' among the runs, found {len(base)}")
    _, _, brows = base[0]
    bkey = {(r["id"], r.get("sample_sha")): r for r in brows}
    for name, _, rows in runs:
        stray = [r["id"] for r in rows if (r["id"], r.get("sample_sha")) not in bkey]
        if stray:
            raise ValueError(f"run {name!r}: {len(stray)} of its rows are not samples of the full run "
                             "(another seed, length, protocol or prompt set)")
    # every row is scored on the samples all runs have (a run stopped early narrows the table, never skews it)
    common = set(bkey)
    for _, _, rows in runs:
        common &= {(r["id"], r.get("sample_sha")) for r in rows}
    bkey = {k: v for k, v in bkey.items() if k in common}
    formats = sorted({r.get("task") for r in brows})
    header = ["run", "policy", "options", "accuracy", "x full", "kept (of full's)", *formats, "KV bytes x full",
              "reads x full", "samples"]
    out, records = [], []
    for name, cfg, rows in runs:
        shared = [r for r in rows if (r["id"], r.get("sample_sha")) in bkey]
        if not shared:
            continue
        b = [bkey[(r["id"], r.get("sample_sha"))] for r in shared]
        acc = sum(r["score"] for r in shared) / len(shared)
        bacc = sum(r["score"] for r in b) / len(b)
        known = [r for r, x in zip(shared, b) if x["score"] >= 1.0]
        kept = sum(r["score"] for r in known) / len(known) if known else None
        per = {f: [r["score"] for r in shared if r.get("task") == f] for f in formats}
        kvb = sum(r["kv_bytes"] for r in shared) / max(1, sum(x["kv_bytes"] for x in b))
        # mean bytes read per step / full's. Rows written before kvkit recorded kv_read have none; the full cache reads
        # every byte it holds, so full's own rows stand in with their kv_bytes
        reads = None
        if all("kv_read" in r for r in shared):
            reads = sum(r["kv_read"] for r in shared) / max(1, sum(x.get("kv_read", x["kv_bytes"]) for x in b))
        rec = dict(run=name, policy=cfg.get("policy"), options=cfg.get("options") or {},
                   label=point_label(cfg.get("policy"), cfg.get("options") or {}), accuracy=acc,
                   x_full=acc / bacc if bacc else None, kept=kept, kv_fraction=kvb, read_fraction=reads,
                   samples=len(shared),
                   per_format={f: (sum(v) / len(v) if v else None) for f, v in per.items()})
        records.append(rec)
        opts = rec["options"]
        label = (f"{opts.get('nbits')}-bit {opts.get('backend')}, groups {opts.get('q_group_size')}, "
                 f"{opts.get('residual_length')} recent exact") if rec["policy"] == "quantized" else \
            options_label(opts, {k: v for k, v in (cfg.get("option_files") or {}).items() if k not in opts})
        out.append([name, rec["policy"], label or "-", round(acc, 3),
                    None if rec["x_full"] is None else round(rec["x_full"], 3), None if kept is None else round(kept, 3),
                    *[None if rec["per_format"][f] is None else round(rec["per_format"][f], 3) for f in formats],
                    round(kvb, 3), None if reads is None else round(reads, 3), len(shared)])
    return header, out, records


def options_label(options: dict, picked: dict | None = None) -> str:
    """Every option a run set, ``budget`` first (``budget=1526,protect_heads=0.2``), then the files the policy picked
    by itself, by the first 8 hex digits of their sha256 (``shipped pattern 738e2724``): a row names its whole
    setting, and two runs of the shipped pattern before and after a recalibration read apart."""
    keys = sorted(options, key=lambda k: (k != "budget", k))
    parts = [f"{k}={options[k]}" for k in keys] + [f"shipped {k} {sha[:8]}" for k, sha in sorted((picked or {}).items())]
    return ",".join(parts) or "-"


#: how a figure label reads an option (``None``: left out, it does not tell settings apart at a glance)
LABEL_OPTIONS = {"protect_heads": lambda v: f"protect heads {float(v):.0%}", "landmark": lambda v: f"{v} landmark",
                 "selection": lambda v: {"shared": "shared selection", "q_head": "per query head",
                                         "kv_head": "per KV head"}.get(v, f"selection {v}"),
                 "pool_window": lambda v: f"{v} window", "key_bits": lambda v: f"{v}-bit keys",
                 "key_group": lambda v: "per-channel statistics" if v is None else f"key groups of {v}",
                 "pattern": lambda v: f"pattern {Path(str(v)).stem}", "protect": lambda v: f"protect {v}",
                 "adaptive": lambda v: "ranked together" if v else "uniform per layer",
                 "min_prompt": None, "protect_pattern": None, "kernel": None, "pool_kernel": None, "pooling": None,
                 "stats": None, "high_bits": None, "low_bits": None, "high_ratio": None}
LABEL_SIZE = ("budget", "ratio", "sparsity")  # the option a label puts right after the policy's name


def point_label(policy: str, options: dict) -> str:
    """A figure label that names the policy and its setting in words: ``snapkv 1526, protect heads 20%``,
    ``zipcache, 8-bit keys``, ``quanto 4-bit`` (transformers' QuantizedCache). Options that only fine-tune a setting
    (pooling kernels, ``min_prompt``, pattern files) are left to the table's ``options`` column."""
    if policy == "quantized":
        return f"quanto {options.get('nbits', '?')}-bit"
    size = next((options[k] for k in LABEL_SIZE if k in options), None)
    head = policy if size is None else f"{policy} {size:g}" if isinstance(size, float) else f"{policy} {size}"
    parts = []
    for k in sorted(options):
        if k in LABEL_SIZE:
            continue
        fmt = LABEL_OPTIONS.get(k, lambda v, k=k: f"{k}={v}")
        if fmt is not None:
            parts.append(fmt(options[k]))
    return ", ".join([head, *parts])


def uncompressed(records: list[dict]) -> list[str]:
    """The runs of a compressing policy that held and read (about) all of full's bytes and offloaded nothing: they
    ran as ``full`` (e.g. every prompt was at most the policy's ``min_prompt``), so their accuracy says nothing of
    the policy. Runs without read counts are not judged."""
    return [r["run"] for r in records if r["policy"] not in ("full",) and r["read_fraction"] is not None
            and r["kv_fraction"] >= 0.99 and r["read_fraction"] >= 0.99]


#: one 8-pt text line in y units of the figure's axis (~290 pt tall, spanning ~1.05), and one 8-pt character as a
#: fraction of the axis width (~470 pt; the estimate errs long): times the x span in decades
LABEL_LINE, LABEL_CHAR = 0.036, 0.0115
LABEL_WRAP = 30  # characters per line of a shared label ("a, b, c" wraps after a comma)


def wrap_names(names: list[str], width: int = LABEL_WRAP, sep: str = ", ") -> list[str]:
    """The lines of a shared label: ``names`` joined by ``sep``, a new line before a name that would pass ``width``
    (a single longer name keeps its own line)."""
    lines, cur = [], ""
    for n in names:
        if cur and len(cur) + len(sep) + len(n) > width:
            lines.append(cur + sep.rstrip())
            cur = n
        else:
            cur = f"{cur}{sep}{n}" if cur else n
    return lines + [cur]


def label_spots(shown: list[dict], decades: float = 1.0) -> list[tuple]:
    """Where the figure's labels go, in data units (x in decades of the log axis), so that the overlap test and the
    placement agree: a run's label is its ``label`` (:func:`point_label`; its ``run`` name without one); runs at the
    same point share one label (``"a, b"``, wrapped into lines of ``LABEL_WRAP``
    characters by :func:`wrap_names`); a label goes right of its point, else left of it, else a line lower (then with
    a leader line), never over another label or a marker. Labels that fit on their point's line are placed before the
    moved ones; a moved label keeps clear of the places beside other points, and its leader line crosses no other.
    Returns one ``(text, point, text_xy, left, moved, box)`` per label: ``text_xy`` is where the label's bottom line starts (its end when ``left``), ``moved`` when it sits below
    its point's line, ``box`` its ``(x0, x1, y0, y1)`` (x in decades). ``decades``: the x axis' span (a character is
    ``LABEL_CHAR x decades`` wide, a marker ~0.75 of one; :func:`label_axis` makes the axis that span)."""
    shown = [{**r, "kv_fraction": max(r["kv_fraction"], 1e-9)} for r in shown]  # log axis
    groups: list[list[dict]] = []
    for r in sorted(shown, key=lambda r: (-r["x_full"], r["kv_fraction"])):
        same = [g for g in groups if abs(g[0]["x_full"] - r["x_full"]) < 0.005
                and abs(math.log10(g[0]["kv_fraction"] / r["kv_fraction"])) < 0.005]
        (same[0].append(r) if same else groups.append([r]))
    char = LABEL_CHAR * decades
    taken = [(math.log10(r["kv_fraction"]) - 0.75 * char, math.log10(r["kv_fraction"]) + 0.75 * char,
              r["x_full"] - 0.015, r["x_full"] + 0.015) for r in shown]  # the markers, then each placed label's box
    out: list = [None] * len(groups)
    leaders: list[tuple] = []  # (x0, y0, x1, y1) of each moved label's leader line
    # beside each group's point, where a label reads as that point's: no other group's moved label goes there
    beside = [(math.log10(g[0]["kv_fraction"]) - 4 * char, math.log10(g[0]["kv_fraction"]) + 4 * char,
               g[0]["x_full"] - 0.6 * LABEL_LINE, g[0]["x_full"] + 0.6 * LABEL_LINE) for g in groups]

    def hits(box: tuple, boxes) -> bool:
        x0, x1, y0, y1 = box
        return any(a < x1 and x0 < b and c < y1 and y0 < d for a, b, c, d in boxes)

    def place(i: int, lines_down: range, last_resort: bool) -> bool:
        """Put group ``i``'s label on the first free spot: lines in order, within a line right then left. A spot is
        free when its box covers no marker and no label; a moved one (below its point's line) must also keep clear of
        the places beside other groups' points and have a leader line that crosses no other. When none is free:
        False, or with ``last_resort`` the right side of the last line."""
        g = groups[i]
        x, y0 = math.log10(g[0]["kv_fraction"]), g[0]["x_full"]
        # worded labels hold commas themselves ("snapkv 1526, protect heads 20%"): several at a point part with "; "
        lines = wrap_names([r.get("label", r["run"]) for r in g], sep="; " if any("label" in r for r in g) else ", ")
        w = char * max(len(line) for line in lines)
        h = LABEL_LINE * (len(lines) - 1) + 0.9 * LABEL_LINE  # lines stack upwards from the bottom one
        others = [b for j, b in enumerate(beside) if j != i]
        for n in lines_down:
            y = y0 + 0.005 - n * LABEL_LINE
            # (box, where the text is anchored: its start right of the point, its end left of it)
            spots = [((x + char, x + char + w, y, y + h), x + char), ((x - char - w, x - char, y, y + h), x - char)]
            free = [sp for sp in spots if not hits(sp[0], taken) and not (
                n and (hits(sp[0], others) or any(_crosses((x, y0, sp[1], y), seg) for seg in leaders)))]
            if free:
                break
        if not free and not last_resort:
            return False
        (box, end), left = (free[0], free[0] is spots[1]) if free else (spots[0], False)
        taken.append(box)
        if n:
            leaders.append((x, y0, end, y))
        out[i] = ("\n".join(lines), (10 ** x, y0), (10 ** end, y), left, n > 0, box)
        return True

    # First every label that fits on its own point's line (right, else left). A label moved down first would take
    # the place beside a lower point that that point's label needs, and read as that point's. Then the rest, a line
    # lower or more, with leader lines that cross no other.
    later = [i for i in range(len(groups)) if not place(i, range(1), last_resort=False)]
    for i in later:
        place(i, range(1, 40), last_resort=True)
    return out


def _crosses(p: tuple, q: tuple) -> bool:
    """Whether the segments ``p`` and ``q`` (``(x0, y0, x1, y1)`` each) cross at a point inside both."""
    def side(ax, ay, bx, by, cx, cy):
        return (bx - ax) * (cy - ay) - (by - ay) * (cx - ax)

    a, b = side(*p, q[0], q[1]), side(*p, q[2], q[3])
    c, d = side(*q, p[0], p[1]), side(*q, p[2], p[3])
    return a * b < 0 and c * d < 0


#: the byte fractions the scatter's log axis may mark
BYTE_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def byte_ticks(least: float, most: float) -> tuple[list[float], float, float]:
    """The ticks of the scatter's byte axis for points from ``least`` to ``most`` (fractions of full's bytes), and the
    span in decades ``(lo, hi)`` the axis must hold: the points and every tick within a factor 1.2 of them, so a
    point just above a tick (0.34) has that tick (0.3) on the axis beside it rather than past its edge."""
    least, most = max(least, 1e-9), max(most, 1e-9)
    ticks = [t for t in BYTE_TICKS if least / 1.2 <= t <= 1.2 * most]
    lo = min([math.log10(least), *(math.log10(t) for t in ticks)])
    hi = max([math.log10(most), *(math.log10(t) for t in ticks)])
    return ticks, lo, hi


def label_axis(shown: list[dict], lo: float, hi: float) -> tuple[list[tuple], float, float]:
    """The labels (:func:`label_spots`) and the x axis ``(x0, x1)`` in decades that holds every point (``lo`` .. ``hi``)
    and every label, sized for the span it gets: labels are measured in fractions of the axis width, and an axis
    widened for them makes them wider in decades, so the span is grown until it holds what was measured for it (a
    few passes; wrapped labels keep the growth small). The axis is exactly the span the labels were sized for."""
    decades = max(hi - lo, 0.05) * 1.25  # the data plus the margins and the labels' reach
    for _ in range(8):
        spots = label_spots(shown, decades)
        pad = 0.04 * decades
        x0 = min([lo, *(b[0] for *_, b in spots)]) - pad
        x1 = max([hi, *(b[1] for *_, b in spots)]) + pad
        if x1 - x0 <= decades:
            break
        decades = (x1 - x0) * 1.001
    return spots, x0, max(x1, x0 + decades)  # (x1 beyond it only if the passes ran out: then every label still fits)


#: more runs than this are drawn as a dot chart (:func:`dot_chart_png`): labelled points at a few shared byte
#: fractions (the same compression ratio for many policies) cannot be told apart in the scatter
SCATTER_MOST = 16


def dot_chart_png(records: list[dict], title: str) -> bytes:
    """One row per run, grouped by policy (``full`` first), ordered by the bytes a step reads within a policy: a
    marker at ``x full`` (needles answered / full's on the same samples), its colour and the number at the right the
    bytes a decode step reads / full's (held where no read count was recorded). For roots of many runs at a few byte
    fractions, where the scatter's labels would crowd (matplotlib, Agg)."""
    from matplotlib import colormaps

    shown = [r for r in records if r["x_full"] is not None]
    frac = lambda r: r["read_fraction"] if r.get("read_fraction") is not None else r["kv_fraction"]  # noqa: E731
    shown.sort(key=lambda r: (r["policy"] != "full", r["policy"], -frac(r), r.get("label", r["run"])))
    n = len(shown)
    fig, ax = agg_pyplot().subplots(figsize=(9.5, 1.2 + 0.24 * n), layout="constrained")
    cmap = colormaps["viridis"]
    ys = list(range(n))[::-1]  # the first run on top
    for i, (y, r) in enumerate(zip(ys, shown)):
        ax.plot([0, r["x_full"]], [y, y], color="0.85", lw=0.8, zorder=1)
        ax.scatter(r["x_full"], y, s=36, color=cmap(min(frac(r), 1.0)), edgecolor="0.2", lw=0.4, zorder=2)
        ax.text(1.13, y, f"{frac(r):.2f}", va="center", ha="right", fontsize=7.5)
        if i and r["policy"] != shown[i - 1]["policy"]:  # a thin rule between policies
            ax.axhline(y + 0.5, color="0.6", lw=0.5)
    ax.set_yticks(ys)
    ax.set_yticklabels([r.get("label", r["run"]) for r in shown], fontsize=7.5)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlim(0, 1.15)
    ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0])
    ax.axvline(1.0, color="black", lw=0.6, ls=":")
    ax.text(1.13, n - 0.35, "reads\nx full", va="bottom", ha="right", fontsize=7.5)
    ax.set_xlabel("needles answered / full's (same samples)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10, loc="left")
    return png_bytes(fig, 120)


def figure_png(records: list[dict], title: str) -> bytes:
    """Accuracy x full vs KV bytes x full, one point per run, labelled (matplotlib, Agg); more than
    :data:`SCATTER_MOST` runs: :func:`dot_chart_png`."""
    if sum(r["x_full"] is not None for r in records) > SCATTER_MOST:
        return dot_chart_png(records, title)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = agg_pyplot().subplots(figsize=(7.5, 5))
    shown = [r for r in records if r["x_full"] is not None]
    for r in shown:
        peer = r["policy"] == "quantized"
        ax.scatter(r["kv_fraction"], r["x_full"], s=45, marker="s" if peer else "o",
                   color="tab:gray" if peer else ("black" if r["policy"] == "full" else "tab:blue"))
    ticks, lo, hi = byte_ticks(min(r["kv_fraction"] for r in records), max(r["kv_fraction"] for r in records))
    spots, x0, x1 = label_axis(shown, lo, hi)
    for text, (px, py), (tx, ty), left, moved, _ in spots:
        ax.annotate(text, (px, py), xytext=(tx, ty), textcoords="data", fontsize=8, va="bottom",
                    ha="right" if left else "left",
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.45", shrinkA=0, shrinkB=4) if moved else None)
    top = max(1.05, max((r["x_full"] for r in shown), default=1.0) + 0.05, *(b[3] + 0.01 for *_, b in spots))
    ax.set_xlabel("KV bytes held / full's (log scale)")
    ax.set_xscale("log")
    ax.set_xlim(10 ** x0, 10 ** x1)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("needles answered / full's (same samples)")
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return png_bytes(fig, 130)


def model_label(model, dtype: str = "float32") -> str:
    """The model as a report names it: its name, with the dtype when it ran in another than fp32."""
    return f"{model}" if dtype == "float32" else f"{model} ({dtype})"


def report_title(model: str, length: int, protocol: str, haystack: str, dtype: str = "float32") -> str:
    """The report's title and the figure's: ``Fresh needles: default, 4096 tokens of essay, question-agnostic``;
    a model run in another dtype than fp32 says so (``Fresh needles: default (bfloat16), ...``)."""
    return f"Fresh needles: {model_label(model, dtype)}, {length} tokens of {haystack}, question-{protocol}"


def write_report(root: Path, folders: list[Path], title: str) -> str:
    """``root/needles.md`` (+ ``needles.png``) over ``folders``; returns the markdown."""
    runs = load_runs(folders)
    header, rows, records = table(runs)
    cfg = runs[0][1]
    md = (f"# {title}\n\nModel {model_label(cfg.get('model'), cfg.get('dtype', 'float32'))}; protocol {cfg.get('protocol')}; lengths {cfg.get('lengths')}; "
          f"formats {cfg.get('formats')}; haystack {cfg.get('haystack')}; seed {cfg.get('seed')} (calibrations: "
          "seeds 0-99 of kvkit.calibrate.needles, other needles and text). `x full`: accuracy / full's on the same "
          "samples; `kept`: accuracy on the samples full answers; `reads x full`: bytes a decode step reads at the "
          "end / full's.\n\n" + markdown_table(header, rows) + "\n")
    same = uncompressed(records)
    if same:
        md += (f"\n**Did not compress**: {', '.join(same)} held and read all of full's KV (e.g. every prompt at most "
               "the policy's `min_prompt`): these rows measure `full`, not the policy.\n")
    atomic_write_text(root / "needles.md", md)
    atomic_write_bytes(root / "needles.png", figure_png(records, title))
    return md
