"""The command line's shared grammar: one policy parser, typed arguments refused by argparse with one error line
naming the flag, the old spellings kept as warned aliases, a mistyped flag answered with the subcommand's usage,
help / policy listing / refusals without torch, and the policy catalog kept in step with the registry."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvkit import catalog, cli
from kvkit.cli_grammar import PolicySpec, parse_policy, policy_spec


def run(*argv):
    return cli.main([str(a) for a in argv])


# ------------------------------------------------------------------ one policy parser


@pytest.mark.parametrize("spec,want", [
    ("snapkv", PolicySpec("snapkv", {})),
    ("snapkv:budget=512,window=32", PolicySpec("snapkv", {"budget": 512, "window": 32})),
    ("chelsea:ratio=0.5,size_bias=false", PolicySpec("chelsea", {"ratio": 0.5, "size_bias": False})),
    ("duo:pattern=None,sparsity=0.5", PolicySpec("duo", {"pattern": None, "sparsity": 0.5})),
    ("tidal:select_layers=[2,6],selection=kv_head", PolicySpec("tidal", {"select_layers": [2, 6],
                                                                          "selection": "kv_head"})),
    ("kvzip:instruct=True", PolicySpec("kvzip", {"instruct": True})),
    ("duo:pattern=/tmp/p.json", PolicySpec("duo", {"pattern": "/tmp/p.json"})),
])
def test_policy_spec_values_are_typed(spec, want):
    assert parse_policy(spec) == want
    assert parse_policy(str(want)) == want  # a spec reads back from how it is shown


@pytest.mark.parametrize("bad", ["", ":budget=3", "a b", "snapkv:budget", "snapkv:=3", "x=snapkv"])
def test_malformed_policy_spec_is_refused(bad):
    with pytest.raises(ValueError, match="must look like"):
        parse_policy(bad)


def test_every_multi_policy_command_takes_repeated_policies(monkeypatch):
    """run, eval sweep, eval needles, bench and speculate take --policy repeatedly; --budget and --compression-ratio
    reach every policy but full."""
    from kvkit.cli_grammar import policies_of

    for argv in (["run"], ["eval", "sweep", "--prompts", "p.jsonl", "--out", "o"],
                 ["eval", "needles", "--out", "o"], ["bench"], ["speculate"]):
        p = cli.build_parser(argv[0])
        args = p.parse_args([*argv, "--policy", "full", "--policy", "snapkv:window=8", "--policy", "streaming",
                             "--compression-ratio", "0.5"])
        specs = policies_of(args)
        assert [s.name for s in specs] == ["full", "snapkv", "streaming"], argv
        assert specs[0].options == {} and specs[1].options == {"window": 8, "compression_ratio": 0.5}


def test_budget_and_compression_ratio_reach_single_policy_evals():
    from kvkit.evals.commands import runs

    p = cli.build_parser("eval")
    args = p.parse_args(["eval", "ruler", "--policy", "snapkv:window=16", "--budget", "128",
                         "--compression-ratio", "0.25"])
    assert args.policy == PolicySpec("snapkv", {"window": 16})
    spec = args.policy
    assert spec.name == "snapkv" and args.budget == 128 and args.compression_ratio == 0.25
    assert runs.policy_of(args.__class__(**{**vars(args), "compression_ratio": None})) == \
        ("snapkv", {"window": 16, "budget": 128})


# ------------------------------------------------------------------ old spellings


@pytest.mark.parametrize("argv,dest,want", [
    (["eval", "needles", "--out-root", "o"], "out", "o"),
    (["eval", "sweep", "--prompts", "p", "--out-root", "o"], "out", "o"),
    (["speculate", "--json", "s.jsonl"], "out", "s.jsonl"),
    (["speculate", "--new-tokens", "8"], "max_new_tokens", 8),
    (["speculate", "--draft-policy", "streaming,retrieval"], "policy",
     [PolicySpec("streaming"), PolicySpec("retrieval")]),
    (["bench", "--policy", "snapkv", "--add", "streaming:budget=64"], "policy",
     [PolicySpec("snapkv"), PolicySpec("streaming", {"budget": 64})]),
    (["bench", "--shape", "tiny", "--policies", "full", "hf-dynamic"], "shape_rows",
     [PolicySpec("full"), PolicySpec("hf-dynamic")]),
    (["eval", "ruler", "--opt", "budget=3,sink=1"], "opt", ["budget=3,sink=1"]),
    (["eval", "needles", "--run", "a=full"], "run", ["a=full"]),
])
def test_old_spellings_still_work_with_one_warning(capsys, argv, dest, want):
    from kvkit import cli_grammar

    cli_grammar._WARNED.clear()
    args = cli.build_parser(argv[0]).parse_args(argv)
    assert getattr(args, dest) == want
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is deprecated; use" in err[0], err


def test_options_json_error_names_the_flag_given(capsys):
    assert run("run", "--options", '{"sink": 2') == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvkit: error: --options is not valid JSON") and "--policy-options" not in err


# ------------------------------------------------------------------ mistyped flags: the subcommand's usage


@pytest.mark.parametrize("argv,prog,hint", [
    (["eval", "ruler", "--samplez", "3"], "kvkit eval ruler", "did you mean --samples?"),
    (["run", "--max-new-tokenz", "3"], "kvkit run", "did you mean --max-new-tokens?"),
    (["bench", "--lenghts", "256"], "kvkit bench", "did you mean --lengths?"),
    (["policies", "snapkv", "--zzz"], "kvkit policies", "see kvkit policies --help"),
])
def test_mistyped_flag_shows_the_subcommands_usage(capsys, argv, prog, hint):
    with pytest.raises(SystemExit) as e:
        run(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ") and f"{prog}: error: unrecognized arguments" in err and hint in err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        run("eval", "needles", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 33)" in out and "(default: agnostic)" in out


# ------------------------------------------------------------------ every typed argument of every command


def _leaves(parser, path=()):
    """(argv prefix, parser) of every subcommand that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sp in subs[0].choices.items():
        yield from _leaves(sp, (*path, name))


