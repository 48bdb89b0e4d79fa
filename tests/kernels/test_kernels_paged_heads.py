"""Per-(row, KV head) block lists over vLLM's bf16 pages (kvkit.kernels.paged_heads_cpu): the C kernel == the torch
reference == dense attention over exactly the tokens listed, in both page layouts (vLLM's amx and vec)."""

import pytest
import torch

from kvkit.kernels import paged_heads_cpu as PH

needs_kernel = pytest.mark.skipif(not PH.available(), reason="no C compiler (the torch reference runs instead)")


def _setup(layout, D, G, bs, seqs, H=3, sink_blocks=1, recent=None, retrieval=None, seed=0):
    """vLLM-like layer cache with random K/V for rows of ``seqs`` tokens in shuffled blocks, and DuoAttention lists:
    retrieval heads read every block, streaming heads the sink blocks + the blocks of the last ``recent`` tokens.
    Returns (kv_cache, q, blocks, ntok, per-row exact K/V, per-(row, head) token positions read)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-s // bs) for s in seqs]
    NB = sum(nbs) + 5
    kv_cache = torch.randn(NB, H, bs, 2 * D, generator=g).bfloat16()  # unwritten slots hold junk, as in vLLM
    kc, vc = PH.split_cache(kv_cache)
    perm = torch.randperm(NB, generator=g)
    recent = recent if recent is not None else bs + 7
    retrieval = retrieval or [h % 2 == 0 for h in range(H)]
    W = max(nbs)
    blocks = torch.zeros(len(seqs), H, W, dtype=torch.int32)
    ntok = torch.zeros(len(seqs), H, dtype=torch.int32)
    exact, read = [], []
    used = 0
    for i, (s, nb) in enumerate(zip(seqs, nbs)):
        tbl = perm[used: used + nb].to(torch.int32)
        used += nb
        k = torch.randn(s, H, D, generator=g).bfloat16()
        v = torch.randn(s, H, D, generator=g).bfloat16()
        pos = torch.arange(s)
        PH.write(kc, vc, k, v, tbl.long()[pos // bs] * bs + pos % bs, layout)
        exact.append((k.float(), v.float()))
        first = max(sink_blocks, max(0, s - recent) // bs)
        rows = []
        for h in range(H):
            if retrieval[h] or first <= sink_blocks:
                cols = list(range(nb))
            else:
                cols = list(range(sink_blocks)) + list(range(first, nb))
            blocks[i, h, : len(cols)] = tbl[cols]
            ntok[i, h] = (len(cols) - 1) * bs + (s - (nb - 1) * bs)
            rows.append(torch.cat([torch.arange(c * bs, min((c + 1) * bs, s)) for c in cols]))
        read.append(rows)
    q = torch.randn(len(seqs), H * G, D, generator=g).bfloat16()
    return kv_cache, q, blocks, ntok, exact, read


def _dense(q, exact, read, G, scale):
    """Softmax attention of each (row, KV head)'s query heads over exactly the token positions it reads (fp32)."""
    n, Hq, D = q.shape
    out = torch.zeros(n, Hq, D)
    for i, (k, v) in enumerate(exact):
        for h, pos in enumerate(read[i]):
            qi = q[i, h * G: (h + 1) * G].float()
            p = torch.softmax(qi @ k[pos, h].T * scale, dim=-1)
            out[i, h * G: (h + 1) * G] = p @ v[pos, h]
    return out


@pytest.mark.parametrize("layout", ["amx", "vec"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 3])
@pytest.mark.parametrize("bs", [32, 128])
def test_reference_equals_dense_and_kernel_equals_reference(layout, D, G, bs):
    seqs = [7, 3 * bs + 5, 5 * bs, 6 * bs + 1, 2 * bs + 17]  # partially filled last blocks, one full, one short row
    kv_cache, q, blocks, ntok, exact, read = _setup(layout, D, G, bs, seqs, H=3, recent=bs + 9,
                                                    retrieval=[True, False, False], seed=D + G + bs)
    kc, vc = PH.split_cache(kv_cache)
    scale = D ** -0.5
    ref = PH.decode_ref(q, kc, vc, blocks, ntok, scale, layout)
    dense = _dense(q, exact, read, G, scale)
    torch.testing.assert_close(ref, dense, atol=2e-5, rtol=1e-4)
    # streaming heads of the long rows really read fewer tokens than the row holds
    assert int(ntok[3, 1]) < seqs[3] and int(ntok[3, 0]) == seqs[3]
    if PH.available():
        out = PH.decode(q, kc, vc, blocks, ntok, scale, layout)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _nan_tail(kc, vc, block, fill, layout):
    """NaN in the slots ``fill ..`` of ``block`` (every head), in the page layout."""
    nb, H, bs, D = kc.shape
    koff, voff = PH.page_offsets(bs, D, layout)
    for pages, off in ((kc, koff), (vc, voff)):
        flat = torch.as_strided(pages, (nb, H, bs * D), (pages.stride(0), pages.stride(1), 1), pages.storage_offset())
        flat[block, :, off[fill:].flatten()] = float("nan")


