"""Evaluation runs are compared, resumed and locked safely.

-   ``kvkit eval compare`` names its baseline (several full runs of one setting need ``--baseline``); retention only
    against a baseline of the same settings (seed, dtype, ...); ``--matched`` pairs rows only of the same sample.
-   ``--resume`` checks every row-changing setting (dtype, seed, the content of file-valued options, ...) and the
    finished rows' prompts.
-   An eval folder is locked while a run writes it: a second writer is refused naming the folder and the holder's pid.
-   A ``--prompts`` row with an unknown metric (or another bad field) is refused before any sample runs.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from argparse import Namespace

import pytest

from kvkit.cli import main
from kvkit.evals import files, generation, ruler, rundir, runner, settings
from kvkit.evals.commands import runs as eval_runs
from kvkit.evals.compare import compare, compare_matched


def run(*argv):
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (3 layers, 2 KV heads, 2048-token context) saved with the real SmolLM2 tokenizer."""
    from kvkit.models import load_tokenizer
    from kvkit.testing import tiny_model

    tok = load_tokenizer("default")
    d = tmp_path_factory.mktemp("tiny")
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _niah(tiny_dir, out, *extra):
    """A one-cell NIAH run on the tiny model (a 256-token prompt, 2 new tokens)."""
    return run("eval", "niah", "--model", tiny_dir, "--lengths", 256, "--depths", 1, "--max-new-tokens", 2,
               "--out", out, *extra)


# ============================================================================== 8. compare's baseline


def _summary(tmp_path, name, policy, average, **settings):
    d = tmp_path / name
    files.atomic_write_json(d / "summary.json", dict(dict(
        benchmark="ruler", model="m", length=4096, seed=42, dtype="float32", policy=policy,
        options={} if policy == "full" else {"budget": 512}, scores={"vt": average}, average=average), **settings))
    return d


def _retention(md, policy):
    line = next(ln for ln in md.splitlines() if f"| {policy} |" in ln)
    return line.split("|")[-2].strip()


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_compare_two_full_runs_without_baseline_is_refused(tmp_path, order):
    a = _summary(tmp_path, "fullA", "full", 80.0)
    b = _summary(tmp_path, "fullB", "full", 40.0)
    s = _summary(tmp_path, "stream", "streaming", 40.0)
    dirs = [a, b, s] if order == "AB" else [b, a, s]
    # before: the last full run given was the baseline (streaming 0.50 or 1.00 by argument order)
    with pytest.raises(ValueError, match=r"2 full runs.*--baseline DIR") as e:
        compare(dirs)
    assert str(a) in str(e.value) and str(b) in str(e.value)
    md = compare(dirs, baselines=[a])
    assert _retention(md, "streaming") == "0.50"
    assert f"Retention is relative to:\n- {a}: full" in md
    assert _retention(compare(dirs, baselines=[b]), "streaming") == "1.00"
    runs = [_run(tmp_path, n, p, [("vt/0", sc)]) for n, p, sc in
            (("mA", "full", 1.0), ("mB", "full", 0.0), ("mS", "streaming", 0.0))]
    with pytest.raises(ValueError, match=r"2 full runs.*--baseline"):
        compare_matched(runs)
    assert "| streaming | budget=8 | 1 | 1 | 0.00 | 0.00 | 100.00 | 0.00 |" in compare_matched(runs, baselines=[runs[0]])


def test_compare_cli_baseline_flag(tmp_path, capsys):
    a = _summary(tmp_path, "fullA", "full", 80.0)
    b = _summary(tmp_path, "fullB", "full", 40.0)
    s = _summary(tmp_path, "stream", "streaming", 40.0)
    assert run("eval", "compare", a, b, s) == 2
    err = capsys.readouterr().err
    assert "--baseline DIR" in err and str(a) in err and str(b) in err
    assert run("eval", "compare", a, b, s, "--baseline", b) == 0
    assert _retention(capsys.readouterr().out, "streaming") == "1.00"
    # a baseline not among the folders is added; two baselines of the same settings are refused
    assert run("eval", "compare", s, "--baseline", a) == 0
    assert _retention(capsys.readouterr().out, "streaming") == "0.50"
    assert run("eval", "compare", s, "--baseline", a, "--baseline", b) == 2
    assert "same settings" in capsys.readouterr().err