def _bad_value(action) -> str | None:
    """A value ``action``'s type or choices refuse (None: it takes any text)."""
    if action.option_strings == [] or action.nargs == 0:
        return None
    t = action.type
    if t is policy_spec or getattr(t, "__name__", "") == "policy":
        return "=bad"
    if getattr(t, "__name__", "") in ("out_folder", "out_file", "pattern_out"):
        return __file__ + "/under-a-file.json"
    if t is not None and t is not str:
        return "abc"
    if action.choices:
        return "nosuch"
    return None


def _typed_arguments():
    from kvkit.calibrate import cli as calibrate_cli  # noqa: F401  (its parsers are built with the rest)

    out = []
    for path, leaf in _leaves(cli.build_parser("*")):
        for action in leaf._actions:
            bad = _bad_value(action)
            if bad is not None:
                out.append(pytest.param([*path, action.option_strings[-1], bad], action.option_strings[-1],
                                        id=" ".join([*path, action.option_strings[-1]])))
    return out


TYPED = _typed_arguments()


def test_typed_arguments_cover_every_command():
    commands = {" ".join(p.values[0][:p.values[0].index(p.values[1])]) for p in TYPED}
    assert {"run", "speculate", "bench", "eval ruler", "eval sweep", "eval niah", "eval needles", "eval longbench",
            "calibrate duo", "calibrate duo-refine", "calibrate shadowkv"} <= commands
    assert len(TYPED) >= 80, len(TYPED)


@pytest.mark.parametrize("argv,flag", TYPED)
def test_wrong_typed_value_is_refused_by_the_parser(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0], err
    assert errors[0] == err.strip().splitlines()[-1] and "Traceback" not in err


# ------------------------------------------------------------------ no torch for help, listing and refusals

