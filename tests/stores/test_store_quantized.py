"""The quantized-segment store (kvkit/stores/quantized.py), driven directly: any quantizer on top of it."""

import pytest
import torch

from kvkit.kernels import dequantize
from kvkit.stores import LayerInfo, QuantizedSegmentStore
from kvkit.stores.quantized import rank_groups

Hq, H, D = 4, 2, 16


class NormSplit(QuantizedSegmentStore):
    """A made-up quantizer in a few lines: the keys with the largest norm at 8 bits, the rest at 2 bits."""

    def split_block(self, k, v, valid, score):
        return rank_groups(k.norm(dim=-1), valid, (0.25,), ((8, 8), (2, 2)))


def _prefill(store, k, v, valid=None):
    """What ``attend`` does at prefill, minus the exact prompt attention: store, mark padding, compress."""
    store.update(k, v)
    n = k.shape[2]
    store.first_pos = torch.zeros(k.shape[0], dtype=torch.int32)
    if valid is not None:
        store.pos[:, :, :] = torch.where(valid[:, None, :], store.pos, torch.full_like(store.pos, -1))
    store.on_prefill(None, None)
    store.committed = store.seen
    assert store.keys.shape[-2] == 0 and store.quantized_tokens() == n


def _decode(store, q, k, v):
    store.update(k, v)
    qpos = torch.arange(store.seen - 1, store.seen, dtype=torch.int32)
    return store.decode(q, qpos, D**-0.5)


def _reference(store, q, row_valid=None):
    """Dense fp32 attention over every dequantised part and the fp tail (one query per row)."""
    ks, vs, oks = [], [], []
    for kp, vp, n in store.parts():
        ks.append(dequantize(kp, torch.float32))
        vs.append(dequantize(vp, torch.float32))
        oks.append(torch.arange(kp.shape[2])[None, :] < n[:, None])
    ks.append(store.keys.float())
    vs.append(store.values.float())
    oks.append(store.pos[:, 0] >= 0)
    k, v, ok = torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(oks, 1)
    k, v = k.repeat_interleave(Hq // H, 1), v.repeat_interleave(Hq // H, 1)
    s = (q.float() @ k.transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)  # [B, 1, Hq, D]


@pytest.mark.parametrize("store_cls,kw", [(QuantizedSegmentStore, dict(bits=4)), (QuantizedSegmentStore, dict(bits=2, value_prescale=True)),
                                          (NormSplit, {})])
def test_decode_equals_dense_attention_over_dequantized_parts(store_cls, kw):
    g = torch.Generator().manual_seed(0)
    store = store_cls(LayerInfo(0, 1, Hq, H, D), tail_tokens=5, **kw)
    _prefill(store, torch.randn(2, H, 23, D, generator=g), torch.randn(2, H, 23, D, generator=g))
    for _ in range(7):  # compresses the tail at steps 5 (tail of 5): 2 segments, 2 tail tokens
        q = torch.randn(2, Hq, 1, D, generator=g)
        out = _decode(store, q, torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g))
        torch.testing.assert_close(out, _reference(store, q), rtol=1e-5, atol=1e-5)
    assert len(store.segments) == 2 and store.keys.shape[-2] == 2 and store.num_slots() == 30
    bits = sorted({(kp.bits, vp.bits) for kp, vp, _ in store.parts()})
    assert bits == ([(8, 8), (2, 2)][::-1] if store_cls is NormSplit else [(kw["bits"], kw["bits"])])


def test_custom_split_puts_largest_keys_at_high_precision():
    g = torch.Generator().manual_seed(1)
    store = NormSplit(LayerInfo(0, 1, Hq, H, D), tail_tokens=8)
    k = torch.randn(1, H, 20, D, generator=g)
    k[:, :, 3] *= 10
    _prefill(store, k, torch.randn(1, H, 20, D, generator=g))
    (k8, _, n8), (k2, _, n2) = store.segments[0].parts
    assert (k8.bits, k2.bits, int(n8), int(n2)) == (8, 2, 5, 15)
    big = dequantize(k8, torch.float32)
    assert bool(((big - k[:, :, 3:4]).abs().amax(-1) < 0.1).any(-1).all())  # token 3 is in the 8-bit group


def test_rank_groups_counts_order_and_padding():
    score = torch.tensor([[[0.1, 0.9, 0.5, 0.3, 0.7]]])
    valid = torch.tensor([[False, True, True, True, True]])  # one left-padding slot, ranked last
    g1, g2 = rank_groups(score, valid, (0.5,), ((4, 4), (2, 2)))
    assert g1.idx.tolist() == [[[1, 4]]] and int(g1.count) == 2
    assert g2.idx.tolist() == [[[2, 3]]] and int(g2.count) == 2
    (only,) = rank_groups(score, valid, (), ((8, 8),))
    assert only.idx[0, 0, :4].tolist() == [1, 4, 2, 3] and int(only.count) == 4
    with pytest.raises(ValueError, match="fractions"):
        rank_groups(score, valid, (0.5,), ((4, 4),))


def test_ragged_rows_pad_groups_with_their_first_token():
    """Rows with different numbers of real tokens: a group's rectangular padding repeats its first token and the
    row's valid count masks it at decode."""
    score = torch.arange(6.0).view(1, 1, 6).expand(2, 1, 6)
    valid = torch.tensor([[True] * 6, [False, False, False, True, True, True]])
    g1, g2 = rank_groups(score, valid, (0.5,), ((4, 4), (2, 2)))
    assert g1.count.tolist() == [3, 2] and g2.count.tolist() == [3, 1]
    assert g1.idx[1, 0].tolist() == [5, 4, 5]  # padded with the group's first token (unchanged min/max)
    assert g2.idx[1, 0].tolist() == [3, 3, 3]


def test_left_padded_row_equals_the_row_alone():
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, H, 12, D, generator=g), torch.randn(2, H, 12, D, generator=g)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False
    batch = QuantizedSegmentStore(LayerInfo(0, 1, Hq, H, D), tail_tokens=3, bits=4)
    alone = QuantizedSegmentStore(LayerInfo(0, 1, Hq, H, D), tail_tokens=3, bits=4)
    _prefill(batch, k, v, valid)
    _prefill(alone, k[1:, :, 4:], v[1:, :, 4:])
    for _ in range(4):
        q, k1, v1 = torch.randn(2, Hq, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
        a = _decode(batch, q, k1, v1)
        b = _decode(alone, q[1:], k1[1:], v1[1:])
        torch.testing.assert_close(a[1:], b, rtol=1e-5, atol=1e-6)


def test_crop_of_the_tail_is_exact_and_nbytes_follow():
    g = torch.Generator().manual_seed(3)
    store = QuantizedSegmentStore(LayerInfo(0, 1, Hq, H, D), tail_tokens=10, bits=4)
    _prefill(store, torch.randn(1, H, 16, D, generator=g), torch.randn(1, H, 16, D, generator=g))
    q = torch.randn(1, Hq, 1, D, generator=g)
    _decode(store, q, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
    before = (store.keys.clone(), store.values.clone(), store.pos.clone(), store.nbytes(), store.seen)
    out = _decode(store, q, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
    _decode(store, q, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
    assert store.nbytes() > before[3]
    store.crop(-2)
    assert torch.equal(store.keys, before[0]) and torch.equal(store.values, before[1])
    assert torch.equal(store.pos, before[2]) and store.nbytes() == before[3] and store.seen == before[4]
    with pytest.raises(ValueError, match="crop"):
        store.crop(-2)  # below the last compression (the prompt segment)
    assert out.shape == (1, 1, Hq, D)