@pytest.mark.parametrize("setting, value", [("seed", 7), ("dtype", "bfloat16"), ("max_new_tokens", 4)])
def test_compare_retention_only_against_a_baseline_of_the_same_settings(tmp_path, setting, value):
    full = _summary(tmp_path, "full", "full", 80.0)
    s = _summary(tmp_path, "stream", "streaming", 40.0, **{setting: value})
    md = compare([full, s])
    assert _retention(md, "streaming") == "-"  # before: 0.50, a seed-7 run against the seed-42 baseline
    assert f"{s}: no retention: no baseline of its settings ({setting} {value!r}" in md
    same = _summary(tmp_path, "stream42", "streaming", 40.0)
    assert _retention(compare([full, same]), "streaming") == "0.50"


def _run(tmp_path, name, policy, rows, **cfg):
    """A run folder: config.json (ruler, seed 42, float32 unless given) and samples.jsonl of (id, score[, extra])."""
    d = tmp_path / name
    files.atomic_write_json(d / "config.json", dict(dict(benchmark="ruler", model="m", length=4096, seed=42,
                                                          dtype="float32", policy=policy,
                                                          options={} if policy == "full" else {"budget": 8}), **cfg))
    files.atomic_write_jsonl(d / "samples.jsonl", [dict(id=r[0], task=r[0].split("/")[0], score=r[1], kv_bytes=100,
                                                         **(r[2] if len(r) > 2 else {})) for r in rows])
    return d


def test_compare_matched_refuses_a_run_of_another_seed(tmp_path):
    full = _run(tmp_path, "full", "full", [("vt/0", 1.0), ("vt/1", 0.0)])
    other = _run(tmp_path, "s7", "streaming", [("vt/0", 0.0), ("vt/1", 1.0)], seed=7)
    # before: vt/0 of seed 7 was paired with vt/0 of seed 42 (another prompt)
    with pytest.raises(ValueError, match=rf"{other} has no baseline of its settings \(seed 7 \(baseline 42\)"):
        compare_matched([full, other])
    same = _run(tmp_path, "s42", "streaming", [("vt/0", 0.0), ("vt/1", 1.0)])
    assert "| streaming | budget=8 | 2 |" in compare_matched([full, same])


def test_compare_matched_pairs_rows_only_of_the_same_sample(tmp_path):
    full = _run(tmp_path, "full", "full", [("vt/0", 1.0, {"sample_sha": "aaaa", "seed": 42}),
                                           ("vt/1", 1.0, {"sample_sha": "bbbb", "seed": 42})])
    # same config, but the rows were made from other prompts (another seed's rows merged in, a changed prompts file)
    other = _run(tmp_path, "other", "streaming", [("vt/0", 0.0, {"sample_sha": "cccc", "seed": 7}),
                                                  ("vt/1", 1.0, {"sample_sha": "bbbb", "seed": 42})])
    with pytest.raises(ValueError, match=r"1 row\(s\) of .*other.* another sample \(sample_sha, seed differ; "
                                         r"first: 'vt/0'\)"):
        compare_matched([full, other])
    good = _run(tmp_path, "good", "streaming", [("vt/0", 0.0, {"sample_sha": "aaaa", "seed": 42}),
                                                ("vt/1", 1.0, {"sample_sha": "bbbb", "seed": 42})])
    assert "| 4096 | streaming | budget=8 | 2 | 2 | 50.00 | 50.00 | 100.00 | 0.50 |" in compare_matched([full, good])


def test_rows_record_their_sample_identity_and_compare_matched_refuses_another_seed_end_to_end(tiny_dir, tmp_path):
    a, b, c = tmp_path / "full1", tmp_path / "stream1", tmp_path / "stream2"
    assert _niah(tiny_dir, a, "--seed", 1) == 0
    assert _niah(tiny_dir, b, "--seed", 1, "--policy", "streaming", "--budget", 64) == 0
    assert _niah(tiny_dir, c, "--seed", 2, "--policy", "streaming", "--budget", 64) == 0
    ra, rc = (files.read_jsonl(d / "samples.jsonl")[0] for d in (a, c))
    assert ra["id"] == rc["id"] and ra["seed"] == 1 and rc["seed"] == 2 and ra["sample_sha"] != rc["sample_sha"]
    assert "| streaming | budget=64 | 1 |" in compare_matched([a, b])
    with pytest.raises(ValueError, match="seed 2 \\(baseline 1\\)"):
        compare_matched([a, b, c])


