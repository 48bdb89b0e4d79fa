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
from kvkit.cli_grammar import PolicySpec, check_device, extra_options, has_option, parse_policy
from kvkit.evals.files import atomic_write_jsonl
from kvkit.evals.peers import is_peer
from kvkit.evals.report import task_scores, write_summary
from kvkit.evals.rundir import check_out_folder
from kvkit.evals.settings import (
    build_policy,
    calibration_used,
    load_model,
    option_files,
    policy_files,
    resolve_policy_options,
)


def ints(spec, what: str) -> list[int]:
    if isinstance(spec, list):  # parsed by the argument's type already
        return spec
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


def _options_of(args, spec: PolicySpec) -> dict:
    """``spec``'s options with the hidden ``--opt`` / ``--policy-options`` and ``--compression-ratio`` folded in
    (``full`` and the peers take none of them)."""
    if spec.name == "full" or is_peer(spec.name):
        return dict(spec.options)
    opts = {**extra_options(args), **spec.options}
    if getattr(args, "compression_ratio", None) is not None:
        opts["compression_ratio"] = args.compression_ratio
    return opts


def _budget_for(args, spec: PolicySpec, strict: bool):
    """``--budget`` for ``spec``: None for full and the peers; with ``strict`` False (one of several policies) also
    None for a policy without a ``budget`` option (duo, zipcache) or whose spec sets its own."""
    budget = getattr(args, "budget", None)
    if budget is None or spec.name == "full" or is_peer(spec.name):
        return None
    if not strict and ("budget" in spec.options or not has_option(spec.name, "budget")):
        return None
    return budget


def resolved(args, spec: PolicySpec, strict: bool = True) -> tuple[str, dict]:
    """``(policy, options)`` of ``spec`` with ``--budget`` / ``--compression-ratio`` / the hidden ``--opt`` folded in,
    resolved against the policy's options (ValueError naming the valid ones; ``strict`` False: ``--budget`` only
    where the policy has one)."""
    budget = _budget_for(args, spec, strict)
    return spec.name, resolve_policy_options(spec.name, _options_of(args, spec), budget)


def policy_of(args) -> tuple[str, dict]:
    """``--policy NAME[:KEY=VALUE,...]`` of a single-policy eval with ``--budget`` / ``--compression-ratio`` (and the
    hidden ``--opt``) resolved against the policy's options (ValueError naming the valid ones: ``--policy full
    --budget 64`` is refused, not ignored)."""
    spec = args.policy if isinstance(args.policy, PolicySpec) else parse_policy(str(args.policy or "full"))
    opts = {**extra_options(args), **spec.options}
    if getattr(args, "compression_ratio", None) is not None:
        opts["compression_ratio"] = args.compression_ratio
    return spec.name, resolve_policy_options(spec.name, opts, getattr(args, "budget", None))


def out_dir(args, bench: str, label: str) -> Path:
    return Path(args.out) if args.out else Path("results") / bench / label


def preflight(args) -> None:
    """What must hold before a model loads: a usable ``--device`` (CUDA present when asked for) and an ``--out`` that
    can be a folder (ValueError naming the flag)."""
    check_device(args.device)
    if getattr(args, "out", None):
        check_out_folder(args.out)


def load(args):
    preflight(args)
    print(f"loading model {args.model!r} on {args.device} ({args.dtype}) ...", file=sys.stderr, flush=True)
    return load_model(args.model, device=args.device, dtype=args.dtype)


def check_policies(model, specs) -> None:
    """Every kvkit policy of ``specs`` (``(name, policy, options)``; ``name`` None for a single run) checked on the
    loaded ``model`` as ``kvkit.patch`` checks it (:func:`kvkit.patch.support.check_model`: the architecture, a
    ratio out of the policy's reach here, a pattern for another model), before any run folder is written: a
    setting the model cannot run is refused (ValueError naming the run) and leaves no folder behind. Peers have
    nothing to check here."""
    from kvkit.patch.support import check_model

    for name, policy, options in specs:
        built = build_policy(policy, options)
        if built is None:
            continue
        try:
            check_model(model, built)
        except ValueError as e:
            raise ValueError(f"{f'run {name!r}: ' if name else ''}{e}") from None


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


