"""``kvkit.patch(model, policy)`` without ``static``: static caches on a CUDA model, the growing cache elsewhere.

The decision is :func:`kvkit.patch.defaults.choose_static`; its device input is faked here (``device=``, or
``model_device`` patched), so the CUDA default is checked on the CPU: the patch records a static state,
``generate`` then hands transformers a static cache sized for the request, and the choice is said once.
"""

import sys
import warnings

import pytest
import torch

import kvkit
from kvkit.compat import output_cache
from kvkit.patch import defaults
from kvkit.registry import get_policy
from kvkit.state import patch_state
from kvkit.testing import policy_test_options, random_ids, tiny_model
from tests._nostatic import no_static_policy


@pytest.fixture(autouse=True)
def _unsaid(monkeypatch):
    monkeypatch.setattr(defaults, "_said", set())


def _cuda(monkeypatch):
    monkeypatch.setattr(defaults, "model_device", lambda model: torch.device("cuda", 0))


def test_cuda_model_defaults_to_static_and_says_so_once():
    model = tiny_model("llama")
    pol = get_policy("streaming", budget=16)
    with pytest.warns(defaults.StaticDefaultWarning, match="static=False"):
        assert defaults.choose_static(model, pol, None, device="cuda") is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert defaults.choose_static(model, pol, None, device="cuda:0") is True  # said once per process


def test_cpu_model_and_explicit_values_keep_their_choice():
    model = tiny_model("llama")
    pol = get_policy("full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert defaults.choose_static(model, pol, None) is False  # the model's own device: the CPU
        assert defaults.choose_static(model, pol, None, device="cpu") is False
        assert defaults.choose_static(model, pol, False, device="cuda") is False
        assert defaults.choose_static(model, pol, True, device="cpu") is True
        # a capacity without static=True is left for check_static to refuse, on every device
        assert defaults.choose_static(model, pol, None, max_length=64, device="cuda") is False


def test_cuda_default_stays_dynamic_where_no_static_cache_fits():
    with no_static_policy() as name:
        pol = get_policy(name, budget=16)
        assert "no static stores" in defaults.static_fits(tiny_model("llama"), pol)
        assert defaults.choose_static(tiny_model("llama"), pol, None, device="cuda") is False
    sliding = tiny_model("mistral")  # sliding-window layers: no static sliding store
    assert defaults.static_fits(sliding, get_policy("full")) is not None
    assert defaults.choose_static(sliding, get_policy("full"), None, device="cuda") is False
    # shadowkv offloads its values by default (a CUDA graph cannot read them): static only with offload=False
    assert "offload=False" in defaults.static_fits(tiny_model("llama"), get_policy("shadowkv"))
    assert defaults.choose_static(tiny_model("llama"), get_policy("shadowkv"), None, device="cuda") is False
    with pytest.warns(defaults.StaticDefaultWarning):
        assert defaults.choose_static(tiny_model("llama"), get_policy("shadowkv", offload=False), None,
                                      device="cuda") is True
    offloaded = tiny_model("llama")
    offloaded.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    assert defaults.choose_static(offloaded, get_policy("full"), None, device="cuda") is False


def test_model_device_is_cuda_only_when_every_parameter_is():
    assert defaults.model_device(tiny_model("llama")).type == "cpu"
    assert defaults.model_device(torch.nn.Module()).type == "cpu"


def test_patch_without_static_takes_the_static_path_on_cuda_and_generate_sizes_it(monkeypatch):
    """``kvkit.patch`` reads the device only through ``choose_static``: with it faked to CUDA the patch is static
    and ``generate`` decodes over a static cache holding the whole request, the tokens of the growing cache."""
    model = tiny_model("llama")
    ids = random_ids(30, seed=3)
    kvkit.patch(model, "streaming", budget=16)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert patch_state(model).static is False  # the CPU default
    _cuda(monkeypatch)
    with pytest.warns(defaults.StaticDefaultWarning):
        kvkit.patch(model, "streaming", budget=16)
    try:
        assert patch_state(model).static is True
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        cache = output_cache(out)
        assert cache.is_compileable and cache.layers[0].cap() >= 30 + 6
        assert torch.equal(out.sequences, ref)
    finally:
        kvkit.unpatch(model)


def test_explicit_static_false_keeps_the_growing_cache_on_cuda(monkeypatch):
    _cuda(monkeypatch)
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit choice is not announced
        kvkit.patch(model, "full", static=False)
    try:
        assert patch_state(model).static is False
        out = model.generate(random_ids(20, seed=4), max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
        assert not output_cache(out).is_compileable  # the growing cache
    finally:
        kvkit.unpatch(model)


def test_patch_routes_the_static_decision_through_choose_static(monkeypatch):
    """The one place: whatever ``choose_static`` returns is the patch's ``static`` (here True on the CPU)."""
    seen = []

    def fake(model, pol, static, max_length=None, device=None):
        seen.append((pol.name, static, max_length))
        return True

    monkeypatch.setattr(sys.modules["kvkit.patch"], "choose_static", fake)
    model = tiny_model("llama")
    kvkit.patch(model, "snapkv", **policy_test_options("snapkv"))
    try:
        assert seen == [("snapkv", None, None)] and patch_state(model).static is True
    finally:
        kvkit.unpatch(model)
