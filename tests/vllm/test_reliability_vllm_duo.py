"""The vLLM plugin's switch is checked as ``kvkit.patch`` checks it,
a duo pattern path is a regular file of bounded size with type-checked fields, and a patched model keeps the pattern
it was patched with. No vLLM needed (``kvkit.vllm.config`` imports nothing from it): runs in the main venv."""

import copy
import dataclasses
import hashlib
import json
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

import kvkit
from kvkit import fileio
from kvkit.evals.settings import file_hashes
from kvkit.patch import is_patched
from kvkit.policies import duo as D
from kvkit.policies import duo_patterns as DP
from kvkit.policies.duo import Duo, DuoStore, PatternFile, load_pattern
from kvkit.testing import greedy, tiny_model
from kvkit.vllm import config as C

# tiny models (kvkit.testing): 3 layers, 2 KV heads
MIXED = [[1.0, 0.9], [0.1, 0.2], [0.8, 0.3]]  # sparsity 0.5: layer 0 all retrieval, layer 1 all streaming
RETRIEVAL = [[True, True], [False, False], [True, False]]
FLIPPED = [[0.1, 0.2], [1.0, 0.9], [0.3, 0.8]]
FLIPPED_RETRIEVAL = [[False, False], [True, True], [False, True]]
SMALL = dict(sparsity=0.5, sink=3, recent=8, tail=4)


def _write(path, alpha, **extra) -> bytes:
    raw = json.dumps({"format": "kvkit-duo-pattern", "alpha": alpha, **extra}).encode()
    path.write_bytes(raw)
    return raw


def _retrieval(cache) -> list:
    return [layer.retrieval for layer in cache.layers if isinstance(layer, DuoStore)]


def _vllm_config(layers=6, kv=2, extra=None):
    hf = LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv, hidden_size=256,
                     head_dim=64, vocab_size=512)
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf), additional_config=extra)


@pytest.fixture(autouse=True)
def _no_env_switch(monkeypatch):
    monkeypatch.delenv(C.ENV_VAR, raising=False)


# ---- 10: the vLLM switch ------------------------------------------------------------------------------------------
def test_vllm_reselect_layer_past_the_model_is_refused_not_dropped(monkeypatch):
    # it parses (the model is not known yet), but the engine's config names a 6-layer model: refused there
    p = C.parse_policy("tidal:reselect_layer=999")
    with pytest.raises(ValueError, match=r"reselect_layer must be in \[3, 5\] for a model with 6 layers.*got 999"):
        p.select_layers(6)  # no longer (2,): the layer and the default one silently gone
    with pytest.raises(ValueError, match=r"reselect_layer must be in \[3, 5\].*got 999.*additional_config\['kvkit'\]"):
        C.policy_from(_vllm_config(extra={"kvkit": "tidal:reselect_layer=999"}))
    monkeypatch.setenv(C.ENV_VAR, "tidal:reselect_layer=6")  # one past the last layer
    with pytest.raises(ValueError, match=r"reselect_layer.*got 6.*\$KVKIT_VLLM_POLICY"):
        C.policy_from(_vllm_config())
    monkeypatch.delenv(C.ENV_VAR)
    # kvkit.patch refuses the same value on a model of the same depth
    with pytest.raises(ValueError, match="reselect_layer must be in"):
        kvkit.patch(tiny_model("llama", num_hidden_layers=6), "tidal", reselect_layer=999)
    assert C.policy_from(_vllm_config(extra={"kvkit": "tidal:reselect_layer=5"})).select_layers(6) == (2, 5)
    assert C.policy_from(_vllm_config(extra={"kvkit": "tidal"})).select_layers(6) == (2,)  # default unchanged
    with pytest.raises(ValueError, match="quest needs at least 3 layers.*this model has 2"):
        C.policy_from(_vllm_config(layers=2, extra={"kvkit": "quest"}))  # would run as full attention


def test_vllm_dict_switch_with_two_policy_names_is_refused():
    with pytest.raises(ValueError, match=r"names two policies, 'policy': 'streaming' and 'name': 'tidal'"):
        C.parse_policy({"policy": "streaming", "name": "tidal"})
    assert C.parse_policy({"name": "tidal", "budget": 256}).name == "tidal"
    assert C.parse_policy({"policy": "tidal", "name": "Tidal"}).name == "tidal"  # the same name twice: no conflict
    with pytest.raises(ValueError, match=r"needs a 'policy' key.*\['budget'\]"):
        C.parse_policy({"budget": 256})


