"""Merge DuoAttention patterns of one model: the mean rank of each KV head's gate over several calibrations.

Why: a calibration's gates split the KV heads into a clear majority (the heads every run ranks above or below the
sparsity cut) and a few heads near the cut, whose side depends on the run's text, length, regulariser and seed
(for the default model three runs on the calibration text agree on 40 of their 45 retrieval heads at sparsity
0.5). Averaging *ranks* rather than gate values keeps one run's scale from outvoting the others: a 1K run's gates
collapse to ~1e-4 below the cut while a 4K run's sit near 0.05, so a mean of values is decided by whichever run
has the larger gates.

Algorithm, for patterns ``alpha_r [L, H]`` (r = 1..R, same model):

* ``rank_r = averaged_rank(alpha_r over all L*H heads) / (L*H - 1)``: 0 for the lowest gate, 1 for the highest,
  tied gates (the exact zeros a run drives its streaming heads to) share the mean of their ranks;
* ``merged = mean_r rank_r``, in [0, 1], written as the new pattern's alpha.

``kvkit.policies.duo.binarize`` only orders the gates, so ``merged`` binarises at any sparsity; its values are
ranks, not gates (the file's ``calibration.method`` says so). The merge reads files that
:func:`kvkit.policies.duo_patterns.read_pattern` accepts and refuses patterns of different models or shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvkit.policies.duo_patterns import read_pattern, save_pattern


def averaged_rank(values: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of a flat tensor's values, ascending; tied values get the mean of the ranks they span."""
    v = values.reshape(-1).to(torch.float64)
    _, inverse, counts = torch.unique(v, sorted=True, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # rank of the first member of each tie group
    mean_rank = first.to(torch.float64) + (counts.to(torch.float64) - 1) / 2
    return mean_rank[inverse].view_as(values)


def merge_alphas(alphas: list[torch.Tensor]) -> torch.Tensor:
    """Mean normalised rank ``[L, H]`` of several ``[L, H]`` gate matrices (see the module docstring)."""
    if len(alphas) < 2:
        raise ValueError(f"duo-merge: give at least two patterns to merge, got {len(alphas)}")
    shape = tuple(alphas[0].shape)
    for i, a in enumerate(alphas[1:], start=2):
        if tuple(a.shape) != shape:
            raise ValueError(f"duo-merge: pattern {i} is {tuple(a.shape)} (layers x KV heads), the first is {shape}; "
                             "merge patterns of one model")
    n = alphas[0].numel()
    if n < 2:
        raise ValueError("duo-merge: a pattern needs at least two heads to rank")
    return torch.stack([averaged_rank(a) / (n - 1) for a in alphas]).mean(0)


def read_sources(paths: list, verb: str) -> tuple[list[Path], list, dict]:
    """``(paths, PatternFile per path, model)`` of source patterns that must be of one model: ``model`` is the first
    ``model`` object any of them names ({} when none does); ValueError when two differ (``verb``: the command's,
    ``duo-<verb>``, in the message)."""
    paths = [Path(p) for p in paths]
    files = [read_pattern(p) for p in paths]
    named = [(p, f.meta) for p, f in zip(paths, files) if f.meta]
    for p, m in named[1:]:
        if m != named[0][1]:
            raise ValueError(f"duo-{verb}: {p} is a pattern for {m.get('name')!r} ({m.get('num_layers')} layers), "
                             f"{named[0][0]} for {named[0][1].get('name')!r} ({named[0][1].get('num_layers')} "
                             f"layers); {verb} patterns of one model")
    return paths, files, named[0][1] if named else {}


def merge_files(paths: list, out, command: str | None = None) -> Path:
    """Merge the pattern files ``paths`` into ``out`` (kvkit JSON, or TSV by suffix); the kvkit JSON's
    ``calibration`` lists each source with its sha256 and its own ``calibration.settings``."""
    paths, files, meta = read_sources(paths, "merge")
    merged = merge_alphas([torch.tensor(f.alpha, dtype=torch.float64) for f in files])
    calibration = {
        "method": "mean normalised rank of the sources' gates (kvkit.calibrate.duo_merge); the values are ranks "
                  "in [0, 1], not gates",
        "sources": [{"path": str(p), "sha256": f.sha256, "settings": f.settings} for p, f in zip(paths, files)],
    }
    if command:
        calibration["command"] = command
    return save_pattern(out, merged, meta, calibration)
