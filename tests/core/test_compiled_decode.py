"""Static caches (``kvkit.patch(model, policy, static=True)``): a decode step compiles whole on the CPU.

For every policy with static stores: the decode step compiles with ``fullgraph=True`` (no graph break), runs many
steps (compression events included) without recompiling, and decodes the tokens the eager static step decodes
(which are the tokens of the policy's ordinary, growing cache); ``KVCache.is_compileable`` says which caches can;
``generate`` with a compile config compiles on the CPU too; crops stay exact. The ``aot_eager`` backend keeps the
compile short: dynamo's tracing (what decides graph breaks and recompiles) is the same for every backend.
"""

import importlib.util
import os

import pytest
import torch
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

import kvkit
from kvkit.cache import STATIC_POLICIES, static_policies
from kvkit.compat import cache_kw, output_cache
from kvkit.hostsync import HostSyncCounter
from kvkit.testing import greedy, left_padded_batch, policy_test_options, random_ids, tiny_model
from tests._nostatic import no_static_policy

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
STEPS = 12  # tail = 4 in the test options: three compression events


def _config(**kw):
    cc = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None, **kw)
    cc._compile_all_devices = True  # transformers' switch for compiling generate's decode step off CUDA
    return cc


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@torch.no_grad()
def _decode(model, ids, steps, step, cache=None):
    """Eager prefill into a fresh cache, then ``steps`` single-token steps through ``step``.
    Returns (tokens ``[B, steps]``, logits ``[B, V]`` per step, the prefill's first, cache)."""
    cache = kvkit.KVCache(model) if cache is None else cache
    out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
    logits, toks = [out.logits[:, -1]], []
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        toks.append(nxt)
        logits.append(step(input_ids=nxt, **cache_kw(cache), use_cache=True).logits[:, -1])
    return torch.cat(toks, 1), logits, cache


