"""``kvkit eval needles``: fresh needles no calibration saw (:mod:`kvkit.evals.needles`) through several runs --
kvkit policies and peers (:mod:`kvkit.evals.peers`, e.g. ``quantized:nbits=4``) -- one run folder each under
``--out-root``, then the table and the accuracy-vs-bytes figure of every needle run folder there (earlier
invocations' too). ``--protocol agnostic`` prefills and compresses the context before the question is fed;
``aware`` prefills them together.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvkit.evals import needles, ruler
from kvkit.evals.commands import runs
from kvkit.evals.generation import check_length
from kvkit.evals.needles_report import report_title, write_report
from kvkit.evals.peers import is_peer, peer_options
from kvkit.evals.rundir import RunDir
from kvkit.evals.runner import run_samples
from kvkit.options import parse_options


def _parse_needle_run(spec: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[:KEY=VALUE,...]`` where POLICY is a kvkit policy or a peer (:mod:`kvkit.evals.peers`)."""
    name, sep, rest = spec.partition("=")
    policy, _, opts = rest.partition(":")
    if is_peer(policy.strip()):
        if not sep or not name.strip() or "/" in name:
            raise ValueError(f"--run {spec!r} must look like NAME=POLICY[:key=value,...]")
        return name.strip(), policy.strip(), peer_options(policy.strip(), parse_options([opts] if opts else None))
    return runs.parse_run(spec)


def cmd_needles(args) -> int:
    """Fresh needles (:mod:`kvkit.evals.needles`) through several runs (policies and peers), then the table and the
    accuracy-vs-bytes figure of every run folder under --out-root made with the same samples."""
    specs = runs.run_specs(args, "needles (one run of them full)", _parse_needle_run)
    lengths = runs.ints(args.lengths, "--lengths")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.haystack not in needles.HAYSTACKS:
        raise ValueError(f"--haystack must be one of {', '.join(needles.HAYSTACKS)}, got {args.haystack!r}")
    args.seed = needles.DEFAULT_SEED if args.seed is None else args.seed
    runs.check_counts(args)
    model, tok = runs.load(args)
    check_length(model, max(lengths), "--lengths")
    samples = needles.generate_samples(tok, lengths, args.samples, seed=args.seed, formats=formats,
                                       haystack=args.haystack, depths=args.depths)
    aware = args.protocol == "aware"
    root = Path(args.out_root)
    for name, policy, options in specs:
        cfg = runs.run_config(args, "needles", policy, options, model=model, length=max(lengths), lengths=lengths,
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
    print(write_report(root, folders, report_title(args.model, max(lengths), args.protocol, args.haystack)))
    return 0
