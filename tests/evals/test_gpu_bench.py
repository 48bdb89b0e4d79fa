"""``kvkit bench --shape NAME`` (kvkit/evals/gpu/) on the CPU with the tiny shape: the whole benchmark
through the CLI, its files, its rows (the compiled ``<policy> static+compile`` rows included), the byte-bound
arithmetic, the time limit and the errors for unknown shapes / rows.

The compiled rows compile with ``--compile-backend aot_eager`` (as tests/core/test_compiled_decode.py: dynamo's tracing,
which decides graph breaks and recompiles, is the same for every backend; inductor's code generation is what the GPU
run pays for), and hf-static runs eager (``--no-compile``): compile cost is not what these tests measure."""

import json

import pytest

from kvkit.cli import main
from kvkit.evals import gpu
from tests._nostatic import no_static_policy

B, L, WARMUP, STEPS = 2, 48, 2, 4
ROWS = ["hf-dynamic", "hf-static", "full", "streaming:budget=16,sink=2,tail=4", "tidal", "shadowkv:budget=16,min_prompt=16",
        "nostatic"]
SHADOWC = "shadowkv static+compile"
FULLC, STREAMC = "full static+compile", "streaming static+compile"


def _run(*argv) -> int:
    return main(["bench", *map(str, argv)])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_bench") / "tiny"
    with no_static_policy():  # "nostatic": a policy without a static store (every built-in one has one)
        code = _run("--shape", "tiny", "--batch", B, "--lengths", L, "--steps", STEPS, "--warmup", WARMUP, "--rounds", 2,
                    "--no-compile", "--compile-backend", "aot_eager", "--time-limit", 120, "--out", d, "--policies",
                    *ROWS)
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
    # full first (the reference), then each static policy's compiled row right after its eager one
    assert names == ["full", FULLC, "hf-dynamic", "hf-static", "streaming", STREAMC, "tidal", "tidal static+compile",
                     "shadowkv", SHADOWC, "nostatic"]
    assert cfg["rows_planned"] == names and cfg["compiled_rows"] is True and cfg["compile_backend"] == "aot_eager"
    by = {r["name"]: r for r in rows}
    for n in ("full", "hf-dynamic", "hf-static", "streaming", "shadowkv", "nostatic"):
        r = by[n]
        assert r["status"] == "ok", r
        assert r["steps"] == STEPS and r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert r["syncs_per_step"] >= 0 and r["attention"] and r["compile"] == "eager"
        assert "chunks of" in r["prefill"] and not r["compiled"] and "compile_s" not in r
    # tidal needs more than 2 layers: an error row, not a crash of the run (its compiled row too)
    for n in ("tidal", "tidal static+compile"):
        assert by[n]["status"] == "error" and "layers" in by[n]["error"]
    md = (out / "summary.md").read_text()
    for r in rows:
        assert f"| {r['row']} |" in md
    assert "Command: `" in md


def test_compiled_rows(out):
    """full and streaming (static stores) get a compiled row: static cache, eager chunked prefill, compiled steps
    timed after the compiling warm-up, compile time apart, no recompile while timed, their byte counts."""
    rows = {r["name"]: r for r in _rows(out)}
    for n, policy in ((FULLC, "full"), (STREAMC, "streaming")):
        r = rows[n]
        assert r["status"] == "ok", r
        assert r["compiled"] is True and r["policy"] == policy and r["row"].startswith(n)
        assert r["options"] == rows[policy]["options"]  # the eager row's settings
        assert r["compile"] == "aot_eager" and "one compiled graph" in r["attention"]
        assert "static=True" in r["prefill"] and "chunks of" in r["prefill"]
        # timed: STEPS steps, none of them the compiling one; the compile is reported apart
        assert r["steps"] == STEPS and r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        for k in ("step_ms", "step_ms_mean", "prefill_s", "syncs_per_step", "kv_held", "kv_read_step"):
            assert r[k] is not None
        assert r["compile_s"] > 0 and r["compile_s"] == r["first_step_s"]  # CPU: no CUDA-graph recording
        assert "cudagraph_record_s" not in r
        assert r["graphs_compiled"] >= 1 and r["recompiles"] == 0 and r["cudagraph_skips"] == 0
        assert r["syncs_per_step"] >= 0
        # a compiled step reads its whole static buffers
        assert r["kv_read_step"] == r["kv_allocated"] >= r["kv_held"] > 0
        assert "full_ms_paired" not in r  # not interleaved (re-patching between compiled calls)
    tok = 2 * 2 * 2 * 16 * 4 * B  # layers x (K, V) x KV heads x head_dim x fp32 x rows, per token
    assert rows[FULLC]["kv_held"] == rows["full"]["kv_held"] == tok * (L + WARMUP + STEPS)
    assert rows[FULLC]["kv_read_step"] == tok * 256  # L + steps + margin, rounded up to StaticFullStore.grow
    assert rows[STREAMC]["kv_read_step"] < rows[FULLC]["kv_read_step"]
    # the ratios against kvkit full static+compile
    t_fc = rows[FULLC]["step_ms"]
    for r in rows.values():
        if r["status"] == "ok":
            assert r["t_full_compiled_ms"] == t_fc
            assert r["speedup_vs_full_compiled"] == pytest.approx(t_fc / r["step_ms"], rel=1e-3)
    assert rows[FULLC]["speedup_vs_full_compiled"] == 1.0 and rows[FULLC]["fraction_to_bound_vs_full_compiled"] == 0
    md = (out / "summary.md").read_text()
    top = md.splitlines()[2]  # the line under the title
    assert top.startswith("Compiled rows: ") and FULLC in top and STREAMC in top and "compile s" in top
    assert "hf-static" not in top  # --no-compile: eager
    assert "| vs full compiled |" in md and "| compile s |" in md


