"""kvkit.kernels.decode over a DecodeView: the fused split-K Triton kernel (under TRITON_INTERPRET=1 on CPU) vs
the torch reference vs fp64; the reference vs plain softmax attention written out per (row, head); no host
synchronisation; torch.compile(fullgraph=True) on the CPU; clear errors for bad views."""

import dataclasses
import math

import pytest
import torch

import kvkit.kernels as K
from kvkit.hostsync import HostSyncCounter
from kvkit.kernels import reference as R
from tests._kernel_utils import HAS_TRITON, INTERPRET, assert_flash_rule, max_err, needs_cuda, needs_triton

B, H, CAP, D = 2, 2, 37, 32  # cap not a multiple of the block; D = 32 lets int8/int4 parts run in Triton
CASES = ["dense", "length_bh", "length_b", "index", "index_length", "pos", "pos_shared", "log_weight", "all",
         "parts", "container"]


@pytest.fixture
def triton_path(monkeypatch):
    if not (HAS_TRITON and INTERPRET):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    monkeypatch.setenv("KVKIT_KERNELS", "triton")


def _kv(g, dtype, cap=CAP, d=D, heads=H):
    return (torch.randn(B, heads, cap, d, generator=g).to(dtype), torch.randn(B, heads, cap, d, generator=g).to(dtype))


def _index(g, k=12, cap=CAP):
    idx = torch.stack([torch.randperm(cap, generator=g)[:k] for _ in range(B * H)]).view(B, H, k)
    idx[0, 0, -3:] = -1  # ragged list
    idx[0, 1, 0] = cap + 3  # out of range: reads nothing
    idx[1, 1, :] = -1  # a head that reads nothing
    return idx.to(torch.int32)


def _pos(shared=False, cap=CAP):
    pos = torch.arange(cap, dtype=torch.int32).repeat(B, 1 if shared else H, 1)
    pos[0, :, :5] = -1  # left padding
    if not shared:
        pos[1, 1, 10:15] = -1  # dead slots
    return pos


def _log_weight(g, cap=CAP):
    lw = torch.log(torch.randint(1, 5, (B, H, cap), generator=g).float())
    lw[0, 0, :4] = float("-inf")
    lw[1, 1, :] = float("-inf")  # every key hidden
    return lw


