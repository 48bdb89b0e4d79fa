"""A run folder names the commit and command that made its rows, through every ``--resume``: a resume that adds
nothing changes neither, one that adds rows is recorded beside the folder's maker, and a summary counts the rows
each commit wrote."""

import json

import pytest

from kvkit.evals import report, rundir
from kvkit.evals.commands import runs

TASKS = ["digits"]


@pytest.fixture
def at_commit(monkeypatch):
    """``at_commit(sha)``: kvkit runs from ``sha`` from now on (``KVKIT_GIT_COMMIT``, the commit cache cleared)."""
    def set_commit(sha):
        monkeypatch.setenv("KVKIT_GIT_COMMIT", sha)
        report.commit.cache_clear()
    yield set_commit
    report.commit.cache_clear()


def _config(command):
    return dict(benchmark="needles", model="default", policy="snapkv", options={"compression_ratio": 0.5},
                seed=1, dtype="float32", command=command, kvkit_version="0.test")


def _row(i):
    return dict(id=f"digits/{i}", task="digits", index=i, score=1.0, prompt_tokens=100, kv_bytes=1000, seconds=0.1)


def _run(folder, command, ids, resume):
    """One invocation: open the folder, add the rows of ``ids`` it lacks, write the summary; the summary.json."""
    with rundir.RunDir(folder, _config(command), resume=resume) as run:
        for i in ids:
            if f"digits/{i}" not in run.done():
                run.add(_row(i))
        rows = [r for r in run.rows if r["id"] in {f"digits/{i}" for i in ids}]
        runs.task_summary(run, rows, TASKS, "t")
    return json.loads((folder / "summary.json").read_text())


def test_a_resume_that_adds_no_row_keeps_the_commit_and_command_that_made_the_rows(tmp_path, at_commit):
    folder = tmp_path / "run"
    at_commit("a" * 40)
    first = _run(folder, "kvkit eval needles --first", [0, 1], resume=False)
    assert first["commit"] == "a" * 40 and first["row_commits"] == {"a" * 40: 2}

    at_commit("b" * 40)
    again = _run(folder, "kvkit eval needles --later", [0, 1], resume=True)
    config = json.loads((folder / "config.json").read_text())
    assert again["commit"] == "a" * 40 and again["row_commits"] == {"a" * 40: 2}
    assert again["command"] == config["command"] == "kvkit eval needles --first"
    assert "resumed" not in config
    assert "kvkit eval needles --first" in (folder / "summary.md").read_text()


def test_a_resume_that_adds_rows_is_recorded_beside_the_folders_maker(tmp_path, at_commit):
    folder = tmp_path / "run"
    at_commit("a" * 40)
    _run(folder, "kvkit eval needles --first", [0, 1], resume=False)

    at_commit("c" * 40)
    more = _run(folder, "kvkit eval needles --more", [0, 1, 2], resume=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["command"] == "kvkit eval needles --first"
    assert config["resumed"] == [dict(command="kvkit eval needles --more", commit="c" * 40, kvkit_version="0.test")]
    assert more["commit"] == "c" * 40  # the commit that wrote the last row
    assert more["row_commits"] == {"a" * 40: 2, "c" * 40: 1}
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert [r["commit"] for r in rows] == ["a" * 40, "a" * 40, "c" * 40]

    # a summary of fewer rows than the folder holds counts only those
    at_commit("d" * 40)
    part = _run(folder, "kvkit eval needles --part", [0], resume=True)
    assert part["commit"] == "a" * 40 and part["row_commits"] == {"a" * 40: 1}
    assert len(json.loads((folder / "config.json").read_text())["resumed"]) == 1  # this resume wrote nothing


def test_rows_written_before_rows_were_stamped_count_under_their_summarys_commit(tmp_path, at_commit):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config("kvkit eval needles --old")))
    (folder / "samples.jsonl").write_text("".join(json.dumps(_row(i)) + "\n" for i in (0, 1)))
    (folder / "summary.json").write_text(json.dumps({"commit": "e" * 40}))

    at_commit("f" * 40)
    s = _run(folder, "kvkit eval needles --new", [0, 1], resume=True)
    assert s["commit"] == "e" * 40 and s["row_commits"] == {"e" * 40: 2}
    assert s["command"] == "kvkit eval needles --old"

    (folder / "summary.json").unlink()  # and with nothing naming them: unknown, not the current commit
    s = _run(folder, "kvkit eval needles --new", [0, 1], resume=True)
    assert s["commit"] is None and s["row_commits"] == {"unknown": 2}


def test_two_resumes_sharing_a_folder_are_both_recorded(tmp_path, at_commit):
    folder = tmp_path / "run"
    at_commit("a" * 40)
    _run(folder, "kvkit eval needles --first", [0], resume=False)

    at_commit("b" * 40)
    one = rundir.RunDir(folder, _config("kvkit eval sweep --tasks one"), resume=True)
    two = rundir.RunDir(folder, _config("kvkit eval sweep --tasks two"), resume=True)  # joins the held folder
    try:
        one.add(_row(1))
        two.add(_row(2))
    finally:
        one.close()
        two.close()
    config = json.loads((folder / "config.json").read_text())
    assert config["command"] == "kvkit eval needles --first"
    assert [e["command"] for e in config["resumed"]] == ["kvkit eval sweep --tasks one", "kvkit eval sweep --tasks two"]
