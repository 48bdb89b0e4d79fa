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
from kvkit.evals.files import atomic_write_bytes, atomic_write_json, atomic_write_text
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


def agg_pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int) -> bytes:
    """``fig`` as PNG bytes at ``dpi``; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    agg_pyplot().close(fig)
    return buf.getvalue()


def heatmap_png(grid: list[list[float | None]], lengths: list[int], depths: list[float], title: str) -> bytes:
    """NIAH heatmap: depth on y (0% at top), context length on x, score (0-100) in each cell."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("niah", list(NIAH_COLORS))
    data = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
    fig, ax = agg_pyplot().subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.45 * len(depths)))
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
    return png_bytes(fig, 110)


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


def options_text(options: dict) -> str:
    """A run's policy options as ``key=value`` pairs in key order (``-`` for none): every option shown, so two runs
    of a policy that differ in any option get different rows, and a number is never shown without its knob (a
    ``budget`` of tokens, a ``compression_ratio`` removed, chelsea's ``ratio`` kept)."""
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


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if _number(a) and _number(b) and b else None


def fmt_bytes(n) -> str:
    return fmt(int(n))
