"""Calibrator registry: ``@calibrator("name", command=...)`` on a calibration's command-line entry, lookup by name.

A calibrator writes one section of a model's calibration file (:mod:`kvkit.calibration`) for the policy of the
same name, which must declare the options it sets (the policy class's ``calibrated_options``). It lives in
``kvkit/calibrate/<policy>.py`` and declares two things:

* ``command(subparsers)``: adds ``kvkit calibrate <name>``'s parser with its options and returns it (options that
  need checking before the model loads parse with an argparse ``type``); the built-in ones live in
  :mod:`kvkit.calibrate.parsers` (torch-free, listed in its ``COMMANDS``), so the command line is built without
  importing the calibrators;
* the decorated ``run(model, tokenizer, args, out, log) -> (options, evidence)``: the calibration on the loaded
  model, ``out`` being the file the section goes to (a calibrator may read the section it replaces there).

:func:`calibrators` imports ``kvkit.calibrate.<policy>`` for every registered policy that declares calibrated
options and has such a module (registration order = the policy registry's); a calibrator elsewhere registers by
being imported (before ``kvkit calibrate``'s parser is built, for its command to be offered: :func:`registered`).
The shared command-line options (:func:`common_options`, :func:`needle_values`, :func:`sweep_command`, from
:mod:`kvkit.calibrate.parsers`) are here too. Importing this module imports no policy and no torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvkit.calibrate.parsers import (  # noqa: F401  (re-exported: the options calibrators share)
    common_options,
    needle_values,
    sweep_command,
)
from kvkit.registry import available_policies, policy_class


@dataclass(frozen=True)
class Calibrator:
    name: str
    #: command(subparsers) -> the ``kvkit calibrate <name>`` parser, its options added
    command: Callable
    #: run(model, tokenizer, args, out, log) -> (options, evidence)
    run: Callable


_CALIBRATORS: dict[str, Calibrator] = {}


def calibrator(name: str, *, command: Callable):
    """Decorator on a calibration's ``run(model, tokenizer, args, out, log)``: register it under the policy ``name``
    with its ``command`` (refused when that policy declares no calibrated options: the store would refuse its
    section)."""
    if not policy_class(name).calibrated_options:
        raise ValueError(f"calibrator {name!r}: policy {name!r} declares no calibrated_options for it to set")

    def deco(run):
        cal = Calibrator(name, command, run)
        old = _CALIBRATORS.get(name)
        if old is not None and old.run.__module__ != run.__module__:
            raise ValueError(f"calibrator {name!r} is already registered by {old.run.__module__}")
        _CALIBRATORS[name] = cal
        return run

    return deco


def _load_builtin() -> None:
    here = {m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])}
    for name in available_policies():
        if name in here and policy_class(name).calibrated_options:
            importlib.import_module(f"kvkit.calibrate.{name}")


def calibrators() -> dict[str, Calibrator]:
    """Every registered calibrator by policy name (the built-in ones imported first)."""
    _load_builtin()
    return dict(_CALIBRATORS)


def registered() -> dict[str, Calibrator]:
    """The calibrators registered so far, by policy name (imports nothing: a built-in one is there once its module
    is imported)."""
    return dict(_CALIBRATORS)


def get(name: str) -> Calibrator:
    found = calibrators()
    if name not in found:
        raise ValueError(f"no calibrator for policy {name!r}; calibrated policies: {', '.join(found)}")
    return found[name]


# ---- what a needle-sweep calibration takes from its options ---------------------------------------------------
def sweep_args(args) -> dict:
    """The keyword arguments a needle-sweep calibration takes from :func:`sweep_command`'s options."""
    return dict(length=args.length, samples=args.samples, budget_fraction=args.budget_fraction, seed=args.seed,
                values=args.values)
