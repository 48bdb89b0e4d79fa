"""``kvkit eval longbench``: LongBench's 21 tasks from the official jsonl files (``--data-dir``), each record a
sample truncated to the length budget (default: the model's context), scored by the task's metric, summarised per
task. The tasks, the length and the data folder are checked before the model loads.
"""

from __future__ import annotations

from kvkit.evals import longbench
from kvkit.evals.commands import runs
from kvkit.evals.generation import check_length, model_context
from kvkit.evals.rundir import RunDir
from kvkit.evals.runner import run_samples
from kvkit.evals.settings import run_label


def cmd_longbench(args) -> int:
    runs.check_counts(args)
    policy, options = runs.policy_of(args)
    names = longbench.parse_tasks(args.tasks)
    if args.length is not None:
        longbench.check_length(names, args.length)  # before the (slow) model load
    longbench.check_data_dir(args.data_dir, names)
    args.seed = runs.generate_seed(args)  # not used by LongBench (its records are the samples); still recorded
    model, tok = runs.load(args)
    length = args.length or model_context(model) or 4096
    check_length(model, length)
    samples = longbench.make_samples(tok, args.data_dir, names, length, limit=args.samples, chat=not args.no_chat)
    runs.check_policies(model, [(None, policy, options)])
    with RunDir(runs.out_dir(args, "longbench", run_label(args.model, policy, options, length)),
                runs.run_config(args, "longbench", policy, options, model=model, length=length, tasks=names,
                                chat=not args.no_chat, data_dir=str(args.data_dir), sample_ids="task/line"),
                resume=args.resume) as run:
        rows = run_samples(model, tok, runs.cap(args, samples), run, policy, options, longbench.score,
                           desc=f"LongBench {policy}", full_prompt_prefill=args.full_prompt_prefill)
        runs.task_summary(run, rows, names, f"LongBench {length} - {args.model} - {policy} {options or ''}".strip())
        print((run.path / "summary.md").read_text())
    return 0
