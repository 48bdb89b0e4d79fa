"""quantize / dequantize / packed sizes / quant_decode (Triton under TRITON_INTERPRET=1, and on CUDA)."""

import pytest
import torch

import kvkit.kernels as K
from kvkit.kernels import reference as R
from tests._kernel_utils import assert_flash_rule, max_err, needs_cuda, needs_triton

# round-trip bound: |x - deq(q(x))| <= step/2 (+ stat rounding); step = range / (2^bits - 1)
BITS = [8, 4, 2]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis,group", [(-1, None), (-1, 8), (-2, None), (-2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_bound_and_exact_size(bits, axis, group, dtype):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 37, 32, generator=g).to(dtype)
    p = K.quantize(x, bits, group, axis)
    y = K.dequantize(p)
    assert y.shape == x.shape and y.dtype == dtype
    xf = x.float()
    G = group or (32 if axis == -1 else 37)
    if axis == -1:
        xg = xf.view(2, 3, 37, 32 // G, G)
        rng = (xg.amax(-1) - xg.amin(-1)).repeat_interleave(G, -1)
    else:
        NG = -(-37 // G)
        rng = torch.stack([xf[..., i * G:(i + 1) * G, :].amax(-2) - xf[..., i * G:(i + 1) * G, :].amin(-2)
                           for i in range(NG)], -2).repeat_interleave(G, -2)[..., :37, :]
    step = rng / ((1 << bits) - 1)
    out_ulp = torch.finfo(dtype).eps * xf.abs()  # rounding of the dequantised value to dtype
    err = (y.float() - xf).abs()
    assert torch.all(err <= 0.5 * step * 1.01 + 2e-3 * rng + out_ulp + 1e-6)
    # mean error of a uniform rounding ~ step/4: a loose sanity check that it is really quantised
    assert err.mean() <= 0.35 * step.mean() + out_ulp.mean() + 1e-6
    n_stats = p.scale.numel()
    stat_bytes = 2 * n_stats * p.scale.element_size()
    assert K.packed_nbytes(p) == x.numel() * bits // 8 + stat_bytes
    assert p.data.dtype == torch.uint8 and p.data.numel() == x.numel() * bits // 8
    assert n_stats == (2 * 3 * 37 * 32 // G if axis == -1 else 2 * 3 * (-(-37 // G)) * 32)


def test_zipcache_value_prescale():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 2, 40, 16, generator=g) * torch.linspace(0.1, 20, 16)  # outlier channels
    p = K.quantize(v, 4, None, -1, channel_prescale=True)
    c = v.abs().amax(dim=-2, keepdim=True).sqrt()
    assert torch.allclose(p.prescale, c)
    y = K.dequantize(p)
    vs = v / c
    step = (vs.amax(-1, keepdim=True) - vs.amin(-1, keepdim=True)) / 15
    assert torch.all((y - v).abs() <= (0.5 * step * 1.01 + 1e-3) * c)
    assert K.packed_nbytes(p) == v.numel() // 2 + 2 * p.scale.numel() * 4 + 16 * 2 * 4


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="bits"):
        K.quantize(torch.randn(4, 8), 3)
    with pytest.raises(ValueError, match="multiple of"):
        K.quantize(torch.randn(4, 7), 4)
    with pytest.raises(ValueError, match="divide"):
        K.quantize(torch.randn(4, 8), 4, group_size=3, axis=-1)


CASES = [  # (B, Hq, Hkv, N, D, kbits, vbits, kgroup, vgroup, prescale)
    (2, 3, 3, 37, 16, 8, 8, None, None, False),
    (1, 3, 1, 50, 32, 4, 4, 16, 8, True),
    (2, 7, 1, 19, 64, 2, 2, None, 16, True),
    (1, 4, 2, 64, 64, 2, 4, 32, None, True),
    (1, 2, 2, 21, 32, 4, 8, 16, 8, False),
]


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("Tq", [None, 2])
def test_quant_decode_kernel_vs_fp64(monkeypatch, case, Tq):
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    B, Hq, Hkv, N, D, kb, vb, kg, vg, pre = case
    g = torch.Generator().manual_seed(N)
    q = torch.randn((B, Hq, D) if Tq is None else (B, Hq, Tq, D), generator=g).bfloat16()
    k = torch.randn(B, Hkv, N, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, N, D, generator=g).bfloat16()
    kp = K.quantize(k, kb, kg, axis=-2)  # keys channel-wise
    vp = K.quantize(v, vb, vg, axis=-1, channel_prescale=pre)  # values token-wise
    valid = torch.tensor([N - 5] + [N] * (B - 1))
    out, lse = K.quant_decode(q, kp, vp, valid=valid, return_lse=True, num_splits=2)
    assert out.shape == q.shape and out.dtype == q.dtype
    q4 = q if Tq else q.unsqueeze(2)
    mask = torch.arange(N)[None] < valid[:, None]
    t_out, t_lse = R.quant_decode_ref(q4.double(), kp, vp, scale=D**-0.5, mask=mask, upcast=False)
    r_out, _ = R.quant_decode_ref(q4, kp, vp, scale=D**-0.5, mask=mask, upcast=False)
    if not Tq:
        t_out, r_out, t_lse = t_out[:, :, 0], r_out[:, :, 0], t_lse[:, :, 0]
    assert_flash_rule(out, r_out, t_out, name=f"quant {case}")
    assert max_err(lse, t_lse) < 1e-4
    # and the quantised attention is close to the unquantised one (8 bit: very; 2 bit: loosely)
    exact = K.weighted_decode(q.float(), k.float(), v.float(), valid=valid)
    assert max_err(out, exact) < {8: 0.05, 4: 0.5, 2: 2.0}[min(kb, vb)]


@needs_triton
def test_quant_decode_many_query_rows_tile_over_programs(monkeypatch):
    """G x Tq = 4 x 40 = 160 query rows (a prefill chunk over packed segments) run as ceil(160 / MAX_BLOCK_M) row
    tiles, not one 256-row tile (one 4096-row tile asked an H100 for 569 KB of shared memory): same result."""
    from kvkit.kernels.quant_attn import MAX_BLOCK_M

    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    B, Hq, Hkv, Tq, N, D = 2, 8, 2, 40, 45, 32
    assert Hq // Hkv * Tq > 2 * MAX_BLOCK_M
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, Tq, D, generator=g)
    kp = K.quantize(torch.randn(B, Hkv, N, D, generator=g), 8, 16, axis=-2)
    vp = K.quantize(torch.randn(B, Hkv, N, D, generator=g), 4, None, axis=-1)
    valid = torch.tensor([N, 30])
    out, lse = K.quant_decode(q, kp, vp, valid=valid, return_lse=True, num_splits=2)
    mask = torch.arange(N)[None] < valid[:, None]
    t_out, t_lse = R.quant_decode_ref(q.double(), kp, vp, scale=D**-0.5, mask=mask, upcast=False)
    assert max_err(out, t_out) < 1e-5 and max_err(lse, t_lse) < 1e-5


