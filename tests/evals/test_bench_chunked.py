"""``kvkit bench --prefill-chunk N``: chunked vs one-shot prefill, peak memory of both in one run."""

import json

import pytest

from kvkit.cli import main


def run(*argv):
    return main([str(a) for a in argv])


def test_bench_prefill_chunk_rows_and_fields(tiny_dir, tmp_path):
    out = tmp_path / "bench"
    assert run("bench", "--model", tiny_dir, "--policy", "streaming", "--budget", 64, "--lengths", "256",
               "--decode-tokens", 3, "--prefill-chunk", 64, "--out", out) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["prefill_chunk"] == 64
    rows = {(r["policy"], r["prefill_chunk"]): r for r in s["rows"]}
    assert set(rows) == {("full", 0), ("streaming", 0), ("full", 64), ("streaming", 64)}
    for r in rows.values():
        for k in ("peak_prefill_bytes", "peak_decode_bytes", "prefill_s", "kv_bytes_prefill", "peak_prefill_bytes_vs_full"):
            assert k in r, k
        assert r["peak_prefill_bytes"] >= 0 and r["prefill_s"] > 0 and r["decode_tokens"] == 3
    # chunked prefill really compressed between chunks: a streaming store never holds more than budget + chunk
    assert rows[("streaming", 64)]["kv_bytes_prefill"] < rows[("full", 0)]["kv_bytes_prefill"]
    # the same KV after the prompt as a full cache, whichever way it was fed
    assert rows[("full", 64)]["kv_bytes_prefill"] == rows[("full", 0)]["kv_bytes_prefill"]
    assert rows[("full", 0)]["peak_prefill_bytes_vs_full"] == 1.0  # ratios against the one-shot full row
    md = (out / "summary.md").read_text()
    assert "chunks of 64" in md and "one-shot" in md and "peak prefill" in md
    assert [r["prefill_chunk"] for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())] == [0, 0, 64, 64]


def test_bench_prefill_chunk_must_be_positive(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run("bench", "--model", tiny_dir, "--lengths", "256", "--prefill-chunk", 0, "--out", tmp_path / "b")
    assert e.value.code == 2 and "argument --prefill-chunk: must be an integer >= 1" in capsys.readouterr().err


def test_bench_run_rejects_bad_chunk():
    from kvkit.evals.bench import run as bench_run

    with pytest.raises(ValueError, match="--prefill-chunk must be a positive"):
        bench_run(None, None, "full", {}, [256], prefill_chunk=-5)