def summary(run, rows: list[dict], scores: dict) -> dict:
    """A run's summary.json (:func:`kvkit.evals.report.write_summary` adds ``schema``): the config of ``run`` (a
    :class:`~kvkit.evals.rundir.RunDir`), the commit that made its rows and how many rows each commit made
    (:meth:`~kvkit.evals.rundir.RunDir.provenance`), ``scores`` per task and ``average``, the setting as ``--policy`` writes it, ``compression_ratio`` when given, and
    per sample means of prompt tokens, KV bytes held at the end, KV bytes read per decode step (rows that record
    it) and seconds."""
    n = len(rows)
    config = run.config
    reads = [r["kv_read"] for r in rows if r.get("kv_read") is not None]
    options = config.get("options") or {}
    return dict(config, **run.provenance(rows), **scores, samples_scored=n,
                policy_spec=str(PolicySpec(str(config.get("policy")), dict(options))),
                compression_ratio=options.get("compression_ratio"),
                mean_prompt_tokens=round(sum(r["prompt_tokens"] for r in rows) / n, 1) if n else None,
                mean_kv_bytes=round(sum(r["kv_bytes"] for r in rows) / n) if n else None,
                mean_kv_read=round(sum(reads) / len(reads)) if reads and len(reads) == n else None,
                mean_seconds=round(sum(r["seconds"] for r in rows) / n, 3) if n else None)


def task_summary(run, rows, names, title: str) -> None:
    """summary.json/.md/.csv of a per-task benchmark run (RULER, LongBench): score and samples per task."""
    scores = task_scores(rows, names)
    table = [[t, scores["scores"].get(t), sum(r["task"] == t for r in rows)] for t in names]
    table.append(["average", scores["average"], len(rows)])
    write_summary(run.path, summary(run, rows, scores), ["task", "score", "samples"], table, title=title)


def split_run(spec: str) -> tuple[str, PolicySpec]:
    """The hidden ``--run NAME=POLICY[:KEY=VALUE,...]`` -> (folder name, policy spec) (:func:`parse_policy`)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip() or "/" in name or not rest.partition(":")[0].strip():
        raise ValueError(f"--run {spec!r} must look like NAME=POLICY or NAME=POLICY:key=value,key=value "
                         f"(NAME is a folder name under --out); or give --policy POLICY[:key=value,...]")
    return name.strip(), parse_policy(rest)


def parse_run(spec: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[:KEY=VALUE,...]`` -> (name, policy, options), the options resolved against the policy's."""
    name, p = split_run(spec)
    return name, p.name, resolve_policy_options(p.name, p.options)


def run_specs(args, command: str, resolve=None) -> list[tuple[str, str, dict]]:
    """``(folder name, policy, options)`` of every ``--policy`` (folder: the spec's label) and hidden ``--run
    NAME=POLICY[:options]`` of a multi-run command, with ``--budget`` / ``--compression-ratio`` folded in and the
    options resolved (``resolve(name, options)``: :func:`resolve_policy_options` unless given); ValueError when none
    is given or two share a folder."""
    given = [(None, s) for s in (args.policy or [])] + [split_run(r) for r in (getattr(args, "run", None) or [])]
    if not given:
        raise ValueError(f"kvkit eval {command} needs at least one --policy NAME[:KEY=VALUE,...]")
    specs = []
    for name, spec in given:
        budget = _budget_for(args, spec, strict=False)
        given = _options_of(args, spec)
        opts = (resolve or resolve_policy_options)(spec.name, given, budget)
        # a --policy's folder: the setting as given, as a label (snapkv-window32-budget512; --budget and
        # --compression-ratio included, defaults left out)
        label = PolicySpec(spec.name, {**given, **({"budget": budget} if budget is not None else {})}).label()
        specs.append((name or label, spec.name, opts))
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"run folder names must be unique, got {names}")
    return specs
