"""``kvkit bench --batch B``: batched decode of every policy against full in one run, the byte bound,
``--memory`` (largest batch that fits), ``--profile``; chunked prefill at batch. Tiny random model, fast."""

import json

import pytest
import torch

from kvkit.cli import main
from kvkit.evals import bench

POLICIES = [("streaming", {"budget": 48}), ("cake", {"budget": 64}), ("zipcache", {}),
            ("shadowkv", {"budget": 32, "min_prompt": 48}), ("chelsea", {"ratio": 0.5}),
            ("tidal", {"budget": 32, "selection": "kv_head"})]


@pytest.fixture(scope="module")
def tok():
    from kvkit.models import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def model(tok):
    from kvkit.testing import tiny_model

    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model, tok):
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def result(model, tok):
    return bench.decode_bench(model, tok, POLICIES, batch=3, length=128, threads=[1], rounds=1, steps=2,
                              memory_gib=0.002, max_batch=4, profile=True, profile_steps=1)


def test_batch_prompts_left_padded_distinct(tok):
    ids, mask = bench.batch_prompts(tok, 4, 256)
    assert ids.shape == mask.shape == (4, 256)
    real = mask.sum(1).tolist()
    assert real[0] == 256 and real == sorted(real, reverse=True) and real[-1] < 256  # left padding, row 0 full
    for i in range(4):
        assert mask[i, -real[i]:].all() and not mask[i, : 256 - real[i]].any()
    assert len({tuple(ids[i, -100:].tolist()) for i in range(4)}) == 4  # different passages


def test_rows_for_every_policy_and_consistent_numbers(result):
    rows = result["rows"]
    assert [r["label"] for r in rows] == ["full"] + [bench.config_label(n, o) for n, o in POLICIES]
    full = rows[0]
    assert full["speedup"] == 1.0 and full["bound"] == 1.0 and full["fraction"] is None
    for r in rows:
        assert r["batch"] == 3 and r["length"] == 128 and r["threads"] == 1
        assert r["steps"] == (2 * len(POLICIES) if r["label"] == "full" else 2)  # full: its steps over every pair
        assert r["step_ms"] > 0 and r["tok_s"] == pytest.approx(3 / (r["step_ms"] / 1e3), rel=1e-2)
        assert r["kv_held"] > 0 and r["kv_read_step"] > 0 and r["weights"] == result["weights"]
        bound = bench.byte_bound(r["weights"], full["kv_read_step"], r["kv_read_step"])
        assert r["bound"] == pytest.approx(bound, abs=1e-3)
        if r["kv_read_step"] < full["kv_read_step"]:
            assert r["bound"] > 1.0  # reading less: a bound above 1
        if r["fraction"] is not None:
            assert r["fraction"] == pytest.approx((r["speedup"] - 1) / (r["bound"] - 1), abs=2e-3)
    by = {r["policy"]: r for r in rows}
    assert by["streaming"]["kv_held"] < full["kv_held"] and by["zipcache"]["kv_held"] < full["kv_held"]
    assert by["shadowkv"]["kv_offloaded"] > 0  # it compressed (min_prompt below the context)


def test_memory_fit_monotone_and_measured(result):
    fits = {f["label"]: f for f in result["fits"]}
    assert set(fits) == {"full"} | {bench.config_label(n, o) for n, o in POLICIES}
    assert fits["streaming budget=48"]["fit_batch"] > fits["full"]["fit_batch"]
    for f in fits.values():
        assert f["measured_batch"] == min(f["fit_batch"], 4)
        held, head = f["kv_held_per_seq"], f["headroom_per_seq"]
        assert head > 0
        fs = [bench.memory_fit(m * 2**20, held, head) for m in (0.5, 1, 2, 4, 8, 64)]
        assert fs == sorted(fs) and fs[-1] > fs[0]
        assert (held + head) * f["fit_batch"] <= 0.002 * 2**30 < (held + head) * (f["fit_batch"] + 1)
    mem = [r for r in result["memory"] if not r.get("paired_with")]
    assert {r["label"] for r in mem} == set(fits) - {"full"}
    for r in mem:
        assert r["batch"] == fits[r["label"]]["measured_batch"] and r["throughput_vs_full"] > 0
    paired = [r for r in result["memory"] if r.get("paired_with")]
    assert all(r["batch"] == fits["full"]["measured_batch"] for r in paired)


def test_profile_lists_top_ops(result):
    prof = result["profile"]
    assert set(prof) == {"full"} | {bench.config_label(n, o) for n, o in POLICIES}
    for p in prof.values():
        assert p["ops"] and p["step_ms"] > 0
        assert all(o["name"].startswith("aten::") or o["name"] for o in p["ops"])
        assert [o["self_ms"] for o in p["ops"]] == sorted((o["self_ms"] for o in p["ops"]), reverse=True)
    h, rows = bench.profile_summary(result)
    assert len(rows) == len(prof) and "%" in rows[0][2]


@pytest.mark.parametrize("name,opts", POLICIES + [("full", {})])
def test_replayed_prefill_decodes_like_own_prefill(model, tok, name, opts):
    """The recorded-attention replay (and its batch tiling for --memory) leaves the cache the policy's own
    prefill leaves: same greedy tokens."""
    import kvkit

    ids, mask = bench.batch_prompts(tok, 2, 80, pad_step=7)
    kvkit.patch(model, "full")
    rec = bench.record_prefill_spilled(model, ids, mask)
    kvkit.unpatch(model)

    def tokens(run, n=3):
        out = [run.nxt.clone()]
        kvkit.patch(model, run.name, **run.options)
        with torch.no_grad():
            for _ in range(n):
                bench.decode_step(model, run)
                out.append(run.nxt.clone())
        kvkit.unpatch(model)
        return torch.cat(out, 1)

    for batch in (2, 3):
        replayed = bench.prefill_run(model, name, opts, ids, mask, rec, batch=batch)
        own = bench.prefill_run(model, name, opts, ids, mask, batch=batch)
        assert replayed.replayed and not own.replayed
        assert replayed.kv_held == own.kv_held
        assert torch.equal(tokens(replayed), tokens(own))


