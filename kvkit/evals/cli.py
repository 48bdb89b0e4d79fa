"""``kvkit eval ruler|niah|longbench|compare`` and ``kvkit bench`` (added to the ``kvkit`` console script)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from pathlib import Path

from kvkit import env
from kvkit.options import parse_options as parse_opts

PROMPT_FIELDS = ("id", "task", "prompt", "outputs", "tokens_to_generate", "metric")


# ------------------------------------------------------------------------------------------ helpers


def _ints(spec: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {spec!r}") from None
    if not xs or any(x <= 0 for x in xs):
        raise ValueError(f"{what} must be positive integers, got {spec!r}")
    return xs


def _check_counts(args) -> None:
    """``--samples`` / ``--max-new-tokens``, when given, must be positive (checked before the model loads: 0
    is neither "the default" nor "all", and a negative count would make an empty run with an empty
    summary)."""
    for flag in ("samples", "max_new_tokens"):
        n = getattr(args, flag, None)
        if n is not None and n < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {n}")


def _command() -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "kvkit " + shlex.join(sys.argv[1:]) if prog in ("kvkit", "cli.py") else ""


def _policy(args) -> tuple[str, dict]:
    from kvkit.evals.common import resolve_policy_options

    opts = parse_opts(getattr(args, "opt", None), getattr(args, "policy_options", None))
    return args.policy, resolve_policy_options(args.policy, opts, getattr(args, "budget", None))


def _out(args, bench: str, label: str) -> Path:
    return Path(args.out) if args.out else Path("results") / bench / label


def _load(args):
    from kvkit.evals.common import load_model

    print(f"loading model {args.model!r} on {args.device} ({args.dtype}) ...", file=sys.stderr, flush=True)
    return load_model(args.model, device=args.device, dtype=args.dtype)


def _read_prompts(path, bench: str = "ruler", need_index: bool = False) -> list[dict]:
    """The samples of a ``--dump-prompts`` file, every row checked (:func:`_prompt_checker`) before anything runs:
    a bad row is refused naming the file, the line and the sample, instead of failing after samples ran."""
    from kvkit.evals.common import read_jsonl

    rows = read_jsonl(path, required=PROMPT_FIELDS + (("target_length", "depth") if bench == "niah" else ()),
                      check=_prompt_checker(need_index))
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return rows


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_checker(need_index: bool):
    """A check of one prompts-file row: field types and ranges, a RULER metric (:func:`kvkit.evals.metrics.
    ruler_metric`), ids unique in the file."""
    from kvkit.evals.metrics import ruler_metric

    seen: set = set()

    def check(row: dict) -> None:
        rid = row["id"]
        if not (_int(rid) or isinstance(rid, str) and rid):
            raise ValueError(f"'id' must be a non-empty string or an integer, got {rid!r}")
        if rid in seen:
            raise ValueError(f"sample id {rid!r} appears twice in the file")
        seen.add(rid)
        what = f"sample {rid!r}:"
        if not isinstance(row["task"], str) or not row["task"]:
            raise ValueError(f"{what} 'task' must be a non-empty string, got {row['task']!r}")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"{what} 'prompt' must be a non-empty string")
        outs = row["outputs"]
        if not isinstance(outs, list) or not outs or not all(isinstance(o, str) for o in outs):
            raise ValueError(f"{what} 'outputs' must be a non-empty list of strings, got {outs!r}")
        n = row["tokens_to_generate"]
        if not _int(n) or n < 1:
            raise ValueError(f"{what} 'tokens_to_generate' must be a positive integer, got {n!r}")
        try:
            ruler_metric(row["metric"])
        except ValueError as e:
            raise ValueError(f"{what} {e}") from None
        if "index" in row and not (_int(row["index"]) and row["index"] >= 0):
            raise ValueError(f"{what} 'index' must be an integer >= 0, got {row['index']!r}")
        if need_index and "index" not in row:
            raise ValueError(f"{what} no 'index' field (--samples takes the first N samples of each task by it)")
        ce = row.get("context_end")
        if ce is not None and not (_int(ce) and 0 <= ce <= len(row["prompt"])):
            raise ValueError(f"{what} 'context_end' must be a character offset in the prompt (0 to "
                             f"{len(row['prompt'])}), got {ce!r}")
        tl = row.get("target_length")
        if tl is not None and not (_int(tl) and tl >= 1):
            raise ValueError(f"{what} 'target_length' must be a positive integer, got {tl!r}")
        d = row.get("depth")
        if d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 100):
            raise ValueError(f"{what} 'depth' must be a percentage from 0 to 100, got {d!r}")
        if "seed" in row and not _int(row["seed"]):
            raise ValueError(f"{what} 'seed' must be an integer, got {row['seed']!r}")

    return check


def _generate_seed(args) -> int:
    """``--seed`` of a run that generates its samples (RULER's default 42)."""
    return 42 if args.seed is None else args.seed


def _prompts_seed(args, samples: list[dict]):
    """The seed the ``--prompts`` samples were made with (what the run's config records: the prompts decide the
    samples, not ``--seed``); a ``--seed`` that disagrees is refused."""
    seeds = sorted({s["seed"] for s in samples if "seed" in s})
    if not seeds:
        return _generate_seed(args)
    if args.seed is not None and seeds != [args.seed]:
        raise ValueError(f"--seed {args.seed}: the prompts of {args.prompts} were made with seed "
                         f"{', '.join(map(str, seeds))} (the prompts decide the samples); drop --seed, or make prompts "
                         f"of seed {args.seed} with --dump-prompts --seed {args.seed}")
    return seeds[0] if len(seeds) == 1 else seeds


def _dump(path, samples: list[dict]) -> None:
    from kvkit.evals.common import atomic_write_jsonl

    atomic_write_jsonl(path, samples)
    print(f"wrote {len(samples)} prompts to {path}")


def _check_prompt_lengths(model, tokenizer, samples, what) -> None:
    from kvkit.evals.common import check_length, count_tokens

    longest = max(samples, key=lambda s: s.get("target_length") or 0)
    if longest.get("target_length"):
        check_length(model, longest["target_length"], what)
    s = samples[0]
    if "prompt_tokens" in s and count_tokens(tokenizer, s["prompt"]) != s["prompt_tokens"]:
        print(f"warning: prompt {s['id']} has {count_tokens(tokenizer, s['prompt'])} tokens with this tokenizer, "
              f"{s['prompt_tokens']} when it was made (another tokenizer?)", file=sys.stderr)


def _cap(args, samples: list[dict]) -> list[dict]:
    """``--max-new-tokens``: cap every sample's generation length (quick checks; not the official setting)."""
    if getattr(args, "max_new_tokens", None):
        for s in samples:
            s["tokens_to_generate"] = min(s["tokens_to_generate"], args.max_new_tokens)
    return samples


def _config(args, bench: str, policy: str, options: dict, model=None, **extra) -> dict:
    """A run's config.json: every setting that changes its rows (checked on ``--resume``: RunDir) plus where and how
    it ran. File-valued policy options (duo's ``pattern``) are recorded by content (``option_files``)."""
    import kvkit
    from kvkit.evals.common import calibration_used, option_files

    cfg = dict(benchmark=bench, model=args.model, policy=policy, options=options, option_files=option_files(options),
               seed=args.seed, device=args.device, dtype=args.dtype, kvkit_version=kvkit.__version__,
               command=_command(), max_new_tokens=getattr(args, "max_new_tokens", None),
               full_prompt_prefill=getattr(args, "full_prompt_prefill", False), **extra)
    if model is not None:
        # the calibrated values themselves (what changes the rows; the file's other policies and notes do not)
        cfg["calibration"] = calibration_used(model, policy, options)
    return cfg


def _summary(config: dict, rows: list[dict], scores: dict) -> dict:
    n = len(rows)
    return dict(config, **scores, samples_scored=n,
                mean_prompt_tokens=round(sum(r["prompt_tokens"] for r in rows) / n, 1) if n else None,
                mean_kv_bytes=round(sum(r["kv_bytes"] for r in rows) / n) if n else None,
                mean_seconds=round(sum(r["seconds"] for r in rows) / n, 3) if n else None)


# -------------------------------------------------------------------------------------------- ruler


def cmd_ruler(args) -> int:
    from kvkit.evals import ruler
    from kvkit.evals.common import RunDir, check_length, run_label, run_samples

    _check_counts(args)
    policy, options = _policy(args)
    if args.prompts:
        samples, names, length, model, tok = _ruler_prompts(args)
    else:
        names = ruler.parse_tasks(args.tasks)
        length = args.length
        args.seed = _generate_seed(args)
        model, tok = _load(args)
        check_length(model, length)
        n = 10 if args.samples is None else args.samples
        samples = ruler.generate_samples(tok, names, length, n, seed=args.seed, chat=not args.no_chat)
        if args.dump_prompts:
            _dump(args.dump_prompts, samples)
            return 0
    with RunDir(_out(args, "ruler", run_label(args.model, policy, options, length)),
                _config(args, "ruler", policy, options, model=model, length=length, tasks=names, chat=not args.no_chat,
                        prompts=str(args.prompts) if args.prompts else None),
                resume=args.resume) as run:
        rows = run_samples(model, tok, _cap(args, samples), run, policy, options,
                           lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"RULER {policy}",
                           full_prompt_prefill=args.full_prompt_prefill)
        _ruler_summary(run, rows, names, length, args.model, policy, options)
        print((run.path / "summary.md").read_text())
    return 0


def _ruler_prompts(args):
    """The RULER samples of ``--prompts`` (filtered by ``--tasks`` / ``--samples``), their tasks and length,
    and the model, checked against the prompts' length and tokenizer."""
    from kvkit.evals import ruler

    _check_counts(args)
    samples = _read_prompts(args.prompts, "ruler", need_index=args.samples is not None)
    names = ruler.parse_tasks(args.tasks) if args.tasks != "all" else list(dict.fromkeys(s["task"] for s in samples))
    samples = [s for s in samples if s["task"] in names and (args.samples is None or s["index"] < args.samples)]
    if not samples:
        raise ValueError(f"{args.prompts}: no prompts for tasks {', '.join(names)}")
    args.seed = _prompts_seed(args, samples)
    length = max(s.get("target_length", 0) for s in samples)
    model, tok = _load(args)
    _check_prompt_lengths(model, tok, samples, "prompt length")
    return samples, names, length, model, tok


def _task_summary(run, rows, names, title: str) -> None:
    """summary.json/.md/.csv of a per-task benchmark run (RULER, LongBench): score and samples per task."""
    from kvkit.evals.common import task_scores
    from kvkit.evals.report import write_summary

    scores = task_scores(rows, names)
    summary = _summary(run.config, rows, scores)
    table = [[t, scores["scores"].get(t), sum(r["task"] == t for r in rows)] for t in names]
    table.append(["average", scores["average"], len(rows)])
    write_summary(run.path, summary, ["task", "score", "samples"], table, title=title)


def _ruler_summary(run, rows, names, length, model, policy, options) -> None:
    _task_summary(run, rows, names, f"RULER {length} - {model} - {policy} {options or ''}".strip())


def _parse_run(spec: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[:KEY=VALUE,...]`` -> (name, policy, options)."""
    from kvkit.evals.common import resolve_policy_options

    name, sep, rest = spec.partition("=")
    policy, _, opts = rest.partition(":")
    if not sep or not name.strip() or not policy.strip() or "/" in name:
        raise ValueError(f"--run {spec!r} must look like NAME=POLICY or NAME=POLICY:key=value,key=value "
                         f"(NAME is a folder name under --out-root)")
    return name.strip(), policy.strip(), resolve_policy_options(policy.strip(), parse_opts([opts] if opts else None))


def _run_specs(args, command: str, parse=None) -> list[tuple[str, str, dict]]:
    """The ``--run NAME=POLICY[:options]`` of a multi-run command, parsed, with unique names (ValueError)."""
    if not args.run:
        raise ValueError(f"kvkit eval {command} needs at least one --run NAME=POLICY[:options]")
    specs = [(parse or _parse_run)(r) for r in args.run]
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--run names must be unique, got {names}")
    return specs


def cmd_sweep(args) -> int:
    """RULER prompts through several policies, one shared (recorded, replayed) context prefill per sample."""
    from kvkit.evals import ruler
    from kvkit.evals.common import RunDir, run_sweep

    specs = _run_specs(args, "sweep")
    samples, tasks, length, model, tok = _ruler_prompts(args)
    with contextlib.ExitStack() as held:  # every run folder locked until the sweep ends
        runs = []
        for name, policy, options in specs:
            cfg = _config(args, "ruler", policy, options, model=model, length=length, tasks=tasks, chat=True,
                          prompts=str(args.prompts))
            cfg["full_prompt_prefill"] = False
            runs.append((held.enter_context(RunDir(Path(args.out_root) / name, cfg, resume=args.resume)), policy,
                         options))
        run_sweep(model, tok, _cap(args, samples), runs, lambda s, p: ruler.score(s["metric"], p, s["outputs"]),
                  desc=f"RULER sweep x{len(runs)}")
        order = {s["id"]: i for i, s in enumerate(samples)}
        for (run, policy, options), (name, _, _) in zip(runs, specs):
            rows = sorted((r for r in run.rows if r["id"] in order), key=lambda r: order[r["id"]])
            _ruler_summary(run, rows, tasks, length, args.model, policy, options)
            print(f"== {name}\n" + (run.path / "summary.md").read_text())
    return 0


# --------------------------------------------------------------------------------------------- niah


def cmd_niah(args) -> int:
    from kvkit.evals import niah
    from kvkit.evals.common import RunDir, check_length, run_label

    _check_counts(args)
    policy, options = _policy(args)
    if args.prompts:
        samples = _read_prompts(args.prompts, "niah")
        lengths = sorted({s["target_length"] for s in samples})
        depths = sorted({s["depth"] for s in samples})
        args.seed = _prompts_seed(args, samples)
        model, tok = _load(args)
        _check_prompt_lengths(model, tok, samples, "prompt length")
    else:
        lengths = _ints(args.lengths, "--lengths")
        depths = niah.depth_grid(args.depths)
        args.seed = _generate_seed(args)
        model, tok = _load(args)
        check_length(model, max(lengths), "--lengths")
        samples = niah.generate_samples(tok, lengths, depths, args.samples, seed=args.seed, task=args.task,
                                        chat=not args.no_chat)
        if args.dump_prompts:
            _dump(args.dump_prompts, samples)
            return 0
    with RunDir(_out(args, "niah", run_label(args.model, policy, options, f"{max(lengths)}")),
                _config(args, "niah", policy, options, model=model, length=max(lengths), lengths=lengths, depths=depths,
                        task=args.task, chat=not args.no_chat), resume=args.resume) as run:
        _niah_run(args, run, model, tok, samples, policy, options, lengths, depths)
    return 0


def _niah_run(args, run, model, tok, samples, policy, options, lengths, depths) -> None:
    """The samples of a NIAH run not yet in ``run`` (each scored by its own metric), then its grid summary and heatmap."""
    from kvkit.evals import niah, ruler
    from kvkit.evals.common import run_samples
    from kvkit.evals.report import write_heatmap, write_summary

    rows = run_samples(model, tok, _cap(args, samples), run, policy, options,
                       lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"NIAH {policy}",
                       full_prompt_prefill=args.full_prompt_prefill)
    grid = niah.grid_scores(rows, lengths, depths)
    cells = [v for line in grid for v in line if v is not None]
    per_len = {str(L): round(sum(r["score"] for r in rows if r["target_length"] == L) * 100 /
                             max(1, sum(r["target_length"] == L for r in rows)), 2) for L in lengths}
    summary = _summary(run.config, rows, dict(scores=per_len, average=round(sum(cells) / len(cells), 2) if cells
                                                else None, grid=grid))
    header = ["depth", *[str(L) for L in lengths]]
    table = [[f"{d:g}%", *line] for d, line in zip(depths, grid)]
    write_summary(run.path, summary, header, table, title=f"NIAH - {args.model} - {policy} {options or ''}".strip())
    write_heatmap(run.path / "heatmap.png", grid, lengths, depths,
                  title=f"NIAH {args.model} {policy} {options or ''}".strip())
    print((run.path / "summary.md").read_text())


# ------------------------------------------------------------------------------------------ needles


def _parse_needle_run(spec: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[:KEY=VALUE,...]`` where POLICY is a kvkit policy or a peer (:mod:`kvkit.evals.peers`)."""
    from kvkit.evals.peers import is_peer, peer_options

    name, sep, rest = spec.partition("=")
    policy, _, opts = rest.partition(":")
    if is_peer(policy.strip()):
        if not sep or not name.strip() or "/" in name:
            raise ValueError(f"--run {spec!r} must look like NAME=POLICY[:key=value,...]")
        return name.strip(), policy.strip(), peer_options(policy.strip(), parse_opts([opts] if opts else None))
    return _parse_run(spec)


def cmd_needles(args) -> int:
    """Fresh needles (:mod:`kvkit.evals.needles`) through several runs (policies and peers), then the table and the
    accuracy-vs-bytes figure of every run folder under --out-root made with the same samples."""
    from kvkit.evals import needles, ruler
    from kvkit.evals.common import RunDir, check_length, run_samples
    from kvkit.evals.needles_report import write_report

    specs = _run_specs(args, "needles (one run of them full)", _parse_needle_run)
    lengths = _ints(args.lengths, "--lengths")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.haystack not in needles.HAYSTACKS:
        raise ValueError(f"--haystack must be one of {', '.join(needles.HAYSTACKS)}, got {args.haystack!r}")
    args.seed = needles.DEFAULT_SEED if args.seed is None else args.seed
    _check_counts(args)
    model, tok = _load(args)
    check_length(model, max(lengths), "--lengths")
    samples = needles.generate_samples(tok, lengths, args.samples, seed=args.seed, formats=formats,
                                       haystack=args.haystack, depths=args.depths)
    aware = args.protocol == "aware"
    root = Path(args.out_root)
    for name, policy, options in specs:
        cfg = _config(args, "needles", policy, options, model=model, length=max(lengths), lengths=lengths,
                      formats=formats, haystack=args.haystack, depths=args.depths, protocol=args.protocol,
                      chat=True)
        cfg["full_prompt_prefill"] = aware
        with RunDir(root / name, cfg, resume=args.resume) as run:
            run_samples(model, tok, samples, run, policy, options,
                        lambda s, p: ruler.score(s["metric"], p, s["outputs"]), desc=f"needles {name}",
                        full_prompt_prefill=aware)
    # the table covers every needle run folder under --out-root (earlier invocations' runs too)
    folders = sorted(d for d in root.iterdir() if (d / "config.json").is_file()
                     and json.loads((d / "config.json").read_text()).get("benchmark") == "needles")
    print(write_report(root, folders, f"Fresh needles - {args.model} - {args.protocol}"))
    return 0


# ---------------------------------------------------------------------------------------- longbench


def cmd_longbench(args) -> int:
    from kvkit.evals import longbench
    from kvkit.evals.common import RunDir, model_context, run_label, run_samples

    _check_counts(args)
    policy, options = _policy(args)
    names = longbench.parse_tasks(args.tasks)
    if args.length is not None:
        longbench.check_length(names, args.length)  # before the (slow) model load
    longbench.check_data_dir(args.data_dir, names)
    args.seed = _generate_seed(args)  # not used by LongBench (its records are the samples); still recorded
    model, tok = _load(args)
    length = args.length or model_context(model) or 4096
    from kvkit.evals.common import check_length

    check_length(model, length)
    samples = longbench.make_samples(tok, args.data_dir, names, length, limit=args.samples, chat=not args.no_chat)
    with RunDir(_out(args, "longbench", run_label(args.model, policy, options, length)),
                _config(args, "longbench", policy, options, model=model, length=length, tasks=names,
                        chat=not args.no_chat, data_dir=str(args.data_dir), sample_ids="task/line"),
                resume=args.resume) as run:
        rows = run_samples(model, tok, _cap(args, samples), run, policy, options, longbench.score,
                           desc=f"LongBench {policy}", full_prompt_prefill=args.full_prompt_prefill)
        _task_summary(run, rows, names, f"LongBench {length} - {args.model} - {policy} {options or ''}".strip())
        print((run.path / "summary.md").read_text())
    return 0


def cmd_compare(args) -> int:
    from kvkit.evals.report import compare, compare_matched

    fn = compare_matched if args.matched else compare
    print(fn(args.dirs, Path(args.out) if args.out else None, baselines=args.baseline))
    return 0


# -------------------------------------------------------------------------------------------- bench


def cmd_bench(args) -> int:
    from kvkit.evals import bench
    from kvkit.evals.common import atomic_write_json, atomic_write_jsonl, resolve_policy_options, run_label
    from kvkit.evals.report import write_summary
    from kvkit.options import fmt_bytes

    args.seed = _generate_seed(args)
    if args.shape:  # the shaped-model decode benchmark (random weights; kvkit/evals/gpu_bench.py)
        from kvkit.evals import gpu_bench

        if args.lengths:
            _ints(args.lengths, "--lengths")
        return gpu_bench.run_cli(args, _command())
    for flag in ("policies", "no_compile", "no_interleave", "no_cudnn_sdpa"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} applies to --shape only")
    args.dtype = args.dtype or "float32"
    args.steps = 4 if args.steps is None else args.steps
    policy, options = _policy(args)
    lengths = _ints(args.lengths or "2048,4096,8192", "--lengths")
    if args.decode_tokens < 1:
        raise ValueError(f"--decode-tokens must be >= 1, got {args.decode_tokens}")
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    more = []
    for spec in args.add or []:
        name, _, opts = spec.partition(":")
        if not name.strip():
            raise ValueError(f"--add {spec!r} must look like POLICY or POLICY:key=value,key=value")
        more.append((name.strip(), resolve_policy_options(name.strip(), parse_opts([opts] if opts else None))))
    if args.batch is not None and args.batch <= 0:
        raise ValueError(f"--batch must be a positive number of sequences, got {args.batch}")
    if args.memory is not None and not args.memory > 0:
        raise ValueError(f"--memory must be a positive number of GiB, got {args.memory}")
    if args.max_batch <= 0:
        raise ValueError(f"--max-batch must be a positive number of sequences, got {args.max_batch}")
    threads = _ints(args.threads, "--threads") if args.threads else None
    if (args.memory is not None or args.profile) and not args.batch:
        raise ValueError("--memory and --profile measure batched decode: give --batch B too")
    if args.batch and not args.prefill_chunk:
        return _bench_batch(args, policy, options, lengths, more, threads)
    model, tok = _load(args)
    if threads:
        import torch

        torch.set_num_threads(threads[0])
    rows = bench.with_ratios(bench.run(model, tok, policy, options, lengths, args.decode_tokens,
                                       prefill_chunk=args.prefill_chunk, more=more, batch=args.batch or 1,
                                       oneshot=args.oneshot))
    out = _out(args, "bench", run_label(args.model, policy, options, max(lengths)))
    cfg = _config(args, "bench", policy, options, lengths=lengths, decode_tokens=args.decode_tokens,
                  prefill_chunk=args.prefill_chunk)
    atomic_write_json(out / "config.json", cfg)
    atomic_write_jsonl(out / "samples.jsonl", rows)
    header = ["policy", "length", "prefill", "prefill s", "decode tok/s", "peak prefill", "peak decode", "KV after prefill",
              "KV after decode", "KV vs full", "KV read/step", "reads vs full", "prefill vs full", "decode vs full"]
    table = [[r["policy"] + (f" {r['options']}" if r["options"] else ""), r["length"],
              f"chunks of {r['prefill_chunk']}" if r.get("prefill_chunk") else "one-shot", r["prefill_s"],
              r["decode_tok_s"], fmt_bytes(r["peak_prefill_bytes"]), fmt_bytes(r["peak_decode_bytes"]),
              fmt_bytes(r["kv_bytes_prefill"]), fmt_bytes(r["kv_bytes_decode"]), r.get("kv_bytes_decode_vs_full"),
              fmt_bytes(r.get("kv_read_step", 0)), r.get("kv_read_step_vs_full"),
              r.get("prefill_s_vs_full"), r.get("decode_tok_s_vs_full")] for r in rows]
    write_summary(out, dict(cfg, rows=rows, device_name=_device_name(args.device)), header, table,
                  title=f"kvkit bench - {args.model} - {policy} {options or ''} - {_device_name(args.device)}")
    print((out / "summary.md").read_text())
    return 0


def _bench_batch(args, policy, options, lengths, more, threads) -> int:
    """``kvkit bench --batch B``: :func:`kvkit.evals.bench.decode_bench` at each length."""
    import subprocess

    import torch

    from kvkit.evals import bench
    from kvkit.evals.common import run_label

    configs = bench.check_configs([(policy, options)] + more)  # unknown policies refused before the model loads
    model, tok = _load(args)
    threads = threads or [torch.get_num_threads()]
    try:
        commit = env.git_commit() or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvkit"], capture_output=True, text=True,
                               timeout=10, cwd=Path(__file__).resolve().parent).stdout.split("\n")
        dirty = [x.strip() for x in dirty if x.strip()]
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    out_root = _out(args, "bench", run_label(args.model, policy, options, max(lengths)) + f"-b{args.batch}")
    cfg = _config(args, "bench", policy, options, lengths=lengths, added=[list(c) for c in more], git_commit=commit,
                  git_dirty_kvkit=dirty, device_name=_device_name(args.device), cpu_count=os.cpu_count())
    for L in lengths:
        out = out_root if len(lengths) == 1 else out_root / f"len{L}"
        res = bench.decode_bench(model, tok, configs[1:], batch=args.batch, length=L, threads=threads,
                                 rounds=args.rounds, steps=args.steps, memory_gib=args.memory,
                                 max_batch=args.max_batch, profile=args.profile, spill_dir=args.prefill_cache,
                                 reuse_prefill=args.prefill_cache is not None,
                                 log=lambda m: print(m, file=sys.stderr, flush=True),
                                 on_partial=lambda r, o=out: bench.write_partial(o, r, cfg))
        md = bench.write_decode_results(out, res, cfg, title=f"kvkit bench --batch {args.batch} - {args.model} - "
                                                            f"{L} tokens - {_device_name(args.device)}")
        print(md)
    return 0


def _device_name(device: str) -> str:
    import platform

    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


# ------------------------------------------------------------------------------------------- parser


def _common(p, with_out=True):
    p.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    p.add_argument("--policy", default="full", help="a kvkit policy (see `kvkit policies`)")
    p.add_argument("--budget", type=int, default=None, help="sets the policy's `budget` option")
    p.add_argument("--opt", action="append", metavar="KEY=VALUE[,KEY=VALUE]", help="policy option (repeatable)")
    p.add_argument("--policy-options", default=None, metavar="JSON", help="policy options as a JSON object")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the generated samples (default RULER's 42; with --prompts: the file's)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    if with_out:
        p.add_argument("--out", default=None, help="output folder (default results/<bench>/<model>-<policy>-<len>)")
        p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
        p.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
        p.add_argument("--full-prompt-prefill", action="store_true",
                       help="prefill context and question together (default: the context is prefilled and "
                            "compressed first, then the question is fed, as kvpress does)")
        p.add_argument("--max-new-tokens", type=int, default=None,
                       help="cap the generation length of every sample (quick checks only)")


def add_commands(sub) -> None:
    ev = sub.add_parser("eval", help="long-context evaluations: ruler, niah, longbench, compare")
    esub = ev.add_subparsers(dest="eval_command", required=True)

    r = esub.add_parser("ruler", help="RULER's 13 synthetic tasks at one context length")
    _common(r)
    r.add_argument("--length", type=int, default=4096, help="prompt + generation tokens (model tokenizer)")
    r.add_argument("--tasks", default="all", help="all | comma-separated task names")
    r.add_argument("--samples", type=int, default=None, help="samples per task (default 10)")
    r.add_argument("--dump-prompts", default=None, metavar="FILE", help="write the prompts as jsonl and stop")
    r.add_argument("--prompts", default=None, metavar="FILE", help="run the prompts of a --dump-prompts file")
    r.set_defaults(func=cmd_ruler)

    sw = esub.add_parser("sweep", help="RULER prompts through several policies sharing one exact prefill per sample")
    sw.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    sw.add_argument("--run", action="append", metavar="NAME=POLICY[:KEY=VALUE,...]",
                    help="one policy setting, written to OUT_ROOT/NAME like `kvkit eval ruler --out` (repeatable)")
    sw.add_argument("--prompts", required=True, metavar="FILE", help="a `kvkit eval ruler --dump-prompts` file")
    sw.add_argument("--out-root", required=True, help="folder holding one run folder per --run")
    sw.add_argument("--resume", action="store_true", help="continue interrupted runs (each run folder separately)")
    sw.add_argument("--tasks", default="all", help="all | comma-separated task names")
    sw.add_argument("--samples", type=int, default=None, help="first N samples per task")
    sw.add_argument("--max-new-tokens", type=int, default=None, help="cap the generation length (quick checks only)")
    sw.add_argument("--seed", type=int, default=None,
                    help="the seed the prompts were made with (default: the file's; another is refused)")
    sw.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    sw.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    sw.set_defaults(func=cmd_sweep)

    n = esub.add_parser("niah", help="needle in a haystack: depth x length grid and heatmap")
    _common(n)
    n.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated context lengths")
    n.add_argument("--depths", type=int, default=11, help="number of depths from 0%% to 100%%")
    n.add_argument("--samples", type=int, default=1, help="samples per cell")
    n.add_argument("--task", default="niah_single_2", help="the RULER needle task used for each cell")
    n.add_argument("--dump-prompts", default=None, metavar="FILE", help="write the prompts as jsonl and stop")
    n.add_argument("--prompts", default=None, metavar="FILE", help="run the prompts of a --dump-prompts file")
    n.set_defaults(func=cmd_niah)

    nd = esub.add_parser("needles", help="fresh needles no calibration saw: policies and peers, accuracy vs bytes")
    nd.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    nd.add_argument("--run", action="append", metavar="NAME=POLICY[:KEY=VALUE,...]",
                    help="a kvkit policy setting or a peer (quantized:nbits=4) written to OUT_ROOT/NAME; one run "
                         "must be full (repeatable)")
    nd.add_argument("--out-root", required=True, help="folder holding one run folder per --run, needles.md/png")
    nd.add_argument("--lengths", default="2048,4096", help="comma-separated prompt + generation lengths")
    nd.add_argument("--samples", type=int, default=33, help="samples per length (formats and depths cycle)")
    nd.add_argument("--formats", default="digits,uuid,words", help="needle values: digits, uuid, words")
    nd.add_argument("--haystack", default="essay", help="essay (first 66%% of the essays) | squad (paragraphs)")
    nd.add_argument("--depths", type=int, default=11, help="number of depths from 0%% to 100%%")
    nd.add_argument("--protocol", choices=["agnostic", "aware"], default="agnostic",
                    help="agnostic: context prefilled and compressed before the question; aware: together")
    nd.add_argument("--seed", type=int, default=None, help="sample seed (default kvkit.evals.needles.DEFAULT_SEED)")
    nd.add_argument("--resume", action="store_true", help="continue interrupted runs (each run folder separately)")
    nd.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    nd.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    nd.set_defaults(func=cmd_needles)

    lb = esub.add_parser("longbench", help="LongBench's 21 tasks from the official jsonl files")
    _common(lb)
    lb.add_argument("--data-dir", default=None, help="folder with the official <task>.jsonl files")
    lb.add_argument("--tasks", default="all", help="all | comma-separated task names")
    lb.add_argument("--samples", type=int, default=None, help="first N samples per task (default all)")
    lb.add_argument("--length", type=int, default=None, help="prompt + generation budget (default: model context)")
    lb.set_defaults(func=cmd_longbench)

    c = esub.add_parser("compare", help="join eval summaries into one policy x budget table with retention")
    c.add_argument("dirs", nargs="+", help="eval output folders (or summary.json files)")
    c.add_argument("--out", default=None, help="also write compare.md / compare.csv here")
    c.add_argument("--matched", action="store_true",
                   help="score every run only on the samples it shares with its baseline (from samples.jsonl: same "
                        "id and same prompt; runs of another seed, dtype, length or generation length are refused)")
    c.add_argument("--baseline", action="append", metavar="DIR",
                   help="the run retention is relative to (repeatable: one per benchmark/model/length/seed/dtype "
                        "setting). Default: the one `full` run of each setting; several full runs of one setting "
                        "need --baseline")
    c.set_defaults(func=cmd_compare)

    b = sub.add_parser("bench", help="prefill time, decode tok/s, peak memory, KV bytes: policy vs full")
    _common(b, with_out=False)
    b.set_defaults(dtype=None)  # float32; --shape: bfloat16 on CUDA
    b.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 2048,4096,8192; "
                   "--shape: 16384)")
    b.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the prefill")
    b.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="also run chunked prefill (kvkit.prefill, N tokens per forward) for the policy and the "
                        "full cache, next to the one-shot prefill: peak prefill memory of both modes")
    b.add_argument("--add", action="append", metavar="POLICY[:KEY=VALUE,...]",
                   help="another policy setting measured in the same run against the same full-cache rows (repeatable)")
    b.add_argument("--batch", type=int, default=None, metavar="B",
                   help="batched decode: B left-padded essay passages per length; every policy prefilled once, then "
                        "interleaved rounds of decode steps: step time, tok/s, KV held/read, byte bound, fraction of "
                        "it (with --prefill-chunk: the prefill-memory rows at batch B instead)")
    b.add_argument("--threads", default=None, metavar="N[,N...]", help="torch CPU threads of the decode steps "
                   "(comma-separated: each measured; default: torch's current count)")
    b.add_argument("--rounds", type=int, default=3, help="--batch: interleaved rounds per thread count")
    b.add_argument("--steps", type=int, default=None, help="--batch: timed decode steps per policy per round "
                   "(default 4); --shape: timed decode steps per row over all rounds (default 20)")
    b.add_argument("--memory", type=float, default=None, metavar="GIB",
                   help="--batch: the largest batch whose KV fits in GIB GiB for each policy, and the decode "
                        "throughput measured there (capped at --max-batch)")
    b.add_argument("--max-batch", type=int, default=32, help="--memory: largest batch actually decoded")
    b.add_argument("--profile", action="store_true",
                   help="--batch: torch.profiler over a few decode steps per policy, top ops by self CPU time")
    b.add_argument("--prefill-cache", default=None, metavar="DIR",
                   help="--batch: keep the recorded exact prefill in DIR and reuse it in later runs with the same "
                        "model and prompts (it does not depend on the policies)")
    b.add_argument("--oneshot", default="all", choices=("all", "full"),
                   help="--prefill-chunk: which settings also run the one-shot prefill (default all)")
    b.add_argument("--shape", default=None, metavar="NAME",
                   help="decode benchmark on random weights of a model shape (tiny | llama-3.2-1b | llama-3.1-8b; "
                        "nothing downloaded) instead of the bundled model: transformers' DynamicCache and compiled "
                        "StaticCache, kvkit full and every policy in one run (kvkit/evals/gpu_bench.py); default "
                        "--batch 16 --lengths 16384")
    b.add_argument("--policies", nargs="+", action="extend", default=None, metavar="ROW[:KEY=VALUE,...]",
                   help="--shape: the rows (hf-dynamic, hf-static, full, any kvkit policy with options; default all)")
    b.add_argument("--warmup", type=int, default=3, help="--shape: untimed decode steps per row")
    b.add_argument("--time-limit", type=float, default=420.0, metavar="S",
                   help="--shape: seconds from the start after which the remaining rows are skipped")
    b.add_argument("--no-compile", action="store_true", help="--shape: run hf-static eager (no torch.compile)")
    b.add_argument("--compiled", dest="compiled", action="store_true", default=True,
                   help="--shape (default): after each kvkit policy with a static store (full, streaming, snapkv, "
                        "duo, cake, tidal) a '<policy> static+compile' row: kvkit.patch(..., static=True), eager "
                        "prefill, decode steps through model.get_compiled_call (CUDA graphs on CUDA); its compile "
                        "time is reported apart and counts against --time-limit")
    b.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="--shape: no kvkit static+compile rows")
    b.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="--shape: torch.compile backend of hf-static and the static+compile rows (default inductor; "
                        "aot_eager: a short compile for CPU tests, no speed-up to measure)")
    b.add_argument("--no-interleave", action="store_true",
                   help="--shape: do not keep kvkit full alive to interleave its steps with every row's")
    b.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="--shape: torch.backends.cuda.enable_cudnn_sdp(False) for the whole run")
    b.add_argument("--out", default=None, help="output folder (default results/bench/<model>-<policy>-<len>; "
                                               "--shape: results/bench/gpu/<shape>-b<B>-<L>)")
    b.set_defaults(func=cmd_bench)
