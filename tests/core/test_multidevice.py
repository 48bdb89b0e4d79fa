"""Models spread over several devices (accelerate's dispatch / ``device_map``): every layer's KV store lives on
that layer's device, cross-layer state (TidalDecode's selection, CAKE's budget cascade) follows the layer
that reads it, and the output equals the same policy on one device.

The CPU tests dispatch with accelerate's hooks on every module (all on "cpu") so the hook path is exercised
without a GPU. The CUDA tests (``needs_cuda``: a GPU, triton and ``TRITON_INTERPRET=0``) interleave the
decoder layers over ``cuda:0`` and ``cpu``::

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -q tests/core/test_multidevice.py
"""

import pytest
import torch

import kvkit
from kvkit.doctor import small_options
from kvkit.testing import greedy, left_padded_batch, tiny_model
from tests._kernel_utils import needs_cuda

POLICIES = kvkit.available_policies()
ARCHS = ("llama", "gemma3_text")
NEW = 8


def _model(arch: str, seed: int = 0):
    """4 decoder layers; Gemma 3 gets local/global/local/global so each device holds a global layer when the
    layers are interleaved over two devices."""
    over = dict(num_hidden_layers=4)
    if arch == "gemma3_text":
        over["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return tiny_model(arch, seed, **over)


def _options(policy: str) -> dict:
    opts = small_options(policy)
    if policy == "duo":  # one row of gates per layer of the 4-layer models
        opts["pattern"] = [[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.4, 0.6]]
    return opts


def device_map(model, devices) -> dict:
    """Decoder layer i on ``devices[i % len(devices)]``; embeddings/rotary on the first, norm and head on the last."""
    dm = {}
    for name, _ in model.model.named_children():
        if name != "layers":
            dm[f"model.{name}"] = devices[-1] if name == "norm" else devices[0]
    for i in range(model.config.num_hidden_layers):
        dm[f"model.layers.{i}"] = devices[i % len(devices)]
    dm["lm_head"] = devices[-1]
    return dm


def dispatch(model, devices):
    """accelerate's dispatch with a hook on every block; layers *run* on their device (main device cpu, so a
    "cpu" entry means execution on the CPU, not weight offload to a GPU)."""
    from accelerate import dispatch_model

    return dispatch_model(model, device_map(model, devices), main_device="cpu", force_hooks=True,
                          skip_keys="past_key_values")


def layer_device(model, i: int) -> torch.device:
    """Where decoder layer i computes (its accelerate hook's execution device, else its weights' device)."""
    layer = model.model.layers[i]
    hook = getattr(layer, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is None:
        dev = next(layer.parameters()).device
    return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")


OFF_DEVICE = {"v_off"}  # ShadowKV's value store is offloaded to the CPU on purpose


def store_tensors(store, prefix: str = ""):
    """``(name, tensor)`` of every tensor a store holds, into DuoStore's parts."""
    for name, val in vars(store).items():
        if isinstance(val, torch.Tensor):
            yield prefix + name, val
        elif name == "parts":
            for j, (sub, kv, q) in enumerate(val):
                yield f"{prefix}parts[{j}].kv_heads", kv
                yield f"{prefix}parts[{j}].q_heads", q
                yield from store_tensors(sub, f"{prefix}parts[{j}].")


def assert_on_layer_devices(model, cache):
    checked = 0
    for i, layer in enumerate(cache.layers):
        dev = layer_device(model, i)
        for name, t in store_tensors(layer):
            if name in OFF_DEVICE:
                continue
            assert t.device == dev, f"layer {i} ({type(layer).__name__}) {name} is on {t.device}, layer runs on {dev}"
            checked += 1
    assert checked > 0


def _run(model, policy, ids, mask):
    kvkit.patch(model, policy, **_options(policy))
    try:
        toks, logits, cache = greedy(model, ids, NEW, attention_mask=mask)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    finally:
        kvkit.unpatch(model)
    return toks, torch.stack(logits, 1), cache, gen


# ---- CPU: accelerate hooks on every module --------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_dispatched_model_equals_plain(arch, policy):
    ids, mask, _ = left_padded_batch((40, 27))
    plain = _model(arch)
    ref_toks, ref_logits, ref_cache, ref_gen = _run(plain, policy, ids, mask)

    model = dispatch(_model(arch), ["cpu"])
    assert hasattr(model.model.layers[0], "_hf_hook")  # the hooks really wrap the layers
    toks, logits, cache, gen = _run(model, policy, ids, mask)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert torch.equal(gen, ref_gen)
    assert cache.nbytes() == ref_cache.nbytes()
    assert_on_layer_devices(model, cache)
    with torch.no_grad():  # unpatched again: the plain model's output
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_stores_allocate_on_the_key_states_device(arch, policy):
    """A store's tensors (KV, positions, per-head index tensors) go where the incoming key states are: no
    tensor is created on a fixed device. The meta device stands in for a second device on a CPU-only machine."""
    model = _model(arch)
    cache = kvkit.KVCache(model, policy, **_options(policy))
    for layer in cache.layers:
        k = torch.empty(2, 2, 20, 16, device="meta")
        layer.update(k, torch.empty_like(k))
        tensors = list(store_tensors(layer))
        assert tensors, type(layer).__name__
        for name, t in tensors:
            assert t.device.type == "meta", f"{type(layer).__name__}.{name} was created on {t.device}"


def test_rope_fn_returns_on_the_positions_device():
    from kvkit.model_info import make_rope_fn

    model = _model("llama")
    rope = make_rope_fn(model)
    cos, sin = rope(torch.arange(5))
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1), torch.arange(5)[None])
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)
    assert cos.device == sin.device == torch.device("cpu")


