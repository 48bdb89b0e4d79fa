"""lowrank_decode (ShadowKV; its reference's key step reconstruct_keys) and the scoring helpers."""

import operator

import pytest
import torch

import kvkit.kernels as K
from kvkit.kernels import reference as R
from tests._kernel_utils import assert_flash_rule, max_err, needs_cuda, needs_triton


def _factors(B, Hkv, N, D, r, dtype, g, device="cpu"):
    U = (torch.randn(B, N, r, generator=g) / r**0.5).to(device, dtype)
    SV = torch.randn(B, Hkv, r, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
    return U, SV, v


def test_reconstruct_keys_matches_transformers_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    B, Hkv, N, D, r = 2, 2, 20, 16, 6
    U, SV, _ = _factors(B, Hkv, N, D, r, torch.float32, g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.randint(0, 5000, (B, N), generator=g)
    tok = torch.arange(N).expand(B, Hkv, 1, N)
    got = R.reconstruct_keys(U, SV, tok, inv_freq, positions=pos, attention_scaling=1.5)[:, :, 0]
    k_pre = torch.einsum("bnr,bhrd->bhnd", U, SV)
    freqs = pos[:, :, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos() * 1.5, emb.sin() * 1.5
    want, _ = apply_rotary_pos_emb(k_pre, k_pre, cos, sin)
    assert max_err(got, want) < 1e-4


CASES = [  # (B, Hq, Hkv, N, D, r, cs, C, Tq, per_token, dr)
    (2, 3, 3, 37, 16, 8, 8, 3, None, False, 16),
    (1, 3, 1, 50, 32, 20, 4, 1, 2, False, 32),
    (2, 7, 1, 40, 16, 5, 8, 4, 2, True, 8),  # partial rotary (first 8 of 16 dims)
]


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pos_kind", ["positions", "offset"])
def test_lowrank_decode_kernel_vs_fp64(monkeypatch, case, pos_kind):
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    B, Hq, Hkv, N, D, r, cs, C, Tq, per_token, dr = case
    g = torch.Generator().manual_seed(N + C)
    U, SV, v = _factors(B, Hkv, N, D, r, torch.bfloat16, g)
    q = torch.randn((B, Hq, D) if Tq is None else (B, Hq, Tq, D), generator=g).bfloat16()
    nC = -(-N // cs)
    shape = (B, Hkv, Tq, C) if per_token else (B, Hkv, C)
    ids = torch.stack([torch.randperm(nC, generator=g)[:C] for _ in range(int(torch.tensor(shape[:-1]).prod()))])
    ids = ids.view(shape)
    ids[0, 0, ..., 0] = nC - 1  # the partial last chunk
    if C > 1:
        ids[-1, -1, ..., -1] = -1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dr, 2).float() / dr))
    kw = dict(positions=torch.randint(0, 100_000, (B, N), generator=g)) if pos_kind == "positions" else dict(
        position_offset=torch.arange(B) * 1000 + 7)
    out, lse = K.lowrank_decode(q, U, SV, v, ids, cs, inv_freq, attention_scaling=1.1, return_lse=True,
                                num_splits=2, **kw)
    assert out.shape == q.shape
    q4 = q if Tq else q.unsqueeze(2)
    idx = ids if per_token else ids[:, :, None]
    tok = R.chunks_to_tokens(idx, cs, N)
    args = dict(scale=D**-0.5, attention_scaling=1.1, upcast=False, **kw)
    t_out, t_lse = R.lowrank_decode_ref(q4.double(), U.double(), SV.double(), v.double(), tok, inv_freq, **args)
    r_out, _ = R.lowrank_decode_ref(q4, U, SV, v, tok, inv_freq, **args)
    if not Tq:
        t_out, r_out, t_lse = t_out[:, :, 0], r_out[:, :, 0], t_lse[:, :, 0]
    assert_flash_rule(out, r_out, t_out, name=f"lowrank {case}")
    assert max_err(lse, t_lse) < 5e-3
    # values already gathered in selection order give the same result
    vg = R._gather_rows(v, tok.long(), torch.arange(Hkv)).flatten(2, 3)
    out2 = K.lowrank_decode(q, U, SV, vg, ids, cs, inv_freq, attention_scaling=1.1, v_gathered=True, **kw)
    assert max_err(out2, out) < 1e-2


def test_lowrank_decode_with_extra_exact_keys():
    """Selected low-rank chunks + exact extra keys == one attention over the union (reference path)."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, N, D, r, cs = 1, 4, 2, 24, 16, 4, 4
    U, SV, v = _factors(B, Hkv, N, D, r, torch.float32, g)
    q = torch.randn(B, Hq, D, generator=g)
    ek, ev = torch.randn(B, Hkv, 5, D, generator=g), torch.randn(B, Hkv, 5, D, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ids = torch.tensor([[[0, 3], [5, -1]]])
    out = K.lowrank_decode(q, U, SV, v, ids, cs, inv_freq, extra_k=ek, extra_v=ev)
    tok = R.chunks_to_tokens(ids[:, :, None], cs, N)
    keys = R.reconstruct_keys(U, SV, tok, inv_freq)[:, :, 0]  # [B, Hkv, 8, D]
    vals = R._gather_rows(v, tok, torch.arange(Hkv))[:, :, 0]
    lw = torch.zeros(B, Hkv, 13)
    lw[0, 1, 4:8] = float("-inf")  # the -1 chunk of head 1
    want = K.weighted_decode(q, torch.cat([keys, ek], 2), torch.cat([vals, ev], 2), lw)
    assert max_err(out, want) < 1e-5


def test_rope_table_equals_evaluated_rope():
    """The reference with a (cos, sin) table gathers exactly the rotations it would evaluate."""
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, N, D, r, cs = 2, 6, 2, 40, 16, 5, 4
    U, SV, v = _factors(B, Hkv, N, D, r, torch.float32, g)
    q = torch.randn(B, Hq, 3, D, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # partial rotary: 8 of 16 dims
    table = R.rope_cos_sin(torch.arange(200), inv_freq, 1.2)
    ids = torch.stack([torch.randperm(N // cs, generator=g)[:4] for _ in range(B * Hkv * 3)]).view(B, Hkv, 3, 4)
    ids[0, 1, 2, -1] = -1
    for kw in (dict(position_offset=torch.tensor([3, 150])), dict(positions=torch.randint(0, 200, (B, N), generator=g))):
        want = K.lowrank_decode(q, U, SV, v, ids, cs, inv_freq, attention_scaling=1.2, **kw)
        got = K.lowrank_decode(q, U, SV, v, ids, cs, None, rope_table=table, **kw)
        assert torch.equal(got, want)


def test_scores_topk():
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, N, D, cs = 2, 6, 2, 21, 8, 4
    k = torch.randn(B, Hkv, N, D, generator=g)
    lm = torch.stack([k[:, :, i : i + cs].mean(2) for i in range(0, N, cs)], 2)  # chunk-mean landmarks
    assert lm.shape == (B, Hkv, 6, D)
    q = torch.randn(B, Hq, D, generator=g)
    s = K.chunk_scores(q, lm)
    want = torch.einsum("bhgd,bhcd->bhgc", q.view(B, Hkv, 3, D), lm).amax(2) / D**0.5
    assert max_err(s, want) < 1e-5
    sp = K.chunk_scores(q, lm, softmax=True)
    want = torch.softmax(torch.einsum("bhgd,bhcd->bhgc", q.view(B, Hkv, 3, D), lm) / D**0.5, -1).amax(2)
    assert max_err(sp, want) < 1e-6
    mask = torch.ones(B, Hkv, 6, dtype=torch.bool)
    mask[..., 4:] = False
    ids = K.topk_indices(K.chunk_scores(q, lm, chunk_mask=mask), 5, force=[0])
    assert ids.shape == (B, Hkv, 5) and (ids[..., -1] == -1).all() and (ids[..., 0] == 0).all()
    assert ((ids[..., :4] >= 0) & (ids[..., :4] < 4)).all()
    full = K.topk_indices(s, 3, sort=False)
    assert torch.equal(full, s.topk(3, -1).indices)
    # per_token: one list per query token, equal to scoring each token alone
    q3 = torch.randn(B, Hq, 3, D, generator=g)
    pt = K.chunk_scores(q3, lm, softmax=True, chunk_mask=mask, per_token=True)
    assert pt.shape == (B, Hkv, 3, 6)
    for t in range(3):
        assert max_err(pt[:, :, t], K.chunk_scores(q3[:, :, t], lm, softmax=True, chunk_mask=mask)) < 1e-6
    with pytest.raises(ValueError, match="does not fit"):
        K.chunk_scores(torch.randn(B, 5, D), lm)


@needs_cuda
def test_lowrank_decode_cuda(monkeypatch):
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, N, D, r, cs, C = 2, 32, 8, 8200, 128, 160, 8, 256
    U, SV, v = _factors(B, Hkv, N, D, r, torch.bfloat16, g, "cuda")
    q = torch.randn(B, Hq, D, generator=g).cuda().bfloat16()
    ids = torch.stack([torch.randperm(-(-N // cs), generator=g)[:C] for _ in range(B * Hkv)]).view(B, Hkv, C).cuda()
    inv_freq = (1.0 / (500000 ** (torch.arange(0, D, 2).float() / D))).cuda()
    out = K.lowrank_decode(q, U, SV, v, ids, cs, inv_freq)
    tok = R.chunks_to_tokens(ids[:, :, None], cs, N)
    t_out, _ = R.lowrank_decode_ref(q.unsqueeze(2).double(), U.double(), SV.double(), v.double(), tok, inv_freq,
                                    scale=D**-0.5, upcast=False)
    r_out, _ = R.lowrank_decode_ref(q.unsqueeze(2), U, SV, v, tok, inv_freq, scale=D**-0.5, upcast=False)
    assert_flash_rule(out, r_out[:, :, 0], t_out[:, :, 0], atol=1e-4, name="cuda lowrank")


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("rope", ["inv_freq", "table"])
def test_lowrank_decode_traced_is_one_operator_equal_to_eager(monkeypatch, kernels, rope):
    """Traced by ``torch.compile(fullgraph=True)``, :func:`kvkit.kernels.lowrank_decode` is one
    ``torch.ops.kvkit.lowrank_decode`` (Triton under the interpreter with KVKIT_KERNELS=triton, else the reference)
    whose output and lse equal the eager call's; with a rope table instead of ``inv_freq`` too."""
    monkeypatch.setenv("KVKIT_KERNELS", kernels)
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, N, D, r, cs = 2, 4, 2, 40, 16, 6, 8
    U, SV, v = _factors(B, Hkv, N, D, r, torch.float32, g)
    q = torch.randn(B, Hq, 1, D, generator=g)
    ids = torch.tensor([[[0, 3], [4, -1]], [[1, 2], [2, 0]]])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    off = torch.tensor([0, 5])
    if rope == "table":
        pos = torch.arange(N + 8).float()[:, None] * inv_freq
        emb = torch.cat([pos, pos], -1)
        kw = dict(rope_table=(emb.cos(), emb.sin()))
        inv = None if kernels == "reference" else inv_freq
    else:
        kw, inv = {}, inv_freq
    eager = K.lowrank_decode(q, U, SV, v, ids, cs, inv, position_offset=off, return_lse=True, **kw)
    ops = []

    def backend(gm, example_inputs):
        ops.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda *a: K.lowrank_decode(*a, position_offset=off, return_lse=True, **kw),
                       backend=backend, fullgraph=True)
    out, lse = fn(q, U, SV, v, ids, cs, inv)
    op = (torch.ops.kvkit.lowrank_decode, torch.ops.kvkit.lowrank_decode.default)
    assert len(ops) == 1 and sum(t in op for t in ops[0]) == 1
    assert all(t in op or t is operator.getitem for t in ops[0]), ops  # nothing else is traced
    assert max_err(out, eager[0]) < 1e-5 and max_err(lse, eager[1]) < 1e-5
    torch._dynamo.reset()
