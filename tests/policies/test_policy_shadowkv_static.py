"""ShadowKV's static store (``kvkit.patch(model, "shadowkv", static=True)``) and its ``offload`` option: what is
specific to it beyond tests/core/test_compiled_decode.py (which runs every static policy): the compiled step reads
the selected chunks through ``torch.ops.kvkit.lowrank_decode``, a chunked prefill compresses before the first
compiled step, a short prompt compiles as exact attention, the values may stay on the device, and a static store
on CUDA refuses offloaded values."""

import pytest
import torch
from transformers import CompileConfig

import kvkit
from kvkit.compat import cache_kw
from kvkit.policies.shadowkv import ShadowKVStore
from kvkit.testing import greedy, random_ids, tiny_model

OPTS = dict(budget=16, min_prompt=16, outliers=1)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _counting_backend(ops: list):
    """A compile backend (a function: transformers deep-copies the compile config) that appends, per graph, how
    many ``kvkit.lowrank_decode`` operators it holds."""

    def backend(gm, example_inputs):
        ops.append(sum(n.target in (torch.ops.kvkit.lowrank_decode, torch.ops.kvkit.lowrank_decode.default)
                       for n in gm.graph.nodes))
        return gm.forward

    return backend


def _compiled(model, backend):
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True
    return model.get_compiled_call(cc)


@torch.no_grad()
def _steps(model, cache, last, steps, step):
    toks, logits = [], [last]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        toks.append(nxt)
        logits.append(step(input_ids=nxt, **cache_kw(cache), use_cache=True).logits[:, -1])
    return torch.cat(toks, 1), logits


def _assert_same(toks, logits, ref_toks, ref_logits):
    """The reference tokens exactly, the logits of every step to 1e-4."""
    assert torch.equal(toks, ref_toks)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _stores(cache):
    return [layer for layer in cache.layers if isinstance(layer, ShadowKVStore)]


@pytest.mark.parametrize("prompt,compressed,landmark", [(80, True, "mean"), (80, True, "minmax"),
                                                        (12, False, "mean")],
                         ids=["compressed", "compressed-minmax", "short-prompt"])
def test_compiled_step_reads_the_chunks_through_the_lowrank_operator(prompt, compressed, landmark):
    """One graph for 10 steps; each layer's chunk read is one ``kvkit.lowrank_decode`` (none before a compression:
    a prompt of at most ``min_prompt`` tokens is read exactly); the tokens and logits of the eager static steps."""
    model = tiny_model("llama")
    ids = random_ids(prompt, seed=3)
    kvkit.patch(model, "shadowkv", static=True, landmark=landmark, **OPTS)
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            last = model(input_ids=ids, **cache_kw(cache), use_cache=True).logits[:, -1]
        ref_toks, ref_logits = _steps(model, cache, last, 10, model)
        assert all(s.compressed == compressed for s in _stores(cache)) and len(_stores(cache)) == 3
        ops = []
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            last = model(input_ids=ids, **cache_kw(cache), use_cache=True).logits[:, -1]
        with torch._dynamo.config.patch(error_on_recompile=True):
            toks, logits = _steps(model, cache, last, 10, _compiled(model, _counting_backend(ops)))
        assert ops == [3 if compressed else 0]
        _assert_same(toks, logits, ref_toks, ref_logits)
    finally:
        kvkit.unpatch(model)


def test_chunked_prefill_compresses_before_the_first_compiled_step():
    """``kvkit.prefill`` in chunks leaves the prompt exact; the step wrapper compresses it before the first
    compiled step (the first single-token step, as an eager update would), and the steps decode the eager tokens."""
    model = tiny_model("llama")
    ids = random_ids(80, seed=4)
    kvkit.patch(model, "shadowkv", static=True, **OPTS)
    try:
        cache, last = kvkit.prefill(model, ids, chunk_size=16)
        ref_toks, ref_logits = _steps(model, cache, last, 6, model)
        cache, last = kvkit.prefill(model, ids, chunk_size=16)
        assert not any(s.compressed for s in _stores(cache))
        with torch._dynamo.config.patch(error_on_recompile=True):
            toks, logits = _steps(model, cache, last, 6, _compiled(model, "aot_eager"))
        assert all(s.compressed for s in _stores(cache))
        _assert_same(toks, logits, ref_toks, ref_logits)
    finally:
        kvkit.unpatch(model)


