"""``kvkit eval ruler`` (RULER's 13 synthetic tasks at one context length, one policy) and ``kvkit eval sweep``
(the prompts of a ``--dump-prompts`` file through several policies, one recorded exact context prefill per sample
replayed into each policy's cache).

``eval ruler`` generates its samples (``--samples`` per task, default 10, seeded; ``--dump-prompts`` writes them and
stops) or reads them (``--prompts``, filtered by ``--tasks`` / ``--samples``), runs them into a run folder
(:class:`kvkit.evals.rundir.RunDir`; ``--resume`` continues one) and writes the per-task summary. ``eval sweep``
writes one such folder per ``--policy POLICY[:options]`` under ``--out``, every folder locked until the
sweep ends, each with the rows a run of that policy alone would have.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvkit.evals import ruler
from kvkit.evals.commands import runs
from kvkit.evals.commands.prompts import check_prompt_lengths, read_prompts
from kvkit.evals.generation import check_length
from kvkit.evals.rundir import RunDir
from kvkit.evals.runner import run_samples, run_sweep
from kvkit.evals.settings import run_label


def cmd_ruler(args) -> int:
    runs.check_counts(args)
    policy, options = runs.policy_of(args)
    if args.prompts:
        samples, names, length, model, tok = ruler_prompts(args)
    else:
        names = ruler.parse_tasks(args.tasks)
        length = args.length
        args.seed = runs.generate_seed(args)
        model, tok = runs.load(args)
        check_length(model, length)
        n = 10 if args.samples is None else args.samples
        samples = ruler.generate_samples(tok, names, length, n, seed=args.seed, chat=not args.no_chat)
        if args.dump_prompts:
            runs.dump(args.dump_prompts, samples)
            return 0
    runs.check_policies(model, [(None, policy, options)])
    with RunDir(runs.out_dir(args, "ruler", run_label(args.model, policy, options, length)),
                runs.run_config(args, "ruler", policy, options, model=model, length=length, tasks=names,
                                chat=not args.no_chat, prompts=str(args.prompts) if args.prompts else None),
                resume=args.resume) as run:
        rows = run_samples(model, tok, runs.cap(args, samples), run, policy, options,
                           lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"RULER {policy}",
                           full_prompt_prefill=args.full_prompt_prefill)
        ruler_summary(run, rows, names, length, args.model, policy, options)
        print((run.path / "summary.md").read_text())
    return 0


def ruler_prompts(args):
    """The RULER samples of ``--prompts`` (filtered by ``--tasks`` / ``--samples``), their tasks and length,
    and the model, checked against the prompts' length and tokenizer."""
    runs.check_counts(args)
    samples = read_prompts(args.prompts, "ruler", need_index=args.samples is not None)
    names = ruler.parse_tasks(args.tasks) if args.tasks != "all" else list(dict.fromkeys(s["task"] for s in samples))
    samples = [s for s in samples if s["task"] in names and (args.samples is None or s["index"] < args.samples)]
    if not samples:
        raise ValueError(f"{args.prompts}: no prompts for tasks {', '.join(names)}")
    args.seed = runs.prompts_seed(args, samples)
    length = max(s.get("target_length", 0) for s in samples)
    model, tok = runs.load(args)
    check_prompt_lengths(model, tok, samples, "prompt length")
    return samples, names, length, model, tok


def ruler_summary(run, rows, names, length, model, policy, options) -> None:
    runs.task_summary(run, rows, names, f"RULER {length} - {model} - {policy} {options or ''}".strip())


def cmd_sweep(args) -> int:
    """RULER prompts through several policies, one shared (recorded, replayed) context prefill per sample."""
    specs = runs.run_specs(args, "sweep")
    samples, tasks, length, model, tok = ruler_prompts(args)
    runs.check_policies(model, specs)
    with contextlib.ExitStack() as held:  # every run folder locked until the sweep ends
        folders = []
        for name, policy, options in specs:
            cfg = runs.run_config(args, "ruler", policy, options, model=model, length=length, tasks=tasks, chat=True,
                                  prompts=str(args.prompts))
            cfg["full_prompt_prefill"] = False
            folders.append((held.enter_context(RunDir(Path(args.out) / name, cfg, resume=args.resume)), policy,
                            options))
        all_rows = run_sweep(model, tok, runs.cap(args, samples), folders,
                             lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"RULER sweep x{len(folders)}")
        for (run, policy, options), (name, _, _), rows in zip(folders, specs, all_rows):
            ruler_summary(run, rows, tasks, length, args.model, policy, options)
            print(f"== {name}\n" + (run.path / "summary.md").read_text())
    return 0
