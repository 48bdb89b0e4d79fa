"""``kvkit eval niah``: needle in a haystack over a depth x length grid, one RULER needle task per cell, scored per
sample by its own metric; the summary is the grid (score per depth and length, per-length means) and a heatmap.

Samples are generated (``--samples`` per cell at ``--depths`` evenly spaced depths from 0% to 100% and each of
``--lengths``; ``--dump-prompts`` writes them and stops) or read from ``--prompts`` (their lengths and depths make
the grid).
"""

from __future__ import annotations

from kvkit.evals import niah, ruler
from kvkit.evals.commands import runs
from kvkit.evals.commands.prompts import check_prompt_lengths, read_prompts
from kvkit.evals.generation import check_length
from kvkit.evals.needles_report import point_label
from kvkit.evals.report import write_heatmap, write_summary
from kvkit.evals.rundir import RunDir
from kvkit.evals.runner import run_samples
from kvkit.evals.settings import run_label


def cmd_niah(args) -> int:
    runs.check_counts(args)
    policy, options = runs.policy_of(args)
    if args.prompts:
        samples = read_prompts(args.prompts, "niah")
        lengths = sorted({s["target_length"] for s in samples})
        depths = sorted({s["depth"] for s in samples})
        args.seed = runs.prompts_seed(args, samples)
        model, tok = runs.load(args)
        check_prompt_lengths(model, tok, samples, "prompt length")
    else:
        lengths = runs.ints(args.lengths, "--lengths")
        depths = niah.depth_grid(args.depths)
        args.seed = runs.generate_seed(args)
        model, tok = runs.load(args)
        check_length(model, max(lengths), "--lengths")
        samples = niah.generate_samples(tok, lengths, depths, args.samples, seed=args.seed, task=args.task,
                                        chat=not args.no_chat)
        if args.dump_prompts:
            runs.dump(args.dump_prompts, samples)
            return 0
    runs.check_policies(model, [(None, policy, options)])
    with RunDir(runs.out_dir(args, "niah", run_label(args.model, policy, options, f"{max(lengths)}")),
                runs.run_config(args, "niah", policy, options, model=model, length=max(lengths), lengths=lengths,
                                depths=depths, task=args.task, chat=not args.no_chat), resume=args.resume) as run:
        _niah_run(args, run, model, tok, samples, policy, options, lengths, depths)
    return 0


def niah_title(model: str, policy: str, options: dict) -> str:
    """The summary's and heatmap's title in words: ``Needle in a haystack: default, streaming 512``."""
    return f"Needle in a haystack: {model}, {point_label(policy, options)}"


def _niah_run(args, run, model, tok, samples, policy, options, lengths, depths) -> None:
    """The samples of a NIAH run not yet in ``run`` (each scored by its own metric), then its grid summary and heatmap."""
    rows = run_samples(model, tok, runs.cap(args, samples), run, policy, options,
                       lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"NIAH {policy}",
                       full_prompt_prefill=args.full_prompt_prefill)
    grid = niah.grid_scores(rows, lengths, depths)
    cells = [v for line in grid for v in line if v is not None]
    per_len = {str(L): round(sum(r["score"] for r in rows if r["target_length"] == L) * 100 /
                             max(1, sum(r["target_length"] == L for r in rows)), 2) for L in lengths}
    summary = runs.summary(run, rows, dict(scores=per_len, average=round(sum(cells) / len(cells), 2)
                                                  if cells else None, grid=grid))
    header = ["depth", *[str(L) for L in lengths]]
    table = [[f"{d:g}%", *line] for d, line in zip(depths, grid)]
    title = niah_title(args.model, policy, options or {})
    write_summary(run.path, summary, header, table, title=title)
    write_heatmap(run.path / "heatmap.png", grid, lengths, depths, title=title)
    print((run.path / "summary.md").read_text())