def test_vllm_repeated_option_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"option 'budget' is given twice .*budget=64 and budget=128"):
        C.parse_policy("streaming:budget=64,budget=128")
    monkeypatch.setenv(C.ENV_VAR, "tidal:sink=4,budget=512,sink=8")
    with pytest.raises(ValueError, match=r"given twice.*from \$KVKIT_VLLM_POLICY"):
        C.policy_from(None)


def test_vllm_unknown_option_names_the_key_and_the_policys_options():
    with pytest.raises(ValueError, match=r"unknown option 'bits' for 'streaming' \('bits' is an option of quant\); "
                                         r"streaming's options: budget, sink, free"):
        C.parse_policy("streaming:bits=8")  # used to be accepted and ignored
    with pytest.raises(ValueError, match=r"unknown option 'Budget'.*did you mean 'budget'"):
        C.parse_policy({"policy": "tidal", "Budget": 512})
    with pytest.raises(ValueError, match=r"unknown options 'budget', 'window' for 'duo'.*duo's options: sink, "
                                         r"recent, pattern, sparsity"):
        C.parse_policy("duo:budget=4,window=3")
    with pytest.raises(ValueError, match="full's options: none"):
        C.parse_policy("full:budget=3")
    for name, opts in C.POLICY_OPTIONS.items():  # every listed option is one the plugin policy's plan has
        assert set(opts) <= {f.name for f in dataclasses.fields(C.plan_class(name))}, name
    p = C.parse_policy("tidal:budget=512,reselect_layer=4,score=quest")
    assert C.parse_policy(p.spec()) == p  # spec() lists only the policy's own options


@pytest.mark.parametrize("key", ["KVKIT", "Kvkit", "kv_kit", "kvkit_policy", "kvkt"])
def test_vllm_near_miss_config_key_is_an_error_not_silence(key):
    with pytest.raises(ValueError, match=rf"additional_config has the key '{key}', not 'kvkit'.*without kvkit"):
        C.policy_from(_vllm_config(extra={key: "streaming"}))


def test_vllm_unrelated_config_keys_leave_the_plugin_off():
    assert C.policy_from(_vllm_config(extra={"other_plugin": {"x": 1}, "kv_offload": True})) is None
    assert C.policy_from(_vllm_config(extra={"kvkit": "off"})) is None


def test_vllm_switch_runs_the_transformers_policys_checks(tmp_path):
    """Values the plugin's own checks pass but kvkit's duo refuses (``kvkit.patch`` refuses them too)."""
    (tmp_path / "d").mkdir()
    for bad, why in ((tmp_path / "missing.json", "does not exist"), (tmp_path / "d", "is a directory"),
                     ("/dev/zero", "is a character device, not a regular file")):
        with pytest.raises(ValueError, match=f"kvkit.vllm: duo: pattern file .*{why}"):
            C.parse_policy(f"duo:pattern={bad}")
    bad = tmp_path / "strings.json"
    _write(bad, [["0.9", "0.1"]] * 6)
    with pytest.raises(ValueError, match=r"non-numeric value '0.9' \(a string\)"):
        C.parse_policy({"policy": "duo", "pattern": bad})
    # what needs the model: a pattern of another shape, refused when the engine's config names the model
    four = tmp_path / "four.json"
    _write(four, [[0.5, 0.5]] * 4)
    with pytest.raises(ValueError, match=r"has 4 layers x 2 KV heads, but this model \(llama\) has 6 layers"):
        C.policy_from(_vllm_config(extra={"kvkit": f"duo:pattern={four}"}))
    with pytest.raises(ValueError, match="no DuoAttention pattern ships for this model"):
        C.policy_from(_vllm_config(extra={"kvkit": "duo"}))
    assert C.parse_policy("streaming:budget=64").kvkit_policy == kvkit.registry.get_policy("streaming", budget=64)
    assert C.parse_policy("quant:bits=8").kvkit_policy is None  # plugin-only


def test_vllm_duo_pattern_is_read_once_when_parsed(tmp_path):
    path = tmp_path / "p.json"
    raw = _write(path, [[0.9, 0.1], [0.2, 0.8], [0.05, 0.03], [0.95, 0.97], [0.6, 0.4], [0.3, 0.7]])
    p = C.policy_from(_vllm_config(extra={"kvkit": f"duo:pattern={path},sparsity=0.5"}))
    assert p.pattern == str(path) and p.pattern_sha256 == hashlib.sha256(raw).hexdigest()
    cfg = _vllm_config().model_config.hf_config
    before = p.kvkit_policy.retrieval_heads(cfg).tolist()
    _write(path, [[0.0, 1.0]] * 6)
    assert p.kvkit_policy.retrieval_heads(cfg).tolist() == before


