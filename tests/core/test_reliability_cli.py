"""The CLI, input files and the demo: bad input is
refused with a one-line message that names the option or the file (before the model loads); the demo's speeds
leave out the first-use costs (kernel builds, the first decode step)."""

from __future__ import annotations

import ctypes
import json
import os
import time

import pytest
import torch

import kvkit
from kvkit import calibration as store
from kvkit import cli
from kvkit.demo import run_policy
from kvkit.kernels import cbuild
from kvkit.testing import ModelLoaded, calibration_file, random_ids, tiny_model


def run(*argv):
    return cli.main([str(a) for a in argv])


class _Tok:
    """Toy tokenizer for the tiny models (vocab 128): one id per word; no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [2 + sum(map(ord, w)) % 126 for w in text.split()] or [2]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{int(i)}" for i in ids)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ 11. --question without --prompt-file


def test_question_without_prompt_file_is_refused(no_model_load, capsys):
    assert run("run", "--question", "What is the capital of France?") == 2
    err = _one_error_line(capsys)
    assert err.startswith("kvkit: error: --question needs --prompt-file") and "own needle question" in err


@pytest.mark.parametrize("flags", [["--depth", "0.3"], ["--context-tokens", "500"],
                                   ["--context-tokens", "500", "--depth", "0.1"]])
def test_demo_options_with_a_prompt_file_are_refused(no_model_load, capsys, tmp_path, flags):
    f = tmp_path / "p.txt"
    f.write_text("Some long document.")
    assert run("run", "--prompt-file", f, *flags) == 2
    err = _one_error_line(capsys)
    assert err.startswith(f"kvkit: error: {flags[0]}") and "built-in demo" in err


def test_question_with_a_prompt_file_goes_on(no_model_load, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Some long document.")
    with pytest.raises(ModelLoaded):
        run("run", "--prompt-file", f, "--question", "What is it about?")


# ------------------------------------------------------------------ 15. input files: regular and bounded


GUARDED = r"""
import resource, sys
import kvkit.cli, kvkit.models
def refuse(*a, **k):
    raise SystemExit("the model was loaded before the bad input was refused")