NO_TORCH = r"""
import sys
import kvkit.cli
try:
    rc = kvkit.cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
print("HEAVY", heavy, "RC", rc, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["policies"], ["policies", "snapkv"], ["eval", "needles", "--help"],
                                  ["eval", "ruler", "--samples", "abc"], ["eval", "niah", "--lengths", "x"],
                                  ["eval", "needles", "--out", "README.md", "--policy", "full"],
                                  ["run", "--compression-ratio", "two"], ["bench", "--samplez", "1"],
                                  ["speculate", "--gamma", "0"], ["policies", "nosuch"]])
def test_help_listing_and_refusals_import_no_torch(argv):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("HEAVY [] RC"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,msg", [
    (["run", "--policy", "snapkv:compresion_ratio=0.5"], "unknown option(s) compresion_ratio for policy 'snapkv'"),
    (["run", "--policy", "duo:sparsity=0.5,compression_ratio=0.5"], "duo: compression_ratio=0.5 sets sparsity"),
    (["eval", "ruler", "--policy", "snapkv:compression_ratio=1.5"], "snapkv: compression_ratio must be a fraction"),
    (["eval", "needles", "--policy", "full", "--policy", "chelsea:ratio=0.3", "--compression-ratio", "0.5", "--out",
      "runs/x"], "chelsea: compression_ratio=0.5 sets ratio itself; give compression_ratio or ratio=0.3"),
    (["bench", "--policy", "cake:preset=papr"], "cake: preset must be one of kvkit, paper"),
    (["speculate", "--policy", "snapkv:compression_ratio=2"], "snapkv: compression_ratio must be a fraction"),
    (["run", "--policy", "snapkv", "--budget", "512", "--compression-ratio", "0.5"],
     "snapkv: compression_ratio=0.5 sets budget itself; give compression_ratio or budget=512, not both"),
    # a --budget no given policy has would be ignored (several policies: it goes to those that have one)
    (["run", "--policy", "chelsea", "--budget", "512"], "--budget 512: chelsea has no `budget` option, so it would "
                                                          "be ignored; give --compression-ratio R"),
    (["eval", "ruler", "--policy", "duo", "--budget", "512"], "--budget 512: duo has no `budget` option")])
def test_a_policy_setting_the_catalog_refuses_is_refused_without_importing_torch(argv, msg):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert r.stderr.strip().splitlines()[-1] == "HEAVY [] RC 2", r.stderr[-2000:]
    assert f"kvkit: error: {msg}" in r.stderr and "Traceback" not in r.stderr


def _other(v):
    """A value of an option's type other than its default ``v``."""
    if v is None:
        return 4
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return round(v / 2 + 0.01, 3)
    return v + "x"


def _settings_to_check():
    """(policy, options) for every catalogued policy: an unknown option, bad presets and ratios, each ratio knob
    beside compression_ratio (given, and given at its default / paper value, which is no conflict), and a setting
    that is fine."""
    out = []
    for e in catalog.load():
        name, defaults = e["name"], {o["name"]: o["default"] for o in e["options"]}
        out.append((name, {"no_such_option": 1}))
        if "preset" not in defaults:
            continue
        out += [(name, {"preset": "papr"}), (name, {"compression_ratio": 1.5}), (name, {"compression_ratio": 0}),
                (name, {"compression_ratio": True}), (name, {"compression_ratio": 0.5}),
                (name, {"compression_ratio": 0.5, "preset": "paper"})]
        for k in e["ratio_knobs"]:
            out += [(name, {"compression_ratio": 0.5, k: _other(defaults[k])}),
                    (name, {"compression_ratio": 0.5, k: defaults[k]}),
                    (name, {"compression_ratio": 0.5, "preset": "paper", k: _other(defaults[k])})]
            if k in e["paper_preset"]:
                out.append((name, {"compression_ratio": 0.5, "preset": "paper", k: e["paper_preset"][k]}))
    return out


def test_the_catalog_refuses_a_setting_as_the_policy_itself_does():
    """kvkit.cli.main checks every --policy against the catalog before torch loads (catalog.check_options); what it
    refuses, and its message, must be what building the policy refuses and says."""
    from kvkit.evals.settings import resolve_policy_options
    from kvkit.policies.knobs import PRESETS

    assert catalog.PRESETS == PRESETS
    settings = _settings_to_check()
    assert len(settings) > 60
    refused = 0
    for name, opts in settings:
        try:
            resolve_policy_options(name, opts)
            built = None
        except ValueError as e:
            built = str(e)
        try:
            catalog.check_options(name, opts)
            checked = None
        except ValueError as e:
            checked = str(e)
        if checked is not None:  # the catalog refuses only what the policy refuses, in its words
            refused += 1
            assert checked == built, (name, opts)
        elif built is not None:  # what only the policy's code can check: a value of a knob the catalog passes
            assert "compression_ratio" not in built or "out of reach" in built, (name, opts, built)
    assert refused > 40


