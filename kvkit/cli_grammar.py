"""The grammar every ``kvkit`` command shares, and its argparse pieces (standard library only: building a parser and
refusing a bad argument import neither torch nor transformers).

- A policy is written ``NAME[:KEY=VALUE,...]`` (``snapkv:budget=512,window=32``), parsed by :func:`parse_policy`
  (values as JSON -- ``512``, ``0.5``, ``true``, ``[1,2]`` --, ``True``/``False``/``None`` as Python's, anything
  else as text; commas inside brackets belong to the value). ``--policy`` takes one; the commands that run several
  take it repeatedly (``--policy full --policy snapkv:budget=512``). ``--budget N`` and ``--compression-ratio R``
  set ``budget`` / ``compression_ratio`` in the options of every policy given but ``full`` (:func:`with_shared`).
- ``--out`` names every output (a folder, or a file where the command writes one); ``--max-new-tokens`` every
  generation length. Older spellings (``--out-root``, ``--json``, ``--new-tokens``, ``--opt``, ...) stay as hidden
  aliases that print one warning (:func:`add_alias`).
- :class:`Parser`: defaults shown in ``--help``; a mistyped flag is answered by the subcommand's own usage
  (:meth:`Parser.leaf`) with the closest known flag.
- argparse types (:func:`checked`: :data:`positive_int`, :data:`fraction`, :data:`positive_float`,
  :func:`int_list`, :data:`policy_spec`): a wrong value exits 2 with one ``error:`` line naming the flag.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys

from kvkit import catalog
from kvkit.policy_spec import (  # noqa: F401  (re-exported: kvkit.cli_grammar.<name> as before)
    PolicySpec,
    has_option,
    parse_pairs,
    parse_policy,
    parse_value,
    with_shared,
)


# ---------------------------------------------------------------------------------------------------- types
def checked(convert, ok, what: str, name: str):
    """An argparse type: ``convert(text)`` that must pass ``ok``; the error says it must be ``what``."""

    def parse(text: str):
        try:
            v = convert(text)
        except ValueError as e:
            detail = str(e) if convert in (parse_policy,) or getattr(convert, "explain", False) else ""
            raise argparse.ArgumentTypeError(detail or f"must be {what}, got {text!r}") from None
        if not ok(v):  # NaN fails a range check too
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v

    parse.__name__ = parse.__qualname__ = name
    return parse


#: argparse type: an integer >= 1
positive_int = checked(int, lambda v: v >= 1, "an integer >= 1", "positive_int")
#: argparse type: an integer >= 0
nonnegative_int = checked(int, lambda v: v >= 0, "an integer >= 0", "nonnegative_int")
#: argparse type: any integer
integer = checked(int, lambda v: True, "an integer", "integer")
#: argparse type: a number in [0, 1]
fraction = checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]", "fraction")
#: argparse type: a number > 0 (finite)
positive_float = checked(float, lambda v: 0 < v < float("inf"), "a number > 0", "positive_float")
#: argparse type: a number >= 0 (finite)
nonnegative_float = checked(float, lambda v: 0 <= v < float("inf"), "a number >= 0", "nonnegative_float")
def _budget(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is not None and v < 1:
        raise ValueError(f"must be an integer >= 1, got {v}")
    if v is None:
        hint = ""
        try:
            if 0 < float(text) < 1:
                hint = f"; for a fraction of the KV cache removed use --compression-ratio {text}"
        except ValueError:
            pass
        raise ValueError(f"must be an integer >= 1 (tokens kept), got {text!r}{hint}")
    return v


_budget.explain = True
#: argparse type of ``--budget``: tokens, an integer >= 1 (a fraction is pointed to ``--compression-ratio``)
budget_tokens = checked(_budget, lambda v: True, "", "budget")
#: argparse type: ``NAME[:KEY=VALUE,...]`` -> :class:`PolicySpec`
policy_spec = checked(parse_policy, lambda v: True, "NAME[:KEY=VALUE,...]", "policy")


def _policy_list(text: str):
    """One ``NAME[:KEY=VALUE,...]``, or (as older command lines wrote them) bare names separated by commas."""
    if ":" not in text and "," in text and "=" not in text:
        return [parse_policy(t) for t in text.split(",") if t.strip()]
    return parse_policy(text)


_policy_list.explain = True
#: argparse type: :data:`policy_spec`, or a list of them from ``a,b,c`` (bare names)
policy_list = checked(_policy_list, lambda v: True, "", "policy")


def flatten(items) -> list:
    """``[a, [b, c], d]`` -> ``[a, b, c, d]`` (a repeated option whose values may be lists)."""
    return [x for item in items or [] for x in (item if isinstance(item, list) else [item])]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def int_list(name: str = "int_list"):
    """argparse type: comma-separated integers >= 1 (``2048,4096``) -> list."""
    return checked(_ints, lambda v: bool(v) and min(v) >= 1, "comma-separated integers >= 1", name)


def choice_list(choices, name: str):
    """argparse type: comma-separated names, each one of ``choices`` -> list."""
    def convert(text):
        xs = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in xs if x not in choices]
        if bad or not xs:
            raise ValueError(f"must be comma-separated names of {', '.join(choices)}, got {text!r}")
        return xs

    convert.explain = True
    return checked(convert, lambda v: True, "", name)


# ---------------------------------------------------------------------------------------------------- parser
class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default (when it has one) after its help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == [] or \
                action.default is argparse.SUPPRESS or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """kvkit's parser: defaults in ``--help``; the parser that parsed last (the subcommand) is recorded in the
    namespace, so that an unknown flag is answered with that subcommand's usage (:meth:`leaf`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if not hasattr(ns, "_leaf_parser"):
            ns._leaf_parser = self
        return ns, extra

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            ns._leaf_parser.unknown(extra)
        return ns

    def unknown(self, extra: list[str]):
        """Exit 2 with this parser's usage and the unknown arguments (the closest known flag suggested)."""
        flags = [s for a in self._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
        hint = ""
        first = next((x for x in extra if x.startswith("-")), None)
        if first:
            close = difflib.get_close_matches(first.split("=", 1)[0], flags, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else f" (see {self.prog} --help)"
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


# ---------------------------------------------------------------------------------------------------- aliases
_WARNED: set = set()


class _Alias(argparse.Action):
    """A deprecated spelling of another option: prints one warning, then stores (or appends) to its ``dest``."""

    def __init__(self, option_strings, dest, new: str = "", append: bool = False, convert=None, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new, self.append, self.convert = new, append, convert

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string not in _WARNED:
            _WARNED.add(option_string)
            print(f"kvkit: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        if self.convert is not None:
            try:
                values = self.convert(values)
            except ValueError as e:
                parser.error(f"argument {option_string}: {e}")
        if self.append:
            items = list(getattr(namespace, self.dest, None) or [])
            items.extend(flatten(values if isinstance(values, list) else [values]))
            values = items
        setattr(namespace, self.dest, values)
        setattr(namespace, f"_flag_{self.dest}", option_string)  # errors about the value name the flag given


def add_alias(parser, old: str, dest: str, new: str, *, append: bool = False, convert=None, type=None,
              nargs=None, metavar=None) -> None:
    """The hidden deprecated option ``old`` writing to ``dest`` (``new`` names its replacement in the warning);
    ``append``: added to a list (a repeatable option); ``convert``: applied to the value(s) after ``type``."""
    parser.add_argument(old, dest=dest, action=_Alias, new=new, append=append, convert=convert, type=type,
                        nargs=nargs, metavar=metavar, help=argparse.SUPPRESS, default=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------------- shared options
def add_policy_options(p, *, several: bool, default=None, what: str = "policy") -> None:
    """``--policy NAME[:KEY=VALUE,...]`` (repeatable when ``several``), ``--budget``, ``--compression-ratio``, and the
    hidden ``--opt KEY=VALUE`` / ``--policy-options JSON`` / ``--options JSON`` of earlier releases."""
    if several:
        p.add_argument("--policy", action="append", type=policy_spec, default=None, metavar="NAME[:KEY=VALUE,...]",
                       help=f"a {what} and its options, e.g. snapkv:budget=512,window=32 (repeatable)"
                            + (f"; default: {default}" if default else ""))
    else:
        p.add_argument("--policy", type=policy_spec, default=parse_policy(default or "full"),
                       metavar="NAME[:KEY=VALUE,...]",
                       help=f"the {what} and its options, e.g. snapkv:budget=512,window=32 (see `kvkit policies`)")
    p.add_argument("--budget", type=budget_tokens, default=None,
                   help="sets `budget` (tokens kept) in the options of every policy but full")
    p.add_argument("--compression-ratio", type=fraction, default=None, metavar="R",
                   help="sets `compression_ratio` (fraction of the KV removed) in the options of every policy but full")
    add_alias(p, "--opt", "opt", "--policy NAME:KEY=VALUE,...", append=True, metavar="KEY=VALUE")
    add_alias(p, "--policy-options", "policy_options", "--policy NAME:KEY=VALUE,...", metavar="JSON")
    add_alias(p, "--options", "policy_options", "--policy NAME:KEY=VALUE,...", metavar="JSON")


def extra_options(args) -> dict:
    """The options of the hidden ``--policy-options JSON`` and ``--opt KEY=VALUE`` (ValueError naming the flag the
    user gave)."""
    out = {}
    raw = getattr(args, "policy_options", None)
    if raw:
        flag = getattr(args, "_flag_policy_options", "--policy-options")
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e.msg} (column {e.colno}); write the options as "
                             f"--policy NAME:key=value,key=value") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{flag} must be a JSON object")
        out.update(loaded)
    for item in getattr(args, "opt", None) or []:
        out.update(parse_pairs(item, "--opt"))
    return out


def check_policy_args(args) -> None:
    """Every ``--policy`` of a parsed command line, with the options given apart folded in (:func:`policies_of`),
    checked against the policy catalog without importing torch (:func:`kvkit.catalog.check_options`): run by
    ``kvkit.cli.main`` before the command's own imports, so an unknown option, a bad ``preset`` or
    ``compression_ratio`` and a native knob beside ``compression_ratio`` are refused at once, and so is a ``--budget``
    that no given policy has (it would be ignored: with several policies it goes to those that have one).
    ``bench --shape``'s rows (transformers rows and compile settings beside the policies) are left to their own
    parser."""
    if getattr(args, "shape", None) or not getattr(args, "policy", None):
        return
    specs = policies_of(args)
    budget = getattr(args, "budget", None)
    compressing = [s.name for s in specs if s.name != "full"]
    if budget is not None and compressing and not any(has_option(n, "budget") for n in compressing):
        raise ValueError(f"--budget {budget}: {', '.join(dict.fromkeys(compressing))} has no `budget` option, so it "
                         "would be ignored; give --compression-ratio R, or the policy's own knob as "
                         "--policy NAME:KEY=VALUE (`kvkit policies NAME` lists them)")
    for spec in specs:
        catalog.check_options(spec.name, spec.options)


def policies_of(args, default: str | None = None) -> list[PolicySpec]:
    """Every ``--policy`` of ``args`` (a list, or one spec) with ``--budget`` / ``--compression-ratio`` / the hidden
    ``--opt`` folded into its options (:func:`with_shared`); ``[default]`` when none was given."""
    given = flatten(args.policy) if isinstance(args.policy, list) else ([args.policy] if args.policy else [])
    if not given and default:
        given = [parse_policy(default)]
    extra = extra_options(args)
    return [with_shared(s, getattr(args, "budget", None), getattr(args, "compression_ratio", None), extra)
            for s in given]


def check_out_folder(path, flag: str = "--out") -> None:
    """Refuse (ValueError) an output folder that cannot be one: an existing file, or a path under a file, or a
    missing folder whose nearest existing parent is not writable. Checked before anything runs."""
    p = os.path.abspath(str(path))
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{flag} {path} is a file, not a folder; name a folder (it is created when missing)")
    parent = p
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder; name a folder")
    if parent != p and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create it in {parent} (no write permission)")


def check_out_file(path, flag: str = "--out") -> None:
    """Refuse (ValueError) an output file that cannot be one: an existing folder, or a path under a file."""
    p = os.path.abspath(str(path))
    if os.path.isdir(p):
        raise ValueError(f"{flag} {path} is a folder; name a file")
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")


def _explained(check):
    def convert(text):
        check(text, "")
        return text

    convert.explain = True
    return convert


def _strip(check):
    """``check(path, flag)`` whose message starts with the flag: argparse names the flag itself."""
    def run(path, flag):
        try:
            check(path, "@@")
        except ValueError as e:
            raise ValueError(str(e).replace("@@ ", "").replace("@@", "")) from None
    return run


#: argparse types: an output folder / file that can be written (checked when parsed, before anything runs)
out_folder = checked(_explained(_strip(check_out_folder)), lambda v: True, "", "out_folder")
out_file = checked(_explained(_strip(check_out_file)), lambda v: True, "", "out_file")


def add_out(p, help: str, *, required: bool = False, old: tuple[str, ...] = (), kind: str = "folder") -> None:
    """``--out`` (a ``kind`` "folder" or "file", checked when parsed) and the hidden deprecated spellings ``old``."""
    typ = out_folder if kind == "folder" else out_file
    p.add_argument("--out", required=False, default=None, metavar="PATH", type=typ,
                   help=help + (" (required)" if required else ""))
    for o in old:
        add_alias(p, o, "out", "--out", metavar="PATH", type=typ)
    if required:
        p.set_defaults(_required_out=True)


def add_max_new_tokens(p, default=None, help: str = "tokens to generate", old: tuple[str, ...] = ()) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=default, metavar="N", help=help)
    for o in old:
        add_alias(p, o, "max_new_tokens", "--max-new-tokens", type=positive_int, metavar="N")


def add_device(p, default: str = "cpu") -> None:
    p.add_argument("--device", default=default, help="cpu | cuda | cuda:N")


#: what ``--model`` takes
MODEL_HELP = "default | packaged name | local dir | .gguf file"


def add_model(p, help: str = MODEL_HELP, *, device: str | None = "cpu", threads: str | None = None) -> None:
    """Add the options of a command that loads a model: ``--model`` (default ``default``, the bundled model; ``help``
    says what it takes), ``--device`` (default ``device``; None: no such option) and, when ``threads`` gives its
    help, ``--threads`` (torch CPU threads, an integer >= 1)."""
    p.add_argument("--model", default="default", help=help)
    if device is not None:
        add_device(p, device)
    if threads is not None:
        p.add_argument("--threads", type=positive_int, default=None, help=threads)


def lazy_command(module: str, name: str, before=None):
    """The command ``module.name`` for a parser's ``set_defaults(func=...)``, imported when it runs (so building the
    parser imports no command code, nor torch); ``before(args)``, when given, runs first (checks that need none)."""

    def command(args) -> int:
        if before is not None:
            before(args)
        return getattr(importlib.import_module(module), name)(args)

    command.__name__ = command.__qualname__ = name
    return command


def check_device(device: str) -> None:
    """Refuse a CUDA device when torch has none (before the model loads); imports torch only for a CUDA device."""
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}, "
                             f"CUDA {'built in' if torch.backends.cuda.is_built() else 'not built in'}); "
                             "use --device cpu")
        if ":" in str(device):
            idx = str(device).split(":", 1)[1]
            if not idx.isdigit() or int(idx) >= torch.cuda.device_count():
                raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif str(device) not in ("cpu", "mps", "meta") and not str(device).startswith(("cpu:", "mps:")):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