def _compiled_matches(model, ids, step, ref_toks, ref_logits, tol=1e-4):
    """``STEPS`` steps through ``step`` without recompiling: one graph, the reference tokens and logits.
    Returns the cache."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        toks, logits, cache = _decode(model, ids, STEPS, step)
    assert _graphs() == 1
    assert torch.equal(toks, ref_toks)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return cache


@pytest.mark.parametrize("policy", STATIC_POLICIES)
def test_compiled_step_equals_eager_without_recompiling(policy):
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    kvkit.patch(model, policy, **policy_test_options(policy))
    dyn_toks, _, _ = greedy(model, ids, STEPS)  # the ordinary cache
    kvkit.patch(model, policy, static=True, **policy_test_options(policy))
    try:
        ref_toks, ref_logits, cache = _decode(model, ids, STEPS, model)
        assert cache.is_compileable and cache.compile_refusal is None
        assert torch.equal(ref_toks, dyn_toks)  # static buffers keep the policy's decoding
        cache = _compiled_matches(model, ids, model.get_compiled_call(_config()), ref_toks, ref_logits)
        assert cache.get_seq_length() == ids.shape[1] + STEPS
    finally:
        kvkit.unpatch(model)


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("policy", STATIC_POLICIES)
def test_compiled_step_launches_the_fused_decode_operator(monkeypatch, policy):
    """On the Triton path (a GPU; here the interpreter, KVKIT_KERNELS=triton) a compiled static step reads its
    slots through ``torch.ops.kvkit.view_decode`` (the fused split-K kernel), not SDPA over the buffers: the
    operator is in the captured graph once per attention read, and the compiled step decodes the eager tokens."""
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    ids = random_ids(40, seed=1)
    kvkit.patch(model, policy, static=True, **policy_test_options(policy))
    ops = []

    def backend(gm, example_inputs):
        ops.append(sum(1 for n in gm.graph.nodes if n.target in (torch.ops.kvkit.view_decode,
                                                                   torch.ops.kvkit.view_decode.default)))
        return gm.forward

    try:
        ref_toks, ref_logits, _ = _decode(model, ids, STEPS, model)
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
        cc._compile_all_devices = True
        with torch._dynamo.config.patch(error_on_recompile=True):
            toks, logits, _ = _decode(model, ids, STEPS, model.get_compiled_call(cc))
        assert len(ops) == 1
        # every layer reads through the operator (duo: a streaming and a full read per layer; tidal: its full
        # layers do, its selecting layer gathers through kvkit.kernels.gather_attend)
        assert ops[0] >= (layers - 1 if policy == "tidal" else layers), ops
        assert torch.equal(toks, ref_toks)
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        kvkit.unpatch(model)


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON and not INTERPRET),
                    reason="needs a CUDA GPU, triton and TRITON_INTERPRET=0")
@pytest.mark.parametrize("policy", ["full", "snapkv", "shadowkv"])
def test_compiled_step_on_cuda_with_cuda_graphs_equals_eager(policy):
    """On a GPU: inductor + CUDA graphs (transformers' default ``reduce-overhead``) over the fused-kernel operators
    decode the eager static step's tokens, in one graph, without recompiling (fp32: no near-tie flips). ShadowKV
    keeps its values on the device (``offload=False``, its ``static_options``: a CUDA graph reads no host memory)."""
    model = tiny_model("llama").cuda()
    ids = random_ids(40, seed=1).cuda()
    opts = {**policy_test_options(policy), **kvkit.registry.policy_class(policy).static_options}
    kvkit.patch(model, policy, static=True, **opts)
    try:
        ref_toks, ref_logits, _ = _decode(model, ids, STEPS, model)
        compiled = model.get_compiled_call(CompileConfig(fullgraph=True, dynamic=False))

        def step(**kw):  # a CUDA-graph output is overwritten by the next replay: keep a copy
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(**kw)
            out.logits = out.logits.clone()
            return out

        _compiled_matches(model, ids, step, ref_toks, ref_logits, tol=1e-3)
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("opts", [dict(selection="kv_head"), dict(selection="q_head"), dict(selection="shared")],
                         ids=["kv_head", "q_head", "shared"])
def test_tidal_reuse_layers_compile(opts):
    """Five layers: full, full, selection, then reuse layers reading the selection (three layers have none)."""
    model = tiny_model("llama", num_hidden_layers=5)
    ids = random_ids(40, seed=1)
    kvkit.patch(model, "tidal", static=True, budget=8, select_layers=(2,), **opts)
    try:
        assert [layer.role for layer in kvkit.KVCache(model).layers] == ["full", "full", "select", "reuse", "reuse"]
        ref_toks, ref_logits, _ = _decode(model, ids, 8, model)
        with torch._dynamo.config.patch(error_on_recompile=True):
            toks, logits, _ = _decode(model, ids, 8, model.get_compiled_call(_config()))
        assert _graphs() == 1 and torch.equal(toks, ref_toks)
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", STATIC_POLICIES)
def test_eager_static_steps_make_no_host_sync_beyond_transformers(policy):
    """Eager single-token steps over static buffers keep the decode rule (compression events excepted)."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)

    def marks(cache):  # every store's last compression point, nested ones (duo's two halves) included
        return [o.committed for layer in cache.layers for o in (layer, *vars(layer).values())
                if hasattr(o, "committed")]

    @torch.no_grad()
    def syncs():
        cache = kvkit.KVCache(model) if kvkit.patched_policy(model) else None
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
        cache, counts = output_cache(out), []
        for _ in range(STEPS):
            nxt = out.logits[:, -1:].argmax(-1)
            before = marks(cache)
            with HostSyncCounter() as s:
                out = model(input_ids=nxt, **cache_kw(cache), use_cache=True)
            event = before != marks(cache)
            counts.append(None if event else s.count)
        return counts

    base = syncs()
    kvkit.patch(model, policy, static=True, **policy_test_options(policy))
    try:
        counts = syncs()
    finally:
        kvkit.unpatch(model)
    assert sum(c is not None for c in counts) >= STEPS // 2
    assert all(c is None or c <= b for c, b in zip(counts, base)), (counts, base)


@pytest.mark.parametrize("policy,opts", [("streaming", dict(budget=16, sink=2, tail=4)), ("tidal", dict(budget=8)),
                                         ("shadowkv", dict(budget=16, min_prompt=16))])
def test_speculative_decoding_over_a_static_cache_stays_lossless(policy, opts):
    """Verification forwards (eager, several tokens) and their rollbacks on static buffers: the self-speculative
    output is the policy's own greedy output."""
    from kvkit.speculative import generate

    model = tiny_model("llama")
    ids = random_ids(60, seed=1)
    kvkit.patch(model, policy, static=True, **opts)
    try:
        ref, _, _ = greedy(model, ids, 14)
        out = generate(model, ids, draft_policy="streaming", draft_options={"budget": 12, "sink": 2}, gamma=3,
                       max_new_tokens=14, eos_token_id=None)
        assert torch.equal(out[0, 60:], ref[0])
    finally:
        kvkit.unpatch(model)


def test_full_compiles_with_plain_torch_compile_and_crops_exactly():
    """``full`` needs no step wrapper: ``torch.compile`` of the forward itself; after compiled steps the cache's host
    lengths are re-read once, and a crop then re-decodes the same logits (speculative rollback stays exact)."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    kvkit.patch(model, "full", static=True)
    try:
        ref_toks, ref_logits, _ = _decode(model, ids, 6, model)
        fwd = torch.compile(lambda **kw: model(**kw), fullgraph=True, backend="aot_eager")
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            toks, logits, cache = _decode(model, ids, 6, fwd)
            assert torch.equal(toks, ref_toks)
            for a, b in zip(logits, ref_logits):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            cache.crop(-3)
            assert cache.get_seq_length() == ids.shape[1] + 3
            for t, ref in zip(toks[0, 3:6], logits[4:7]):
                out = fwd(input_ids=t.view(1, 1), **cache_kw(cache), use_cache=True)
                torch.testing.assert_close(out.logits[:, -1], ref, rtol=1e-5, atol=1e-5)
        assert _graphs() == 1
    finally:
        kvkit.unpatch(model)


def test_plain_torch_compile_of_a_compressing_store_fails_loudly():
    """Without the step wrapper nobody runs the compression events: the step that would overflow the static slots
    stops with a message saying what to do (a device-side check), instead of writing out of bounds."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    kvkit.patch(model, "streaming", static=True, **policy_test_options("streaming"))
    try:
        fwd = torch.compile(lambda **kw: model(**kw), fullgraph=True, backend="aot_eager")
        with pytest.raises(RuntimeError, match="get_compiled_call"):
            _decode(model, ids, 8, fwd)  # budget 16 + tail 4 slots: the 5th step has no slot
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "shadowkv"])
def test_crop_between_compiled_steps_is_exact(policy):
    model = tiny_model("llama")
    ids = random_ids(48, seed=2)
    kvkit.patch(model, policy, static=True, **policy_test_options(policy))
    try:
        step = model.get_compiled_call(_config())
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            toks, first, cache = _decode(model, ids, 3, step)
            seen = cache.get_seq_length()
            cache.crop(-2)
            assert cache.get_seq_length() == seen - 2
            for t, ref in zip(toks[0, 1:], first[2:]):
                out = step(input_ids=t.view(1, 1), **cache_kw(cache), use_cache=True)
                torch.testing.assert_close(out.logits[:, -1], ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError):
            cache.crop(-(seen + 1))
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", ["full", "streaming"])
def test_generate_with_compile_config_equals_eager_generate(policy):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch((40, 27), seed=4)
    kvkit.patch(model, policy, **policy_test_options(policy))
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    kvkit.patch(model, policy, static=True, **policy_test_options(policy))
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, compile_config=_config())
            again = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                   compile_config=_config())
        assert torch.equal(out, ref) and torch.equal(again, ref)
        assert _graphs() == 1  # compiled once, reused by the second request's new cache
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", [*kvkit.available_policies(), "nostatic"])
def test_is_compileable_says_which_caches_compile(policy):
    """Every built-in policy has a static store; ``nostatic`` (tests/_nostatic.py) stands for one that has none."""
    model = tiny_model("llama")
    with no_static_policy():
        cache = kvkit.KVCache(model, policy, **policy_test_options(policy))
        assert not cache.is_compileable  # the ordinary caches grow: transformers never auto-compiles them
        assert isinstance(cache.compile_refusal, str) and cache.compile_refusal
        if policy != "nostatic":
            assert policy in STATIC_POLICIES
            static = kvkit.KVCache(model, policy, static=True, **policy_test_options(policy))
            assert static.is_compileable and static.compile_refusal is None
        else:
            assert policy not in static_policies()
            with pytest.raises(ValueError, match="static=True.*StreamingStore"):
                kvkit.KVCache(model, policy, static=True, **policy_test_options(policy))
            with pytest.raises(ValueError, match="static=True"):
                kvkit.patch(model, policy, static=True, **policy_test_options(policy))
            assert kvkit.patched_policy(model) is None