def test_policy_without_static_store_lists_its_reason(out):
    cfg = json.loads((out / "config.json").read_text())
    rows = {r["name"]: r for r in _rows(out)}
    why = rows["nostatic"]["compile_refusal"]
    assert "StreamingStore" in why and "static" in why
    assert list(cfg["no_static_store"].values()) == [why] and next(iter(cfg["no_static_store"])).startswith("nostatic")
    assert "nostatic static+compile" not in rows
    assert "compile_refusal" not in rows["streaming"] and "compile_refusal" not in rows["full"]
    top = (out / "summary.md").read_text().splitlines()[2]
    assert "No static store, so no compiled row: nostatic" in top and why in top


def test_shadowkv_compiled_row_keeps_its_values_on_the_device(out):
    """shadowkv's compiled row adds its ``static_options`` (``offload=False``: a CUDA graph reads no host memory),
    shown in its label; its eager row keeps the paper's offload; both decode."""
    rows = {r["name"]: r for r in _rows(out)}
    assert rows[SHADOWC]["status"] == "ok" and rows["shadowkv"]["status"] == "ok"
    assert "offload=False" in rows[SHADOWC]["row"] and "offload" not in rows["shadowkv"]["row"]
    assert rows[SHADOWC]["compiled"] and rows[SHADOWC]["recompiles"] == 0


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
    # the compiled rows' ratios against kvkit full: its own median (not interleaved)
    assert rows[FULLC]["t_full_ms"] == rows["full"]["step_ms"]


def test_bound_arithmetic_by_hand():
    # 2 GB of weights + 1 GB of KV at 3 TB/s: 1 ms
    assert gpu.byte_bound_ms(2_000_000_000, 1_000_000_000, 3e12) == pytest.approx(1.0)
    # full 10 ms, row 4 ms, row's bound 2 ms: 6 of the 8 ms to the bound
    assert gpu.fraction_to_bound(10.0, 4.0, 2.0) == pytest.approx(0.75)
    assert gpu.fraction_to_bound(10.0, 12.0, 2.0) == pytest.approx(-0.25)  # slower than full: not clamped
    assert gpu.fraction_to_bound(10.0, 1.0, 2.0) == pytest.approx(1.125)  # under its bound: not clamped
    assert gpu.fraction_to_bound(2.0, 1.0, 2.0) is None and gpu.fraction_to_bound(None, 1.0, 2.0) is None