def test_quant_decode_falls_back_to_reference_for_small_blocks(monkeypatch):
    """int2 with D=16 (4-channel blocks) is not a Triton shape: the dispatcher uses the reference."""
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    kp, vp = K.quantize(k, 2, axis=-2), K.quantize(v, 2)
    want, _ = R.quant_decode_ref(q.unsqueeze(2), kp, vp, scale=0.25)
    assert max_err(K.quant_decode(q, kp, vp), want[:, :, 0]) < 1e-6


def test_quant_decode_bad_input():
    q = torch.randn(1, 2, 16)
    kp = K.quantize(torch.randn(1, 2, 10, 16), 4, axis=-2)
    vp = K.quantize(torch.randn(1, 2, 12, 16), 4)
    with pytest.raises(ValueError, match="same"):
        K.quant_decode(q, kp, vp)
    with pytest.raises(ValueError, match="Packed"):
        K.quant_decode(q, kp, torch.randn(1, 2, 10, 16))
    with pytest.raises(ValueError, match="do not match"):
        K.quant_decode(torch.randn(1, 2, 8), kp, K.quantize(torch.randn(1, 2, 10, 16), 4))


@needs_cuda
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quant_decode_cuda(monkeypatch, bits):
    B, Hq, Hkv, N, D = 2, 32, 8, 5003, 128
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    kp, vp = K.quantize(k, bits, 128, axis=-2), K.quantize(v, bits, None, axis=-1, channel_prescale=True)
    out = K.quant_decode(q, kp, vp)
    t_out, _ = R.quant_decode_ref(q.unsqueeze(2).double(), kp, vp, scale=D**-0.5, upcast=False)
    r_out, _ = R.quant_decode_ref(q.unsqueeze(2), kp, vp, scale=D**-0.5, upcast=False)
    assert_flash_rule(out, r_out[:, :, 0], t_out[:, :, 0], atol=1e-4, name=f"cuda quant {bits}")


