"""kvkit.calibrate.duo_merge and duo_refine: patterns merged by mean gate rank; disputed heads decided on needles."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from kvkit.calibrate.duo_merge import averaged_rank, merge_alphas, merge_files
from kvkit.policies.duo import binarize
from kvkit.policies.duo_patterns import load_pattern, read_pattern, save_pattern

MODEL = {"name": "toy", "model_type": "llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "hidden_size": 8}


def test_averaged_rank_gives_ties_the_mean_of_their_ranks():
    r = averaged_rank(torch.tensor([[0.0, 0.5], [0.0, 0.0], [0.9, 0.5]]))
    # three zeros share ranks 0, 1, 2 -> 1; the two 0.5s share 3, 4 -> 3.5; 0.9 is rank 5
    assert r.tolist() == [[1.0, 3.5], [1.0, 1.0], [5.0, 3.5]]


def test_merge_follows_ranks_not_gate_scale():
    # run a ranks head (0,0) above (0,1) with tiny gates; run b ranks it below with large ones. By value, b's scale
    # would decide; by rank, the third run (which agrees with a) decides.
    a = torch.tensor([[2e-4, 1e-4], [0.9, 0.0]])
    b = torch.tensor([[0.05, 0.30], [0.9, 0.0]])
    c = torch.tensor([[0.6, 0.4], [0.9, 0.1]])
    merged = merge_alphas([a, b, c])
    assert merged[0, 0] > merged[0, 1]
    by_value = (a + b + c) / 3
    assert by_value[0, 0] < by_value[0, 1]  # the case the rank merge exists for
    assert binarize(merged, 0.5).tolist() == [[True, False], [True, False]]
    assert float(merged.min()) >= 0.0 and float(merged.max()) <= 1.0


def test_merge_keeps_the_heads_all_runs_agree_on():
    g = torch.Generator().manual_seed(0)
    base = torch.rand(6, 3, generator=g)
    runs = [base + 0.01 * torch.rand(6, 3, generator=g) for _ in range(3)]
    agreed = binarize(runs[0], 0.5) & binarize(runs[1], 0.5) & binarize(runs[2], 0.5)
    assert bool((binarize(merge_alphas(runs), 0.5) | ~agreed).all())


def test_merge_refuses_one_pattern_and_different_shapes():
    with pytest.raises(ValueError, match="at least two"):
        merge_alphas([torch.rand(2, 2)])
    with pytest.raises(ValueError, match="merge patterns of one model"):
        merge_alphas([torch.rand(2, 2), torch.rand(3, 2)])


def test_merge_files_records_sources_and_refuses_another_model(tmp_path):
    a = save_pattern(tmp_path / "a.json", [[0.9, 0.1], [0.2, 0.8]], MODEL, {"settings": {"length": 1024}})
    b = save_pattern(tmp_path / "b.json", [[0.7, 0.3], [0.6, 0.4]], MODEL, {"settings": {"length": 4096}})
    out = merge_files([a, b], tmp_path / "m.json", command="kvkit calibrate duo-merge a b --out m")
    alpha, meta = load_pattern(out)
    assert meta == MODEL
    # ranks: a = [3, 0, 1, 2] / 3, b = [3, 0, 2, 1] / 3 -> mean [1, 0, 0.5, 0.5]
    assert alpha.tolist() == [[1.0, 0.0], [0.5, 0.5]]
    cal = json.loads(out.read_text())["calibration"]
    assert [s["settings"]["length"] for s in cal["sources"]] == [1024, 4096]
    assert all(len(s["sha256"]) == 64 for s in cal["sources"]) and cal["command"].startswith("kvkit calibrate")
    other = save_pattern(tmp_path / "o.json", [[0.9, 0.1], [0.2, 0.8]], dict(MODEL, name="other"))
    with pytest.raises(ValueError, match="merge patterns of one model"):
        merge_files([a, other], tmp_path / "x.json")


def test_duo_merge_command_writes_a_pattern_duo_loads(tmp_path, capsys):
    import kvkit
    from kvkit.calibrate.cli import main_calibrate
    from kvkit.testing import tiny_model

    model = tiny_model("llama")
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    g = torch.Generator().manual_seed(1)
    paths = [save_pattern(tmp_path / f"p{i}.json", torch.rand(L, H, generator=g), {}) for i in range(3)]
    out = tmp_path / "merged.json"
    assert main_calibrate(["duo-merge", *map(str, paths), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    kvkit.patch(model, "duo", pattern=str(out), sparsity=0.5)
    try:
        ids = torch.arange(3, 40).view(1, -1)
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    finally:
        kvkit.unpatch(model)


# ---- kvkit.calibrate.duo_refine ----------------------------------------------------------------------------
def test_swing_split_fixes_the_agreed_heads_and_decides_the_rest():
    from kvkit.calibrate.duo_refine import swing_split

    # 4 layers x 2 KV heads, sparsity 0.5: each source keeps 4 heads; all keep (0,0) and (2,1)
    a = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.9], [0.7, 0.0]])  # keeps (0,0) (1,0) (2,1) (3,0)
    b = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.9], [0.0, 0.7]])  # keeps (0,0) (1,1) (2,1) (3,1)
    fixed, swing, m = swing_split([a, b], 0.5)
    assert fixed.tolist() == [[True, False], [False, False], [False, True], [False, False]]
    assert swing == [(1, 0), (1, 1), (3, 0), (3, 1)] and m == 2
    # one source: the window heads on each side of its cut
    fixed1, swing1, m1 = swing_split([a], 0.5, window=1)
    assert int(fixed1.sum()) == 3 and len(swing1) == 2 and m1 == 1
    assert (3, 0) in swing1 or (1, 0) in swing1


class _Tok:
    """Word tokenizer for the tiny models (vocab 128)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + sum(map(ord, w)) % 120 for w in text.split()] or [3]}