# ---- 19: pattern paths and fields -----------------------------------------------------------------------------------
def _special(tmp_path, case):
    if case == "/dev/zero":
        return "/dev/zero"
    p = tmp_path / "p.json"
    if case == "directory":
        p.mkdir()
    elif case == "fifo":
        os.mkfifo(p)
    elif case == "symlink loop":
        p.symlink_to(tmp_path / "q.json")
        (tmp_path / "q.json").symlink_to(p)
    return str(p)


@pytest.mark.parametrize("case, why", [
    ("/dev/zero", "is a character device, not a regular file"),
    ("directory", "is a directory"),
    ("fifo", "is a FIFO, not a regular file"),
    ("symlink loop", r": cannot open it \(Too many levels of symbolic links\)"),
])
def test_pattern_path_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path, case, why):
    path = _special(tmp_path, case)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"duo: pattern file {path} ?{why}") as err:
        kvkit.patch(model, "duo", pattern=path)
    assert "does not exist" not in str(err.value)
    assert not is_patched(model)
    with pytest.raises(ValueError, match=why):
        load_pattern(path)


def test_pattern_file_size_is_bounded_before_reading(tmp_path, monkeypatch):
    big = tmp_path / "big.tsv"
    size = DP.MAX_PATTERN_BYTES + 1
    with open(big, "wb") as f:  # sparse: one byte over the limit on paper, nothing on disk
        f.truncate(size)
    with pytest.raises(ValueError, match=rf"is larger than the limit of {DP.MAX_PATTERN_BYTES:,} bytes.*it has "
                                         rf"{size:,} bytes"):
        Duo(pattern=str(big))
    monkeypatch.setattr(DP, "MAX_PATTERN_BYTES", 40)
    path = tmp_path / "p.json"
    _write(path, MIXED)  # > 40 bytes
    with pytest.raises(ValueError, match="larger than the limit of 40 bytes"):
        Duo(pattern=str(path))
    with pytest.raises(ValueError, match="does not exist"):
        Duo(pattern=str(tmp_path / "nope.json"))


