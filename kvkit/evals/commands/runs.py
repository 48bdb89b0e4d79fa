"""What the eval commands share about a run: its policy and options from the command line, the model, the output
folder, the seed, the config it records, the per-sample generation cap and the summary of its rows; and the
``--run NAME=POLICY[:KEY=VALUE,...]`` specs of the multi-run commands (sweep, needles).

A run's config (:func:`run_config`) holds every setting that changes its rows (checked on ``--resume`` by
:class:`kvkit.evals.rundir.RunDir`) plus where and how it ran; file-valued policy options (duo's ``pattern``) are
recorded by content, and the values a per-model calibration sets by value. Seeds: a generating run uses ``--seed``
(RULER's default 42); a ``--prompts`` run records the seed its prompts were made with and refuses another.
:func:`load` is the one place the commands load a model (tests replace it to check that bad input is refused first).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import kvkit
from kvkit.evals.files import atomic_write_jsonl
from kvkit.evals.report import task_scores, write_summary
from kvkit.evals.settings import (
    build_policy,
    calibration_used,
    load_model,
    option_files,
    policy_files,
    resolve_policy_options,
)
from kvkit.options import parse_options


def ints(spec: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {spec!r}") from None
    if not xs or any(x <= 0 for x in xs):
        raise ValueError(f"{what} must be positive integers, got {spec!r}")
    return xs


def check_counts(args) -> None:
    """``--samples`` / ``--max-new-tokens``, when given, must be positive (checked before the model loads: 0
    is neither "the default" nor "all", and a negative count would make an empty run with an empty
    summary)."""
    for flag in ("samples", "max_new_tokens"):
        n = getattr(args, flag, None)
        if n is not None and n < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {n}")


def command_line() -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "kvkit " + shlex.join(sys.argv[1:]) if prog in ("kvkit", "cli.py") else ""


def policy_of(args) -> tuple[str, dict]:
    opts = parse_options(getattr(args, "opt", None), getattr(args, "policy_options", None))
    return args.policy, resolve_policy_options(args.policy, opts, getattr(args, "budget", None))


def out_dir(args, bench: str, label: str) -> Path:
    return Path(args.out) if args.out else Path("results") / bench / label


def load(args):
    print(f"loading model {args.model!r} on {args.device} ({args.dtype}) ...", file=sys.stderr, flush=True)
    return load_model(args.model, device=args.device, dtype=args.dtype)


def generate_seed(args) -> int:
    """``--seed`` of a run that generates its samples (RULER's default 42)."""
    return 42 if args.seed is None else args.seed


def prompts_seed(args, samples: list[dict]):
    """The seed the ``--prompts`` samples were made with (what the run's config records: the prompts decide the
    samples, not ``--seed``); a ``--seed`` that disagrees is refused."""
    seeds = sorted({s["seed"] for s in samples if "seed" in s})
    if not seeds:
        return generate_seed(args)
    if args.seed is not None and seeds != [args.seed]:
        raise ValueError(f"--seed {args.seed}: the prompts of {args.prompts} were made with seed "
                         f"{', '.join(map(str, seeds))} (the prompts decide the samples); drop --seed, or make prompts "
                         f"of seed {args.seed} with --dump-prompts --seed {args.seed}")
    return seeds[0] if len(seeds) == 1 else seeds


def dump(path, samples: list[dict]) -> None:
    atomic_write_jsonl(path, samples)
    print(f"wrote {len(samples)} prompts to {path}")


def cap(args, samples: list[dict]) -> list[dict]:
    """``--max-new-tokens``: cap every sample's generation length (quick checks; not the official setting)."""
    if getattr(args, "max_new_tokens", None):
        for s in samples:
            s["tokens_to_generate"] = min(s["tokens_to_generate"], args.max_new_tokens)
    return samples


def run_config(args, bench: str, policy: str, options: dict, model=None, **extra) -> dict:
    """A run's config.json: every setting that changes its rows (checked on ``--resume``: RunDir) plus where and how
    it ran. File-valued policy options (duo's ``pattern``) and, given the model, the files the policy
    picks for it (duo's shipped pattern) are recorded by content (``option_files``)."""
    cfg = dict(benchmark=bench, model=args.model, policy=policy, options=options, option_files=option_files(options),
               seed=args.seed, device=args.device, dtype=args.dtype, kvkit_version=kvkit.__version__,
               command=command_line(), max_new_tokens=getattr(args, "max_new_tokens", None),
               full_prompt_prefill=getattr(args, "full_prompt_prefill", False), **extra)
    if model is not None:
        built = build_policy(policy, options)  # one read of the policy's files serves both records
        # the files the policy picks for this model by itself (duo's shipped pattern), by content
        cfg["option_files"] = {**cfg["option_files"], **policy_files(model, policy, options, built)}
        # the calibrated values themselves (what changes the rows; the file's other policies and notes do not)
        cfg["calibration"] = calibration_used(model, policy, options, built)
    return cfg


def summary(config: dict, rows: list[dict], scores: dict) -> dict:
    n = len(rows)
    return dict(config, **scores, samples_scored=n,
                mean_prompt_tokens=round(sum(r["prompt_tokens"] for r in rows) / n, 1) if n else None,
                mean_kv_bytes=round(sum(r["kv_bytes"] for r in rows) / n) if n else None,
                mean_seconds=round(sum(r["seconds"] for r in rows) / n, 3) if n else None)


def task_summary(run, rows, names, title: str) -> None:
    """summary.json/.md/.csv of a per-task benchmark run (RULER, LongBench): score and samples per task."""
    scores = task_scores(rows, names)
    table = [[t, scores["scores"].get(t), sum(r["task"] == t for r in rows)] for t in names]
    table.append(["average", scores["average"], len(rows)])
    write_summary(run.path, summary(run.config, rows, scores), ["task", "score", "samples"], table, title=title)


def parse_run(spec: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[:KEY=VALUE,...]`` -> (name, policy, options)."""
    name, sep, rest = spec.partition("=")
    policy, _, opts = rest.partition(":")
    if not sep or not name.strip() or not policy.strip() or "/" in name:
        raise ValueError(f"--run {spec!r} must look like NAME=POLICY or NAME=POLICY:key=value,key=value "
                         f"(NAME is a folder name under --out-root)")
    return name.strip(), policy.strip(), resolve_policy_options(policy.strip(), parse_options([opts] if opts else None))


def run_specs(args, command: str, parse=None) -> list[tuple[str, str, dict]]:
    """The ``--run NAME=POLICY[:options]`` of a multi-run command, parsed, with unique names (ValueError)."""
    if not args.run:
        raise ValueError(f"kvkit eval {command} needs at least one --run NAME=POLICY[:options]")
    specs = [(parse or parse_run)(r) for r in args.run]
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--run names must be unique, got {names}")
    return specs
