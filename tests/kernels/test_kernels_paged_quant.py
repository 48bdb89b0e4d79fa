"""Packed 4/8-bit K/V pages (kvkit.kernels.paged_quant_cpu): format, writes, the C decode kernel == the torch reference."""

import pytest
import torch

from kvkit.kernels import paged_quant_cpu as PQ


def _cache(blocks, H, bs, D, bits, dtype=torch.uint8, layers=1):
    """A vLLM-like layer view [blocks, H, bs, C / elem] into a shared int8 buffer (layer stride between blocks)."""
    C = PQ.state_bytes(D, bits, bs)
    buf = torch.zeros(layers * blocks * H * bs * C, dtype=torch.int8)
    # layer-outermost: the layer's view starts at layer 1 when there are several (non-zero storage offset)
    off = (layers - 1) * blocks * H * bs * C
    view = torch.as_strided(buf, (blocks, H, bs, C), (H * bs * C, bs * C, C, 1), off)
    return view.view(dtype)


def _fill(cache, H, D, bs, bits, seqs, blocks, seed=0, outlier=True):
    """Write random K/V for rows of ``seqs`` tokens into shuffled blocks; returns (block table, exact K, V per row)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(blocks, generator=g)
    nbs = [(s + bs - 1) // bs for s in seqs]
    width = max(nbs)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    used, exact = 0, []
    for i, (s, nb) in enumerate(zip(seqs, nbs)):
        bt[i, :nb] = perm[used: used + nb].to(torch.int32)
        used += nb
        k = torch.randn(s, H, D, generator=g)
        if outlier:
            k[..., 3] *= 8  # an outlier channel, as RoPE'd keys have
        v = torch.randn(s, H, D, generator=g)
        pos = torch.arange(s)
        slots = bt[i].long()[pos // bs] * bs + pos % bs
        # write in uneven chunks (prefill chunk, then decode tokens), as the engine does
        cut = max(1, s - 3)
        for a, b in ((0, cut), *((t, t + 1) for t in range(cut, s))):
            PQ.write(cache, k[a:b].to(torch.bfloat16), v[a:b].to(torch.bfloat16), slots[a:b], bs, bits)
        exact.append((k, v))
    return bt, exact


def test_page_bytes_and_capacity_ratio():
    # per token and head: codes + 4 fp16 token statistics + the block's fp16 key channel scale (2D bytes / bs tokens)
    assert PQ.state_bytes(64, 4, 128) == 73 and PQ.state_bytes(128, 4, 128) == 138 and PQ.state_bytes(64, 8, 128) == 137
    assert PQ.state_bytes(64, 4, 32) == 76
    assert (64 + 64) * 2 / PQ.state_bytes(64, 4, 128) >= 3.5  # bf16 K+V per token and head vs the packed page
    assert (128 + 128) * 2 / PQ.state_bytes(128, 4, 128) >= 3.5
    with pytest.raises(ValueError):
        PQ.state_bytes(64, 3)


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.uint8)])
def test_write_gather_roundtrip(bits, dtype):
    H, D, bs = 2, 64, 32
    cache = _cache(8, H, bs, D, bits, dtype=dtype, layers=2)
    bt, exact = _fill(cache, H, D, bs, bits, [45], 8)
    pos = torch.arange(45)
    slots = bt[0].long()[pos // bs] * bs + pos % bs
    k, v = PQ.gather(cache, slots, bs, D, bits)
    kx, vx = exact[0][0].bfloat16().float(), exact[0][1].bfloat16().float()
    # values per token: error <= half a step (+ fp16 rounding of the statistics)
    step_v = (vx.amax(-1) - vx.amin(-1)) / ((1 << bits) - 1)
    assert ((v - vx).abs() <= 0.5 * step_v.unsqueeze(-1) + 0.02).all()
    # keys: per token after the block's channel normalisation; the outlier channel does not swamp the others
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    normal = [d for d in range(D) if d != 3]
    assert rel(k[..., normal], kx[..., normal]) < (0.12 if bits == 4 else 0.01), rel(k[..., normal], kx[..., normal])
    # the channel scale is per block: c = sqrt(max(max |k|, its channel mean)) over the tokens written with its first slot
    _, _, _, cs = PQ.page_fields(PQ.as_pages(cache), bs, D, bits)
    m = kx[:bs].abs().amax(0)  # block 0 written whole (the first chunk covers it)
    first = torch.maximum(m, m.mean(-1, keepdim=True)).sqrt()
    assert torch.allclose(cs[bt[0, 0].long()].float(), first, rtol=2e-3)
    # the other layer's bytes (the first half of the buffer) are untouched
    raw = bytes(cache.view(torch.uint8).untyped_storage())
    assert raw[: len(raw) // 2].count(0) == len(raw) // 2


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bits,H,G,D,bs", [(4, 2, 2, 64, 32), (4, 1, 3, 128, 64), (8, 2, 4, 64, 32),
                                           (4, 2, 1, 80, 32), (8, 1, 2, 96, 32)])
def test_decode_kernel_equals_reference(bits, H, G, D, bs, seed):
    if not PQ.available():
        pytest.skip("no C compiler: decode() runs the reference")
    seqs = [1, 31, 32, 33, 100, 150]
    blocks = sum((s + bs - 1) // bs for s in seqs) + 3
    cache = _cache(blocks, H, bs, D, bits)
    bt, exact = _fill(cache, H, D, bs, bits, seqs, blocks, seed=bits + D + 100 * seed)
    q = torch.randn(len(seqs), H * G, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    scale = D ** -0.5
    ref = PQ.decode_ref(q, cache, bt, torch.tensor(seqs), bs, bits, scale)
    out = PQ.decode(q, cache, bt, torch.tensor(seqs, dtype=torch.int32), bs, bits, scale)
    assert (out - ref).abs().max().item() < 2e-4 * max(1.0, ref.abs().max().item())
    # and both are close to exact attention over the unquantised K/V (4-bit: loose; 8-bit: tight)
    errs = []
    for i, (k, v) in enumerate(exact):
        qi = q[i].float().view(H, G, D)
        p = torch.softmax(torch.einsum("hgd,lhd->hgl", qi, k.bfloat16().float()) * scale, -1)
        o = torch.einsum("hgl,lhd->hgd", p, v.bfloat16().float()).reshape(H * G, D)
        err = (out[i] - o).norm() / o.norm()
        errs.append(float(err))
    print(bits, D, [round(e, 3) for e in errs])
    assert max(errs) < (0.3 if bits == 4 else 0.04), errs


def test_decode_reads_only_listed_blocks():
    """Garbage (NaN statistics) in blocks a row does not list, and past a row's last token, never reaches the output."""
    if not PQ.available():
        pytest.skip("no C compiler")
    H, G, D, bs, bits = 2, 2, 64, 32, 4
    cache = _cache(6, H, bs, D, bits, dtype=torch.bfloat16)
    cache.view(torch.uint8).fill_(0xFF)  # fp16 0xFFFF is NaN: every unwritten stat is NaN
    bt, _ = _fill(cache, H, D, bs, bits, [40], 6)
    q = torch.randn(1, H * G, D)
    out = PQ.decode(q, cache, bt, torch.tensor([40], dtype=torch.int32), bs, bits, D ** -0.5)
    ref = PQ.decode_ref(q, cache, bt, torch.tensor([40]), bs, bits, D ** -0.5)
    assert torch.isfinite(out).all() and torch.allclose(out, ref, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_c_write_equals_torch_write(bits):
    """The C write (strided K/V views, skipped slots, a fresh block and a continued one) stores the same bytes as
    the torch path, up to a code off by one where fp rounding lands on a half step."""
    if not PQ.available():
        pytest.skip("no C compiler")
    H, D, bs = 3, 64, 32
    g = torch.Generator().manual_seed(1)
    a, b = _cache(5, H, bs, D, bits), _cache(5, H, bs, D, bits)
    for slots in ([64 + i for i in range(20)] + [-1, 3 * 32], [64 + 20, 96 + 1, -1]):
        slots = torch.tensor(slots)
        qkv = (torch.randn(len(slots), 3, H, D, generator=g) * (1 + 5 * (torch.arange(D) == 7))).bfloat16()
        k, v = qkv[:, 1], qkv[:, 2]  # strided views of a fused qkv, as vLLM hands them
        PQ.write(a, k, v, slots, bs, bits)
        PQ.write_ref(b, k, v, slots, bs, bits)
    ka, va, sa, ca = PQ.page_fields(PQ.as_pages(a), bs, D, bits)
    kb, vb, sb, cb = PQ.page_fields(PQ.as_pages(b), bs, D, bits)
    assert torch.equal(ca, cb) and torch.equal(sa, sb)
    codes = lambda x: PQ.unpack(x, bits).int()  # noqa: E731
    assert (codes(va) - codes(vb)).abs().max() <= 1
    assert (codes(ka.transpose(-1, -2)) - codes(kb.transpose(-1, -2))).abs().max() <= 1
    assert (codes(ka.transpose(-1, -2)) != codes(kb.transpose(-1, -2))).float().mean() < 0.01
    assert int(ca[3].abs().sum()) > 0 and int(ca[0].abs().sum()) == 0  # block 3 was fresh; block 0 never written


def test_row_slots():
    bt = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    rows, slots = PQ.row_slots(bt, torch.tensor([3, 5]), 2)
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert slots.tolist() == [10, 11, 4, 2, 3, 6, 7, 8]


def test_channel_scale_helps_outlier_keys():
    """Keys with an outlier channel: per-token quantisation of k / c (c = sqrt(max |k|) per channel, the page's key
    channel scale) against per-token quantisation of k alone; relative error of the attention output at 4 bits
    (the README's numbers: D=64, 20 draws of 128 tokens)."""
    torch.manual_seed(0)

    def deq(q, s, z):
        return PQ.unpack(q, 4).float() * s.float()[..., None] + z.float()[..., None]

    D, L, H, G = 64, 128, 2, 3
    errs = {"token": [], "channel": []}
    for _ in range(20):
        k, v, q = torch.randn(L, H, D), torch.randn(L, H, D), torch.randn(H, G, D)
        k[..., 3] *= 8
        m = k.abs().amax(0)
        c = torch.maximum(m, m.mean(-1, keepdim=True)).sqrt().half().float()  # as write() sets it
        vq = deq(*PQ.quantize_tokens(v, 4))

        def att(kk, vv, q=q):
            p = torch.softmax(torch.einsum("hgd,lhd->hgl", q, kk) * D ** -0.5, -1)
            return torch.einsum("hgl,lhd->hgd", p, vv)

        o = att(k, v)
        for name, kk in (("token", deq(*PQ.quantize_tokens(k, 4))), ("channel", deq(*PQ.quantize_tokens(k / c, 4)) * c)):
            errs[name].append(float((att(kk, vq) - o).norm() / o.norm()))
    mean = {n: sum(e) / len(e) for n, e in errs.items()}
    print(f"\n4-bit attention rel. error, outlier keys: per-token {mean['token']:.3f} (max {max(errs['token']):.3f}), "
          f"with channel scale {mean['channel']:.3f} (max {max(errs['channel']):.3f})")
    assert mean["channel"] < 0.7 * mean["token"]
    assert max(errs["channel"]) < 0.3


@pytest.mark.parametrize("bits", [4, 8])
def test_block_begun_by_a_decode_token(bits):
    """A block filled one token at a time (its channel scale from its first token only) keeps its keys about as well
    as a block written whole at prefill; without the channel-mean floor, channels near zero in the first token
    would be inflated for the rest of the block."""
    H, D, bs = 2, 64, 32
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2 * bs, H, D, generator=g)
    k[..., 3] *= 8
    v = torch.randn(2 * bs, H, D, generator=g)
    cache = _cache(2, H, bs, D, bits)
    PQ.write(cache, k[:bs].bfloat16(), v[:bs].bfloat16(), torch.arange(bs), bs, bits)  # block 0: whole
    for t in range(bs):  # block 1: token by token
        PQ.write(cache, k[bs + t: bs + t + 1].bfloat16(), v[bs + t: bs + t + 1].bfloat16(), torch.tensor([bs + t]), bs, bits)
    kq, _ = PQ.gather(cache, torch.arange(2 * bs), bs, D, bits)
    kx = k.bfloat16().float()
    err = [float((kq[i * bs:(i + 1) * bs] - kx[i * bs:(i + 1) * bs]).norm() / kx[i * bs:(i + 1) * bs].norm())
           for i in range(2)]
    print(f"\n{bits}-bit key rel. error: block written whole {err[0]:.4f}, token by token {err[1]:.4f}")
    assert err[1] < 1.5 * err[0]