def test_refine_picks_the_heads_the_needles_need(monkeypatch):
    import kvkit
    from kvkit.calibrate import duo_refine, needles
    from kvkit.testing import tiny_model

    model = tiny_model("llama", num_hidden_layers=4)
    a = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.9], [0.7, 0.0]])
    b = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.9], [0.0, 0.7]])
    words = " ".join(f"w{i}" for i in range(40))
    prompt = words + " question answer"
    samples = [needles.NeedleSample(f"needle/{i}", prompt, len(words), "1234567", 0.5, 1) for i in range(2)]
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0: samples)
    needed = {(1, 1), (3, 0)}  # one from each source: no source alone keeps both
    scored = []

    def fake_score(m, tok, s, rec, question_aware=False):
        pol = kvkit.patched_policy(m)
        assert rec.tokens == 40  # the context was really prefilled and recorded
        if pol.name == "full":
            return 0.0, True
        keep = pol.retrieval_heads(m.config)
        scored.append(int(keep.sum()))
        return -sum(1.0 for lh in needed if not keep[lh]), True

    monkeypatch.setattr(needles, "answer_score", fake_score)
    alpha, ev = duo_refine.refine(model, _Tok(), [a, b], 0.5, length=64, samples=2, log=lambda m: None)
    assert binarize(alpha, 0.5).tolist() == [[True, False], [False, True], [False, True], [True, False]]
    assert {(s["layer"], s["kv_head"]) for s in ev["swing"] if s["chosen"]} == needed
    assert ev["validation"]["refined"]["mean_logprob"] == 0.0
    assert ev["validation"]["source1"]["mean_logprob"] == -1.0 and ev["validation"]["source2"]["mean_logprob"] == -1.0
    # heads kept by the scored masks: fixed 2, fixed + h 3, the validation masks 4, all - h 5, all 6
    assert sorted(set(scored)) == [2, 3, 4, 5, 6]
    assert kvkit.patched_policy(model) is None  # unpatched afterwards
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        duo_refine.refine(model, _Tok(), [a, b], 1.0, length=64, samples=2, log=lambda m: None)


def test_merge_records_the_settings_of_the_bytes_it_hashed(tmp_path, monkeypatch):
    """A source's settings and sha256 come from one read: a file rewritten after ``read_pattern`` is merged as it was
    read (its old settings beside its old hash), and the rewrite changes nothing of the merge."""
    from kvkit.calibrate import duo_merge

    meta = {"name": "m", "num_layers": 2}
    p = save_pattern(tmp_path / "a.json", torch.rand(2, 3), meta, {"settings": {"steps": 5}})
    q = save_pattern(tmp_path / "b.json", torch.rand(2, 3), meta, {"settings": "not an object"})
    t = save_pattern(tmp_path / "c.tsv", torch.rand(2, 3), meta)
    first = hashlib.sha256(p.read_bytes()).hexdigest()
    f = read_pattern(p)
    assert (f.settings, f.sha256) == ({"steps": 5}, first)
    assert read_pattern(q).settings == {} and read_pattern(t).settings == {}
    reads = [read_pattern(x) for x in (p, q, t)]
    save_pattern(p, torch.rand(2, 3), meta, {"settings": {"steps": 6}})  # rewritten after it was read
    assert pickle.loads(pickle.dumps(reads[0])).settings == {"steps": 5}
    monkeypatch.setattr(duo_merge, "read_pattern", lambda path: reads[[p, q, t].index(Path(path))])
    out = duo_merge.merge_files([p, q, t], tmp_path / "m.json")
    sources = json.loads(out.read_text())["calibration"]["sources"]
    assert [(s["sha256"], s["settings"]) for s in sources] == [
        (first, {"steps": 5}), (reads[1].sha256, {}), (reads[2].sha256, {})]


def test_refine_files_scores_on_the_model_and_records_the_sources(monkeypatch, tmp_path):
    """``refine_files`` (what ``kvkit calibrate duo-refine`` runs) reads the source files, scores on the model it is
    given, and writes the sources' model object and hashes beside the refined ranks."""
    import kvkit
    from kvkit.calibrate import duo_refine, needles
    from kvkit.testing import tiny_model

    model = tiny_model("llama", num_hidden_layers=4)
    meta = {"name": "tiny", "num_layers": 4}
    a = save_pattern(tmp_path / "a.json", torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.9], [0.7, 0.0]]), meta)
    b = save_pattern(tmp_path / "b.json", torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.9], [0.0, 0.7]]), meta)
    words = " ".join(f"w{i}" for i in range(40))
    samples = [needles.NeedleSample(f"needle/{i}", words + " question answer", len(words), "1234567", 0.5, 1)
               for i in range(2)]
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0: samples)

    def fake_score(m, tok, s, rec, question_aware=False):
        assert m is model
        pol = kvkit.patched_policy(m)
        if pol.name == "full":
            return 0.0, True
        keep = pol.retrieval_heads(m.config)
        return -sum(1.0 for lh in [(1, 1), (3, 0)] if not keep[lh]), True

    monkeypatch.setattr(needles, "answer_score", fake_score)
    out = duo_refine.refine_files(model, _Tok(), [a, b], tmp_path / "r.json", 0.5, command="cmd", length=64,
                                  samples=2, log=lambda m: None)
    alpha, got_meta = load_pattern(out)
    assert binarize(alpha, 0.5).tolist() == [[True, False], [False, True], [False, True], [True, False]]
    assert got_meta == meta
    cal = json.loads(out.read_text())["calibration"]
    assert [s["sha256"] for s in cal["sources"]] == [read_pattern(a).sha256, read_pattern(b).sha256]
    assert cal["command"] == "cmd"