def test_parse_rows():
    rows = gpu.parse_rows(["streaming:budget=8,sink=2", "hf-dynamic,full", "streaming:budget=8,sink=2"])
    assert rows == [("full", {}), ("streaming", {"budget": 8, "sink": 2}), ("hf-dynamic", {})]
    assert [n for n, _ in gpu.parse_rows(None)][:3] == ["full", "hf-dynamic", "hf-static"]
    plan = [gpu.compiled_name(n) if c else n for n, _, c in gpu.plan_rows(gpu.parse_rows(None))]
    # the most wanted rows first; compiled rows only for the policies with static stores (every built-in one)
    assert plan[:6] == ["full", "full static+compile", "hf-dynamic", "hf-static", "streaming",
                        "streaming static+compile"]
    assert {p for p in plan if p.endswith("static+compile")} == {
        f"{p} static+compile" for p in ("full", "streaming", "snapkv", "tidal", "duo", "cake", "kvzip", "chelsea",
                                        "zipcache", "shadowkv")}
    with no_static_policy():
        plan = gpu.plan_rows(gpu.parse_rows(["full", "nostatic"]))
    assert [(n, c) for n, _, c in plan] == [("full", False), ("full", True), ("nostatic", False)]
    assert [n for n, _, c in gpu.plan_rows(gpu.parse_rows(None), compiled=False)] == \
        [n for n, _ in gpu.parse_rows(None)]
    with pytest.raises(ValueError, match="takes no options"):
        gpu.parse_rows(["hf-static:x=1"])
    with pytest.raises(ValueError, match="unknown option"):
        gpu.parse_rows(["streaming:nope=1"])


