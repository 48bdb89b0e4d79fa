"""sparse_decode / weighted_decode / merge_attn: Triton kernel (under
TRITON_INTERPRET=1 on CPU, for real on CUDA) vs torch reference vs fp64."""

import pytest
import torch

import kvkit.kernels as K
from kvkit.kernels import reference as R
from tests._kernel_utils import HAS_TRITON, INTERPRET, assert_flash_rule, max_err, needs_cuda, needs_triton

# (B, Hq, Hkv, N, D, K): GQA ratios 1 / 3 / 7, N not a multiple of the block, k = 1, batch > 1
SHAPES = [(2, 3, 3, 37, 16, 5), (1, 3, 1, 50, 32, 1), (2, 7, 1, 64, 8, 20), (3, 6, 2, 19, 16, 19)]


@pytest.fixture
def triton_path(monkeypatch):
    if not (HAS_TRITON and INTERPRET):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    monkeypatch.setenv("KVKIT_KERNELS", "triton")


def _inputs(B, Hq, Hkv, N, D, Kn, Tq=None, dtype=torch.bfloat16, index_mode="kv_head", seed=0, device="cpu",
            per_token=False):
    g = torch.Generator().manual_seed(seed)
    qs = (B, Hq, D) if Tq is None else (B, Hq, Tq, D)
    q = torch.randn(qs, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
    Hidx = Hkv if index_mode == "kv_head" else Hq
    ishape = (B, Hidx, Tq, Kn) if per_token else (B, Hidx, Kn)
    idx = torch.stack([torch.randperm(N, generator=g)[:Kn] for _ in range(int(torch.tensor(ishape[:-1]).prod()))])
    idx = idx.view(ishape)
    if Kn > 2:  # ragged lists: pad the tail of some lists with -1
        idx[0, 0, ..., -2:] = -1
    return q, k, v, idx.to(device)


def _truth_and_lowp(fn_ref, q, *tensors, **kw):
    truth = fn_ref(q.double(), *[t.double() if t.is_floating_point() else t for t in tensors], upcast=False, **kw)
    lowp = fn_ref(q, *tensors, upcast=False, **kw)
    return truth, lowp


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("Tq", [None, 3])
def test_sparse_decode_kernel_vs_fp64(triton_path, shape, Tq):
    B, Hq, Hkv, N, D, Kn = shape
    q, k, v, idx = _inputs(*shape, Tq=Tq)
    out, lse = K.sparse_decode(q, k, v, idx, return_lse=True, num_splits=2)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    q4 = q if Tq else q.unsqueeze(2)
    (t_out, t_lse), (r_out, _) = _truth_and_lowp(R.sparse_decode_ref, q4, k, v, idx[:, :, None], scale=D**-0.5)
    if not Tq:
        t_out, r_out, t_lse = t_out[:, :, 0], r_out[:, :, 0], t_lse[:, :, 0]
    assert_flash_rule(out, r_out, t_out, name=f"sparse {shape} Tq={Tq}")
    assert max_err(lse, t_lse) < 1e-4


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_decode_q_head_per_token_valid(triton_path, monkeypatch, splits):
    B, Hq, Hkv, N, D, Kn, Tq = 2, 6, 2, 45, 16, 40, 2
    q, k, v, idx = _inputs(B, Hq, Hkv, N, D, Kn, Tq=Tq, index_mode="q_head", per_token=True, dtype=torch.float32)
    valid = torch.tensor([30, 45])
    out, lse = K.sparse_decode(q, k, v, idx, index_mode="q_head", valid=valid, return_lse=True, num_splits=splits)
    mask = torch.arange(N)[None] < valid[:, None]
    r_out, r_lse = R.sparse_decode_ref(q.double(), k.double(), v.double(), idx, scale=D**-0.5, mask=mask,
                                       upcast=False)
    assert max_err(out, r_out) < 1e-5 and max_err(lse, r_lse) < 1e-5
    # the reference path (dispatcher with KVKIT_KERNELS=reference) agrees too
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    ref = K.sparse_decode(q, k, v, idx, index_mode="q_head", valid=valid)
    assert max_err(ref, r_out) < 1e-5


@needs_triton
def test_sparse_decode_empty_lists_and_out_of_range(triton_path):
    q, k, v, idx = _inputs(2, 4, 2, 20, 16, 6, dtype=torch.float32)
    idx[0, 1] = -1  # an all-padding list: output 0, lse -inf
    idx[1, 0, 0] = 10_000  # out of range: treated as padding (never read)
    idx[1, 0, 1] = -7
    out, lse = K.sparse_decode(q, k, v, idx, return_lse=True)
    assert torch.all(out[0, 2:] == 0) and torch.all(torch.isneginf(lse[0, 2:]))
    ref, rlse = R.sparse_decode_ref(q.unsqueeze(2), k, v, idx[:, :, None], scale=16**-0.5)
    assert max_err(out, ref[:, :, 0]) < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse[:, :, 0]))


