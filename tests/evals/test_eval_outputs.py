"""What every eval writes for other tools: summary.json with a schema version and the commit, KV bytes held and
read, per-run needles summaries that ``kvkit eval compare`` reads beside the other evals, and samples.jsonl
appended one row at a time (never rewritten) without counting a sample twice."""

from __future__ import annotations

import json

import pytest

from kvkit.evals import report, rundir
from kvkit.evals.commands import runs
from kvkit.evals.commands.needles import write_root_summary


def _row(i, score, kv, read=None, task="digits"):
    r = dict(id=f"512/{i}", task=task, index=i, score=score, kv_bytes=kv, prompt_tokens=100, seconds=0.5,
             sample_sha=f"s{i}")
    if read is not None:
        r["kv_read"] = read
    return r


def _needle_run(root, name, policy, options, scores, kv, read):
    cfg = dict(benchmark="needles", model="m", policy=policy, options=options, seed=1, dtype="float32",
               length=512, lengths=[512], protocol="agnostic", formats=["digits"], max_new_tokens=None)
    with rundir.RunDir(root / name, cfg) as run:
        for i, s in enumerate(scores):
            run.add(_row(i, s, kv, read))
        runs.task_summary(run, run.rows, ["digits"], f"needles {name}")


def test_summary_has_schema_commit_spec_and_kv_bytes(tmp_path):
    _needle_run(tmp_path, "snap", "snapkv", {"budget": 128, "compression_ratio": 0.5}, [1.0, 0.0], 400, 100)
    s = json.loads((tmp_path / "snap" / "summary.json").read_text())
    assert s["schema"] == report.SCHEMA == 1 and "commit" in s
    assert s["policy_spec"] == "snapkv:budget=128,compression_ratio=0.5" and s["compression_ratio"] == 0.5
    assert s["mean_kv_bytes"] == 400 and s["mean_kv_read"] == 100
    assert s["scores"] == {"digits": 50.0} and s["average"] == 50.0


def test_compare_reads_a_needles_folder_with_retention_beside_bytes(tmp_path, capsys):
    _needle_run(tmp_path, "full", "full", {}, [1.0, 1.0], 1000, 1000)
    _needle_run(tmp_path, "snap", "snapkv", {"budget": 128}, [1.0, 0.0], 250, 125)
    write_root_summary(tmp_path, [tmp_path / "full", tmp_path / "snap"])
    root = json.loads((tmp_path / "summary.json").read_text())
    assert root["schema"] == 1 and root["benchmark"] == "needles"
    assert [(r["folder"], r["mean_kv_bytes"], r["mean_kv_read"]) for r in root["runs"]] == [
        ("full", 1000, 1000), ("snap", 250, 125)]
    from kvkit.cli import main

    assert main(["eval", "compare", str(tmp_path)]) == 0
    md = capsys.readouterr().out
    head = [c.strip() for c in md.splitlines()[0].split("|")[1:-1]]
    snap = [c.strip() for c in next(ln for ln in md.splitlines() if "| snapkv |" in ln).split("|")[1:-1]]
    row = dict(zip(head, snap))
    assert row["retention"] == "0.50" and row["KV vs baseline"] == "0.25" and row["reads vs baseline"] == "0.12"
    assert row["KV bytes"] == "250 B"
    assert main(["eval", "compare", "--matched", str(tmp_path)]) == 0  # the run folders' rows, too


def test_samples_are_appended_not_rewritten(tmp_path, monkeypatch):
    cfg = {"benchmark": "ruler", "policy": "full"}
    run = rundir.RunDir(tmp_path / "r", cfg)
    monkeypatch.setattr(rundir, "atomic_write_jsonl", lambda *a: pytest.fail("samples.jsonl rewritten whole"))
    path = tmp_path / "r" / "samples.jsonl"
    before = b""
    for i in range(5):
        run.add(_row(i, 1.0, 10))
        now = path.read_bytes()
        assert now.startswith(before) and now.count(b"\n") == i + 1  # one line more, the earlier bytes untouched
        before = now
    run.close()


def test_resume_drops_a_row_cut_short_and_counts_each_sample_once(tmp_path):
    cfg = {"benchmark": "ruler", "policy": "full"}
    with rundir.RunDir(tmp_path / "r", cfg) as run:
        run.add(_row(0, 1.0, 10))
        run.add(_row(1, 0.0, 10))
    path = tmp_path / "r" / "samples.jsonl"
    with open(path, "a") as f:
        f.write('{"id": "512/2", "sco')  # a crash in the middle of a row
    with pytest.warns(UserWarning, match="unfinished last row"):
        run = rundir.RunDir(tmp_path / "r", cfg, resume=True)
    assert run.done() == {"512/0", "512/1"}
    run.add(_row(2, 1.0, 10))
    run.add(_row(1, 1.0, 10))  # the same sample again: the last row wins, counted once
    assert sorted((r["id"], r["score"]) for r in run.rows) == [("512/0", 1.0), ("512/1", 1.0), ("512/2", 1.0)]
    run.close()
    with pytest.warns(UserWarning, match="512/1"):
        again = rundir.RunDir(tmp_path / "r", cfg, resume=True)
    assert len(again.rows) == 3 and len(path.read_text().splitlines()) == 3  # compacted once on resume
    again.close()
