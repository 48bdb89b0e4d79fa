"""Needle in a haystack: a depth x context-length grid of single-needle retrieval (RULER's
``niah_single_2`` sample: Paul Graham essays, a word key, a 7-digit number value) with the needle at
a fixed depth, scored with ``string_match_all``; a heatmap in the conventional colours."""

from __future__ import annotations

from kvkit.evals import ruler
from kvkit.evals.ruler_tasks import TASKS
from kvkit.evals.runner import progress


def depth_grid(n: int) -> list[float]:
    """``n`` depths evenly from 0% (top) to 100% (bottom)."""
    if n < 1:
        raise ValueError(f"--depths must be >= 1, got {n}")
    return [0.0] if n == 1 else [round(100 * i / (n - 1), 2) for i in range(n)]


def generate_samples(tokenizer, lengths: list[int], depths: list[float], samples: int = 1, seed: int = 42,
                     task: str = "niah_single_2", chat: bool = True) -> list[dict]:
    if samples < 1:
        raise ValueError(f"samples (--samples) must be a positive number per cell, got {samples}")
    if not lengths or not depths:
        raise ValueError(f"NIAH needs at least one length and one depth, got lengths {lengths}, depths {depths}")
    if task not in TASKS or TASKS[task].kind != "niah":
        known = [t for t, v in TASKS.items() if v.kind == "niah"]
        raise ValueError(f"unknown NIAH task {task!r}; use one of {', '.join(known)}")
    out = []
    bar = progress(total=len(lengths) * len(depths) * samples, desc="NIAH prompts")
    for L in lengths:
        size = None
        for d in depths:
            for i in range(samples):
                s = ruler.generate_sample(tokenizer, task, i, L, seed=seed, chat=chat, depth=d, start_size=size)
                size = s["size"]
                s.update(id=f"{L}/{d:g}/{i}", task=f"{L}", depth=d)
                out.append(s)
                bar.update(1)
    bar.close()
    return out


def grid_scores(rows: list[dict], lengths: list[int], depths: list[float]) -> list[list[float | None]]:
    """Mean score x 100 per (depth, length) cell: ``grid[depth_i][length_j]``."""
    grid = []
    for d in depths:
        line = []
        for L in lengths:
            xs = [r["score"] for r in rows if r.get("target_length") == L and r.get("depth") == d]
            line.append(round(100 * sum(xs) / len(xs), 2) if xs else None)
        grid.append(line)
    return grid
