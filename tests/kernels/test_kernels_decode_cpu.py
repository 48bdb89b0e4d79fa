"""The C kernel of ShadowKV's CPU decode (kvkit/kernels/decode_cpu.py) against the torch reference."""

import pytest
import torch

from kvkit.kernels import decode_cpu, lowrank_decode
from kvkit.kernels.reference import rope_cos_sin

needs_kernel = pytest.mark.skipif(not decode_cpu.available(), reason="no C compiler: ShadowKV keeps its torch path")


def _case(B=2, Hkv=2, G=3, N=64, r=12, D=32, k=4, chunk=4, seed=0, dr=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    U = torch.randn(B, N, r, generator=g)
    SV = torch.randn(B, Hkv, r, D, generator=g) / r ** 0.5
    v = torch.randn(B, Hkv, N, D, generator=g)
    ids = torch.stack([torch.randperm(N // chunk, generator=g)[:k] for _ in range(B * Hkv)]).view(B, Hkv, k)
    dr = D if dr is None else dr
    inv = 1.0 / (10000 ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr))
    return q, U, SV, v, ids, inv, chunk


@needs_kernel
@pytest.mark.parametrize("D,dr", [(64, None), (128, None), (32, None), (64, 32)])  # vector paths (D 64/128, full
@pytest.mark.parametrize("offset", [True, False])  # rotary) and the generic loop (other widths, partial rotary)
def test_lowrank_attn_matches_reference(D, dr, offset):
    q, U, SV, v, ids, inv, chunk = _case(D=D, dr=dr, k=5)  # 20 tokens: a 16-lane block and a tail
    B, N = U.shape[0], U.shape[1]
    ids[1, 0, -1] = -1  # a row/head with one chunk fewer
    kw = dict(position_offset=torch.tensor([3, 40])) if offset else dict(
        positions=torch.stack([torch.randperm(200)[:N].sort().values for _ in range(B)]))
    ref, ref_lse = lowrank_decode(q, U, SV, v, ids, chunk, inv, scale=0.2, return_lse=True, **kw)
    P = 300
    cos, sin = rope_cos_sin(torch.arange(P), inv, 1.0)
    h = cos.shape[-1] // 2
    tok = (ids[..., None] * chunk + torch.arange(chunk)).flatten(2)
    tok = torch.where(ids.repeat_interleave(chunk, -1) >= 0, tok, -1)
    out, lse = decode_cpu.lowrank_attn(q, U, SV, v, tok, 0.2, cos[:, :h], sin[:, :h], **kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_lowrank_attn_no_token_gives_zeros():
    q, U, SV, v, ids, inv, chunk = _case(B=1, Hkv=1)
    cos, sin = rope_cos_sin(torch.arange(80), inv, 1.0)
    h = cos.shape[-1] // 2
    tok = torch.full((1, 1, 8), -1)
    out, lse = decode_cpu.lowrank_attn(q, U, SV, v, tok, 0.2, cos[:, :h], sin[:, :h],
                                        position_offset=torch.zeros(1, dtype=torch.long))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


def test_supported_needs_fp32_cpu():
    q, U, SV, v, *_ = _case()
    assert decode_cpu.supported(q, U, SV, v)
    assert not decode_cpu.supported(q.bfloat16(), U.bfloat16(), SV.bfloat16(), v.bfloat16())


@needs_kernel
@pytest.mark.parametrize("D", [64, 32])
def test_lowrank_attn_with_exact_parts_is_one_softmax(D):
    """Exact parts (an outlier block with its own positions per head, a local window with one position row per
    batch row and a dead slot) join the rebuilt keys in one softmax: the same as the reference merged by LSE."""
    from kvkit.kernels import merge_attn
    from kvkit.stores.attend import attend_slots

    q, U, SV, v, ids, inv, chunk = _case(D=D, k=5)
    B, Hkv = SV.shape[:2]
    g = torch.Generator().manual_seed(1)
    ok_, ov = torch.randn(B, Hkv, 6, D, generator=g), torch.randn(B, Hkv, 6, D, generator=g)
    opos = torch.arange(6, dtype=torch.int32).expand(B, Hkv, 6).clone()
    opos[0, 1, 2] = -1
    buf_k, buf_v = torch.randn(B, Hkv, 12, D, generator=g), torch.randn(B, Hkv, 12, D, generator=g)
    lk, lv = buf_k[:, :, :7], buf_v[:, :, :7]  # a view into a larger buffer, as SlotStore's in-place append leaves
    lpos = torch.arange(100, 107, dtype=torch.int32).expand(B, 1, 7).clone()
    lpos[1, 0, 0] = -1
    off = torch.tensor([3, 40])
    ref, ref_lse = lowrank_decode(q, U, SV, v, ids, chunk, inv, scale=0.2, return_lse=True, position_offset=off)
    qpos = torch.tensor([200], dtype=torch.int32)
    for k, vv, p in ((ok_, ov, opos), (lk, lv, lpos)):
        o, l_ = attend_slots(q, k, vv, p, qpos, 0.2, return_lse=True)
        ref, ref_lse = merge_attn(ref, ref_lse, o.transpose(1, 2), l_)
    cos, sin = rope_cos_sin(torch.arange(300), inv, 1.0)
    h = cos.shape[-1] // 2
    tok = (ids[..., None] * chunk + torch.arange(chunk)).flatten(2)
    out, lse = decode_cpu.lowrank_attn(q, U, SV, v, tok, 0.2, cos[:, :h], sin[:, :h], position_offset=off,
                                        exact=[(ok_, ov, opos), (lk, lv, lpos)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