# ---- the CPU path: packed-code C kernel (kvkit/kernels/quant_cpu.py) ---------------------------------------
from kvkit.kernels import quant_cpu  # noqa: E402

needs_cpu_kernel = pytest.mark.skipif(not quant_cpu.available(), reason="no C compiler: quant_decode uses the reference")

CPU_CASES = [  # (B, Hq, Hkv, Tq, D, [(N, kbits, vbits, prescale, key group tokens or None)])
    (2, 9, 3, 1, 64, [(37, 4, 4, True, None), (50, 2, 2, True, None)]),  # the default model's shape, two groups
    (1, 4, 2, 3, 16, [(20, 4, 2, False, None), (7, 2, 8, True, None)]),  # tiny models' head_dim (4/8-byte rows)
    (2, 8, 1, 2, 128, [(33, 8, 4, True, None)]),  # 8 query rows per KV head: two row blocks
    (1, 2, 2, 1, 32, [(1, 2, 4, True, None), (16, 8, 8, False, None), (3, 4, 2, True, None)]),
    # key statistics per token group (KIVI-style; ZipCache's key_group): ragged last group, a group of 1
    (2, 9, 3, 1, 64, [(37, 4, 4, True, 16), (50, 2, 2, True, 8), (5, 4, 4, False, 1)]),
    (1, 4, 2, 3, 16, [(20, 4, 2, False, 32), (70, 8, 8, True, 64)]),
]


@needs_cpu_kernel
@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_prior", [False, True])
def test_quant_decode_cpu_kernel_matches_reference(monkeypatch, case, with_mask, with_prior):
    """Several parts in one call (one softmax over their union), optional masks and a merged prior: same
    result as the reference (dequantize each part, attend densely, merge by LSE) up to fp32 rounding."""
    B, Hq, Hkv, Tq, D, parts = case
    g = torch.Generator().manual_seed(D + len(parts))
    q = torch.randn(B, Hq, Tq, D, generator=g)
    kps, vps, valids = [], [], []
    for N, kb, vb, pre, kg in parts:
        k = torch.randn(B, Hkv, N, D, generator=g) * 3
        k[..., :: 7, :] *= 4  # outlier tokens: per-group statistics differ between groups
        v = torch.randn(B, Hkv, N, D, generator=g)
        kps.append(K.quantize(k, kb, kg, axis=-2))
        vps.append(K.quantize(v, vb, None, axis=-1, channel_prescale=pre))
        valids.append(torch.randint(0, N + 1, (B,), generator=g) if with_mask else torch.full((B,), N))
    prior = None
    if with_prior:
        prior = (torch.randn(B, Hq, Tq, D, generator=g), torch.randn(B, Hq, Tq, generator=g))
    assert all(quant_cpu.supported(k, v, D) for k, v in zip(kps, vps))
    out, lse = K.quant_decode(q, kps, vps, valid=valids, return_lse=True, prior=prior)
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    want, want_lse = K.quant_decode(q, kps, vps, valid=valids, return_lse=True, prior=prior)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert max_err(out, want) < 2e-5
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    # fp32 rounding of the log-sum-exp grows with its magnitude (|lse| reaches ~30 with the outlier keys): 2e-5
    # absolute plus ~16 fp32 ulps of the value (the C kernel and the reference sum in different orders)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=2e-6, atol=2e-5)
    # rows that see no key at all read zeros
    assert not out[~finite].any()


