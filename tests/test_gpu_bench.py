"""``kvkit bench --shape NAME`` (kvkit/evals/gpu_bench.py) on the CPU with the tiny shape: the whole benchmark
through the CLI, its files, its rows, the byte-bound arithmetic and the errors for unknown shapes / rows."""

import json

import pytest

from kvkit.cli import main
from kvkit.evals import gpu_bench

B, L, WARMUP, STEPS = 2, 48, 2, 4
ROWS = ["hf-dynamic", "hf-static", "full", "streaming:budget=16,sink=2,tail=4", "tidal"]


def _run(*argv) -> int:
    return main(["bench", *map(str, argv)])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_bench") / "tiny"
    code = _run("--shape", "tiny", "--batch", B, "--lengths", L, "--steps", STEPS, "--warmup", WARMUP, "--rounds", 2,
                "--no-compile", "--time-limit", 120, "--out", d, "--policies", *ROWS)
    assert code == 0
    return d


def _rows(d):
    return [json.loads(x) for x in (d / "rows.jsonl").read_text().splitlines()]


def test_files_and_rows(out):
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shape"] == "tiny" and cfg["batch"] == B and cfg["length"] == L and cfg["dtype"] == "float32"
    for k in ("torch", "transformers", "triton", "device_name", "git_commit", "command", "bandwidth_bytes_s",
              "weights_read_bytes", "prefill_chunk"):
        assert k in cfg
    assert cfg["command"].startswith("kvkit bench --shape tiny") or cfg["command"] == ""
    rows = _rows(out)
    names = [r["name"] for r in rows]
    assert names == ["full", "hf-dynamic", "hf-static", "streaming", "tidal"]  # full first: the reference
    by = {r["name"]: r for r in rows}
    for n in ("full", "hf-dynamic", "hf-static", "streaming"):
        r = by[n]
        assert r["status"] == "ok", r
        assert r["steps"] == STEPS and r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert r["syncs_per_step"] >= 0 and r["attention"] and r["compile"] == "eager"
        assert "chunks of" in r["prefill"]
    # tidal needs more than 2 layers: an error row, not a crash of the run
    assert by["tidal"]["status"] == "error" and "layers" in by["tidal"]["error"]
    md = (out / "summary.md").read_text()
    for r in rows:
        assert f"| {r['row']} |" in md
    assert "Command: `" in md


def test_byte_counts_and_bound(out):
    cfg = json.loads((out / "config.json").read_text())
    rows = {r["name"]: r for r in _rows(out)}
    # tiny: vocab 256, hidden 64, intermediate 128, 2 layers, 4/2 heads of 16, tied embeddings, fp32
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    weights = 4 * (256 * 64 + 2 * per_layer + 64)
    assert cfg["weights_read_bytes"] == weights
    tok = 2 * 2 * 2 * 16 * 4 * B  # layers x (K, V) x KV heads x head_dim x fp32 x rows, per token
    assert rows["full"]["kv_read_step"] == rows["full"]["kv_held"] == tok * (L + WARMUP + STEPS)
    assert rows["hf-dynamic"]["kv_read_step"] == tok * (L + WARMUP + STEPS)
    assert rows["hf-static"]["kv_read_step"] % tok == 0 and rows["hf-static"]["kv_read_step"] > tok * L
    assert rows["streaming"]["kv_read_step"] < rows["full"]["kv_read_step"]
    bw = cfg["bandwidth_bytes_s"]
    for r in rows.values():
        if r["status"] != "ok":
            continue
        assert r["weights_bytes"] == weights
        assert r["byte_bound_ms"] == pytest.approx((weights + r["kv_read_step"]) / bw * 1e3, rel=1e-3)
        t_full = r["t_full_ms"]
        assert r["speedup_vs_full"] == pytest.approx(t_full / r["step_ms"], rel=1e-3)
        if t_full > r["byte_bound_ms"]:
            f = (t_full - r["step_ms"]) / (t_full - r["byte_bound_ms"])
            assert r["fraction_to_bound"] == pytest.approx(f, rel=1e-3, abs=1e-3)
    assert rows["full"]["speedup_vs_full"] == 1.0 and rows["full"]["fraction_to_bound"] == 0.0
    assert "full_ms_paired" in rows["streaming"] and "full_ms_paired" not in rows["hf-static"]


def test_bound_arithmetic_by_hand():
    # 2 GB of weights + 1 GB of KV at 3 TB/s: 1 ms
    assert gpu_bench.byte_bound_ms(2_000_000_000, 1_000_000_000, 3e12) == pytest.approx(1.0)
    # full 10 ms, row 4 ms, row's bound 2 ms: 6 of the 8 ms to the bound
    assert gpu_bench.fraction_to_bound(10.0, 4.0, 2.0) == pytest.approx(0.75)
    assert gpu_bench.fraction_to_bound(10.0, 12.0, 2.0) == pytest.approx(-0.25)  # slower than full: not clamped
    assert gpu_bench.fraction_to_bound(10.0, 1.0, 2.0) == pytest.approx(1.125)  # under its bound: not clamped
    assert gpu_bench.fraction_to_bound(2.0, 1.0, 2.0) is None and gpu_bench.fraction_to_bound(None, 1.0, 2.0) is None


def test_parse_rows():
    rows = gpu_bench.parse_rows(["streaming:budget=8,sink=2", "hf-dynamic,full", "streaming:budget=8,sink=2"])
    assert rows == [("full", {}), ("streaming", {"budget": 8, "sink": 2}), ("hf-dynamic", {})]
    assert [n for n, _ in gpu_bench.parse_rows(None)][:3] == ["full", "hf-dynamic", "hf-static"]
    with pytest.raises(ValueError, match="takes no options"):
        gpu_bench.parse_rows(["hf-static:x=1"])
    with pytest.raises(ValueError, match="unknown option"):
        gpu_bench.parse_rows(["streaming:nope=1"])


def test_unknown_shape_and_row(tmp_path, capsys):
    assert _run("--shape", "llama-9", "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "unknown shape 'llama-9'" in err and "tiny, llama-3.2-1b, llama-3.1-8b" in err
    assert _run("--shape", "tiny", "--policies", "full", "nosuch", "--out", tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "unknown row 'nosuch'" in err and "hf-dynamic, hf-static, full, streaming" in err and "kvzip" in err
    assert _run("--shape", "tiny", "--add", "streaming", "--out", tmp_path / "c") == 2
    assert "--policies" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_time_limit_skips_rows(tmp_path):
    d = tmp_path / "skip"
    assert _run("--shape", "tiny", "--batch", 1, "--lengths", 16, "--steps", 2, "--no-compile", "--time-limit", 0,
                "--policies", "full", "hf-dynamic", "--out", d) == 0
    rows = _rows(d)
    assert [r["name"] for r in rows] == ["full", "hf-dynamic"]
    assert all(r["status"] == "skipped" and "time limit" in r["error"] for r in rows)
    assert "skipped: time limit" in (d / "summary.md").read_text()