def _view(case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = _kv(g, dtype)
    if case == "dense":
        return K.DecodeView(k, v)
    if case == "length_bh":
        return K.DecodeView(k, v, length=torch.tensor([[CAP, 0], [20, 5]], dtype=torch.int32))
    if case == "length_b":
        return K.DecodeView(k, v, length=torch.tensor([25, CAP]))
    if case == "index":
        return K.DecodeView(k, v, index=_index(g).long())
    if case == "index_length":
        return K.DecodeView(k, v, index=_index(g), length=torch.tensor([[30, 10], [CAP, 0]], dtype=torch.int32))
    if case == "pos":
        return K.DecodeView(k, v, pos=_pos(), qpos=torch.tensor([30, 20]))
    if case == "pos_shared":
        return K.DecodeView(k, v, pos=_pos(shared=True), qpos=torch.tensor(25, dtype=torch.int32))
    if case == "log_weight":
        return K.DecodeView(k, v, log_weight=_log_weight(g))
    if case == "all":
        return K.DecodeView(k, v, length=torch.tensor([[33, 20], [CAP, 12]]), index=_index(g, k=20), pos=_pos(),
                            qpos=torch.tensor([31, 36], dtype=torch.int32), log_weight=_log_weight(g))
    k2, v2 = _kv(g, dtype, cap=9)
    k3, v3 = _kv(g, torch.float32, cap=21)
    if case == "parts":  # a tail, an int8-key / int4-value segment, each with its own lengths
        packed = K.PackedPart(K.quantize(k3, 8, 16, axis=-2), K.quantize(v3, 4, None, axis=-1),
                              length=torch.tensor([21, 7]))
        return K.DecodeView(k, v, length=torch.tensor([[30, 0], [CAP, 5]]),
                            parts=(K.DecodeView(k2, v2, length=torch.tensor([4, 9])), packed))
    if case == "container":  # no keys of its own; an int2 part (no Triton layout at D=32: reference fallback)
        packed = K.PackedPart(K.quantize(k3, 2, None, axis=-2), K.quantize(v3, 2, None, axis=-1))
        inner = K.DecodeView(k, v, pos=_pos(), qpos=torch.tensor([3, 36]), log_weight=_log_weight(g))
        return K.DecodeView(None, None, parts=(inner, K.DecodeView(k2, v2), packed))
    raise AssertionError(case)


def _cast(view, dtype):
    """The same view with float tensors in ``dtype`` (fp64: the ground truth's inputs)."""
    if isinstance(view, K.PackedPart):
        return view

    def f(t):
        return None if t is None else t.to(dtype)

    return dataclasses.replace(view, k=f(view.k), v=f(view.v), log_weight=f(view.log_weight),
                               parts=tuple(_cast(p, dtype) for p in view.parts))


def _to(view, device):
    """The same view (packed parts included) on ``device``."""
    def f(t):
        return None if t is None else t.to(device)

    if isinstance(view, K.PackedPart):
        def pk(p):
            return dataclasses.replace(p, data=f(p.data), scale=f(p.scale), zero=f(p.zero), prescale=f(p.prescale))

        return dataclasses.replace(view, k=pk(view.k), v=pk(view.v), length=f(view.length))
    return dataclasses.replace(view, k=f(view.k), v=f(view.v), length=f(view.length), index=f(view.index),
                               pos=f(view.pos), qpos=f(view.qpos), log_weight=f(view.log_weight),
                               parts=tuple(_to(p, device) for p in view.parts))


def _direct(q, view, scale):
    """Plain softmax attention, fp64, written out per (row, query head) with Python loops over the slots."""
    Bq, Hq, Dq = q.shape
    out = torch.zeros(Bq, Hq, Dq, dtype=torch.float64)
    lse = torch.full((Bq, Hq), float("-inf"), dtype=torch.float64)

    def keys(view, b, hq):
        rows = []
        if view.k is not None:
            Hk, cap = view.k.shape[1], view.k.shape[2]
            h = hq // (Hq // Hk)
            slots = view.index[b, h].tolist() if view.index is not None else range(cap)
            for s in slots:
                if not 0 <= s < cap:
                    continue
                if view.length is not None and s >= int(view.length[b, h] if view.length.dim() == 2 else view.length[b]):
                    continue
                if view.pos is not None:
                    p = int(view.pos[b, h if view.pos.shape[1] > 1 else 0, s])
                    qp = int(view.qpos if view.qpos.dim() == 0 else view.qpos[b])
                    if not 0 <= p <= qp:
                        continue
                w = float(view.log_weight[b, h, s]) if view.log_weight is not None else 0.0
                if w != float("-inf"):
                    rows.append((view.k[b, h, s].double(), view.v[b, h, s].double(), w))
        for part in view.parts:
            if isinstance(part, K.PackedPart):
                kd, vd = K.dequantize(part.k, torch.float64), K.dequantize(part.v, torch.float64)
                h = hq // (Hq // kd.shape[1])
                n = kd.shape[2] if part.length is None else int(part.length[b])
                rows += [(kd[b, h, s], vd[b, h, s], 0.0) for s in range(n)]
            else:
                rows += keys(part, b, hq)
        return rows

    for b in range(Bq):
        for hq in range(Hq):
            rows = keys(view, b, hq)
            if not rows:
                continue
            kk = torch.stack([r[0] for r in rows])
            vv = torch.stack([r[1] for r in rows])
            s = kk @ q[b, hq].double() * scale + torch.tensor([r[2] for r in rows], dtype=torch.float64)
            out[b, hq] = torch.softmax(s, 0) @ vv
            lse[b, hq] = torch.logsumexp(s, 0)
    return out, lse


def _assert_lse(lse, ref, tol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows without keys differ"
    fin = torch.isfinite(ref)
    assert torch.isfinite(lse[fin]).all() and max_err(lse[fin], ref[fin]) < tol


def _q(G, dtype, seed=1, d=D):
    return torch.randn(B, G * H, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- the reference -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_reference_equals_direct_softmax(monkeypatch, case):
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    view, q = _view(case, torch.float32), _q(2, torch.float32)
    out, lse = K.decode(q, view, return_lse=True)
    d_out, d_lse = _direct(q, view, D ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2]
    assert max_err(out, d_out) < 1e-5
    _assert_lse(lse, d_lse, 1e-5)
    # rows that see nothing: zeros
    assert torch.all(out[torch.isneginf(d_lse)] == 0)


def test_reference_rows_without_keys_and_4d_query(monkeypatch):
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    view = _view("length_bh", torch.float32)
    q = _q(1, torch.float32)
    out, lse = K.decode(q[:, :, None], view, return_lse=True)
    assert out.shape == (B, H, 1, D)
    assert torch.all(out[0, 1] == 0) and torch.isneginf(lse[0, 1])
    g = torch.Generator().manual_seed(2)
    empty = K.DecodeView(*_kv(g, torch.float32, cap=0))
    out, lse = K.decode(q, empty, return_lse=True)
    assert torch.all(out == 0) and torch.isneginf(lse).all()


# ---- the fused Triton kernel ------------------------------------------------------------------------------
# every view kind in bf16 (G = 2) and fp32 (G = 1); the combined kinds also at G = 4 in both dtypes
FUSED = ([(c, 2, torch.bfloat16) for c in CASES] + [(c, 1, torch.float32) for c in CASES]
         + [(c, 4, dt) for c in ("index_length", "all", "parts") for dt in (torch.float32, torch.bfloat16)])


@needs_triton
@pytest.mark.parametrize("case,G,dtype", FUSED)
def test_fused_kernel_vs_fp64(triton_path, case, G, dtype):
    view, q = _view(case, dtype, seed=G), _q(G, dtype, seed=G)
    out, lse = K.decode(q, view, return_lse=True, num_splits=2)
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    scale = D ** -0.5
    t_out, t_lse = R.decode_ref(q.double(), _cast(view, torch.float64), scale=scale, upcast=False)
    r_out, _ = R.decode_ref(q, view, scale=scale, upcast=False)
    assert_flash_rule(out, r_out, t_out, name=f"{case} G={G} {dtype}")
    _assert_lse(lse, t_lse, 1e-4)
    assert torch.all(out[torch.isneginf(t_lse)] == 0)


@needs_triton
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_fused_kernel_splits_and_odd_head_dim(triton_path, monkeypatch, splits):
    """One split writes the output itself, several go through the LSE merge; D = 24 masks the channel tile."""
    g = torch.Generator().manual_seed(5)
    k, v = _kv(g, torch.float32, cap=50, d=24)
    view = K.DecodeView(k, v, length=torch.tensor([[50, 1], [17, 33]]), index=None,
                        log_weight=torch.randn(B, H, 50, generator=g))
    q = _q(2, torch.float32, d=24)
    out, lse = K.decode(q, view, return_lse=True, num_splits=splits)
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    r_out, r_lse = K.decode(q, view, return_lse=True)
    assert max_err(out, r_out) < 1e-5 and max_err(lse, r_lse) < 1e-5


@needs_triton
def test_fused_kernel_empty_views(triton_path):
    g = torch.Generator().manual_seed(6)
    q = _q(2, torch.float32)
    for view in (K.DecodeView(*_kv(g, torch.float32, cap=0)),
                 K.DecodeView(*_kv(g, torch.float32), index=torch.zeros(B, H, 0, dtype=torch.long)),
                 K.DecodeView(*_kv(g, torch.float32), length=torch.zeros(B, dtype=torch.int32))):
        out, lse = K.decode(q, view, return_lse=True)
        assert torch.all(out == 0) and torch.isneginf(lse).all()


@needs_cuda
@pytest.mark.parametrize("case,G,dtype", FUSED)
def test_fused_kernel_cuda_vs_fp64(monkeypatch, case, G, dtype):
    """The compiled kernel on a GPU (TRITON_INTERPRET=0): the same views as above, moved to CUDA."""
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    view, q = _view(case, dtype, seed=G), _q(G, dtype, seed=G)
    scale = D ** -0.5
    t_out, t_lse = R.decode_ref(q.double(), _cast(view, torch.float64), scale=scale, upcast=False)
    r_out, _ = R.decode_ref(q, view, scale=scale, upcast=False)
    out, lse = K.decode(q.cuda(), _to(view, "cuda"), return_lse=True, num_splits=2)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == dtype
    assert_flash_rule(out.cpu(), r_out, t_out, name=f"cuda {case} G={G} {dtype}")
    tol = 1e-4 + (_packed_bf16_score_bound(q, view, scale) if dtype == torch.bfloat16 else 0.0)
    _assert_lse(lse.cpu(), t_lse, tol)


def _packed_bf16_score_bound(q, view, scale):
    """Largest score error the bf16 dots of a packed part allow (0 without packed parts). quant_attn's bf16 path
    rounds its dot operands to bf16 (relative error <= 2^-9 each): the scaled query ``q_d * s_d`` against exact
    codes (folded channel-wise keys), or q against the dequantized key ``k_d`` (other layouts); so a score moves
    by at most ``2^-9 * scale * sum_d |q_d| (|s_d code_d| + |k_d|)``, and the lse by at most its maximum. (On the
    GPU run of 2026-11-26 the bf16 'parts' cases missed a flat 1e-4 with 3.5e-4 / 8.6e-4.)"""
    bound = 0.0
    for part in view.parts:
        if not isinstance(part, K.PackedPart):
            continue
        k = K.dequantize(part.k, torch.float64)  # [B, H, N, D]
        sc_code = K.dequantize(dataclasses.replace(part.k, zero=torch.zeros_like(part.k.zero)), torch.float64)
        G = q.shape[1] // k.shape[1]
        qa = q.double().abs().view(q.shape[0], k.shape[1], G, -1)  # [B, H, G, D]
        per = torch.einsum("bhgd,bhnd->bhgn", qa, sc_code.abs() + k.abs())
        bound = max(bound, 2.0 ** -9 * scale * per.max().item())
    return bound


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_fused_kernel_cuda_long_ragged(monkeypatch, d):
    """Decode shapes (GQA 4, 16K slots, ragged lengths, default split count) on a GPU vs the fp32 reference."""
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    g = torch.Generator(device="cuda").manual_seed(d)
    b, hk, cap = 4, 8, 16384
    k = torch.randn(b, hk, cap, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, hk, cap, d, device="cuda", generator=g, dtype=torch.bfloat16)
    length = torch.tensor([cap, 1, 9000, 16001], device="cuda", dtype=torch.int32)
    lw = torch.randn(b, hk, cap, device="cuda", generator=g)
    q = torch.randn(b, 4 * hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    for view in (K.DecodeView(k, v, length=length), K.DecodeView(k, v, length=length, log_weight=lw)):
        out = K.decode(q, view)
        monkeypatch.setenv("KVKIT_KERNELS", "reference")
        ref = K.decode(q.double(), _cast(view, torch.float64))
        monkeypatch.setenv("KVKIT_KERNELS", "triton")
        torch.cuda.synchronize()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel


# ---- no host sync, compiled -------------------------------------------------------------------------------
def test_decode_makes_no_host_sync_on_cpu(monkeypatch):
    monkeypatch.delenv("KVKIT_KERNELS", raising=False)
    monkeypatch.delenv("KVKIT_DEBUG", raising=False)
    q = _q(2, torch.float32)
    for case in ("all", "parts", "container"):
        view = _view(case, torch.float32)
        with HostSyncCounter() as syncs:
            K.decode(q, view, return_lse=True)
        assert syncs.count == 0, syncs.where()
    monkeypatch.setenv("KVKIT_DEBUG", "1")  # the debug range check reads device values (and says so)
    with HostSyncCounter() as syncs:
        K.decode(q, _view("length_bh", torch.float32))
    assert syncs.count > 0


def test_compile_fullgraph_cpu_equals_eager(monkeypatch):
    monkeypatch.delenv("KVKIT_KERNELS", raising=False)
    monkeypatch.delenv("KVKIT_DEBUG", raising=False)
    torch._dynamo.reset()

    def step(q, view):
        return K.decode(q, view, return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    q = _q(2, torch.float32)
    view = _view("all", torch.float32)
    part = _view("parts", torch.float32).parts[1]
    view = dataclasses.replace(view, parts=(part,))
    with torch._inductor.config.patch(compile_threads=1):  # no pool of compile workers for one small graph
        out, lse = compiled(q, view)
    e_out, e_lse = step(q, view)
    assert max_err(out, e_out) < 1e-5
    _assert_lse(lse, e_lse, 1e-5)
    # new device values (lengths, positions, log-weights) with the same shapes: same graph, right answer
    view2 = dataclasses.replace(view, length=view.length.flip(0).contiguous(), qpos=view.qpos - 3,
                                log_weight=view.log_weight.flip(1).contiguous())
    with torch.compiler.set_stance("fail_on_recompile"):
        out2, _ = compiled(q, view2)
    assert max_err(out2, step(q, view2)[0]) < 1e-5


@pytest.mark.parametrize("case", ["parts", "container"])
def test_compiled_decode_reads_every_part_through_an_operator(triton_path, case):
    """Traced by ``torch.compile``, a view's own keys go through ``torch.ops.kvkit.view_decode`` and each packed part
    through ``torch.ops.kvkit.packed_decode`` (quant_attn's Triton kernel here; the int2 part of "container" has no
    Triton layout at D=32 and reads through the reference inside the operator), merged in the graph: the same
    read as the eager one."""
    view, q = _view(case, torch.float32, seed=2), _q(2, torch.float32, seed=2)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out, lse = torch.compile(lambda q, v: K.decode(q, v, return_lse=True), fullgraph=True, backend=backend)(q, view)
    e_out, e_lse = K.decode(q, view, return_lse=True)
    # "parts": its own keys and a nested view; "container": two nested views
    assert sum("packed_decode" in o for o in ops) == 1 and sum("view_decode" in o for o in ops) == 2, ops
    assert max_err(out, e_out) < 1e-5
    _assert_lse(lse, e_lse, 1e-5)


# ---- bad input ---------------------------------------------------------------------------------------------
class _LowRankLike:
    kind = "lowrank"


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_bad_views_clear_errors(monkeypatch, path):
    if path == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("KVKIT_KERNELS", path)
    g = torch.Generator().manual_seed(7)
    k, v = _kv(g, torch.float32)
    q = _q(2, torch.float32)
    V = K.DecodeView
    bad = [
        (q, (k, v), "DecodeView"),
        (q.half(), V(k, v), "share one dtype"),
        (q, V(k, v[:, :, :5]), "must both be"),
        (q, V(k, None), "go together"),
        (torch.randn(B, 3, D), V(k, v), "multiple of"),
        (torch.randn(B, 4, 16), V(k, v), "head_dim"),
        (torch.randn(B, 4, 2, D), V(k, v), "one query token"),
        (q, V(k, v, length=torch.ones(B, 3, dtype=torch.int32)), "length must be"),
        (q, V(k, v, length=torch.ones(B)), "length has dtype"),
        (q, V(k, v, index=torch.zeros(B, 3, 4, dtype=torch.long)), "index must be"),
        (q, V(k, v, pos=_pos()), "pos and view.qpos go together"),
        (q, V(k, v, pos=torch.zeros(B, 3, CAP, dtype=torch.int32), qpos=torch.tensor(1)), "pos must be"),
        (q, V(k, v, pos=_pos(), qpos=torch.zeros(B, 1, dtype=torch.long)), "qpos must have"),
        (q, V(k, v, log_weight=torch.zeros(B, H, CAP - 1)), "log_weight must be"),
        (q, V(None, None), "holds nothing"),
        (q, V(None, None, length=torch.ones(B, dtype=torch.int32), parts=(V(k, v),)), "needs view.k"),
        (q, V(k, v, parts=(_LowRankLike(),)), "lowrank_decode"),
        (q, V(k, v, parts=(K.quantize(k, 8),)), "cannot read"),
        (q, V(k, v, parts=(V(k[:, :1], v[:, :1]),)), "KV heads but the enclosing"),
        (q, V(k, v, parts=(K.PackedPart(K.quantize(k, 8), K.quantize(v[:, :, :9], 8)),)), "must pack the same"),
        (q, V(k, v, parts=(K.PackedPart(K.quantize(k, 8), K.quantize(v, 8), length=torch.ones(3, dtype=torch.int32)),)),
         "length must be"),
        (q, V(k.to("meta"), v.to("meta")), "move all inputs"),
    ]
    for qq, view, msg in bad:
        with pytest.raises(ValueError, match=msg):
            K.decode(qq, view)


def test_debug_range_check(monkeypatch):
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    monkeypatch.setenv("KVKIT_DEBUG", "1")
    g = torch.Generator().manual_seed(8)
    k, v = _kv(g, torch.float32)
    q = _q(1, torch.float32)
    with pytest.raises(IndexError, match="index out of range"):
        K.decode(q, K.DecodeView(k, v, index=torch.full((B, H, 2), CAP, dtype=torch.long)))
    with pytest.raises(IndexError, match="length out of range"):
        K.decode(q, K.DecodeView(k, v, length=torch.full((B,), CAP + 1)))
    out = K.decode(q, K.DecodeView(k, v, index=_index(g)[..., :3].clamp(max=CAP - 1)))
    assert math.isfinite(out.abs().sum().item())