def test_unknown_shape_and_row(tmp_path, capsys):
    assert _run("--shape", "llama-9", "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "unknown shape 'llama-9'" in err and "tiny, llama-3.2-1b, llama-3.1-8b" in err
    assert _run("--shape", "tiny", "--policies", "full", "nosuch", "--out", tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "unknown row 'nosuch'" in err and "hf-dynamic, hf-static, full, streaming" in err and "kvzip" in err
    assert _run("--shape", "tiny", "--budget", "64", "--out", tmp_path / "c") == 2
    assert "--budget does not apply to --shape" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_time_limit_skips_rows(tmp_path):
    d = tmp_path / "skip"
    with no_static_policy():
        assert _run("--shape", "tiny", "--batch", 1, "--lengths", 16, "--steps", 2, "--no-compile", "--time-limit", 0,
                    "--policies", "full", "hf-dynamic", "nostatic", "--out", d) == 0
    rows = _rows(d)
    assert [r["name"] for r in rows] == ["full", "full static+compile", "hf-dynamic", "nostatic"]
    assert all(r["status"] == "skipped" and "time limit" in r["error"] for r in rows)
    assert "its compile included" in rows[1]["error"] and "compile" not in rows[0]["error"]
    assert "StreamingStore" in rows[3]["compile_refusal"]  # a skipped row still says why it has no compiled row
    md = (d / "summary.md").read_text()
    assert "skipped: time limit" in md and "Compiled rows: full static+compile (skipped)" in md
    # --no-compiled: no compiled row, no refusal
    with no_static_policy():
        assert _run("--shape", "tiny", "--batch", 1, "--lengths", 16, "--steps", 2, "--no-compile", "--no-compiled",
                    "--time-limit", 0, "--policies", "full", "nostatic", "--out", d) == 0
    rows = _rows(d)
    assert [r["name"] for r in rows] == ["full", "nostatic"] and "compile_refusal" not in rows[1]
    md = (d / "summary.md").read_text()
    assert "Compiled rows: none. kvkit static+compile rows: off (--no-compiled)." in md


def test_time_estimate_counts_the_compile():
    """A compiled row is expected to take a measured compiled row's time, else an eager row's + the compile
    estimate (30 s on CUDA, 20 s on the CPU with inductor, 5 s with another backend); eager rows: the eager median."""
    import torch

    spec = [("full", {})]
    cpu = gpu.Bench("tiny", "cpu", torch.float32, spec, 1, 16)
    assert cpu.compile_estimate == gpu.COMPILE_ESTIMATE_S["cpu"] == 20.0
    assert gpu.Bench("tiny", "cpu", torch.float32, spec, 1, 16, compile_backend="aot_eager").compile_estimate == 5
    assert gpu.COMPILE_ESTIMATE_S["cuda"] == 30.0
    assert cpu._estimate(True, [2.0, 4.0], []) == pytest.approx(23.0)
    assert cpu._estimate(True, [2.0], [10.0, 30.0]) == pytest.approx(20.0)
    assert cpu._estimate(False, [2.0, 4.0], [10.0]) == pytest.approx(3.0)
    assert cpu._estimate(False, [], [10.0]) == 0.0 and cpu._estimate(True, [], []) == 20.0
    assert [c for _, _, c in cpu.plan] == [False, True]
    assert [c for _, _, c in gpu.Bench("tiny", "cpu", torch.float32, spec, 1, 16, compiled=False).plan] == [False]


def test_git_state_sees_changes_under_the_checkouts_kvkit(tmp_path, monkeypatch):
    """The run's ``git_dirty_kvkit``: uncommitted changes under the checkout's top-level ``kvkit/``, found from a
    folder below it (where the benchmark's module lives), and nothing outside ``kvkit/``."""
    import shutil
    import subprocess

    from kvkit.evals.gpu.report import git_state

    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.delenv("KVKIT_GIT_COMMIT", raising=False)
    sub = tmp_path / "kvkit" / "evals"
    sub.mkdir(parents=True)
    (tmp_path / "kvkit" / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True, capture_output=True)
    commit, dirty = git_state(sub)
    assert len(commit) == 40 and dirty == []
    (tmp_path / "kvkit" / "a.py").write_text("x = 2\n")
    (tmp_path / "notes.txt").write_text("outside kvkit/\n")
    assert git_state(sub)[1] == ["M kvkit/a.py"]
    monkeypatch.setenv("KVKIT_GIT_COMMIT", "abc")  # the device machine has no checkout: the commit comes with the run
    assert git_state(sub)[0] == "abc"


@pytest.mark.parametrize("policy", ["zipcache", "duo", "shadowkv"])
def test_compiled_read_bytes_of_every_static_store_kind(policy):
    """A compiled row's KV read: the whole static buffers of each store (zipcache's segments included, whose
    ``parts`` is a method), duo's two halves summed (its ``parts`` a list); no store kind makes it fail."""
    import kvkit
    from kvkit.evals.gpu.compiled import compiled_read_bytes
    from kvkit.testing import policy_test_options, random_ids, tiny_model

    model = tiny_model("llama")
    kvkit.patch(model, policy, static=True, max_length=64, **policy_test_options(policy))
    try:
        cache, _ = kvkit.prefill(model, random_ids(40, seed=2))
        got = compiled_read_bytes(cache)
        if policy == "duo":
            want = sum(p[0].allocated_nbytes() for layer in cache.layers for p in layer.parts)
        elif policy == "shadowkv":  # its own count (selected chunks, outliers, held slots) + the free slots
            want = sum(layer.read_nbytes() + layer.free_slot_nbytes() for layer in cache.layers)
            assert all(layer.free_slot_nbytes() > 0 and layer.compressed for layer in cache.layers)
        else:
            want = sum(layer.allocated_nbytes() for layer in cache.layers)
        assert got == want > 0
    finally:
        kvkit.unpatch(model)


# -- the production grid (kvkit/evals/gpu/production.py) ----------------------------------------------------------
GIB = 1 << 30


@pytest.mark.parametrize("shape,params", [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248)])
def test_grid_weight_and_kv_bytes_of_the_real_shapes(shape, params):
    """The computed bytes are the published parameter counts and Llama 3's KV per token (bf16)."""
    import torch

    from kvkit.evals.gpu import production as prod
    from kvkit.evals.gpu.shapes import shape_config

    cfg = shape_config(shape)
    assert prod.weight_bytes(cfg, torch.bfloat16) == 2 * params
    per_token = {"llama-3.2-1b": 32 * 1024, "llama-3.1-8b": 128 * 1024}[shape]
    assert prod.kv_bytes_per_token(cfg, torch.bfloat16) == per_token


def test_grid_weight_bytes_match_the_built_tiny_model():
    import torch

    from kvkit.evals.gpu import production as prod
    from kvkit.evals.gpu.shapes import build_model, shape_config

    model = build_model("tiny", "cpu", torch.float32)
    assert prod.weight_bytes(shape_config("tiny"), torch.float32) == sum(
        p.numel() * p.element_size() for p in model.parameters())


def test_grid_skips_the_cells_that_do_not_fit_the_card_and_says_why():
    import torch

    from kvkit.evals.gpu import production as prod
    from kvkit.evals.gpu.shapes import shape_config

    h100, h200 = 80 * GIB, 141 * GIB
    big = prod.plan_cells(shape_config("llama-3.1-8b"), torch.bfloat16, prod.CELLS, h100)
    fit = {(c["batch"], c["length"]): c for c in big}
    # 32 x (32K + the decode room) of the 8B shape holds 129 GiB of KV: on neither card
    assert not fit[32, 32768]["fits"] and "KV 129.0 GiB" in fit[32, 32768]["skip_reason"]
    assert not prod.plan_cells(shape_config("llama-3.1-8b"), torch.bfloat16, [(32, 32768)], h200)[0]["fits"]
    assert fit[8, 32768]["fits"] and fit[1, prod.LONG]["fits"] and fit[32, 8192]["fits"]
    small = prod.plan_cells(shape_config("llama-3.2-1b"), torch.bfloat16, prod.CELLS, h100)
    assert all(c["fits"] for c in small)  # 32 x 32K of the 1B shape: 32 GiB of KV
    assert all(c["fits"] for c in prod.plan_cells(shape_config("tiny"), torch.float32, prod.TINY_CELLS, None))
    with pytest.raises(ValueError, match="BATCHxLENGTH"):
        prod.parse_cells("8by32768")
    assert prod.parse_cells("8x32768, 1x130816") == ((8, 32768), (1, 130816))


def test_grid_dry_run_on_the_tiny_shape(tmp_path):
    """The whole grid on the CPU (one cell): its hf-static and compiled rows measured with tokens/s, the fraction of
    the byte bound and the ratios to hf-static; the largest-batch probe per policy; the files."""
    from kvkit.evals.gpu import production as prod

    out = tmp_path / "grid"
    code = prod.main(["--shape", "tiny", "--device", "cpu", "--cells", "2x32", "--steps", "2", "--warmup", "1",
                      "--policies", "full", "streaming:budget=8,sink=2,tail=4", "--probe-length", "48",
                      "--compile-backend", "aot_eager", "--time-limit", "300", "--out", str(out)])
    assert code == 0
    res = json.loads((out / "grid.json").read_text())
    rows = res["rows"]
    assert [(r["batch"], r["name"]) for r in rows] == [
        (2, n) for n in ("hf-static", FULLC, STREAMC)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3, abs=0.051)
        assert r["of_byte_bound"] == pytest.approx(r["byte_bound_ms"] / r["step_ms"], abs=1e-3)
        assert r["speedup_vs_hf_static"] > 0 and r["prefill_s"] > 0
    probes = {p["policy"]: p for p in res["probes"]}
    assert set(probes) == {"full", "streaming"}
    # full keeps every token: its rows cost more than streaming's 8-token budget
    assert probes["full"]["per_row_bytes"] > probes["streaming"]["per_row_bytes"] > 0
    assert probes["full"]["max_batch"] is None  # no card: no largest batch on the CPU
    md = (out / "grid.md").read_text()
    assert "| 2 | 32 | full static+compile |" in md and "Largest batch at 48 tokens" in md


def test_largest_batch_arithmetic(monkeypatch):
    from kvkit.evals.gpu import production as prod

    peaks = {1: 1000 + 300, 2: 1000 + 600}
    monkeypatch.setattr(prod, "_probe_once", lambda model, policy, opts, b, length, cuda, seed: dict(
        peak=peaks[b], allocated=200 * b))
    r = prod.max_batch(None, "full", {}, 100, usable=10_000, cuda=True)
    assert r["per_row_bytes"] == 300 and r["fixed_bytes"] == 1000 and r["max_batch"] == 30


# -- the prepared GPU scripts (benchmarks/gpu/) -------------------------------------------------------------------
def _script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_gpu_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compiled_profile_kernel_arithmetic():
    """Kernels, busy time (overlaps merged), the gaps inside steps (the steps - 1 largest gaps, between steps,
    left out) and the span, per step."""
    ks = _script("profile_step").kernel_stats([(0, 10), (5, 12), (14, 20), (100, 110), (112, 120)], steps=2)
    assert ks["kernels"] == 2.5
    assert ks["busy_ms"] == pytest.approx((12 + 6 + 10 + 8) / 1e3 / 2)
    assert ks["gaps_ms"] == pytest.approx((2 + 2) / 1e3 / 2)  # the 80 us between the steps is not a gap
    assert ks["span_ms"] == pytest.approx(120 / 1e3 / 2) and ks["median_gap_us"] == 2
    assert _script("profile_step").kernel_stats([], steps=3)["kernels"] == 0.0


def test_profile_script_defaults_follow_its_mode():
    """``benchmarks/gpu/profile_step.py`` profiles eager steps of every policy by default, and with ``--compiled`` the
    static+compile rows of full, streaming and snapkv; ``--compile-backend`` is refused without ``--compiled``."""
    mod = _script("profile_step")
    eager, compiled = mod._parse([]), mod._parse(["--compiled", "--compile-backend", "aot_eager"])
    assert (eager.compiled, eager.warmup, eager.policies) == (False, 3, mod.POLICIES)
    assert (compiled.compiled, compiled.warmup, compiled.policies) == (True, 2, ["full", "streaming", "snapkv"])
    assert compiled.compile_backend == "aot_eager" and mod._parse(["--compiled"]).compile_backend == "inductor"
    with pytest.raises(SystemExit):
        mod._parse(["--compile-backend", "aot_eager"])


@pytest.mark.slow
def test_run_all_dry_run_end_to_end(tmp_path):
    """``DRY=1 bash benchmarks/gpu/run_all.sh`` on the CPU (tiny shape): every stage runs and leaves its file, at
    most 8 files in all (what the device tool brings back), the speculative rounds lossless."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    env = dict(os.environ, DRY="1", PY=sys.executable, OUT=str(out), PYTHONPATH=str(root))
    r = subprocess.run(["bash", str(root / "benchmarks" / "gpu" / "run_all.sh")], env=env, capture_output=True,
                       text=True, timeout=1200, check=False)
    assert r.returncode == 0, r.stdout[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["grid-1b.json", "grid-1b.md", "grid-8b.json", "grid-8b.md", "log.txt", "ops.md", "profile.txt",
                     "speculative.json"]
    assert "| full | 2, 4 |" in (out / "ops.md").read_text()
    for g in ("grid-1b", "grid-8b"):
        rows = json.loads((out / f"{g}.json").read_text())["rows"]
        assert rows and all(x["status"] == "ok" for x in rows), rows
    spec = json.loads((out / "speculative.json").read_text())["rows"]
    assert spec and all("error" not in x and x["tokens_equal"] == 1.0 for x in spec), spec
    prof = (out / "profile.txt").read_text()
    assert all(f"## {p} static+compile" in prof for p in ("full", "streaming", "snapkv")), prof


def test_grid_from_the_bench_arguments(monkeypatch, capsys):
    """``kvkit bench --shape NAME --grid``'s code path: the bench's arguments become the grid's settings
    (``--batch`` x each of ``--lengths`` as the cells), the tables printed."""
    import argparse

    from kvkit.evals.gpu import production as prod

    seen = {}

    def fake(shape, device, **kw):
        seen.update(kw, shape=shape, device=device)
        return dict(info={}, cells=[], rows=[], probes=[])

    monkeypatch.setattr(prod, "run_grid", fake)
    args = argparse.Namespace(shape="llama-3.1-8b", device="cuda", policy=["full", "snapkv"], steps=None, warmup=3,
                              time_limit=100.0, out=None, compile_backend="inductor", lengths="8192,32768", batch=8)
    assert prod.run_bench_args(args, "kvkit bench --shape llama-3.1-8b --grid") == 0
    assert seen["cells"] == ((8, 8192), (8, 32768)) and seen["policies"] == ["full", "snapkv"]
    assert seen["steps"] == 10 and seen["warmup"] == 3 and seen["shape"] == "llama-3.1-8b"
    assert "# Decode grid: llama-3.1-8b" in capsys.readouterr().out
    args.lengths, args.policy = None, None
    prod.run_bench_args(args)
    assert seen["cells"] is None and seen["policies"] == list(prod.DEFAULT_POLICIES)


def test_bench_grid_flag_reaches_the_production_grid(monkeypatch):
    """``kvkit bench --shape NAME --grid`` runs the production grid with the rows given as ``--policy``."""
    from kvkit.cli import main
    from kvkit.evals.gpu import production as prod

    seen = {}
    monkeypatch.setattr(prod, "run_grid", lambda shape, device, **kw: seen.update(kw, shape=shape) or
                        dict(info={}, cells=[], rows=[], probes=[]))
    main(["bench", "--shape", "tiny", "--grid", "--device", "cpu", "--policy", "full", "--policy", "streaming",
          "--lengths", "64", "--batch", "2"])
    assert seen["shape"] == "tiny" and seen["policies"] == ["full", "streaming"] and seen["cells"] == ((2, 64),)
