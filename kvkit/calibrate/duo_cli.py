"""``kvkit calibrate duo`` (learn a DuoAttention head pattern: :mod:`kvkit.calibrate.duo`), ``duo-merge`` (several
patterns into one by mean gate rank: :mod:`kvkit.calibrate.duo_merge`) and ``duo-refine`` (the heads patterns
disagree on, decided on calibration needles: :mod:`kvkit.calibrate.duo_refine`). Patterns are JSON (or TSV) files
for ``kvkit.patch(model, "duo", pattern=...)``."""

from __future__ import annotations

import json
from pathlib import Path

from kvkit.cli_grammar import (
    add_model,
    check_device,
    checked,
    fraction,
    integer,
    positive_float,
    positive_int,
)


def _pattern_path(text: str) -> str:
    """A pattern file to write: ``.json`` (kvkit's format) or ``.tsv`` (the reference's), as
    ``kvkit.patch(model, "duo", pattern=...)`` reads them by their extension; not a folder."""
    p = Path(text)
    if p.suffix.lower() not in (".json", ".tsv"):
        raise ValueError(f"must end in .json (kvkit pattern) or .tsv (reference format): the policy reads a pattern "
                         f"by its extension, got {text!r}")
    if p.is_dir():
        raise ValueError(f"{text} is a folder; name a .json or .tsv file")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{parent} is a file, not a folder")
            break
    return text


_pattern_path.explain = True
#: argparse type of a pattern file written by ``kvkit calibrate duo*`` (``--out``)
pattern_out = checked(_pattern_path, lambda v: True, "", "pattern_out")


def _pattern_command(sub, name: str, func, summary: str, description: str, patterns_help: str):
    """A ``kvkit calibrate <name>`` parser that reads pattern files and writes one (``--out``)."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.add_argument("patterns", nargs="+", help=patterns_help)
    parser.add_argument("--out", required=True, type=pattern_out,
                        help="output pattern: .json (kvkit) or .tsv (reference format)")
    parser.set_defaults(func=func)
    return parser


def add_duo_commands(sub) -> None:
    """Add ``duo``, ``duo-merge`` and ``duo-refine`` to ``kvkit calibrate``'s subparsers."""
    d = sub.add_parser(
        "duo",
        help="DuoAttention gate optimisation: which KV heads need the full context (retrieval) vs sink+recent",
        description="Optimise one gate per KV head per layer on synthetic multi-passkey retrieval (paper: "
        "arXiv:2410.10819); writes the continuous gates as a pattern for kvkit.patch(model, 'duo', pattern=...).",
    )
    add_model(d, threads="torch CPU threads")
    d.add_argument("--out", required=True, type=pattern_out,
                   help="output pattern: .json (kvkit) or .tsv (reference format)")
    d.add_argument("--steps", type=positive_int, default=60, help="optimiser steps (paper: 2000)")
    d.add_argument("--length", type=positive_int, default=1024, help="longest sample in tokens (paper: up to 32K)")
    d.add_argument("--min-length", type=positive_int, default=None, help="shortest sample (default: 3/4 of length)")
    d.add_argument("--sink", type=positive_int, default=64, help="training sink tokens (paper: 128)")
    d.add_argument("--recent", type=positive_int, default=256, help="training recent window (paper: 256)")
    d.add_argument("--passkeys", type=positive_int, default=5, help="passkeys per sample (paper: 10)")
    d.add_argument("--passkey-words", type=positive_int, default=8, help="NATO words per passkey (paper: 32)")
    d.add_argument("--task", choices=["passkey", "keyed", "needles"], default="passkey",
                   help="passkey: the paper's (the k-th passkey, asked in order); keyed: passkeys named by a key word, "
                        "asked in a random order (retrieval by key, as key-value needles ask); needles: the knob "
                        "calibrations' vault needles in the chat template")
    d.add_argument("--lr", type=positive_float, default=0.02, help="learning rate of the gates")
    d.add_argument("--reg", type=fraction, default=0.05, help="weight of mean|alpha|")
    d.add_argument("--seed", type=integer, default=0)
    d.add_argument("--time-limit", type=positive_float, default=None,
                   help="stop after the first step that ends past this many seconds (the pattern is still written)")
    d.add_argument("--resume", action="store_true",
                   help="keep the state after every step next to --out (<out>.ckpt.pt) and continue from it when it "
                        "exists (same options): with --time-limit, a long schedule over several runs")
    d.set_defaults(func=cmd_calibrate_duo)
    _pattern_command(
        sub, "duo-merge", cmd_duo_merge,
        "merge DuoAttention patterns of one model: the mean rank of each KV head's gate over the runs",
        "Write a pattern whose alpha is each KV head's mean normalised gate rank over the given patterns "
        "(kvkit.calibrate.duo_merge): the heads the runs agree on stay, the ones near the sparsity cut are decided "
        "by all runs together.",
        "two or more pattern files (.json or .tsv) of the same model")
    r = _pattern_command(
        sub, "duo-refine", cmd_duo_refine,
        "decide the DuoAttention heads the given patterns disagree on by measuring them on calibration needles",
        "Heads every pattern keeps at --sparsity stay retrieval heads; the heads some keep are ranked by how much "
        "they change the answers to calibration needles (kvkit.calibrate.duo_refine) and the best fill the "
        "remaining places. One pattern: the --window heads on each side of its cut are the ones decided.",
        "pattern files (.json or .tsv) of the model")
    add_model(r, threads="torch CPU threads")
    r.add_argument("--sparsity", type=fraction, default=0.5, help="fraction of KV heads that stream")
    r.add_argument("--window", type=positive_int, default=4, help="one pattern: heads each side of its cut to decide")
    r.add_argument("--length", type=positive_int, default=2048, help="calibration needle length in tokens")
    r.add_argument("--samples", type=positive_int, default=16, help="calibration needles (and as many for validation)")
    r.add_argument("--seed", type=integer, default=0, help="needle seed (validation uses seed + 1)")