@needs_cpu_kernel
def test_quant_decode_cpu_kernel_bf16_and_3d_query():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 64, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 40, 64, generator=g).bfloat16(), torch.randn(1, 2, 40, 64, generator=g).bfloat16()
    kp, vp = K.quantize(k, 4, None, axis=-2), K.quantize(v, 2, None, axis=-1, channel_prescale=True)
    assert kp.scale.dtype == torch.float16  # 16-bit models keep fp16 statistics: the kernel reads them as fp32
    out = K.quant_decode(q, kp, vp)
    want, _ = R.quant_decode_ref(q.unsqueeze(2), kp, vp, scale=64**-0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert max_err(out, want[:, :, 0]) < 1e-2  # both round the fp32 result to bf16


def test_quant_decode_layouts_the_cpu_kernel_does_not_read_use_the_reference():
    """Channel-grouped value statistics (groups of 8 channels) are not the kernel's layout: reference path."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 32, generator=g)
    k, v = torch.randn(1, 1, 40, 32, generator=g), torch.randn(1, 1, 40, 32, generator=g)
    kp, vp = K.quantize(k, 4, 16, axis=-2), K.quantize(v, 4, 8, axis=-1)
    assert not quant_cpu.supported(kp, vp, 32)
    want, _ = R.quant_decode_ref(q.unsqueeze(2), kp, vp, scale=32**-0.5)
    assert max_err(K.quant_decode(q, kp, vp), want[:, :, 0]) < 1e-6


def test_quant_decode_parts_bad_input():
    kp = K.quantize(torch.randn(1, 2, 10, 16), 4, axis=-2)
    vp = K.quantize(torch.randn(1, 2, 10, 16), 4)
    with pytest.raises(ValueError, match="equal-length"):
        K.quant_decode(torch.randn(1, 2, 16), [kp, kp], [vp])
    with pytest.raises(ValueError, match="prior"):
        K.quant_decode(torch.randn(1, 2, 16), kp, vp, prior=(torch.randn(1, 2, 8), torch.randn(1, 2)))


@needs_triton
def test_quant_decode_triton_parts_and_prior_match_reference(monkeypatch):
    """The CUDA path with a list of parts and a prior: one Triton launch per part, merged by LSE."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D = 1, 4, 2, 64
    q = torch.randn(B, Hq, D, generator=g)
    kps = [K.quantize(torch.randn(B, Hkv, n, D, generator=g), b, None, axis=-2) for n, b in ((19, 4), (12, 2))]
    vps = [K.quantize(torch.randn(B, Hkv, n, D, generator=g), b, None, axis=-1, channel_prescale=True)
           for n, b in ((19, 4), (12, 2))]
    prior = (torch.randn(B, Hq, D, generator=g), torch.randn(B, Hq, generator=g))
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    out, lse = K.quant_decode(q, kps, vps, return_lse=True, prior=prior)
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    want, want_lse = K.quant_decode(q, kps, vps, return_lse=True, prior=prior)
    assert max_err(out, want) < 1e-4 and max_err(lse, want_lse) < 1e-4


def test_fp16_statistics_fall_back_to_fp32_beyond_fp16_range():
    """stat_dtype=float16 (ZipCache's default) keeps fp32 statistics for a block fp16 cannot hold, as the default
    for 16-bit inputs does; inside the range the statistics are fp16."""
    x = torch.randn(1, 1, 8, 16)
    assert K.quantize(x, 4, axis=-2, stat_dtype=torch.float16).scale.dtype == torch.float16
    big = K.quantize(x * 1e5, 4, axis=-1, stat_dtype=torch.float16)
    assert big.scale.dtype == big.zero.dtype == torch.float32
    assert max_err(K.dequantize(big, torch.float32), x * 1e5) < 1e5 * 0.5  # finite, not inf statistics