@needs_triton
@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("Tq", [None, 2])
def test_weighted_decode(triton_path, shape, Tq):
    B, Hq, Hkv, N, D, _ = shape
    q, k, v, _ = _inputs(*shape, Tq=Tq)
    g = torch.Generator().manual_seed(3)
    lw = torch.log(torch.randint(1, 5, (B, Hkv, N), generator=g).float())
    lw[0, 0, :3] = float("-inf")  # masked keys
    out = K.weighted_decode(q, k, v, lw, num_splits=2)
    q4 = q if Tq else q.unsqueeze(2)
    (t_out, _), (r_out, _) = _truth_and_lowp(R.dense_decode_ref, q4, k, v, scale=D**-0.5, bias=lw)
    if not Tq:
        t_out, r_out = t_out[:, :, 0], r_out[:, :, 0]
    assert_flash_rule(out, r_out, t_out, name=f"weighted {shape}")


def test_weighted_log_weight_equals_duplicated_keys():
    """log(c) bias == attending to c copies of the key (the ToMe / Chelsea semantics), reference path."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    counts = torch.tensor([1, 3, 1, 2, 1])
    out = K.weighted_decode(q, k, v, counts.float().log().view(1, 1, 5))
    rep = K.weighted_decode(q, k.repeat_interleave(counts, dim=2), v.repeat_interleave(counts, dim=2))
    assert max_err(out, rep) < 1e-5


def test_merge_attn_equals_joint_attention():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
    o1, l1 = K.weighted_decode(q, k[:, :, :12], v[:, :, :12], return_lse=True)
    o2, l2 = K.weighted_decode(q, k[:, :, 12:], v[:, :, 12:], return_lse=True)
    o, lse = K.merge_attn(o1, l1, o2, l2)
    ref, rl = K.weighted_decode(q, k, v, return_lse=True)
    assert max_err(o, ref) < 1e-5 and max_err(lse, rl) < 1e-5
    # an empty part is neutral
    o3, l3 = K.merge_attn(o1, l1, torch.zeros_like(o2), torch.full_like(l2, float("-inf")))
    assert max_err(o3, o1) < 1e-6 and max_err(l3, l1) < 1e-6


def test_merge_partials_equals_joint_attention_and_ignores_empty_parts():
    """``merge_partials`` over S stacked parts (one of them empty) == attention over all their keys."""
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
    parts = [K.weighted_decode(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 7), (7, 19), (19, 30))]
    parts.append((torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], float("-inf"))))
    o, lse = K.merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref, rl = K.weighted_decode(q, k, v, return_lse=True)
    assert max_err(o, ref) < 1e-5 and max_err(lse, rl) < 1e-5
    empty, el = K.merge_partials(torch.zeros(3, 2, 4, 16), torch.full((3, 2, 4), float("-inf")))
    assert bool((empty == 0).all()) and bool(torch.isneginf(el).all())


def test_references_vs_dense_fp64():
    """Each reference (fp32 CPU path) against a dense fp64 softmax written out by hand."""
    g = torch.Generator().manual_seed(6)
    B, Hq, Hkv, N, D = 2, 6, 2, 23, 8
    q, k, v = torch.randn(B, Hq, D, generator=g), torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    kk = k.double().repeat_interleave(Hq // Hkv, 1)
    vv = v.double().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kk) / D**0.5
    uniq = torch.stack([torch.randperm(N, generator=g)[:7] for _ in range(B * Hkv)]).view(B, Hkv, 7)
    sel = torch.full_like(s, float("-inf")).scatter_(-1, uniq.repeat_interleave(Hq // Hkv, 1), 0.0)
    p = torch.softmax(s + sel, -1)
    want = torch.einsum("bhn,bhnd->bhd", p, vv)
    assert max_err(K.sparse_decode(q, k, v, uniq), want) < 1e-5
    lw = torch.randn(B, Hkv, N, generator=g)
    p = torch.softmax(s + lw.double().repeat_interleave(Hq // Hkv, 1), -1)
    assert max_err(K.weighted_decode(q, k, v, lw), torch.einsum("bhn,bhnd->bhd", p, vv)) < 1e-5
    tok = R.chunks_to_tokens(torch.tensor([[[0, 2]], [[1, -1]]]).expand(B, Hkv, 2), 8, N)
    assert tok.shape == (B, Hkv, 16) and tok[1, 0, 8:].eq(-1).all() and tok[0, 0, 15] == -1  # 23 = 2*8+7


@needs_cuda
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (28, 4), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_decode_cuda(monkeypatch, Hq, Hkv, dtype):
    B, N, D, Kn = 3, 4099, 128, 1000
    q, k, v, idx = _inputs(B, Hq, Hkv, N, D, Kn, dtype=dtype, device="cuda")
    out, lse = K.sparse_decode(q, k, v, idx, return_lse=True)
    (t_out, t_lse), (r_out, _) = _truth_and_lowp(R.sparse_decode_ref, q.unsqueeze(2), k, v, idx[:, :, None],
                                                 scale=D**-0.5)
    assert_flash_rule(out, r_out[:, :, 0], t_out[:, :, 0], atol=1e-4, name="cuda sparse")
    assert max_err(lse, t_lse[:, :, 0]) < 1e-2
    lw = torch.randn(B, Hkv, N, device="cuda")
    out = K.weighted_decode(q, k, v, lw)
    (t_out, _), (r_out, _) = _truth_and_lowp(R.dense_decode_ref, q.unsqueeze(2), k, v, scale=D**-0.5, bias=lw)
    assert_flash_rule(out, r_out[:, :, 0], t_out[:, :, 0], atol=1e-4, name="cuda weighted")