kvkit.models.load = refuse
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), used + (1 << 30)))  # an unbounded read dies, not the host
sys.exit(kvkit.cli.main(sys.argv[1:]))
"""


def _guarded_run(*argv):
    """``kvkit`` in a child process with 1 GiB of memory to spare and a time limit: a prompt file read without
    bound (``/dev/zero``) or a FIFO that blocks fails the test instead of the machine or the test run."""
    import subprocess
    import sys

    try:
        r = subprocess.run([sys.executable, "-c", GUARDED, *map(str, argv)], capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvkit {' '.join(map(str, argv))} did not return (reading the input blocked)")
    return r.returncode, r.stderr


@pytest.mark.parametrize("case", ["/dev/zero", "fifo", "symlink loop", "sparse 16 GiB", "grows past the limit",
                                  "over the limit"])
def test_prompt_file_is_a_bounded_regular_file(no_model_load, capsys, tmp_path, monkeypatch, case):
    f = tmp_path / "prompt.txt"
    if case == "/dev/zero":
        f = "/dev/zero"
    elif case == "fifo":
        os.mkfifo(f)
    elif case == "symlink loop":
        f.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(f)
    elif case == "sparse 16 GiB":
        with open(f, "wb") as fh:
            fh.truncate(16 << 30)
    elif case == "grows past the limit":  # st_size 0, more text than the limit: the read itself is bounded
        f = "/proc/self/maps"
        monkeypatch.setattr(cli, "MAX_PROMPT_BYTES", 100)
        real_read = os.read

        def read(fd, n):
            b = real_read(fd, n)
            got.append(len(b))
            return b

        got = []
        monkeypatch.setattr(os, "read", read)
    else:
        f.write_text("x" * 150)
        monkeypatch.setattr(cli, "MAX_PROMPT_BYTES", 100)
    if case in ("/dev/zero", "fifo", "sparse 16 GiB"):  # unfixed: a read without end, or that never starts
        rc, err = _guarded_run("run", "--prompt-file", f)
        assert rc == 2, err[-500:]
        err = err.strip()
        assert len(err.splitlines()) == 1, err[-500:]
    else:
        assert run("run", "--prompt-file", f) == 2
        err = _one_error_line(capsys)
    assert err.startswith(f"kvkit: error: --prompt-file {f}")
    want = {"/dev/zero": "is a character device, not a regular file", "fifo": "is a FIFO, not a regular file",
            "symlink loop": "cannot open it (Too many levels of symbolic links)",
            "sparse 16 GiB": f"is larger than the limit of {64 << 20:,} bytes (64 MiB): it has {16 << 30:,} bytes",
            "grows past the limit": "is larger than the limit of 100 bytes",
            "over the limit": "is larger than the limit of 100 bytes (0 MiB): it has 150 bytes"}[case]
    assert want in err
    if case == "grows past the limit":
        assert 0 < sum(got) <= 101, f"read {sum(got)} bytes of a file over the limit of 100"


def test_calibration_file_is_read_bounded(caldir, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=6)
    path = calibration_file(caldir / "big.json", model.config, {"tidal": {"options": {"select_layers": [2, 4]}}})
    monkeypatch.setattr(store, "MAX_FILE_BYTES", 50)
    with pytest.raises(store.CalibrationError, match=rf"kvkit calibration file {path} is larger than the limit of 50"):
        kvkit.patch(model, "tidal", budget=16)
    kvkit.unpatch(model)


# ------------------------------------------------------------------ 17. counts validated


@pytest.mark.parametrize("flags,want", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1, got 0"),
    (["--max-new-tokens", "-3"], "--max-new-tokens: must be an integer >= 1, got -3"),
    (["--context-tokens", "0"], "--context-tokens: must be an integer >= 1, got 0"),
    (["--budget", "0"], "--budget: must be an integer >= 1, got 0"),
    (["--depth", "1.5"], "--depth: must be a number in [0, 1], got 1.5"),
    (["--depth", "nan"], "--depth: must be a number in [0, 1], got nan"),
])
def test_run_counts_are_validated(no_model_load, capsys, flags, want):
    with pytest.raises(SystemExit) as e:
        run("run", *flags)
    assert e.value.code == 2
    assert want in capsys.readouterr().err


@pytest.mark.parametrize("flags,want", [(["--policy", "nosuch"], "nosuch"),
                                        (["--policy", "streaming:budget=-5"], "budget")])
def test_policies_and_options_checked_before_the_model_loads(no_model_load, capsys, flags, want):
    assert run("run", *flags) == 2
    assert want in _one_error_line(capsys)


def test_run_policy_refuses_zero_and_never_reports_a_negative_speed():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = random_ids(30, seed=2)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
            run_policy(model, _Tok(), ids, "full", max_new_tokens=bad)
    for n in (1, 2):  # no decode step left to time after the warm-up
        r = run_policy(model, _Tok(), ids, "full", max_new_tokens=n)
        assert r.new_tokens == n and r.decode_tok_s is None
    r = run_policy(model, _Tok(), ids, "full", max_new_tokens=5)
    assert r.new_tokens == 5 and r.decode_tok_s > 0


def test_cli_prints_no_speed_for_one_token(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    monkeypatch.setattr("kvkit.models.load", lambda name, device="cpu": (model, _Tok()))
    f = tmp_path / "p.txt"
    f.write_text("alpha beta gamma " * 20)
    assert run("run", "--prompt-file", f, "--policy", "streaming", "--budget", "32", "--max-new-tokens", "1") == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("full", "streaming"))]
    assert len(rows) == 2 and all(" n/a " in ln and "tok/s" not in ln for ln in rows)


# ------------------------------------------------------------------ 18. calibration errors name file and field


def test_huge_layer_shares_are_relative_weights_not_an_overflow():
    """[1e308] * n summed to inf and the budgets to NaN ('cannot convert float NaN to integer'): the shares are scaled
    by their largest first, so huge equal shares give the uniform budgets."""
    from kvkit.registry import policy_class

    tidal = policy_class("tidal")
    huge = tidal(budget=16, layer_shares=[1e308] * 6, calibrated=False, select_layers=[0, 3])
    assert huge.layer_budgets(6) == [16] * 6
    mixed = tidal(budget=16, layer_shares=[1.0, 1e308, 5e307, 1.0, 1e308, 5e307], calibrated=False,
                  select_layers=[0, 3])
    assert mixed.layer_budgets(6) == tidal(budget=16, layer_shares=[1.0, 2.0, 1.0, 1.0, 2.0, 1.0], calibrated=False,
                                           select_layers=[0, 3]).layer_budgets(6)


@pytest.mark.parametrize("how", ["patch", "KVCache"])
def test_layer_shares_that_do_not_fit_name_the_file_and_field(caldir, how):
    model = tiny_model("llama", num_hidden_layers=6)
    path = calibration_file(caldir / "shares.json", model.config,
                      {"tidal": {"options": {"layer_shares": [1.0] * 5}}})  # one share short of the 6 layers
    with pytest.raises(store.CalibrationError,
                       match=rf"calibration file '{path}' is malformed: policies\.tidal\.options\.layer_shares does "
                             r"not fit this model \(llama, 6 layers\)"):
        if how == "patch":
            kvkit.patch(model, "tidal", budget=16)
        else:
            kvkit.KVCache(model, "tidal", budget=16)
    kvkit.unpatch(model)


def test_too_large_shadowkv_rank_names_the_file_and_field(caldir):
    model = tiny_model("llama")
    path = calibration_file(caldir / "rank.json", model.config, {"shadowkv": {"options": {"rank": 4096}}})
    with pytest.raises(store.CalibrationError,
                       match=rf"'{path}' is malformed: policies\.shadowkv\.options\.rank does not fit this model.*"
                             r"rank=4096 is larger than the key width"):
        kvkit.patch(model, "shadowkv", budget=16)
    kvkit.unpatch(model)


def test_only_the_bad_field_is_named(caldir):
    model = tiny_model("llama", num_hidden_layers=6)
    calibration_file(caldir / "two.json", model.config,
               {"tidal": {"options": {"select_layers": [2, 9], "layer_shares": [1, 1, 1, 1, 1, 1]}}})
    with pytest.raises(store.CalibrationError, match=r"options\.select_layers does not fit.*must be < 6") as e:
        kvkit.patch(model, "tidal", budget=16)
    assert "layer_shares" not in str(e.value)
    kvkit.unpatch(model)


@pytest.mark.parametrize("raw,want", [("1e999", r"policies\.tidal\.options\.layer_shares\[2\] is not a finite number"),
                                      ("NaN", "NaN is not a number JSON allows"),
                                      ("-Infinity", "-Infinity is not a number JSON allows")])
def test_non_finite_numbers_are_refused_by_path(caldir, raw, want):
    model = tiny_model("llama", num_hidden_layers=6)
    path = calibration_file(caldir / "inf.json", model.config,
                      {"tidal": {"options": {"layer_shares": [1, 1, "@RAW@", 1, 1, 1]}}}, raw=raw)
    with pytest.raises(store.CalibrationError, match=rf"'{path}' is malformed: {want}"):
        kvkit.patch(model, "tidal", budget=16)
    kvkit.unpatch(model)


def test_a_policy_that_fails_on_its_own_does_not_blame_the_file(caldir):
    model = tiny_model("llama", num_hidden_layers=2)  # tidal needs more than 2 layers, calibrated or not
    calibration_file(caldir / "ok.json", model.config, {"tidal": {"options": {"layer_shares": [1, 1]}}})
    with pytest.raises(ValueError, match="tidal needs more than 2 layers") as e:
        kvkit.patch(model, "tidal", budget=16)
    assert "calibration file" not in str(e.value)
    kvkit.unpatch(model)


# ------------------------------------------------------------------ 20. the demo's timing leaves first use out


def _timed_run(model, hook, steps=12):
    model.generation_config.eos_token_id = None
    h = model.register_forward_pre_hook(hook)
    try:
        return run_policy(model, _Tok(), random_ids(30, seed=4), "full", max_new_tokens=steps)
    finally:
        h.remove()


def test_first_decode_step_is_a_warm_up(monkeypatch):
    import types

    import kvkit.demo

    clock = [0.0]  # a fake clock (no wall-time threshold): 1 ms per reading, 1000 s in the first decode step

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(kvkit.demo, "time", types.SimpleNamespace(perf_counter=perf_counter))
    calls = []

    def first_use(*a):  # a first-use cost of the first decode step (e.g. a kernel loaded, a pool started)
        calls.append(1)
        if len(calls) == 2:
            clock[0] += 1000.0

    r = _timed_run(tiny_model("llama"), first_use)
    assert len(calls) == 12 and r.new_tokens == 12
    assert r.decode_tok_s > 1, f"{r.decode_tok_s:.4f} tok/s: the warm-up step was timed"


SRC_A = "int kvkit_warm_a(int a) { return a + 1; }\n"
SRC_B = "int kvkit_warm_b(int a) { return a + 2; }\n"


BUILD_S = 3.0  # seconds one slow kernel build takes in test_kernel_builds_are_not_timed (longer than either timed phase of the run)


@pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler")
def test_kernel_builds_are_not_timed(tmp_path, monkeypatch):
    import subprocess as real

    monkeypatch.setenv("KVKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_DIRS", {}, raising=False)

    class SlowCompiler:  # a compile as slow as quant_cpu's on a busy machine
        SubprocessError = real.SubprocessError

        @staticmethod
        def run(cmd, **kw):
            if "-o" in cmd:
                time.sleep(BUILD_S)
            return real.run(cmd, **kw)

    monkeypatch.setattr(cbuild, "subprocess", SlowCompiler)
    built = {}
    calls = []

    def build_on_first_use(*a):  # kernels built inside the prefill and inside a timed decode step
        calls.append(1)
        for at, name, src in ((1, "warm_a", SRC_A), (5, "warm_b", SRC_B)):
            if len(calls) == at:
                built[name] = cbuild.Kernel(name, src, {f"kvkit_{name}": ([ctypes.c_int], ctypes.c_int)},
                                            env="KVKIT_RELTEST_KERNEL").load()

    t0 = time.perf_counter()
    r = _timed_run(tiny_model("llama"), build_on_first_use)
    assert time.perf_counter() - t0 > 2 * BUILD_S and all(built.values())  # the two builds did run, slowly
    # a build timed as part of a phase would make that phase last at least BUILD_S by itself
    assert r.prefill_s < BUILD_S, f"prefill {r.prefill_s:.2f} s: a kernel build was timed as prefill"
    decode_s = r.new_tokens / r.decode_tok_s
    assert decode_s < BUILD_S, f"decode {decode_s:.2f} s for {r.new_tokens} tokens: a kernel build was timed as decode"


# ------------------------------------------------------------------ what cannot run is refused up front


def _counting(model):
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_run_refuses_prompt_plus_max_new_tokens_beyond_the_context_before_any_forward(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama", max_position_embeddings=256)
    calls = _counting(model)
    monkeypatch.setattr("kvkit.models.load", lambda name, device="cpu": (model, _Tok()))
    f = tmp_path / "p.txt"
    f.write_text("alpha beta gamma " * 20)
    assert run("run", "--prompt-file", f, "--policy", "full", "--max-new-tokens", 100000) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("loading model") and len(lines) == 2  # progress, then the one error line
    err = lines[1]
    assert "more than the model's trained context of 256 tokens" in err and "--max-new-tokens 196 or less" in err
    assert calls == []


def test_run_policy_keeps_the_tokens_made_before_a_failing_step():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    calls = []

    def fail_on_fifth(*a):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("index out of range in self")

    model.register_forward_pre_hook(fail_on_fifth)
    r = run_policy(model, _Tok(), random_ids(30, seed=2), "full", max_new_tokens=10)
    assert r.new_tokens == 4 and r.error == "RuntimeError: index out of range in self" and r.answer


def test_calibrate_refuses_an_existing_out_that_is_not_a_calibration_file_before_loading(no_model_load, tmp_path,
                                                                                        capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert run("calibrate", "shadowkv", "--out", notes) == 2
    err = _one_error_line(capsys)
    assert f"--out {notes}" in err and "name a .json file" in err
    bad = tmp_path / "notes.json"
    bad.write_text("my notes\n")
    assert run("calibrate", "shadowkv", "--out", bad) == 2
    err = _one_error_line(capsys)
    assert f"--out {bad} exists and is not a kvkit calibration file" in err and "not valid JSON" in err
    assert notes.read_text() == bad.read_text() == "my notes\n"


@pytest.mark.parametrize("command", ["duo", "duo-merge"])
def test_calibrate_duo_refuses_a_pattern_name_the_policy_would_not_read(no_model_load, tmp_path, capsys, command):
    pattern = tmp_path / "pattern.txt"
    argv = ["calibrate", command, *(["a.json", "b.json"] if command == "duo-merge" else []), "--out", pattern]
    with pytest.raises(SystemExit) as e:
        run(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out: must end in .json (kvkit pattern) or .tsv (reference format)" in err
    assert not pattern.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["run"], ["bench", "--lengths", "64"], ["eval", "niah", "--lengths", "512"],
                                  ["eval", "ruler", "--tasks", "vt"], ["speculate"],
                                  ["calibrate", "shadowkv"]])
def test_cuda_device_without_cuda_is_refused_before_loading(no_model_load, monkeypatch, capsys, argv):
    monkeypatch.setattr("kvkit.evals.settings.load_model",
                        lambda *a, **k: pytest.fail("the model loaded before --device was checked"))
    assert run(*argv, "--device", "cuda") == 2
    err = _one_error_line(capsys)
    assert err.startswith("kvkit: error: --device cuda: torch sees no CUDA device here") and "--device cpu" in err


@pytest.mark.parametrize("argv", [["eval", "niah"], ["eval", "ruler"], ["bench"], ["eval", "needles", "--policy",
                                                                                     "full"]])
@pytest.mark.parametrize("flag", ["--out", "--out-root"])
def test_out_that_is_a_file_is_refused_when_parsed(capsys, tmp_path, argv, flag):
    if flag == "--out-root" and argv[1:2] != ["needles"]:
        pytest.skip("--out-root is an old spelling of the needles / sweep --out only")
    f = tmp_path / "results.txt"
    f.write_text("x")
    for out in (f, f / "run"):
        with pytest.raises(SystemExit) as e:
            run(*argv, flag, out)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {out}" in err and "is a file, not a folder" in err and "Traceback" not in err
    assert f.read_text() == "x"


@pytest.mark.parametrize("flag", ["--length", "--samples"])
@pytest.mark.parametrize("value", [0, -2])
def test_calibrate_counts_must_be_positive(no_model_load, capsys, flag, value):
    assert run("calibrate", "shadowkv", flag, value) == 2
    assert _one_error_line(capsys) == f"kvkit: error: {flag} must be an integer >= 1, got {value}"


@pytest.mark.parametrize("field,value,want", [
    ("scores", "high", "'scores' must be an object of task -> score"),
    ("scores", {"vt": "high"}, "'scores' must be an object of task -> score"),
    ("average", [1], "'average' must be a number or null"),
    ("options", "budget=3", "'options' must be an object"),
    ("mean_kv_bytes", "many", "'mean_kv_bytes' must be a number"),
])
def test_compare_refuses_a_malformed_summary_naming_the_field(tmp_path, capsys, field, value, want):
    good = dict(benchmark="ruler", model="m", length=4096, policy="full", options={}, scores={"vt": 80.0},
                average=80.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(dict(good, **{field: value})))
    assert run("eval", "compare", tmp_path / "a") == 2
    err = _one_error_line(capsys)
    assert err.startswith(f"kvkit: error: {tmp_path / 'a' / 'summary.json'}: {want}")