def cmd_duo_merge(args) -> int:
    import shlex

    from kvkit.calibrate.duo_merge import merge_files
    from kvkit.policies.duo import binarize
    from kvkit.policies.duo_patterns import load_pattern

    command = "kvkit calibrate duo-merge " + " ".join(shlex.quote(a) for a in [*args.patterns, "--out", args.out])
    path = merge_files(args.patterns, args.out, command=command)
    alpha, _ = load_pattern(path)
    print(f"wrote {path} ({alpha.shape[0]} layers x {alpha.shape[1]} KV heads) from {len(args.patterns)} patterns")
    print("retrieval KV heads per layer at sparsity 0.5:", json.dumps(binarize(alpha, 0.5).sum(1).tolist()))
    return 0


def cmd_duo_refine(args) -> int:
    import shlex
    import sys

    if not 0.0 < args.sparsity < 1.0:  # the checks that need no model and no torch come first
        raise ValueError(f"--sparsity must be a fraction strictly between 0 and 1, got {args.sparsity}")
    if args.samples < 1 or args.window < 1:
        raise ValueError("--samples and --window must be positive")
    check_device(args.device)

    import torch

    from kvkit.calibrate.duo_refine import refine_files
    from kvkit.models import load

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model {args.model!r} ...", file=sys.stderr, flush=True)
    model, tok = load(args.model, device=args.device)
    model.eval()
    argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("kvkit") else ["calibrate", "duo-refine", *getattr(args, "_argv", [])]
    command = "kvkit " + " ".join(shlex.quote(a) for a in argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    path = refine_files(model, tok, args.patterns, args.out, args.sparsity, command=command, window=args.window,
                        length=args.length, samples=args.samples, seed=args.seed, log=log)
    ev = json.loads(path.read_text())["calibration"]["evidence"]
    print(f"wrote {path}: picked {[(s['layer'], s['kv_head']) for s in ev['swing'] if s['chosen']]}")
    print("validation (mean answer log-prob, exact answers):", json.dumps(ev["validation"]))
    return 0


def cmd_calibrate_duo(args) -> int:
    import sys
    from dataclasses import fields

    check_device(args.device)  # before torch and the model load

    import torch

    from kvkit.calibrate.duo import DuoCalibration, calibrate
    from kvkit.models import load, resolve_name

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model {args.model!r} ...", file=sys.stderr, flush=True)
    model, tok = load(args.model, device=args.device)
    # every DuoCalibration field but steps comes from the option of its name (num_passkeys: --passkeys)
    settings = {f.name: getattr(args, "passkeys" if f.name == "num_passkeys" else f.name)
                for f in fields(DuoCalibration) if f.name != "steps"}
    res = calibrate(model, tok, steps=args.steps, out=args.out, model_name=resolve_name(args.model),
                    time_limit=args.time_limit, resume=args.resume, **settings)
    last = res["history"][-1]
    print(
        f"wrote {res['path']} ({res['model']['num_layers']} layers x {res['model']['num_kv_heads']} KV heads) in "
        f"{res['wall_s']:.0f} s; final distill loss {last['distill']:.5f}, mean alpha {last['reg']:.3f}"
    )
    print("retrieval KV heads per layer at the default sparsity:",
          json.dumps(res["retrieval_heads_at_default_sparsity"]))
    return 0
