"""The ``kvkit`` console script.

``kvkit`` alone runs the built-in demo (full cache vs compressed policies on the bundled model); ``kvkit run``,
``kvkit policies [NAME]``, ``kvkit doctor``, ``kvkit eval ...``, ``kvkit bench``, ``kvkit speculate`` and
``kvkit calibrate ...``. The grammar they share (``--policy NAME[:KEY=VALUE,...]``, ``--out``, ``--max-new-tokens``,
``--compression-ratio``) is :mod:`kvkit.cli_grammar`.

Only the parser of the command asked for is built (:data:`COMMANDS`; the others are listed by name and help), and
every parser is built without importing torch or transformers: ``kvkit --help``, ``kvkit policies`` (read from
:mod:`kvkit.catalog`'s data file), ``kvkit calibrate --help`` (its parsers: :mod:`kvkit.calibrate.parsers`) and the
refusal of a bad argument take a fraction of a second. A command's code (and torch with it) is imported when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvkit.cli_grammar import (
    Parser,
    PolicySpec,
    add_alias,
    add_max_new_tokens,
    add_model,
    add_out,
    add_policy_options,
    check_device,
    check_policy_args,
    choice_list,
    fraction,
    int_list,
    integer,
    lazy_command,
    parse_policy,
    policies_of,
    policy_list,
    policy_spec,
    positive_int,
)
from kvkit.fileio import read_text_file  # noqa: F401  (kvkit.cli.read_text_file: the reader the CLI uses)
from kvkit.options import fmt_bytes, parse_options  # noqa: F401  (kvkit.cli.parse_options: used by tests)

# the demo: full next to two policies that keep the needle with fewer bytes on the default model (duo with its
# shipped pattern; zipcache with its calibrated 4-bit setting) and StreamingLLM, which drops the middle (bytes
# and answers of each: results/demo/README.md)
DEMO_POLICIES = ("duo", "zipcache", "streaming:budget=256")
DEMO_OPTIONS = {"streaming": {"budget": 256}}
DEMO_CONTEXT_TOKENS, DEMO_DEPTH = 3000, 0.5


# ------------------------------------------------------------------------------------------ policies
def cmd_policies(args) -> int:
    """``kvkit policies``: every policy, what it saves, its paper and options; ``kvkit policies NAME``: one policy's
    options with their defaults, meaning and the reason for the default (from :mod:`kvkit.catalog`)."""
    from kvkit import catalog

    entries = catalog.load()
    if args.name is None:
        for e in entries:
            print(f"{e['name']:<10} saves {e['saves']:<13} {e['summary']}")
            opts = ", ".join(f"{o['name']}={o['default']}" for o in e["options"]) or "(no options)"
            print(f"{'':<10} options: {opts}")
        print("\n`kvkit policies NAME` explains each option of a policy; give options as --policy NAME:KEY=VALUE,...")
        return 0
    print(catalog.describe_text(catalog.entry(args.name, entries)))
    return 0


# ------------------------------------------------------------------------------------------ run
#: The largest --prompt-file read (a million-token prompt is ~4-5 MiB of text).
MAX_PROMPT_BYTES = 64 << 20


def read_prompt_file(path, limit: int | None = None) -> str:
    """The text of ``--prompt-file`` (:func:`read_text_file`: a regular UTF-8 file of at most ``limit`` bytes),
    or a one-line ValueError (also when it is empty); called before the model loads."""
    text = read_text_file(path, "--prompt-file", MAX_PROMPT_BYTES if limit is None else limit)
    if not text.strip():
        raise ValueError(f"--prompt-file {path} is empty; put the prompt text in it")
    return text


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


def run_plan(args) -> list[PolicySpec]:
    """The settings ``kvkit run`` compares: ``full`` first, then every ``--policy`` (default: the demo's) with
    ``--budget`` / ``--compression-ratio`` / the hidden ``--opt`` folded in."""
    given = [s for item in (args.policy or []) for s in (item if isinstance(item, list) else [item])]
    if not given:
        given = [parse_policy(p) for p in DEMO_POLICIES]
        if args.budget is not None or args.compression_ratio is not None or getattr(args, "opt", None) \
                or getattr(args, "policy_options", None):  # options given apart replace the demo's own
            given = [PolicySpec(s.name) for s in given]
    args.policy = given
    specs = policies_of(args)
    return [PolicySpec("full"), *[s for s in specs if s.name != "full"]]


def context_limit(model) -> int | None:
    """The model's trained context (``max_position_embeddings`` of its text config), or None when it has none."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    text = get(decoder=True) if callable(get) else cfg
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_fits(model, prompt_tokens: int, max_new_tokens: int, flag: str = "--max-new-tokens") -> None:
    """Refuse (ValueError) a prompt of ``prompt_tokens`` plus ``max_new_tokens`` new tokens beyond the model's
    trained context, before any forward runs (``model.generate`` refuses the same request up front)."""
    limit = context_limit(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        fix = f"use {flag} {room} or less" if room >= 1 else "use a shorter prompt"
        raise ValueError(f"the prompt ({prompt_tokens} tokens) + {flag} {max_new_tokens} is more than the model's "
                         f"trained context of {limit} tokens; {fix}")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    check_run_mode(args)
    plan = run_plan(args)
    text = read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    check_device(args.device)
    from kvkit.registry import get_policy

    for spec in plan:  # unknown policies and refused options before the model loads
        get_policy(spec.name, **spec.options)

    import torch

    from kvkit.demo import chat_ids, needle_prompt, run_policy
    from kvkit.models import load

    torch.manual_seed(0)
    _log(f"loading model {args.model!r} on {args.device} ...")
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
    check_fits(model, ids.shape[1], args.max_new_tokens)
    runs, failed = [], None
    for i, spec in enumerate(plan):
        _log(f"[{i + 1}/{len(plan)}] {spec}")
        try:
            runs.append((spec, run_policy(model, tok, ids, spec.name, max_new_tokens=args.max_new_tokens, log=_log,
                                          **spec.options)))
        except Exception as e:  # the finished settings are still shown, then the error
            failed = (spec, e)
            break
    print_run_table(runs, expected)
    if failed is not None:  # what finished is printed above; the failure in one line
        spec, e = failed
        print(f"kvkit: error: {spec} failed after {len(runs)} finished setting(s): {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    return 0


def print_run_table(runs: list, expected: str | None) -> None:
    """The demo's table: each setting as given (``streaming:budget=256``: no truncation), KV bytes against the first
    (full) row, prefill seconds, decode speed and the answer."""
    if not runs:
        return
    full = runs[0][1]
    width = max(len("policy"), *(len(str(s)) for s, _ in runs))
    print()
    print(f"{'policy':<{width}} {'KV bytes':>11} {'vs full':>8} {'prefill':>8} {'decode':>12}  answer")
    for spec, r in runs:
        ratio = full.kv_bytes / max(r.kv_bytes, 1)
        ok = "" if expected is None else ("  [correct]" if expected in r.answer else f"  [expected {expected}]")
        off = f" (+{fmt_bytes(r.kv_offloaded)} offloaded)" if r.kv_offloaded else ""
        speed = f"{r.decode_tok_s:>6.1f} tok/s" if r.decode_tok_s is not None else f"{'n/a':>12}"
        stop = f"  [stopped after {r.new_tokens} tokens: {r.error}]" if getattr(r, "error", None) else ""
        print(f"{str(spec):<{width}} {fmt_bytes(r.kv_bytes):>11} {ratio:>7.1f}x {r.prefill_s:>7.2f}s "
              f"{speed}  {r.answer!r}{ok}{off}{stop}")


def add_run(sub) -> None:
    r = sub.add_parser("run", help=COMMAND_HELP["run"], description=COMMAND_HELP["run"])
    add_model(r)
    add_policy_options(r, several=True, default=" ".join(f"--policy {p}" for p in DEMO_POLICIES) + " (full is "
                       "always run first)")
    r._option_string_actions["--policy"].type = policy_list  # also the older "duo,zipcache"
    r.add_argument("--prompt-file", default=None, help="text file with the prompt (default: built-in needle demo)")
    r.add_argument("--question", default=None, help="question appended after the prompt file (needs --prompt-file)")
    r.add_argument("--context-tokens", type=positive_int, default=None,
                   help=f"demo haystack size in tokens (default {DEMO_CONTEXT_TOKENS}; not with --prompt-file)")
    r.add_argument("--depth", type=fraction, default=None,
                   help=f"demo needle depth in [0, 1] (default {DEMO_DEPTH}; not with --prompt-file)")
    add_max_new_tokens(r, 16, "tokens to generate per policy (prompt + this must fit the model's context)")
    r.add_argument("--seed", type=integer, default=0, help="seed of the demo's needle")
    r.set_defaults(func=cmd_run)


def add_policies(sub) -> None:
    p = sub.add_parser("policies", help=COMMAND_HELP["policies"], description=COMMAND_HELP["policies"])
    p.add_argument("name", nargs="?", default=None, help="a policy: its options, defaults, meaning and reasons")
    p.set_defaults(func=cmd_policies)


# ------------------------------------------------------------------------------------------ speculate
def add_speculate(sub) -> None:
    """``kvkit speculate``'s parser (the command: :func:`kvkit.speculative.cli.cmd_speculate`)."""
    s = sub.add_parser("speculate", help=COMMAND_HELP["speculate"], description=COMMAND_HELP["speculate"])
    add_model(s, "target model: default | packaged name | local dir | .gguf",
              threads="CPU threads for torch (default: torch's)")
    s.add_argument("--length", type=positive_int, default=4096,
                   help="prompt length in tokens (essay haystack + question + chat template)")
    s.add_argument("--task", default="needle", choices=["needle", "continue"],
                   help="needle: question about a fact deep in the prompt; continue: continue raw essay text "
                        "(PG-19 style)")
    add_max_new_tokens(s, 64, "tokens decoded per row (>= 2: the first comes from the prefill)", old=("--new-tokens",))
    s.add_argument("--batch", type=positive_int, default=1,
                   help="rows decoded together (needle: one needle prompt per row, left padded; continue: essay text "
                        "from a different offset per row)")
    s.add_argument("--gamma", type=int_list("gamma"), default=[4], metavar="N[,N...]", help="draft length(s)")
    s.add_argument("--policy", action="append", type=policy_spec, default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="a draft view and its options: streaming | retrieval (repeatable); default: streaming")
    add_alias(s, "--draft-policy", "policy", "--policy NAME[:KEY=VALUE,...]", append=True,
              convert=lambda t: [parse_policy(x) for x in t.split(",") if x.strip()])
    s.add_argument("--budget", type=int_list("budget"), default=None, metavar="N[,N...]",
                   help="draft view budget(s) (default: the view's)")
    s.add_argument("--compression-ratio", type=fraction, default=None, metavar="R",
                   help="sets `compression_ratio` in every draft view's options")
    add_alias(s, "--draft-opt", "opt", "--policy NAME:KEY=VALUE,...", append=True, metavar="KEY=VALUE")
    s.add_argument("--adaptive", type=fraction, default=None, help="stop drafting below this draft confidence")
    s.add_argument("--assistant", default=None, help="tiny draft model sharing the tokenizer (hierarchical)")
    s.add_argument("--assistant-gamma", type=positive_int, default=None, help="the assistant's draft length")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--seed", type=integer, default=0)
    s.add_argument("--repeat", type=positive_int, default=1,
                   help="run plain decoding and every setting this many times, interleaved; report medians "
                        "(speedup: median of the per-repeat ratios, each against the plain run of the same repeat)")
    s.add_argument("--baselines", type=choice_list(("dynamic", "static"), "baselines"), default=[],
                   metavar="NAME[,NAME]",
                   help="extra plain greedy baselines over transformers caches: dynamic (DynamicCache, transformers' "
                        "default: copies the whole KV at every step) and/or static (preallocated StaticCache); "
                        "kvkit's own plain decoding appends in place. Speedups are also reported against each")
    add_out(s, "append one JSON line per setting to this file (.jsonl)", old=("--json",), kind="file")
    s.set_defaults(func=lazy_command("kvkit.speculative.cli", "cmd_speculate"))


# ------------------------------------------------------------------------------------------ the command table
COMMAND_HELP = {
    "run": "answer a long prompt with policies and compare KV bytes / speed with full (kvkit alone: the demo)",
    "policies": "list the policies, or explain one policy's options (kvkit policies NAME)",
    "doctor": "versions, GPU, kernel paths; --matrix runs the support matrix",
    "eval": "long-context evaluations: ruler, sweep, niah, needles, longbench, compare",
    "bench": "prefill time, decode tok/s, peak memory, KV bytes: policies vs full",
    "speculate": "self-speculative decoding: acceptance rate and speedup vs plain",
    "calibrate": "per-model calibration of a policy (kvkit calibrate NAME --help)",
}

#: command -> (module, function adding its parser to the subparsers), built only when that command is asked for
COMMANDS = {
    "run": ("kvkit.cli", "add_run"),
    "policies": ("kvkit.cli", "add_policies"),
    "doctor": ("kvkit.doctor", "add_commands"),
    "eval": ("kvkit.evals.cli", "add_eval"),
    "bench": ("kvkit.evals.cli", "add_bench"),
    "speculate": ("kvkit.cli", "add_speculate"),
    "calibrate": ("kvkit.calibrate.cli", "add_commands"),
}


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The ``kvkit`` parser with ``command``'s subparser built (``"*"``: every command's; None: none, the others
    are listed by name and help only)."""
    p = Parser(prog="kvkit", description="KV-cache compression for Hugging Face transformers. `kvkit` alone runs "
                                         "the built-in demo; `kvkit COMMAND --help` shows a command's options.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, adder) in COMMANDS.items():
        if command in ("*", name):
            getattr(importlib.import_module(module), adder)(sub)
        else:
            sub.add_parser(name, help=COMMAND_HELP[name], add_help=False)
    return p


def _command_of(argv: list[str]) -> str | None:
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):  # the built-in demo
        argv = ["run", *argv]
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    leaf = getattr(args, "_leaf_parser", parser)
    if getattr(args, "_required_out", False) and not args.out:
        leaf.error("the following arguments are required: --out")
    if not hasattr(args, "func"):
        leaf.print_help()
        return 2
    try:
        check_policy_args(args)  # the policy settings against the catalog, before the command imports torch
        return args.func(args) or 0
    except BrokenPipeError:  # `kvkit policies | head`: the reader left
        sys.stdout = open(__import__("os").devnull, "w")
        return 0
    except (ValueError, FileNotFoundError) as e:  # bad input (or a model / file not installed): clear message
        print(f"kvkit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