# ================================================================= 9. --resume checks every row setting


def test_resume_with_another_dtype_is_refused_naming_it(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _niah(tiny_dir, out) == 0
    rows = (out / "samples.jsonl").read_text()
    # before: accepted, rows of both dtypes under one summary that says bfloat16
    assert _niah(tiny_dir, out, "--resume", "--dtype", "bfloat16") == 2
    err = capsys.readouterr().err
    assert f"--resume: {out} was made with a different configuration" in err
    assert "dtype: the folder has 'float32', this run asks for 'bfloat16'" in err
    assert (out / "samples.jsonl").read_text() == rows
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert _niah(tiny_dir, out, "--resume", "--seed", 7) == 2
    assert "seed: the folder has 42, this run asks for 7" in capsys.readouterr().err
    assert _niah(tiny_dir, out, "--resume") == 0  # the same settings resume (nothing left to do)


def test_resume_checks_the_content_of_a_pattern_file(tiny_dir, tmp_path, capsys):
    pattern = tmp_path / "heads.tsv"  # the tiny model: 3 layers x 2 KV heads
    pattern.write_text("0.9\t0.1\n0.8\t0.2\n0.7\t0.3\n")
    out = tmp_path / "duo"
    argv = ("--policy", "duo", "--opt", f"pattern={pattern}", "--opt", "sink=4,recent=32")
    assert _niah(tiny_dir, out, *argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["option_files"] == {"pattern": settings.file_sha256(pattern)}
    assert _niah(tiny_dir, out, *argv, "--resume") == 0
    pattern.write_text("0.1\t0.9\n0.2\t0.8\n0.3\t0.7\n")  # other retrieval heads, same path
    assert _niah(tiny_dir, out, *argv, "--resume") == 2
    err = capsys.readouterr().err
    assert "option_files: the folder has {'pattern': " in err and settings.file_sha256(pattern) in err


def test_resume_checks_the_content_of_the_shipped_pattern(tiny_dir, tmp_path, capsys, monkeypatch):
    import kvkit.policies.duo as duo_mod

    shipped = tmp_path / "shipped.tsv"  # stands in for kvkit/data's pattern of the tiny model: 3 layers x 2 KV heads
    shipped.write_text("0.9\t0.1\n0.8\t0.2\n0.7\t0.3\n")
    monkeypatch.setattr(duo_mod, "shipped_pattern", lambda config: shipped)
    out = tmp_path / "duo"
    argv = ("--policy", "duo", "--opt", "sink=4,recent=32")  # no pattern: the policy picks the shipped one
    assert _niah(tiny_dir, out, *argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["options"] == {"sink": 4, "recent": 32}
    assert cfg["option_files"] == {"pattern": settings.file_sha256(shipped)}
    assert _niah(tiny_dir, out, *argv, "--resume") == 0
    shipped.write_text("0.1\t0.9\n0.2\t0.8\n0.3\t0.7\n")  # the shipped file recalibrated
    assert _niah(tiny_dir, out, *argv, "--resume") == 2
    err = capsys.readouterr().err
    assert "option_files: the folder has {'pattern': " in err and settings.file_sha256(shipped) in err
    # a policy without shipped files records none
    assert settings.policy_files(Namespace(config=None), "streaming", {"budget": 8}) == {}
    assert settings.policy_files(Namespace(config=None), "quantized", {"nbits": 4}) == {}  # a peer: no kvkit policy


def test_option_files_and_config_recorded_in_the_config(tmp_path):
    f = tmp_path / "p.tsv"
    f.write_text("1\t0\n")
    args = Namespace(model="m", seed=42, device="cpu", dtype="float32", max_new_tokens=None, full_prompt_prefill=False)
    cfg = eval_runs.run_config(args, "ruler", "duo", {"pattern": str(f), "sink": 4})
    assert cfg["option_files"] == {"pattern": settings.file_sha256(f)} and cfg["dtype"] == "float32"
    assert settings.option_files({"selection": "kv_head", "budget": 8}) == {}


def test_run_config_builds_the_policy_once_for_both_records(tmp_path, monkeypatch):
    """Given the model, the files the policy picks and the calibration it uses come from one built policy: the
    pattern file that snapkv's ``protect_heads`` ranks by is read once for both records, not once per record."""
    import kvkit.policies.duo as duo_mod
    from kvkit.testing import tiny_model

    model = tiny_model("llama", num_hidden_layers=2)
    f = tmp_path / "p.tsv"
    f.write_text("0.9\t0.1\n0.2\t0.8\n")
    reads = []
    real = duo_mod.read_pattern
    monkeypatch.setattr(duo_mod, "read_pattern", lambda p: reads.append(p) or real(p))
    args = Namespace(model="m", seed=42, device="cpu", dtype="float32", max_new_tokens=None, full_prompt_prefill=False)
    opts = {"budget": 16, "window": 4, "sink": 2, "protect_heads": 0.5, "protect_pattern": str(f)}
    cfg = eval_runs.run_config(args, "ruler", "snapkv", opts, model=model)  # a calibrated policy: both records
    assert reads == [str(f)]
    assert cfg["option_files"] == {"protect_pattern": settings.file_sha256(f)} and cfg["calibration"] is None


def test_resume_keys_recorded_later_still_resume_old_folders(tmp_path):
    cfg = {"benchmark": "ruler", "policy": "duo", "options": {"pattern": "p.tsv"}, "dtype": "float32",
           "option_files": {"pattern": "ab12"}, "calibration": None}
    old = {k: v for k, v in cfg.items() if k not in ("option_files", "calibration")}
    with rundir.RunDir(tmp_path / "old", old):
        pass
    with rundir.RunDir(tmp_path / "old", cfg, resume=True):
        pass
    with pytest.raises(ValueError, match="dtype: the folder has 'float32', this run asks for 'float16'"):
        rundir.RunDir(tmp_path / "old", dict(cfg, dtype="float16"), resume=True)


def test_resume_refuses_finished_rows_made_from_other_prompts(tiny_dir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    assert run("eval", "niah", "--model", tiny_dir, "--lengths", 256, "--depths", 2, "--dump-prompts", f) == 0
    out = tmp_path / "run"
    assert run("eval", "niah", "--model", tiny_dir, "--prompts", f, "--out", out, "--max-new-tokens", 2) == 0
    samples = files.read_jsonl(f)
    samples[1]["prompt"] = samples[1]["prompt"].replace("magic", "secret")  # the file edited since, same ids
    files.atomic_write_jsonl(f, samples)
    assert run("eval", "niah", "--model", tiny_dir, "--prompts", f, "--out", out, "--max-new-tokens", 2,
               "--resume") == 2
    err = capsys.readouterr().err
    assert f"--resume: {out}: 1 finished row(s) ({samples[1]['id']}) were made from other prompts" in err


def test_check_samples_compares_the_sample_digest(tmp_path):
    s = dict(id="vt/0", prompt="p", outputs=["A"], tokens_to_generate=4, metric="string_match_all")
    with rundir.RunDir(tmp_path / "r", {"benchmark": "ruler"}) as r:
        r.add(runner._row(s, generation.Generation("A", 3, 1, 0.1, 10, 0), 1.0))
        r.check_samples([s])
        for change in ({"tokens_to_generate": 8}, {"outputs": ["B"]}, {"context_end": 0}, {"prompt": "q"}):
            with pytest.raises(ValueError, match="other prompts"):
                r.check_samples([dict(s, **change)])


def test_prompts_seed_is_the_files_and_another_seed_is_refused(tiny_dir, tmp_path, no_model_load, capsys):
    f = tmp_path / "p.jsonl"
    row = dict(id="256/0/0", task="256", index=0, prompt="hi", outputs=["A"], tokens_to_generate=2,
               metric="string_match_all", target_length=256, depth=0.0, seed=5)
    files.atomic_write_jsonl(f, [row])
    assert run("eval", "niah", "--model", tiny_dir, "--prompts", f, "--seed", 7) == 2
    assert f"--seed 7: the prompts of {f} were made with seed 5" in capsys.readouterr().err
    assert eval_runs.prompts_seed(Namespace(seed=None, prompts=f), [row]) == 5
    assert eval_runs.prompts_seed(Namespace(seed=5, prompts=f), [row]) == 5


# ================================================================= 12. one writer per eval folder at a time


def test_second_writer_into_a_running_folder_is_refused(tiny_dir, tmp_path, monkeypatch, capsys):
    """The scenario in one process: while the first NIAH run generates, a second NIAH run of other
    settings into the same --out starts. Before: both exited 0 and the first run's rows and summary were gone."""
    out = tmp_path / "niah"
    real = runner.generate
    second = []

    def generate(*a, **k):
        if not second:
            second.append(None)  # once (without the lock, the second run's own samples come back here)
            second.append(_niah(tiny_dir, out, "--policy", "streaming", "--budget", 64))
            second.append(capsys.readouterr().err)
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", generate)
    assert _niah(tiny_dir, out) == 0
    _, rc, err = second
    assert rc == 2
    assert f"{out} is being written by another kvkit eval run (process {os.getpid()}" in err
    assert "wait for it to finish or choose another --out" in err
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "full" and s["samples_scored"] == 1
    assert len(files.read_jsonl(out / "samples.jsonl")) == 1
    assert not (out / rundir.LOCK_NAME).exists()  # the last holder removes the lock file


def test_lock_held_by_another_process_names_its_pid_and_a_killed_holder_blocks_nothing(tiny_dir, tmp_path, capsys):
    out = tmp_path / "niah"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kvkit.evals.rundir import RunDir
        run = RunDir({str(out)!r}, {{"benchmark": "niah", "policy": "snapkv"}})
        print("locked", flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _niah(tiny_dir, out) == 2
        err = capsys.readouterr().err
        assert f"{out} is being written by another kvkit eval run (process {holder.pid}" in err
        assert "with other settings (" in err and "policy: it runs 'snapkv', this run asks for 'full'" in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / rundir.LOCK_NAME).exists()  # a killed holder leaves its file; the kernel dropped its lock
    assert _niah(tiny_dir, out) == 0
    assert json.loads((out / "summary.json").read_text())["policy"] == "full"


def test_same_settings_share_a_folder_only_with_resume(tmp_path):
    """One job split over processes by --tasks (benchmarks/policies/run_shadowkv_8k_cpu.sh) shares its run folders: a writer of
    the same settings joins with --resume; without it, or with other settings, it is refused."""
    cfg = {"benchmark": "ruler", "policy": "full", "dtype": "float32", "tasks": ["vt"]}
    with rundir.RunDir(tmp_path / "run", cfg) as a:
        with pytest.raises(ValueError, match=r"is being written by another .*pass --resume"):
            rundir.RunDir(tmp_path / "run", cfg)
        with pytest.raises(ValueError, match=r"with other settings \(dtype: it runs 'float32', this run asks for "
                                             r"'bfloat16'\)"):
            rundir.RunDir(tmp_path / "run", dict(cfg, dtype="bfloat16"), resume=True)
        with rundir.RunDir(tmp_path / "run", dict(cfg, tasks=["cwe"]), resume=True) as b:
            a.add({"id": "vt/0", "score": 1.0})
            b.add({"id": "cwe/0", "score": 0.0})
        assert (tmp_path / "run" / rundir.LOCK_NAME).exists()  # a still holds it
    assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()
    assert sorted(r["id"] for r in files.read_jsonl(tmp_path / "run" / "samples.jsonl")) == ["cwe/0", "vt/0"]


def test_a_refused_resume_releases_the_folder(tmp_path):
    cfg = {"benchmark": "ruler", "policy": "full", "dtype": "float32"}
    with rundir.RunDir(tmp_path / "run", cfg):
        pass
    with pytest.raises(ValueError, match="different configuration") as e:
        rundir.RunDir(tmp_path / "run", dict(cfg, policy="snapkv"), resume=True)
    assert e.value  # the traceback (and the half-made RunDir) is still alive here
    with rundir.RunDir(tmp_path / "run", cfg, resume=True):
        pass


def test_an_unreferenced_run_dir_releases_its_folder(tmp_path):
    """Library code that makes a RunDir without ``with`` / ``close()`` (tests/calibrate/test_calibrate.py does) holds the folder
    only while the object lives."""
    cfg = {"benchmark": "ruler", "policy": "full", "dtype": "float32"}
    rundir.RunDir(tmp_path / "run", cfg)  # dropped at once
    with rundir.RunDir(tmp_path / "run", dict(cfg, policy="snapkv")):
        pass
    assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()


# ================================================================= 16. prompts rows checked before any sample


def _prompts(tmp_path, *changes):
    good = dict(id="vt/0", task="vt", index=0, prompt="hi", outputs=["A"], tokens_to_generate=2,
                metric="string_match_all", target_length=256, depth=0.0)
    rows = [good] + [dict(dict(good, id=f"vt/{i + 1}", index=i + 1), **c) for i, c in enumerate(changes)]
    f = tmp_path / "prompts.jsonl"
    files.atomic_write_jsonl(f, rows)
    return f


@pytest.mark.parametrize("bench", ["ruler", "niah", "sweep"])
@pytest.mark.parametrize("metric", ["bogus", "best_of", "re", "qa_f1", None])
def test_prompts_unknown_metric_refused_before_any_sample(tmp_path, no_model_load, capsys, bench, metric):
    f = _prompts(tmp_path, {"metric": metric})
    extra = ["--out", tmp_path / "sweep", "--policy", "full"] if bench == "sweep" else []
    # before: the samples ran, then `getattr(metrics, metric)` raised AttributeError (or called whatever it found)
    assert run("eval", bench, "--prompts", f, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0] == (f"kvkit: error: {f}, line 2: sample 'vt/1': unknown metric {metric!r}; "
                      f"known metrics: string_match_all, string_match_part")


@pytest.mark.parametrize("change, message", [
    ({"outputs": []}, "'outputs' must be a non-empty list of strings"),
    ({"outputs": "A"}, "'outputs' must be a non-empty list of strings"),
    ({"tokens_to_generate": 0}, "'tokens_to_generate' must be a positive integer"),
    ({"tokens_to_generate": "2"}, "'tokens_to_generate' must be a positive integer"),
    ({"prompt": ""}, "'prompt' must be a non-empty string"),
    ({"id": "vt/0"}, "sample id 'vt/0' appears twice in the file"),
    ({"context_end": 99}, "'context_end' must be a character offset in the prompt"),
    ({"depth": 150}, "'depth' must be a percentage"),
])
def test_prompts_bad_fields_refused_before_the_model_loads(tmp_path, no_model_load, capsys, change, message):
    f = _prompts(tmp_path, change)
    assert run("eval", "niah", "--prompts", f) == 2
    err = capsys.readouterr().err
    assert f"{f}, line 2:" in err and message in err


def test_ruler_score_refuses_unknown_metric_by_name():
    assert ruler.score("string_match_part", "x A y", ["A", "B"]) == 1.0
    for bad in ("bogus", "re", "best_of", "qa_f1"):
        with pytest.raises(ValueError, match=rf"unknown metric '{bad}'; known metrics: string_match_all"):
            ruler.score(bad, "x", ["A"])


def test_niah_prompts_score_by_their_metric(tiny_dir, tmp_path, monkeypatch):
    """A NIAH prompts row's metric is the one it is scored with (it used to be ignored: string_match_all always)."""
    f = tmp_path / "p.jsonl"
    assert run("eval", "niah", "--model", tiny_dir, "--lengths", 256, "--depths", 1, "--dump-prompts", f) == 0
    rows = files.read_jsonl(f)
    files.atomic_write_jsonl(f, [dict(r, outputs=["zzz-never", "a"], metric="string_match_part") for r in rows])
    monkeypatch.setattr(runner, "generate", lambda *a, **k: generation.Generation("a b", 3, 1, 0.1, 10, 0))
    out = tmp_path / "run"
    assert run("eval", "niah", "--model", tiny_dir, "--prompts", f, "--out", out) == 0
    assert [r["score"] for r in files.read_jsonl(out / "samples.jsonl")] == [1.0]  # all: 0.5


def test_a_single_run_the_model_cannot_run_is_refused_before_its_folder_is_written(tiny_dir, tmp_path, capsys):
    """``eval niah`` with a ratio out of the policy's reach on the model: refused as ``kvkit.patch`` refuses it,
    and no run folder (not even its config.json) is left to look like an unfinished run."""
    out = tmp_path / "niah"
    assert _niah(tiny_dir, out, "--policy", "shadowkv:compression_ratio=0.9,chunk_size=4") == 2
    assert "reaches compression ratios in [0.000, 0.875]" in capsys.readouterr().err
    assert not out.exists()
