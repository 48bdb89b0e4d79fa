"""The transformers releases kvkit claims are the ones it runs on.

* the per-layer information is read from the config by kvkit, whatever transformers' ``get_layer_types_and_kwargs``
  returns on the installed release (absent before 5.14, one shared dict before 5.19, one dict per layer since);
* a ``KVCache`` whose layers do not match the model's decoder layers is refused with a clear error, never an
  ``IndexError`` at the first forward;
* the supported range lives in one place (``kvkit.compat.TRANSFORMERS_SUPPORTED``): the version gate reads it,
  ``pyproject.toml`` and the README state it, and the gate's error names it and the pip command.

CI runs this file in both environments (``.ci/run``: the newest and the lowest supported release).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kvkit
from kvkit.compat import (
    PYTHON_LOWEST,
    RELEASE,
    SUPPORT_STATEMENT,
    TORCH_LOWEST,
    TRANSFORMERS_LOWEST,
    TRANSFORMERS_SUPPORTED,
)
from kvkit.model_info import layer_infos, layer_types_and_windows
from kvkit.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
F, S, C = "full_attention", "sliding_attention", "chunked_attention"

#: config shape -> (model_type, config fields, the layer types, the windows): what transformers 5.24's helper gives
SHAPES = {
    "plain": ("llama", dict(num_hidden_layers=3), [F, F, F], [None] * 3),
    "mistral_sliding_window": ("mistral", dict(num_hidden_layers=3, sliding_window=24), [S, S, S], [24] * 3),
    "mistral_no_window": ("mistral", dict(num_hidden_layers=3, sliding_window=None), [F, F, F], [None] * 3),
    "layer_types_with_sliding": (
        "qwen3",
        dict(num_hidden_layers=4, layer_types=[F, S, F, S], use_sliding_window=True, sliding_window=12),
        [F, S, F, S], [None, 12, None, 12],
    ),
    "qwen2_max_window_layers": (
        "qwen2",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2),
        [F, F, S, S], [None, None, 16, 16],
    ),
    "gemma3_like": (
        "gemma3_text", dict(num_hidden_layers=7, sliding_window=8, head_dim=16), [S, S, S, S, S, F, S],
        [8, 8, 8, 8, 8, None, 8],
    ),
    "gemma2_like": ("gemma2", dict(num_hidden_layers=4, sliding_window=8, head_dim=16), [S, F, S, F], [8, None, 8, None]),
    "chunked": ("llama4_text", dict(num_hidden_layers=4, attention_chunk_size=32), [C, C, C, F], [32, 32, 32, None]),
}


def _config(model_type, fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_SMALL, **fields)


def _helper_per_layer(config):
    """transformers' own answer as ``(types, windows)`` where its helper returns one dict per layer (5.19+), else
    None (absent, or one dict shared by all layers: it cannot say which layer has which window)."""
    if RELEASE < (5, 19):  # absent before 5.14; one shared dict (and no heterogeneous configs) before 5.19
        return None
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    if not isinstance(kwargs, list):
        return None
    return list(types), [kw.get("sliding_window") for kw in kwargs]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_layer_infos_are_read_from_the_config(shape):
    model_type, fields, types, windows = SHAPES[shape]
    try:
        config = _config(model_type, fields)
    except (KeyError, ValueError) as e:  # an architecture this release does not know
        pytest.skip(f"{model_type}: {e}")
    assert layer_types_and_windows(config) == (types, windows)
    infos = layer_infos(config)
    assert len(infos) == config.num_hidden_layers == len(types)
    assert [i.layer_idx for i in infos] == list(range(len(types)))
    assert all(i.num_layers == len(types) for i in infos)
    assert [i.layer_type for i in infos] == types and [i.sliding_window for i in infos] == windows
    helper = _helper_per_layer(config)
    if helper is not None:  # the same as transformers' helper wherever it answers per layer
        assert helper == (types, windows)


def test_heterogeneous_config_reads_each_layers_own_window():
    """transformers >= 5.19: a ``per_layer_config`` gives some layers their own sliding window."""
    try:
        config = _config("mistral", dict(num_hidden_layers=4, sliding_window=None,
                                         per_layer_config={1: {"sliding_window": 8}, 3: {"sliding_window": 16}}))
    except (TypeError, ValueError) as e:
        pytest.skip(f"no heterogeneous configs in transformers {'.'.join(map(str, RELEASE))}: {e}")
    if not getattr(config, "is_heterogeneous", False):
        pytest.skip("per_layer_config is not applied by this release")
    want = ([F, S, F, S], [None, 8, None, 16])
    assert layer_types_and_windows(config) == want
    helper = _helper_per_layer(config)
    assert helper is None or helper == want


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_kvcache_has_one_layer_per_decoder_layer(arch):
    m = tiny_model(arch, num_hidden_layers=4) if arch != "gemma3_text" else tiny_model(arch)
    cache = kvkit.KVCache(m, "streaming", budget=16)
    assert len(cache.layers) == m.config.num_hidden_layers
    kvkit.patch(m, "streaming", budget=16)
    try:
        out = m(torch.randint(3, 100, (1, 12)), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert isinstance(cache, kvkit.KVCache) and len(cache.layers) == m.config.num_hidden_layers
        assert cache.get_seq_length() == 12
    finally:
        kvkit.unpatch(m)


def test_a_cache_built_for_another_model_is_refused_clearly():
    """A KVCache with fewer layers than the model: a ValueError that says so, never an IndexError."""
    from kvkit.compat import cache_kw

    small, big = tiny_model("llama", num_hidden_layers=2), tiny_model("llama", num_hidden_layers=4)
    kvkit.patch(big, "full")
    try:
        with pytest.raises(ValueError, match=r"built for another model"):
            big(torch.randint(3, 100, (1, 6)), **cache_kw(kvkit.KVCache(small)), use_cache=True)
    finally:
        kvkit.unpatch(big)


def test_kvcache_refuses_a_layer_list_that_does_not_match_the_model(monkeypatch):
    """transformers 5.14-5.18's helper made ``layer_infos`` build no layers and KVCache accepted the empty list; the
    first forward then died with an IndexError in the attention pre-hook. Any such mismatch is refused up front."""
    import kvkit.cache

    real = kvkit.cache.layer_infos
    monkeypatch.setattr(kvkit.cache, "layer_infos", lambda *a, **k: real(*a, **k)[:-1])
    m = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"2 cache layers for a model with 3 decoder layers"):
        kvkit.KVCache(m)
    monkeypatch.setattr(kvkit.cache, "layer_infos", lambda *a, **k: [])
    with pytest.raises(ValueError, match=r"0 cache layers for a model with 3 decoder layers"):
        kvkit.KVCache(m)


# ---- the supported range: one place, and what the gate says --------------------------------------------------------
def test_the_installed_release_is_inside_the_supported_range():
    from kvkit.patch import check_transformers

    check_transformers()  # the environments CI runs this file in are the range's two ends
    low, high = TRANSFORMERS_SUPPORTED
    assert TRANSFORMERS_LOWEST.startswith(low + ".")


def test_the_version_gate_reads_the_bounds_from_compat():
    from kvkit.patch import TRANSFORMERS_SUPPORTED as gate  # (``kvkit.patch`` is also the function)

    assert gate is TRANSFORMERS_SUPPORTED


def test_a_release_outside_the_range_is_refused_with_the_range_and_the_pip_command():
    from kvkit.patch import check_transformers

    low, high = TRANSFORMERS_SUPPORTED
    for v in (TRANSFORMERS_LOWEST, "5.24.0"):
        check_transformers(v)
    # releases whose per-layer helper / cache layers kvkit cannot run on, and releases not yet tested
    for v in ("5.15.1", "5.14.1", "5.13.1", "5.0.0", "4.57.6", high + ".0", "6.0.0"):
        with pytest.raises(RuntimeError) as e:
            check_transformers(v)
        msg = str(e.value)
        assert f"transformers >= {low}, < {high}" in msg and v in msg
        assert f"pip install 'transformers>={low},<{high}'" in msg


def test_pyproject_states_the_supported_range():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    low, high = TRANSFORMERS_SUPPORTED
    assert f"transformers>={low},<{high}" in deps
    torch_dep = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_dep == [f"torch>={TORCH_LOWEST}"], torch_dep
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={PYTHON_LOWEST}"


@pytest.mark.parametrize("doc", ["README.md", "docs/USAGE.md"])
def test_docs_quote_the_one_support_statement(doc):
    """Every doc states the supported versions in the words of ``kvkit.compat.SUPPORT_STATEMENT`` and no other range."""
    text = " ".join((ROOT / doc).read_text().split())
    assert SUPPORT_STATEMENT in text, f"{doc} must quote kvkit.compat.SUPPORT_STATEMENT: {SUPPORT_STATEMENT!r}"
    assert not re.search(r"transformers\s*(>=|\d+\.\d+ to)", text.replace(SUPPORT_STATEMENT, "")), \
        f"{doc} states another transformers range than kvkit.compat.SUPPORT_STATEMENT"


def test_install_low_pins_the_lowest_supported_release():
    script = (ROOT / "scripts" / "install_low.sh").read_text()
    assert f"transformers=={TRANSFORMERS_LOWEST}" in script