def test_hf_sdpa_skips_the_prompt_attention_whose_output_is_unused():
    """The replay's shortcut (``replay_prefill(..., skip_prompt_attention=True)``): ``hf_sdpa`` told the output is
    unused returns zeros for the prompt's own attention (queries span all keys) and the real attention for any other
    call; without the option, the real attention."""
    from types import SimpleNamespace

    from kvkit.stores.attend import hf_sdpa

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    prompt, step = hf_sdpa(module, q, k, k, None, 8**-0.5), hf_sdpa(module, q[:, :, -1:], k, k, None, 8**-0.5)
    assert torch.equal(hf_sdpa(module, q, k, k, None, 8**-0.5, output_unused=True), torch.zeros(1, 6, 4, 8))
    assert torch.equal(hf_sdpa(module, q[:, :, -1:], k, k, None, 8**-0.5, output_unused=True), step)
    assert not torch.equal(prompt, torch.zeros_like(prompt))


def test_bad_input_refused(model, tok):
    with pytest.raises(ValueError, match="--batch must be a positive integer"):
        bench.decode_bench(model, tok, [], batch=0, length=64)
    with pytest.raises(ValueError, match="nosuch"):
        bench.decode_bench(model, tok, [("nosuch", {})], batch=2, length=64)
    with pytest.raises(ValueError, match="--memory must be a positive"):
        bench.decode_bench(model, tok, [], batch=2, length=64, memory_gib=0)
    with pytest.raises(ValueError, match="--memory must be a positive"):
        bench.decode_bench(model, tok, [], batch=2, length=64, memory_gib=-1.5)
    with pytest.raises(ValueError, match="--threads must be a positive integer"):
        bench.decode_bench(model, tok, [], batch=2, length=64, threads=[0])
    with pytest.raises(ValueError, match="above the model's context"):
        bench.decode_bench(model, tok, [], batch=2, length=1020)
    with pytest.raises(ValueError, match="--memory must be positive"):
        bench.memory_fit(0, 10, 1)


def run(*argv):
    return main([str(a) for a in argv])


@pytest.mark.parametrize("argv,msg", [
    (["--batch", 0], "argument --batch: must be an integer >= 1"),
    (["--batch", -3], "argument --batch: must be an integer >= 1"),
    (["--batch", 2, "--memory", 0], "argument --memory: must be a number > 0"),
    (["--batch", 2, "--memory", -1], "argument --memory: must be a number > 0"),
    (["--batch", 2, "--add", "nosuch"], "nosuch"),
    (["--batch", 2, "--policy", "nosuch"], "nosuch"),
    (["--batch", 2, "--threads", "0"], "argument --threads: must be comma-separated integers >= 1"),
    (["--memory", 4], "give --batch B too"),
])
def test_cli_bad_input(tiny_dir, tmp_path, capsys, argv, msg):
    try:  # refused by the parser (SystemExit 2) or by the command before the model loads (2)
        code = run("bench", "--model", tiny_dir, "--lengths", "64", *argv, "--out", tmp_path / "b")
    except SystemExit as e:
        code = e.code
    assert code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_cli_batch_writes_tables(tiny_dir, tmp_path):
    out = tmp_path / "b"
    assert run("bench", "--model", tiny_dir, "--policy", "streaming", "--budget", 32, "--lengths", 96, "--batch", 2,
               "--add", "zipcache", "--threads", "1", "--rounds", 2, "--steps", 1, "--profile", "--out", out) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["batch"] == 2 and [r["label"] for r in s["rows"]] == ["full", "streaming budget=32", "zipcache"]
    assert s["git_commit"] and "command" in s
    md = (out / "summary.md").read_text()
    for want in ("Decode at batch", "byte bound", "Profile summary", "streaming budget=32"):
        assert want in md
    assert (out / "decode.csv").read_text().startswith("policy,threads,")
    assert (out / "profile.csv").exists() and not (out / "partial.json").exists()  # partial rows superseded


def test_chunked_prefill_at_batch(model, tok):
    rows = bench.with_ratios(bench.run(model, tok, "streaming", {"budget": 32}, [96], decode_tokens=1,
                                       prefill_chunk=48, batch=2, oneshot="full"))
    assert [(r["policy"], r["prefill_chunk"]) for r in rows] == [("full", 0), ("full", 48), ("streaming", 48)]
    assert all(r["batch"] == 2 for r in rows)
    by = {(r["policy"], r["prefill_chunk"]): r for r in rows}
    assert by[("full", 48)]["kv_bytes_prefill"] == by[("full", 0)]["kv_bytes_prefill"]
    assert by[("streaming", 48)]["kv_bytes_prefill"] < by[("full", 0)]["kv_bytes_prefill"]
    with pytest.raises(ValueError, match="--oneshot"):
        bench.run(model, tok, "full", {}, [64], prefill_chunk=32, oneshot="some")


def test_throughput_figure_png(result):
    png = bench.throughput_figure([result])
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
