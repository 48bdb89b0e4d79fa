"""Retention vs KV kept, one panel per model (the kvpress leaderboard's picture), from the RULER policy tables.

    python benchmarks/policies/policy_table.py --model default && python benchmarks/policies/policy_table.py --model qwen05
    python benchmarks/policies/retention_figure.py      # -> results/ruler/retention.png

x = the fraction of full's KV a policy keeps on the device (``KVCache.nbytes()``), or for TidalDecode, which keeps
every byte, the fraction it reads per decode step; y = RULER-4K retention (score / full's on the same samples).
Filled markers: question-agnostic (context compressed before the question); hollow: question in the prefill. Each
point is labelled with its policy and setting (the tables' ``label`` column); rows marked not drawn there (a setting
another row at the same bytes shows better, or one with fewer than 13 samples) stay in the tables only.
"""

import csv
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

root = pathlib.Path(__file__).resolve().parents[2]
ruler = root / "results" / "ruler"
PANELS = [(ruler / "policies-smollm2-4k.csv", "SmolLM2-135M-Instruct (default model), 65 samples"),
          (ruler / "policies-qwen05-4k.csv", "Qwen2.5-Coder-0.5B-Instruct, 39 samples")]
STYLE = {"duo": ("tab:blue", "o"), "tidal": ("tab:orange", "s"), "zipcache": ("tab:green", "D"),
         "shadowkv": ("tab:red", "^"), "cake": ("tab:purple", "v"), "chelsea": ("tab:brown", "P"),
         "snapkv": ("tab:pink", "X"), "kvzip": ("tab:olive", "h"), "streaming": ("tab:gray", "*")}
MIN_SAMPLES = 13


#: label offsets (points) tried in order next to a marker: beside it first, then further up / down (with a leader line)
SPOTS = [(6, -3), (-6, -3)] + [(sx * dx, dy) for dy in (9, -15, 18, -24, 27, -33, 36, -42, 45, -51)
                               for dx in (6, 30) for sx in (1, -1)]


BOX = dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8)  # a label stays readable over grid lines


def load(path):
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return [r for r in csv.DictReader(fh) if r.get("retention") and int(r["samples"] or 0) >= MIN_SAMPLES
                and r["drawn"] == "True"]


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def place_labels(ax, points):
    """Each label at the first offset (SPOTS) where its box covers no marker, no other label and stays inside the
    axes; measured with the renderer, so no two labels overlap. Labels of crowded points are placed first."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    inv = ax.transData
    marks = [inv.transform((x, y)) for x, y, *_ in points]
    from matplotlib.transforms import Bbox

    taken = [Bbox.from_extents(mx - 6, my - 6, mx + 6, my + 6) for mx, my in marks]
    taken.append(ax.get_legend().get_window_extent(renderer))
    frame = ax.get_window_extent(renderer)
    crowd = [sum(abs(m[0] - o[0]) < 120 and abs(m[1] - o[1]) < 40 for o in marks) for m in marks]
    for i in sorted(range(len(points)), key=lambda i: -crowd[i]):
        x, y, text, color = points[i]
        mx, my = marks[i]
        for dx, dy in SPOTS:
            t = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, color=color,
                            ha="right" if dx < 0 else "left", va="bottom", bbox=BOX)
            box = t.get_window_extent(renderer).expanded(1.02, 1.1)
            inside = frame.x0 < box.x0 and box.x1 < frame.x1 and frame.y0 < box.y0 and box.y1 < frame.y1
            if inside and not any(overlaps(box, b) for b in taken):
                if abs(dy) > 8 or abs(dx) > 6:
                    t.remove()
                    t = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7,
                                    color=color, ha="right" if dx < 0 else "left", va="bottom", bbox=BOX,
                                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=0, shrinkB=5))
                taken.append(box)
                break
            t.remove()
        else:
            raise SystemExit(f"no free place for the label {text!r}: enlarge the figure")


fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 7.5), sharey=True)
panel_points = []
for ax, (path, title) in zip(axes, PANELS):
    rows = load(path)
    seen, points = set(), []
    for r in rows:
        p = r["policy"]
        color, marker = STYLE.get(p, ("black", "."))
        x = float(r["reads_vs_full"]) if r.get("reads_vs_full") else float(r["kv_vs_full"])
        y = float(r["retention"])
        aware = r["protocol"] != "agnostic"
        ax.scatter([x], [y], s=60, marker=marker, color=color if not aware else "none", edgecolors=color,
                   linewidths=1.6, label=p if p not in seen else None, zorder=3)
        seen.add(p)
        points.append((x, y, r["label"] + (", q. in prefill" if aware else ""), color))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("KV kept on device (tidal: K/V read per step), fraction of full")
    ax.set_xlim(0, 0.8)
    ax.set_ylim(0.05, 1.3)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    panel_points.append(sorted(points, key=lambda q: (-q[1], q[0])))
axes[0].set_ylabel("RULER-4K retention (score / full's, same samples)")
fig.suptitle("RULER-4K: answer kept vs KV kept (filled: context compressed before the question; hollow: "
             "question in the prefill)", fontsize=11)
fig.tight_layout()
for ax, points in zip(axes, panel_points):  # after the layout: the labels are measured where they will be drawn
    place_labels(ax, points)
out = ruler / "retention.png"
fig.savefig(out, dpi=120)
print(out)
