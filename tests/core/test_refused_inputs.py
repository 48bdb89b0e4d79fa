"""Inputs kvkit refuses with a message that says what was wrong and what to do, before anything runs: a duo pattern
of another model, a pattern given as a safetensors checkpoint, an empty vLLM switch value, a float bit width, a
calibration file nested too deeply. (The vLLM switch is parsed without vLLM.)"""

import json

import pytest
import torch

import kvkit
from kvkit import calibration
from kvkit.testing import calibration_file, random_ids, tiny_model, tiny_options
from kvkit.vllm import config as vllm_config

#: a Qwen2-7B pattern block over an alpha of the tiny llama's shape (3 layers x 2 KV heads)
OTHER_MODEL = {"name": "Qwen/Qwen2-7B-Instruct", "model_type": "qwen2", "num_layers": 3, "num_heads": 28,
               "num_kv_heads": 2, "hidden_size": 3584}


def _pattern(path, model_block):
    path.write_text(json.dumps({"format": "kvkit-duo-pattern", "version": 1, "model": model_block,
                                "alpha": [[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]}))
    return path


@pytest.mark.parametrize("option", ["pattern", "protect_pattern"])
def test_pattern_calibrated_for_another_model_is_refused_naming_both(tmp_path, option):
    model = tiny_model("llama")
    path = _pattern(tmp_path / "qwen.json", OTHER_MODEL)
    policy, opts = ("duo", {"pattern": str(path)}) if option == "pattern" else (
        "kvzip", {"protect_heads": 0.5, "protect_pattern": str(path), **tiny_options("kvzip")})
    with pytest.raises(ValueError, match=r"calibrated for 'Qwen/Qwen2-7B-Instruct' qwen2 .*28 heads.*3584 hidden "
                                         r"size.*this model is .*llama .*4 heads.*64 hidden size.*kvkit calibrate duo"):
        kvkit.patch(model, policy, **opts)
    with pytest.raises(ValueError, match="calibrated for 'Qwen/Qwen2-7B-Instruct'"):
        kvkit.KVCache(model, policy, **opts)


def test_pattern_of_the_same_model_under_another_name_is_accepted(tmp_path):
    model = tiny_model("llama")
    mine = dict(kvkit.policies.duo.model_identity(model.config), name="/some/local/copy")
    kvkit.patch(model, "duo", pattern=str(_pattern(tmp_path / "mine.json", mine)), sparsity=0.5)
    try:
        with torch.no_grad():
            model(random_ids(12))
    finally:
        kvkit.unpatch(model)


def test_safetensors_checkpoint_as_pattern_names_the_formats_and_the_export(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "pattern.json.ckpt.pt"
    save_file({"t0": torch.ones(3, 2)}, str(path), metadata={"kvkit": "{}"})
    with pytest.raises(ValueError, match=r"safetensors file .*not a pattern; duo reads kvkit JSON patterns .*TSV.*"
                                         r"--resume.*writes the pattern"):
        kvkit.get_policy("duo", pattern=str(path))
    with pytest.raises(ValueError, match="protect_pattern: .*safetensors file"):
        kvkit.get_policy("kvzip", protect_heads=0.5, protect_pattern=str(path))
    other = tmp_path / "binary.tsv"
    other.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match="not a text file .*duo reads kvkit JSON patterns"):
        kvkit.get_policy("duo", pattern=str(other))


@pytest.mark.parametrize("spec", ["streaming:sink=", "streaming:budget=64,sink= ", {"policy": "streaming", "sink": ""}])
def test_vllm_switch_with_an_empty_value_is_refused(spec):
    with pytest.raises(ValueError, match="option 'sink' of 'streaming' has an empty value; give sink=<value>"):
        vllm_config.parse_policy(spec)
    with pytest.raises(ValueError, match="has no name"):
        vllm_config.parse_policy("streaming:=4")
    assert vllm_config.parse_policy("streaming:budget=64,sink=2").sink == 2


@pytest.mark.parametrize("option", ["key_bits", "high_bits", "low_bits"])
def test_zipcache_float_bit_width_is_refused_by_name(option):
    value = {"key_bits": 8.0, "high_bits": 4.0, "low_bits": 2.0}[option]
    with pytest.raises(ValueError, match=rf"zipcache: {option} must be .*an integer of \(2, 4, 8\).*got {value}"
                                         r" \(a float; write it as an integer\)"):
        kvkit.get_policy("zipcache", **{option: value})
    kvkit.get_policy("zipcache", **{option: int(value)})


def test_calibration_file_with_a_float_bit_width_is_refused_naming_the_file(caldir):
    model = tiny_model("llama")
    calibration_file(caldir / "tiny.json", model.config, {"zipcache": {"options": {"high_bits": 4.0, "low_bits": 2}}})
    with pytest.raises(ValueError, match=r"tiny\.json.*high_bits must be .*got 4\.0 \(a float"):
        kvkit.patch(model, "zipcache")


def test_calibration_file_nested_too_deeply_is_refused_naming_the_file(caldir):
    model = tiny_model("llama")
    (caldir / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=r"deep\.json.* is malformed: .*nested too deeply"):
        kvkit.patch(model, "zipcache")
    (caldir / "deep.json").write_text('{"a":' * 900 + "1" + "}" * 900)  # parses; checked without recursion errors
    calibration._CACHE.clear()
    with pytest.raises(ValueError, match=r"deep\.json"):
        kvkit.patch(model, "zipcache")