CALIBRATE_NO_TORCH = r"""
import sys
from kvkit import cli

def refused(argv):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2, (argv, rc)
    assert "torch" not in sys.modules and "transformers" not in sys.modules, argv

p = cli.build_parser("calibrate")
for name in ("duo", "cake", "chelsea", "shadowkv", "snapkv", "tidal", "zipcache"):
    args = p.parse_args(["calibrate", name, *(["--out", "p.json"] if name == "duo" else [])])
    assert callable(args.func), name
p.parse_args(["calibrate", "duo-merge", "a.json", "b.json", "--out", "m.json"])
assert "torch" not in sys.modules and "transformers" not in sys.modules, "building / parsing"
refused(["calibrate", "snapkv", "--length", "x"])
refused(["calibrate", "cake", "--kernels", "4"])
refused(["calibrate", "tidal", "--select-layers", "6,2"])
refused(["calibrate", "zipcache", "--values", "hex"])
refused(["calibrate", "shadowkv", "--samples", "0"])
refused(["calibrate", "shadowkv", "--out", "notes.txt"])
refused(["calibrate", "duo", "--out", "pattern.txt"])
refused(["calibrate", "duo-refine", "a.json", "--out", "p.json", "--sparsity", "1"])
refused(["calibrate", "nosuch"])
print("NO TORCH")
"""


@pytest.mark.parametrize("argv", [["calibrate", "--help"], ["calibrate", "tidal", "--help"],
                                  ["calibrate", "duo-refine", "--help"], ["calibrate", "snapkv", "--samples", "x"]])
def test_calibrate_help_and_refusals_import_no_torch(argv, tmp_path):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.stderr.strip().splitlines()[-1].startswith("HEAVY [] RC"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_calibrate_parsers_and_refused_arguments_import_no_torch(tmp_path):
    """Building ``kvkit calibrate``'s parsers, parsing every subcommand and refusing bad arguments (by the parser, or
    by the checks a command makes before the model loads) import neither torch nor transformers."""
    r = subprocess.run([sys.executable, "-c", CALIBRATE_NO_TORCH], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "NO TORCH", r.stderr[-3000:]


# ------------------------------------------------------------------ kvkit policies [NAME]


def test_policy_catalog_is_up_to_date():
    """kvkit/data/policies.json is what the registry says (regenerate: python -m kvkit.catalog --write)."""
    assert catalog.load() == json.loads(catalog.text(catalog.build()))["policies"], \
        "kvkit/data/policies.json is out of date: run `python -m kvkit.catalog --write`"


def test_catalog_entries_explain_every_option():
    from kvkit.registry import available_policies, policy_options

    entries = {e["name"]: e for e in catalog.load()}
    assert list(entries) == available_policies()
    for name, e in entries.items():
        assert [o["name"] for o in e["options"]] == list(policy_options(name)), name
        assert e["summary"] and e["saves"]
    snap = {o["name"]: o for o in entries["snapkv"]["options"]}
    assert snap["budget"]["default"] == 1024 and "Slots kept per KV head" in snap["budget"]["meaning"]
    assert entries["snapkv"]["paper"] == "arXiv:2404.14469"


def test_policies_name_explains_its_options(capsys):
    assert run("policies", "snapkv") == 0
    out = capsys.readouterr().out
    assert out.startswith("snapkv: SnapKV") and "paper: arXiv:2404.14469" in out
    assert "budget" in out and "default 1024" in out and "why:" in out
    assert "compression_ratio sets: budget" in out  # the knob the ratio maps to, and what the paper preset sets
    assert 'preset="paper" sets: calibrated=false, protect_heads=0.0' in out
    assert run("policies", "nosuch") == 2
    assert "known policies" in capsys.readouterr().err


def test_each_policy_of_a_multi_run_eval_gets_a_folder_named_by_its_setting():
    from kvkit.evals.commands import runs

    args = cli.build_parser("eval").parse_args(["eval", "needles", "--out", "o", "--policy", "full", "--policy",
                                                "snapkv", "--policy", "snapkv:window=8", "--policy",
                                                "quantized:nbits=4", "--budget", "128"])
    from kvkit.evals.commands.needles import _resolve

    specs = runs.run_specs(args, "needles", _resolve)
    assert [n for n, _, _ in specs] == ["full", "snapkv-budget128", "snapkv-window8-budget128", "quantized-nbits4"]
    assert specs[1][1:] == ("snapkv", {"budget": 128}) and specs[3][2]["nbits"] == 4
    old = cli.build_parser("eval").parse_args(["eval", "needles", "--out", "o", "--run", "base=full", "--run",
                                               "s=snapkv:budget=96"])
    assert [(n, p) for n, p, _ in runs.run_specs(old, "needles", _resolve)] == [("base", "full"), ("s", "snapkv")]