class _StopNow(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_static_options_are_checked_and_generate_sizes_the_cache():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="max_length"):
        kvkit.patch(model, "full", max_length=64)  # a capacity without static=True
    with pytest.raises(ValueError, match="static"):
        kvkit.patch(model, "full", static="yes")
    ids = random_ids(30, seed=3)
    kvkit.patch(model, "full", static=True, max_length=512)
    try:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        layer = output_cache(out).layers[0]
        assert layer.cap() == 512 and layer.get_seq_length() == 34  # the last token is never fed back
        kvkit.patch(model, "full", static=True)
        out = model.generate(ids, max_new_tokens=300, do_sample=False, return_dict_in_generate=True,
                             stopping_criteria=StoppingCriteriaList([_StopNow()]))
        layer = output_cache(out).layers[0]
        assert layer.get_seq_length() == 30 and layer.cap() >= 330  # room for the whole request, reserved up front
    finally:
        kvkit.unpatch(model)
    assert "get_compiled_call" not in vars(model) and "generate" not in vars(model)


def test_chelsea_static_holds_its_bound_and_compiles_with_reconstruction_scores():
    """Chelsea's static store: the cluster sizes live in a static buffer too (free slots = a cluster of one), the
    capacity with a ``max_length`` is its merge bound (fewer slots than tokens), and with the reconstruction
    protection score (an extra forward after the prefill) the compiled steps still decode the eager tokens."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    opts = dict(policy_test_options("chelsea"), protect=0.25, protect_score="reconstruct")
    kvkit.patch(model, "chelsea", **opts)
    dyn_toks, _, _ = greedy(model, ids, STEPS)
    kvkit.patch(model, "chelsea", static=True, max_length=256, **opts)
    try:
        ref_toks, ref_logits, cache = _decode(model, ids, STEPS, model)
        assert torch.equal(ref_toks, dyn_toks)
        layer = cache.layers[0]
        assert layer.slots_bound() == 256 // 8 * 4 + 2 + 4 + 8 + 8  # chunks x kept + sink + window + chunk + interval
        assert layer.cap() == layer.slots_bound() < 256
        assert layer.n_merged > 0 and int(layer.size.max()) > 1  # clusters were merged (sizes above one)
        free = layer._buf["size"][:, :, layer.held():]
        assert free.numel() and bool((free == 1).all())
        cache = _compiled_matches(model, ids, model.get_compiled_call(_config()), ref_toks, ref_logits)
        assert cache.layers[0].n_merged > 0
    finally:
        kvkit.unpatch(model)


def test_zipcache_static_reads_its_slot_segments_as_one_stacked_area(monkeypatch):
    """A static ZipCache store keeps its slot segments in one stacked area per part (segment i = rows i*B..(i+1)*B)
    and reads it with one call, the queries repeated per segment: an eager step reads the area's rows of the slot
    segments written so far (its cost follows the tokens held, not the room reserved), a compiled step the whole
    area (one graph over all compression events; one ``packed_decode`` per part whatever the room). Both decode the
    dynamic cache's tokens."""
    import kvkit.stores.quantized as Q

    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    B = ids.shape[0]
    opts = dict(requant_interval=2)
    kvkit.patch(model, "zipcache", **opts)
    dyn_toks, _, _ = greedy(model, ids, STEPS)
    read = []
    real = Q.quant_decode

    def recorded(q, ks, vs, **kw):
        read.append(("base", len(ks)) if isinstance(ks, list) else ("area", q.shape[0] // B))
        return real(q, ks, vs, **kw)

    monkeypatch.setattr(Q, "quant_decode", recorded)
    kvkit.patch(model, "zipcache", static=True, max_length=ids.shape[1] + 4 * STEPS, **opts)
    try:
        toks, _, cache = _decode(model, ids, STEPS, model)
        assert torch.equal(toks, dyn_toks)
        layer = cache.layers[0]
        prompt = len(layer.segments[0].parts)
        slots = [s for s in layer.segments if s.slot]
        assert len(slots) == 2 * STEPS  # reserved for the room asked
        area = layer._area
        assert len(area) == len(slots[0].parts) and area[0][2].shape == (len(slots) * B,)
        for i, seg in enumerate(slots):  # every slot segment is a view of its rows of the area
            assert seg.parts[0][0].data.data_ptr() == area[0][0].data[i * B].data_ptr()
        # step i (0-based), every layer: the prompt's segment, then the i // 2 slot segments written before it as
        # one read of the area per part
        L = len(cache.layers)
        assert read == [c for i in range(STEPS) for _ in range(L)
                        for c in [("base", prompt)] + [("area", i // 2)] * (len(area) if i // 2 else 0)]
        assert layer._read[1][0][3] == len(slots)  # what a compiled step reads: the whole area
        ops = []

        def backend(gm, example_inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        cc = _config()
        cc.backend = backend
        toks, _, _ = _decode(model, ids, STEPS, model.get_compiled_call(cc))
        assert torch.equal(toks, dyn_toks)
        # per layer: the prompt's parts and one read of the slot area per part, not one per slot segment
        assert sum("packed_decode" in o for o in ops) == L * (prompt + len(area)), ops
    finally:
        kvkit.unpatch(model)


def test_zipcache_static_stacked_area_keeps_each_row_of_a_padded_batch():
    """Stacked slot segments of a left-padded batch of 3 rows (segment i of row b is area row i*3 + b): the static
    store decodes each row's tokens as the dynamic cache does, across several compressions and a batch reorder."""
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([40, 31, 36])
    opts = dict(requant_interval=2)
    kvkit.patch(model, "zipcache", **opts)
    dyn_toks, dyn_logits, _ = greedy(model, ids, STEPS, attention_mask=mask)
    kvkit.patch(model, "zipcache", static=True, max_length=ids.shape[1] + 4 * STEPS, **opts)
    try:
        toks, logits, cache = greedy(model, ids, STEPS, attention_mask=mask)
        assert torch.equal(toks, dyn_toks)
        for a, b in zip(logits, dyn_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        layer = cache.layers[0]
        assert layer._slots_used >= 2 and layer._area[0][2].shape[0] == 3 * len(layer._slot_segments())
        before = [n.clone() for _, _, n in layer._area]
        cache.reorder_cache(torch.tensor([2, 0, 1]))  # beam-search reorder: the area is restacked per segment
        for (_, _, n), m in zip(layer._area, before):
            assert torch.equal(n, m.view(-1, 3)[:, [2, 0, 1]].reshape(-1))
        assert layer._slot_segments()[0].parts[0][2].data_ptr() == layer._area[0][2].data_ptr()
    finally:
        kvkit.unpatch(model)


def test_zipcache_static_writes_its_segments_in_place_and_doubles_them_once():
    """ZipCache's static store: the tail is ``requant_interval`` slots, the decoded tokens' segments go to slot
    segments preallocated at the prefill for the room asked (``max_length``) and written in place (the compiled
    step keeps reading the same tensors: one graph over every compression event); bytes held count the written
    ones only. Without room asked, two slot segments are preallocated and doubled once they are used up: one
    re-trace, the eager tokens still."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    opts = dict(requant_interval=2)
    kvkit.patch(model, "zipcache", **opts)
    dyn_toks, _, _ = greedy(model, ids, STEPS)
    kvkit.patch(model, "zipcache", static=True, max_length=ids.shape[1] + STEPS, **opts)
    try:
        ref_toks, ref_logits, cache = _decode(model, ids, STEPS, model)
        assert torch.equal(ref_toks, dyn_toks)
        layer = cache.layers[0]
        slots = [s for s in layer.segments if s.slot]
        assert len(slots) == STEPS // 2 and layer.cap() == 2  # one per requant_interval of the room; the tail
        assert layer._slots_used == STEPS // 2 - 1  # the last tail waits for the next step's compression
        assert layer.nbytes() < layer.allocated_nbytes()
        before = [p.data.data_ptr() for s in slots for k, v, _ in s.parts for p in (k, v)]
        cache = _compiled_matches(model, ids, model.get_compiled_call(_config()), ref_toks, ref_logits)
        layer = cache.layers[0]
        assert [p.data.data_ptr() for s in layer.segments if s.slot for k, v, _ in s.parts for p in (k, v)] != before
        assert layer._slots_used == STEPS // 2 - 1 and len([s for s in layer.segments if s.slot]) == STEPS // 2
    finally:
        kvkit.unpatch(model)
    kvkit.patch(model, "zipcache", static=True, **opts)  # no room asked: 2 slot segments, doubled at the third
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        toks, _, cache = _decode(model, ids, STEPS, model.get_compiled_call(_config()))
        assert torch.equal(toks, ref_toks)
        assert len([s for s in cache.layers[0].segments if s.slot]) == 8
        assert _graphs() == 3  # 2 slots -> 4 -> 8: one re-trace each
    finally:
        kvkit.unpatch(model)