def test_values_on_the_device_decode_the_same_and_are_counted_there():
    """``offload=False``: the same tokens and logits as the offloaded values; their bytes move from
    ``offloaded_nbytes()`` to ``nbytes()``."""
    model = tiny_model("llama")
    ids = random_ids(80, seed=5)
    runs = {}
    for offload in (True, False):
        kvkit.patch(model, "shadowkv", offload=offload, **OPTS)
        try:
            runs[offload] = greedy(model, ids, 8)
        finally:
            kvkit.unpatch(model)
    (t1, l1, c1), (t0, l0, c0) = runs[True], runs[False]
    assert torch.equal(t0, t1)
    for a, b in zip(l0, l1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert c1.offloaded_nbytes() > 0 and c0.offloaded_nbytes() == 0
    assert c0.nbytes() == c1.nbytes() + c1.offloaded_nbytes()
    assert c0.read_nbytes() == c1.read_nbytes()  # the same reads, from the device


def test_static_store_on_cuda_refuses_offloaded_values():
    model = tiny_model("llama")
    for static, offload, refused in ((True, True, True), (True, False, False), (False, True, False)):
        store = kvkit.KVCache(model, "shadowkv", static=static, offload=offload, **OPTS).layers[0]
        store.check_values_device(torch.device("cpu"))  # the CPU: one memory, never refused
        if refused:
            with pytest.raises(ValueError, match="offload=False"):
                store.check_values_device(torch.device("cuda", 0))
        else:
            store.check_values_device(torch.device("cuda", 0))


def test_offload_must_be_a_bool():
    with pytest.raises(ValueError, match="(?i)offload must be true or false"):
        kvkit.get_policy("shadowkv", offload="yes")


def test_a_static_store_of_a_declared_prompt_holds_only_the_local_window_and_the_room_to_generate():
    """Given the first forward's length (``prompt_length``, as ``generate`` and ``kvkit.prefill`` pass it), a
    static store's slots after the compression are the local window plus the tokens left to ``max_length``, not a
    ``max_length`` buffer: a compiled step then reads no more than the cache holds and less than ``full`` holds; the
    compiled steps still decode the eager tokens without a recompile. Without the length: room for the whole prompt
    and more (at least ``max_length`` slots)."""
    from kvkit.evals.gpu.compiled import compiled_read_bytes

    model = tiny_model("llama")
    n, room = 400, 16
    ids = random_ids(n, seed=6)
    kvkit.patch(model, "shadowkv", static=True, max_length=n + room, **OPTS)
    try:
        with torch.no_grad():
            ref = kvkit.KVCache(model, static=False)
            last = model(input_ids=ids, **cache_kw(ref), use_cache=True).logits[:, -1]
        ref_toks, ref_logits = _steps(model, ref, last, 10, model)
        caps = {}
        for declared in (None, n):
            with torch.no_grad():
                cache = kvkit.KVCache(model, prompt_length=declared)
                last = model(input_ids=ids, **cache_kw(cache), use_cache=True).logits[:, -1]
            stores = _stores(cache)
            assert all(s.compressed for s in stores)
            caps[declared] = {s.cap() for s in stores}
            if declared is None:
                continue
            local = (stores[0].local_chunks + 1) * stores[0].chunk - 1
            assert all(s.held() <= local for s in stores)
            held = sum(layer.nbytes() + layer.offloaded_nbytes() for layer in cache.layers)
            assert compiled_read_bytes(cache) <= held
            with torch.no_grad():
                full = kvkit.KVCache(model, "full")
                model(input_ids=ids, **cache_kw(full), use_cache=True)
            assert held < full.nbytes()
            with torch._dynamo.config.patch(error_on_recompile=True):
                toks, logits = _steps(model, cache, last, 10, _compiled(model, "aot_eager"))
            _assert_same(toks, logits, ref_toks, ref_logits)
        assert min(caps[None]) >= n + room and caps[n] == {local + room}
    finally:
        kvkit.unpatch(model)
