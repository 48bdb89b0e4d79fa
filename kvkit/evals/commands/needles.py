"""``kvkit eval needles``: fresh needles no calibration saw (:mod:`kvkit.evals.needles`) through several runs --
kvkit policies and peers (:mod:`kvkit.evals.peers`, e.g. ``quantized:nbits=4``) -- one run folder each under
``--out``, then the table and the accuracy-vs-bytes figure of every needle run folder there (earlier invocations'
too). Every run folder gets its ``summary.json`` (scores per needle format, KV bytes held and read), and ``--out``
one listing the runs (:func:`write_root_summary`), so ``kvkit eval compare OUT`` reads them all. ``--protocol agnostic`` prefills and compresses the context before the question is fed;
``aware`` prefills them together.

Under ``agnostic`` the runs whose prefill replays (:func:`kvkit.workloads.shared_prefill.replayable`: every kvkit
policy but kvzip and reconstruction-scored chelsea) share one exact context prefill per sample
(:func:`kvkit.evals.runner.run_sweep`): their rows are the rows each would write alone, at one prefill per sample
instead of one per run. Peers, kvzip and ``--no-shared-prefill`` runs prefill on their own.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

from kvkit.evals import needles, ruler
from kvkit.evals.commands import runs
from kvkit.evals.files import atomic_write_json
from kvkit.evals.generation import check_length
from kvkit.evals.needles_report import report_title, write_report
from kvkit.evals.peers import is_peer, peer_options
from kvkit.evals.rundir import RunDir, check_out_folder
from kvkit.evals.runner import run_samples, run_sweep
from kvkit.evals.settings import resolve_policy_options
from kvkit.workloads.shared_prefill import replayable


def _resolve(policy: str, options: dict, budget) -> dict:
    """The options of a kvkit policy (resolved, with ``--budget``) or of a peer (:mod:`kvkit.evals.peers`)."""
    return peer_options(policy, options) if is_peer(policy) else resolve_policy_options(policy, options, budget)


def cmd_needles(args) -> int:
    """Fresh needles (:mod:`kvkit.evals.needles`) through several runs (policies and peers), then the table and the
    accuracy-vs-bytes figure of every run folder under --out-root made with the same samples."""
    specs = runs.run_specs(args, "needles (one of them full)", _resolve)
    root = Path(args.out)
    check_out_folder(root)
    for name, _, _ in specs:
        check_out_folder(root / name)
    lengths = runs.ints(args.lengths, "--lengths")
    formats = args.formats if isinstance(args.formats, list) else [f.strip() for f in args.formats.split(",")
                                                                   if f.strip()]
    if args.haystack not in needles.HAYSTACKS:
        raise ValueError(f"--haystack must be one of {', '.join(needles.HAYSTACKS)}, got {args.haystack!r}")
    args.seed = needles.DEFAULT_SEED if args.seed is None else args.seed
    runs.check_counts(args)
    model, tok = runs.load(args)
    runs.check_policies(model, specs)
    check_length(model, max(lengths), "--lengths")
    samples = needles.generate_samples(tok, lengths, args.samples, seed=args.seed, formats=formats,
                                       haystack=args.haystack, depths=args.depths)
    aware = args.protocol == "aware"
    score = lambda s, p: ruler.score(s["metric"], p, s["outputs"])  # noqa: E731

    def config(policy, options):
        cfg = runs.run_config(args, "needles", policy, options, model=model, length=max(lengths), lengths=lengths,
                              formats=formats, haystack=args.haystack, depths=args.depths, protocol=args.protocol,
                              chat=True)
        cfg["full_prompt_prefill"] = aware
        return cfg

    def summarise(run, rows, name):
        runs.task_summary(run, rows, formats, f"Fresh needles - {args.model} - {name}")

    shared = [] if aware or getattr(args, "no_shared_prefill", False) else \
        [sp for sp in specs if not is_peer(sp[1]) and replayable(sp[1], sp[2])]
    if len(shared) < 2:
        shared = []
    if shared:
        with ExitStack() as stack:
            folders = [(stack.enter_context(RunDir(root / name, config(policy, options), resume=args.resume)),
                        policy, options) for name, policy, options in shared]
            all_rows = run_sweep(model, tok, samples, folders, score, desc=f"needles x{len(folders)} (one prefill)")
            for (run, _, _), rows, (name, _, _) in zip(folders, all_rows, shared):
                summarise(run, rows, name)
    for name, policy, options in specs:
        if (name, policy, options) in shared:
            continue
        with RunDir(root / name, config(policy, options), resume=args.resume) as run:
            rows = run_samples(model, tok, samples, run, policy, options, score, desc=f"needles {name}",
                               full_prompt_prefill=aware)
            summarise(run, rows, name)
    # the table covers every needle run folder under --out (earlier invocations' runs too)
    folders = sorted(d for d in root.iterdir() if (d / "config.json").is_file()
                     and json.loads((d / "config.json").read_text()).get("benchmark") == "needles")
    md = write_report(root, folders, report_title(args.model, max(lengths), args.protocol, args.haystack, args.dtype))
    write_root_summary(root, folders)
    print(md)
    return 0


def write_root_summary(root: Path, folders: list[Path]) -> None:
    """``root/summary.json``: schema, commit, model, protocol and one entry per needle run folder under ``root``
    (folder, the commit that made its rows, policy spec, compression ratio, KV bytes held and read, scores per needle format, accuracy), read from
    each folder's own summary.json (``kvkit eval compare ROOT`` expands to those folders)."""
    from kvkit.evals.report import SCHEMA, commit

    entries, cfg = [], {}
    for d in folders:
        f = d / "summary.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text(encoding="utf-8"))
        cfg = cfg or s
        entries.append(dict(folder=d.name, commit=s.get("commit"), policy=s.get("policy"), policy_spec=s.get("policy_spec"),
                            options=s.get("options"), compression_ratio=s.get("compression_ratio"),
                            mean_kv_bytes=s.get("mean_kv_bytes"), mean_kv_read=s.get("mean_kv_read"),
                            scores=s.get("scores"), average=s.get("average"), samples_scored=s.get("samples_scored")))
    atomic_write_json(root / "summary.json", dict(
        schema=SCHEMA, commit=commit(), benchmark="needles", model=cfg.get("model"), protocol=cfg.get("protocol"),
        lengths=cfg.get("lengths"), formats=cfg.get("formats"), haystack=cfg.get("haystack"), seed=cfg.get("seed"),
        runs=entries))
