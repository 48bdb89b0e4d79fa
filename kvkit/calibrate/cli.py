"""``kvkit calibrate``: the DuoAttention commands (:mod:`kvkit.calibrate.duo_cli`: ``duo``, ``duo-merge``,
``duo-refine``) and ``kvkit calibrate <policy>`` for every registered calibrator (:mod:`kvkit.calibrate.registry`:
shadowkv, tidal, cake, snapkv, chelsea, zipcache, ...): a per-model knob, written as one section of the model's
calibration file (:mod:`kvkit.calibration`), which the policy then finds from the model's config. This module names
no calibrated policy: each calibrator brings its own command and run."""

from __future__ import annotations

import json


def add_commands(subparsers) -> None:
    from kvkit.calibrate.duo_cli import add_duo_commands
    from kvkit.calibrate.registry import calibrators

    names = ", ".join(["duo", *calibrators()])
    cal = subparsers.add_parser("calibrate", help=f"per-model calibration of a policy ({names})")
    sub = cal.add_subparsers(dest="calibrate_policy", required=True)
    add_duo_commands(sub)
    _add_calibrator_commands(sub)


def _add_calibrator_commands(sub) -> None:
    from kvkit.calibrate.registry import calibrators

    for name, cal in calibrators().items():
        cal.command(sub).set_defaults(func=cmd_calibrate_knob, knob=name)


def cmd_calibrate_knob(args) -> int:
    """``kvkit calibrate <policy>`` for a registered calibrator: load the model, run the calibration, write its
    section (with the command that made it) to ``--out`` or the model's default calibration file."""
    import shlex
    import sys

    import torch

    from kvkit import calibration as store
    from kvkit.calibrate import registry
    from kvkit.models import load, resolve_name

    cal = registry.get(args.knob)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model {args.model!r} ...", flush=True)
    model, tok = load(args.model, device=args.device)
    model.eval()
    name = resolve_name(args.model)
    log = lambda m: print(m, flush=True)  # noqa: E731
    out = args.out or store.default_out(name)
    opts, ev = cal.run(model, tok, args, out, log)
    argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("kvkit") else ["calibrate", args.knob, *getattr(args, "_argv", [])]
    command = "kvkit " + " ".join(shlex.quote(a) for a in argv)
    path = store.write_section(out, store.identity(model.config, name), args.knob, opts, command, ev)
    print(f"{args.knob}: {json.dumps(opts)} -> {path} ({ev.get('seconds')} s)")
    return 0


def main_calibrate(argv: list[str] | None = None) -> int:
    """``kvkit calibrate ...`` as a function (for scripts and tests)."""
    import argparse

    p = argparse.ArgumentParser(prog="kvkit")
    add_commands(p.add_subparsers(dest="command"))
    args = p.parse_args(["calibrate", *(argv or [])])
    args._argv = list(argv or [])[1:]
    return args.func(args) or 0