def test_fileio_reads_at_most_limit_plus_one_byte(tmp_path, monkeypatch):
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 100)
    assert fileio.read_file_bytes(path, "f", 100) == b"x" * 100
    reads = []
    real_read = os.read
    monkeypatch.setattr(fileio.os, "fstat", lambda fd: os.stat_result((0o100644, 0, 0, 1, 0, 0, 10, 0, 0, 0)))
    monkeypatch.setattr(fileio.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(fileio.FileReadError, match="larger than the limit of 50 bytes") as err:
        fileio.read_file_bytes(path, "f", 50)  # says 10 bytes, has 100 (a file that grows)
    assert err.value.reason == "too_large" and sum(reads) <= 51


@pytest.mark.parametrize("model, match", [
    ({"num_layers": "3"}, r"model.num_layers must be a positive integer, got '3' \(a string\)"),
    ({"num_kv_heads": True}, r"model.num_kv_heads must be a positive integer, got True \(a boolean\)"),
    ({"num_layers": 3.0}, r"model.num_layers must be a positive integer, got 3.0 \(float\)"),
    ({"num_heads": 0}, r"model.num_heads must be a positive integer, got 0"),
    ({"name": 7}, r"model.name must be a string, got 7"),
    (["tiny"], r"'model' must be an object, got a list"),
])
def test_pattern_json_model_fields_are_type_checked(tmp_path, model, match):
    path = tmp_path / "p.json"
    _write(path, MIXED, model=model)
    with pytest.raises(ValueError, match=match) as err:
        kvkit.patch(tiny_model("llama"), "duo", pattern=str(path))
    assert "but 'alpha' has" not in str(err.value) and "p.json" in str(err.value)


@pytest.mark.parametrize("alpha, extra, match", [
    ([["1", "0.9"], [0.1, 0.2], [0.8, 0.3]], {}, r"non-numeric value '1' \(a string\) at layer 0, KV head 0"),
    ([[1.0, 0.9], [0.1, True], [0.8, 0.3]], {}, r"non-numeric value True \(a boolean\) at layer 1, KV head 1"),
    ([[1.0, 0.9], [0.1, None], [0.8, 0.3]], {}, r"non-numeric value None \(null\) at layer 1, KV head 1"),
    ([[1.0, [0.9]], [0.1, 0.2], [0.8, 0.3]], {}, r"non-numeric value \[0.9\] \(a list\) at layer 0, KV head 1"),
    (MIXED, {"format": "something-else"}, r"'format' is 'something-else', expected 'kvkit-duo-pattern'"),
    (MIXED, {"version": "1"}, r"'version' must be an integer, got '1'"),
    (MIXED, {"calibration": 5}, r"'calibration' must be an object, got int"),
])
def test_pattern_json_values_are_type_checked(tmp_path, alpha, extra, match):
    path = tmp_path / "p.json"
    _write(path, alpha, **extra)
    with pytest.raises(ValueError, match=match):
        Duo(pattern=str(path))


def test_pattern_json_nested_too_deeply(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested too deeply"):
        Duo(pattern=str(path))


def test_pattern_values_in_memory_are_type_checked():
    with pytest.raises(ValueError, match=r"non-numeric value '0.5' \(a string\)"):
        Duo(pattern=[["0.5", 0.1]] * 3)
    assert Duo(pattern=torch.tensor(MIXED, dtype=torch.float64)).pattern == tuple(map(tuple, MIXED))  # tensors still fine


# ---- 7: the pattern is read when the policy is built ---------------------------------------------------------------
def test_patched_model_keeps_the_pattern_it_was_patched_with(tmp_path):
    path = tmp_path / "p.json"
    raw = _write(path, MIXED)
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    kvkit.patch(model, "duo", pattern=str(path), **SMALL)
    try:
        assert _retrieval(kvkit.KVCache(model)) == RETRIEVAL
        toks, _, _ = greedy(model, ids, 4)
        _write(path, FLIPPED)  # rewritten after the patch: the patched model does not see it
        assert _retrieval(kvkit.KVCache(model)) == RETRIEVAL
        toks2, _, cache = greedy(model, ids, 4)
        assert _retrieval(cache) == RETRIEVAL and torch.equal(toks, toks2)
        path.unlink()  # nor does it need the file any more
        assert _retrieval(kvkit.KVCache(model)) == RETRIEVAL
        pol = kvkit.patched_policy(model)
        assert pol.pattern_sha256 == hashlib.sha256(raw).hexdigest()
        assert file_hashes(pol) == {"pattern": hashlib.sha256(raw).hexdigest()}
        assert json.loads(json.dumps(pol.options()))["pattern"] == str(path)  # recorded as the path it was given
    finally:
        kvkit.unpatch(model)
    new = _write(path, FLIPPED)
    kvkit.patch(model, "duo", pattern=str(path), **SMALL)  # a new patch reads the file again
    try:
        assert _retrieval(kvkit.KVCache(model)) == FLIPPED_RETRIEVAL
        assert kvkit.patched_policy(model).pattern_sha256 == hashlib.sha256(new).hexdigest()
    finally:
        kvkit.unpatch(model)


def test_frozen_pattern_survives_replace_copy_and_pickle(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("1\t0.9\n0.1\t0.2\n0.8\t0.3\n")
    pol = Duo(pattern=path, **SMALL)  # a PathLike too
    assert isinstance(pol.pattern, PatternFile) and pol.pattern == str(path)
    path.write_text("0.1\t0.2\n1\t0.9\n0.3\t0.8\n")
    cfg = tiny_model("llama").config
    for other in (dataclasses.replace(pol, sparsity=0.5), copy.deepcopy(pol), pickle.loads(pickle.dumps(pol)),
                  kvkit.registry.get_policy("duo", **pol.options())):
        assert other.pattern_sha256 == pol.pattern_sha256
        assert other.retrieval_heads(cfg).tolist() == RETRIEVAL
    assert Duo(pattern=str(path), **SMALL).retrieval_heads(cfg).tolist() == FLIPPED_RETRIEVAL  # a new build reads


def test_pattern_sha256_of_values_and_of_the_shipped_pattern(monkeypatch):
    assert Duo(pattern=MIXED).pattern_sha256 == Duo(pattern=torch.tensor(MIXED, dtype=torch.float64)).pattern_sha256
    assert Duo(pattern=MIXED).pattern_sha256 != Duo(pattern=FLIPPED).pattern_sha256
    assert file_hashes(Duo(pattern=MIXED)) == {}  # no file: the values are the options
    from transformers import AutoConfig

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,  # Gemma-3-270m
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                               sliding_window=512, max_position_embeddings=32768, layer_types=types)
    calls = []
    real = D.read_pattern
    monkeypatch.setattr(D, "read_pattern", lambda p: calls.append(p) or real(p))
    pol = Duo(sink=16, recent=64, tail=8)
    assert pol.pattern_sha256 is None  # the shipped one depends on the model
    for _ in range(3):
        kvkit.KVCache(cfg, pol)
    assert len(calls) == 1  # read once per policy, like a given file
    shipped = D.shipped_pattern(cfg)
    assert pol.pattern_sha256_for(cfg) == hashlib.sha256(shipped.read_bytes()).hexdigest()
