"""``kvkit calibrate``: the DuoAttention commands (:mod:`kvkit.calibrate.duo_cli`: ``duo``, ``duo-merge``,
``duo-refine``) and ``kvkit calibrate <policy>`` for every registered calibrator (:mod:`kvkit.calibrate.registry`:
shadowkv, tidal, cake, snapkv, chelsea, zipcache, ...): a per-model knob, written as one section of the model's
calibration file (:mod:`kvkit.calibration`), which the policy then finds from the model's config. This module names
no calibrated policy: each calibrator brings its own command and run.

Building the parsers imports neither torch nor transformers (the built-in calibrators' parsers come from
:mod:`kvkit.calibrate.parsers`, duo's from :mod:`kvkit.calibrate.duo_cli`): ``kvkit calibrate --help`` and the
refusal of a bad argument take a fraction of a second. A calibrator's module (and torch) loads when its command
runs, after the checks that need no model (counts, ``--out``, ``--device``).
"""

from __future__ import annotations

import json

from kvkit.calibrate import parsers, registry
from kvkit.calibrate.duo_cli import add_duo_commands
from kvkit.cli_grammar import Parser, check_device


def calibrator_commands() -> dict:
    """Policy -> the parser function of its ``kvkit calibrate <policy>`` command: the built-in calibrators'
    (:data:`kvkit.calibrate.parsers.COMMANDS`), then those registered elsewhere that are already imported (without
    importing any calibrator module)."""
    extra = {name: cal.command for name, cal in registry.registered().items() if name not in parsers.COMMANDS}
    return {**parsers.COMMANDS, **extra}


def add_commands(subparsers) -> None:
    """Add ``kvkit calibrate``'s parser and its subcommands (duo's and every calibrator's) to ``subparsers``."""
    commands = calibrator_commands()
    names = ", ".join(["duo", *commands])
    cal = subparsers.add_parser("calibrate", help=f"per-model calibration of a policy ({names})")
    sub = cal.add_subparsers(dest="calibrate_policy", required=True)
    add_duo_commands(sub)
    for name, command in commands.items():
        command(sub).set_defaults(func=cmd_calibrate_knob, knob=name)


def check_calibration_out(out) -> None:
    """Refuse (ValueError naming the file) an ``--out`` a calibration section cannot be added to, before anything
    runs: a name not ending in ``.json``, a folder, a path under a file, or an existing file that is not a kvkit
    calibration file (not JSON, another format)."""
    from pathlib import Path

    from kvkit import calibration as store

    p = Path(out)
    if p.suffix.lower() != ".json":
        raise ValueError(f"--out {p}: a calibration file is JSON; name a .json file (the policy finds it there)")
    if p.is_dir():
        raise ValueError(f"--out {p} is a folder; name a .json file")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {p}: {parent} is a file, not a folder")
            break
    if p.exists():
        try:
            store.read(p)
        except ValueError as e:
            raise ValueError(f"--out {p} exists and is not a kvkit calibration file ({e}); choose another --out "
                             "(the section is added to a calibration file, or a new one is created)") from None


def check_counts(args) -> None:
    """``--length`` / ``--samples`` (and the other counts a calibrator takes) must be >= 1."""
    for flag in ("length", "samples", "threads"):
        v = getattr(args, flag, None)
        if v is not None and (isinstance(v, bool) or v < 1):
            raise ValueError(f"--{flag} must be an integer >= 1, got {v}")


def cmd_calibrate_knob(args) -> int:
    """``kvkit calibrate <policy>`` for a registered calibrator: check the arguments and ``--out``, load the model
    (refusing an ``--out`` of another model), run the calibration, write its section (with the command that made
    it) to ``--out`` or the model's default calibration file. Progress goes to stderr."""
    import os
    import shlex
    import sys

    check_counts(args)  # the checks that need no model and no torch come first
    if args.out:
        check_calibration_out(args.out)
    check_device(args.device)

    import torch

    from kvkit import calibration as store
    from kvkit.models import load, resolve_name

    cal = registry.get(args.knob)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"loading model {args.model!r} ...")
    model, tok = load(args.model, device=args.device)
    model.eval()
    name = resolve_name(args.model)
    out = args.out or store.default_out(name)
    if os.path.exists(out):
        data = store.read(out)
        if not store.matches(data["model"], store.identity(model.config, name)):
            raise ValueError(f"--out {out} belongs to another model ({data['model'].get('name')!r}); choose another "
                             "--out")
    log(f"calibrating {args.knob} ...")
    opts, ev = cal.run(model, tok, args, out, log)
    argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("kvkit") else ["calibrate", args.knob, *getattr(args, "_argv", [])]
    command = "kvkit " + " ".join(shlex.quote(a) for a in argv)
    path = store.write_section(out, store.identity(model.config, name), args.knob, opts, command, ev)
    print(f"{args.knob}: {json.dumps(opts)} -> {path} ({ev.get('seconds')} s)")
    return 0


def main_calibrate(argv: list[str] | None = None) -> int:
    """``kvkit calibrate ...`` as a function (for scripts and tests)."""
    p = Parser(prog="kvkit")
    add_commands(p.add_subparsers(dest="command", parser_class=Parser))
    args = p.parse_args(["calibrate", *(argv or [])])
    args._argv = list(argv or [])[1:]
    return args.func(args) or 0