@needs_kernel
@pytest.mark.parametrize("layout", ["amx", "vec"])
def test_generic_shapes_and_edge_rows(layout):
    """Group sizes and head dims outside the compiled fast paths (G=5, 9; D=96), a row that reads nothing, an odd
    token count in the last block (the amx value pair's unwritten half holds junk, possibly NaN)."""
    for D, G in ((96, 5), (64, 9), (128, 4)):
        if layout == "amx" and D % 32:
            continue
        bs = 32
        seqs = [1, 2 * bs + 3, 4 * bs + 31]
        kv_cache, q, blocks, ntok, exact, read = _setup(layout, D, G, bs, seqs, H=2, recent=33, seed=D * G)
        kc, vc = PH.split_cache(kv_cache)
        for i, s in enumerate(seqs):  # NaN in the unwritten slots of every row's last block
            if s % bs:
                _nan_tail(kc, vc, int(blocks[i, 0, (s - 1) // bs]), s % bs, layout)
        ntok[0, 1] = 0  # a (row, head) that reads nothing: zeros
        scale = D ** -0.5
        out = PH.decode(q, kc, vc, blocks, ntok, scale, layout)
        assert torch.isfinite(out).all()
        assert out[0, G: 2 * G].abs().max() == 0
        ref = PH.decode_ref(q, kc, vc, blocks, ntok, scale, layout)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        dense = _dense(q, exact, read, G, scale)
        torch.testing.assert_close(out[1:], dense[1:], atol=2e-5, rtol=1e-4)


def test_page_offsets_are_permutations():
    for layout in PH.LAYOUTS:
        for bs in (32, 128):
            koff, voff = PH.page_offsets(bs, 64, layout)
            for off in (koff, voff):
                assert torch.equal(off.flatten().sort().values, torch.arange(bs * 64))
    with pytest.raises(ValueError, match="amx layout needs"):
        PH.page_offsets(32, 80, "amx")
    with pytest.raises(NotImplementedError, match="not supported"):
        PH.layout_for_isa("neon")
    assert PH.layout_for_isa("vec16") == "vec"


def test_shape_errors():
    kv_cache, q, blocks, ntok, _, _ = _setup("vec", 64, 2, 32, [40, 70], H=2)
    kc, vc = PH.split_cache(kv_cache)
    with pytest.raises(ValueError, match="do not group"):
        PH.decode(q[:, :3], kc, vc, blocks, ntok, 0.125, "vec")
    with pytest.raises(ValueError, match="do not match"):
        PH.decode(q, kc, vc, blocks[:, :1], ntok, 0.125, "vec")


@pytest.mark.parametrize("layout", ["amx", "vec"])
def test_decode_rows_in_place(layout):
    """The engine's entry: bf16 query rows picked by token index, bf16 results written into those rows of the
    output in place (other rows untouched) == :func:`decode` rounded to bf16."""
    D, G, bs = 64, 3, 32
    kv_cache, q, blocks, ntok, _, _ = _setup(layout, D, G, bs, [50, 3 * bs + 1, 70], H=3, recent=40, seed=7)
    kc, vc = PH.split_cache(kv_cache)
    T = 9
    tok = torch.tensor([1, 4, 8])
    query = torch.randn(T, 3 * G, D).bfloat16()
    query[tok] = q
    output = torch.full((T, 3 * G, D), 7.0, dtype=torch.bfloat16)
    PH.decode_rows(query, tok, kc, vc, blocks, ntok, D ** -0.5, layout, output)
    expect = PH.decode(q, kc, vc, blocks, ntok, D ** -0.5, layout).bfloat16()
    assert torch.equal(output[tok], expect)
    rest = torch.ones(T, dtype=torch.bool)
    rest[tok] = False
    assert bool((output[rest] == 7.0).all())