# ---- CUDA: layers interleaved over cuda:0 and cpu -------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_cpu_split_equals_single_device(arch, policy):
    ids, mask, _ = left_padded_batch((40, 27))
    single = _model(arch).to("cuda")
    ref_toks, ref_logits, _, ref_gen = _run(single, policy, ids.cuda(), mask.cuda())

    model = dispatch(_model(arch), ["cuda:0", "cpu"])
    devs = {str(layer_device(model, i)) for i in range(model.config.num_hidden_layers)}
    assert devs == {"cuda:0", "cpu"}, devs
    toks, logits, cache, gen = _run(model, policy, ids, mask)
    assert torch.equal(toks.cpu(), ref_toks.cpu()), f"split {toks.tolist()} != single device {ref_toks.tolist()}"
    assert torch.equal(gen.cpu(), ref_gen.cpu())
    torch.testing.assert_close(logits.cpu(), ref_logits.cpu(), rtol=1e-3, atol=1e-3)
    assert_on_layer_devices(model, cache)


@needs_cuda
@pytest.mark.parametrize("policy", ["streaming", "duo", "tidal", "cake"])
def test_cuda_offloaded_layers_keep_kv_on_the_execution_device(policy, tmp_path):
    """``from_pretrained(device_map=...)`` with "cpu" entries offloads those layers' weights and runs them on
    the GPU: their stores must follow the key states (cuda:0), not the weights."""
    from transformers import AutoModelForCausalLM

    src = _model("llama")
    src.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map(src, ["cuda:0", "cpu"]),
                                                 dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, mask, _ = left_padded_batch((40, 27))
    toks, _, cache, _ = _run(model, policy, ids.cuda(), mask.cuda())
    ref_toks, _, _, _ = _run(src.to("cuda"), policy, ids.cuda(), mask.cuda())
    assert torch.equal(toks, ref_toks)
    for i, layer in enumerate(cache.layers):
        for name, t in store_tensors(layer):
            if name not in OFF_DEVICE:
                assert t.device.type == "cuda", f"layer {i} {name} on {t.device}"
