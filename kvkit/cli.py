"""The ``kvkit`` console script.

``kvkit`` alone runs the built-in demo (full cache vs a compressed policy on the bundled model);
``kvkit run``, ``kvkit policies``; evaluation, benchmark, calibration and speculative commands are
added by their packages (``kvkit eval``, ``kvkit bench``, ``kvkit calibrate``, ``kvkit speculate``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvkit.fileio import read_text_file  # noqa: F401  (kvkit.cli.read_text_file: the reader the CLI uses)
from kvkit.options import fmt_bytes, parse_options  # noqa: F401  (kvkit.cli.parse_options: used by tests)

# the demo: full next to two policies that keep the needle with fewer bytes on the default model (duo with its
# shipped pattern; zipcache with its calibrated 4-bit setting) and StreamingLLM, which drops the middle (bytes
# and answers of each: results/demo/README.md)
DEMO_POLICIES = ("duo", "zipcache", "streaming")
DEMO_OPTIONS = {"streaming": {"budget": 256}}
DEMO_CONTEXT_TOKENS, DEMO_DEPTH = 3000, 0.5


def cmd_policies(args) -> int:
    from kvkit.registry import _REGISTRY, available_policies, policy_options

    for name in available_policies():
        cls = _REGISTRY[name]
        opts = ", ".join(f"{k}={v!r}" for k, v in policy_options(name).items()) or "(no options)"
        print(f"{name:<10} saves {cls.saves:<13} {cls.description}")
        print(f"{'':<10} defaults: {opts}")
    return 0


#: The largest --prompt-file read (a million-token prompt is ~4-5 MiB of text).
MAX_PROMPT_BYTES = 64 << 20


def read_prompt_file(path, limit: int | None = None) -> str:
    """The text of ``--prompt-file`` (:func:`read_text_file`: a regular UTF-8 file of at most ``limit`` bytes),
    or a one-line ValueError (also when it is empty); called before the model loads."""
    text = read_text_file(path, "--prompt-file", MAX_PROMPT_BYTES if limit is None else limit)
    if not text.strip():
        raise ValueError(f"--prompt-file {path} is empty; put the prompt text in it")
    return text


def _checked(convert, ok, what: str, name: str):
    """An argparse type: ``convert(text)`` that must pass ``ok``; the error says it must be ``what``."""

    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(v):  # NaN fails a range check too
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v

    parse.__name__ = parse.__qualname__ = name
    return parse


#: argparse type: an integer >= 1
positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1", "positive_int")
#: argparse type: a number in [0, 1]
fraction = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]", "fraction")


#: ``kvkit run`` options of the built-in demo (its needle prompt) and of a --prompt-file run: one mode's options are
#: refused in the other, instead of being silently ignored.
DEMO_ONLY = {"context_tokens": "--context-tokens", "depth": "--depth"}
PROMPT_FILE_ONLY = {"question": "--question"}


def check_run_mode(args) -> None:
    """Refuse an option that does not apply to the mode ``kvkit run`` is in (before the model loads)."""
    if args.prompt_file is None:
        given = [flag for k, flag in PROMPT_FILE_ONLY.items() if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{given[0]} needs --prompt-file: it is appended to the prompt file's text (the built-in "
                             "demo asks its own needle question); pass --prompt-file FILE --question '...'")
    else:
        given = [flag for k, flag in DEMO_ONLY.items() if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only shape{'s' if len(given) == 1 else ''} the built-in demo's "
                             "prompt; with --prompt-file the prompt is the file (drop them)")


def cmd_run(args) -> int:
    import torch

    from kvkit.demo import chat_ids, needle_prompt, run_policy
    from kvkit.models import load
    from kvkit.registry import get_policy

    torch.manual_seed(0)
    check_run_mode(args)
    policies = [p for item in (args.policy or list(DEMO_POLICIES)) for p in item.split(",") if p]
    options = parse_options(args.opt, args.options)
    if args.budget is not None:
        options["budget"] = args.budget
    plan = [(name, {} if name == "full" else (options or DEMO_OPTIONS.get(name, {})))
            for name in ["full", *[p for p in policies if p != "full"]]]
    for name, opts in plan:  # unknown policies and refused options before the model loads
        get_policy(name, **opts)
    text = read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    print(f"loading model {args.model!r} ...", flush=True)
    model, tok = load(args.model, device=args.device)
    expected = None
    if text is not None:
        if args.question:
            text = f"{text}\n\n{args.question}"
        ids = chat_ids(tok, text)
    else:
        context = DEMO_CONTEXT_TOKENS if args.context_tokens is None else args.context_tokens
        depth = DEMO_DEPTH if args.depth is None else args.depth
        ids, expected = needle_prompt(tok, context_tokens=context, depth=depth, seed=args.seed)
        print(f"demo: needle question over {ids.shape[1]} tokens of essays (needle at depth {depth:.0%})")
    runs = [run_policy(model, tok, ids, name, max_new_tokens=args.max_new_tokens, **opts) for name, opts in plan]
    full = runs[0]
    print()
    print(f"{'policy':<44} {'KV bytes':>11} {'vs full':>8} {'prefill':>8} {'decode':>10}  answer")
    for r in runs:
        ratio = full.kv_bytes / max(r.kv_bytes, 1)
        ok = "" if expected is None else ("  [correct]" if expected in r.answer else f"  [expected {expected}]")
        off = f" (+{fmt_bytes(r.kv_offloaded)} offloaded)" if r.kv_offloaded else ""
        speed = f"{r.decode_tok_s:>6.1f} tok/s" if r.decode_tok_s is not None else f"{'n/a':>12}"
        print(f"{r.policy[:44]:<44} {fmt_bytes(r.kv_bytes):>11} {ratio:>7.1f}x {r.prefill_s:>7.2f}s "
              f"{speed}  {r.answer!r}{ok}{off}")
    return 0


# sub-command providers: module -> function add_commands(subparsers)
EXTENSIONS = ("kvkit.doctor", "kvkit.evals.cli", "kvkit.speculative.cli", "kvkit.calibrate.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkit", description="KV-cache compression for Hugging Face transformers")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("run", help="answer a long prompt with a policy and compare KV bytes / speed with full")
    r.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    r.add_argument("--policy", action="append", help="policy name(s), comma separated (full is always run)")
    r.add_argument("--budget", type=positive_int, default=None, help="sets the policy's `budget` option")
    r.add_argument("--opt", action="append", metavar="KEY=VALUE", help="policy option, repeatable")
    r.add_argument("--options", default=None, help="policy options as JSON")
    r.add_argument("--prompt-file", default=None, help="text file with the prompt (default: built-in needle demo)")
    r.add_argument("--question", default=None, help="question appended after the prompt file (needs --prompt-file)")
    r.add_argument("--context-tokens", type=positive_int, default=None,
                   help=f"demo haystack size in tokens (default {DEMO_CONTEXT_TOKENS}; not with --prompt-file)")
    r.add_argument("--depth", type=fraction, default=None,
                   help=f"demo needle depth in [0, 1] (default {DEMO_DEPTH}; not with --prompt-file)")
    r.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens to generate (>= 1)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_run)
    pol = sub.add_parser("policies", help="list the registered policies with their defaults")
    pol.set_defaults(func=cmd_policies)
    for mod in EXTENSIONS:
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            if e.name and mod.startswith(e.name):
                continue  # that part of kvkit is not built yet
            raise
        m.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the built-in demo
        args = parser.parse_args(["run", *(argv or [])])
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input (or a model / file not installed): clear message
        print(f"kvkit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
