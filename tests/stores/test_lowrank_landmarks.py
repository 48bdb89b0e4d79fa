"""ShadowKV's chunk landmarks (:mod:`kvkit.stores.lowrank`): the paper's mean key and kvkit's min-max bound."""

import pytest
import torch

from kvkit.stores.lowrank import bound_query, landmarks_and_outliers, select_chunks, top_chunks


def _keys(B=2, H=2, C=6, c=4, D=8, seed=0):
    return torch.randn(B, H, C * c, D, generator=torch.Generator().manual_seed(seed))


def test_minmax_score_bounds_every_key_of_its_chunk():
    """``bound_query(q) . [max, min]`` is at least ``q . k`` for every key of the chunk, and equals the largest one
    when a chunk holds one key."""
    B, H, C, c, D = 2, 2, 6, 4, 8
    kc = _keys(B, H, C, c, D)
    n = torch.full((B,), C)
    lm, lm_ids, _, _ = landmarks_and_outliers(kc, n, c, 0, "minmax")
    assert lm.shape == (B, H, C, 2 * D) and torch.equal(lm_ids[0, 0], torch.arange(C, dtype=torch.int32))
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(1))  # one query head per KV head
    bound = (bound_query(q, 2 * D) @ lm.transpose(-1, -2))[:, :, 0]  # [B, H, C]
    exact = (q @ kc.transpose(-1, -2))[:, :, 0].view(B, H, C, c)  # [B, H, C, c]
    assert (bound[..., None] >= exact - 1e-5).all()
    lm1, _, _, _ = landmarks_and_outliers(kc, torch.full((B,), C * c), 1, 0, "minmax")
    torch.testing.assert_close((bound_query(q, 2 * D) @ lm1.transpose(-1, -2))[:, :, 0], exact.flatten(2))


def test_mean_landmarks_are_the_papers():
    B, H, C, c, D = 1, 2, 5, 4, 8
    kc = _keys(B, H, C, c, D)
    lm, _, _, _ = landmarks_and_outliers(kc, torch.full((B,), C), c, 0)
    torch.testing.assert_close(lm, kc.view(B, H, C, c, D).mean(3))
    q = torch.randn(B, H, 1, D)
    assert bound_query(q, D) is q
    with pytest.raises(ValueError, match="fit neither"):
        bound_query(q, 3 * D)
    with pytest.raises(ValueError, match="landmark must be one of"):
        landmarks_and_outliers(kc, torch.full((B,), C), c, 0, "max")


def test_minmax_keeps_the_one_key_a_mean_averages_away():
    """A needle: one key of chunk 1 matches the query (``q . k = 10``), its 3 neighbours oppose it (-6 each, mean
    -2); every key of chunks 0, 2, 3 scores 1. The paper's mean ranks the needle's chunk last; the bound ranks it
    first. Both selection paths (one token, any number of tokens) agree."""
    D, c, C = 4, 4, 4
    q = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, D)
    k = torch.zeros(1, 1, C, c, D)
    k[..., 0] = 1.0
    k[0, 0, 1, :, 0] = torch.tensor([-6.0, 10.0, -6.0, -6.0])
    kc = k.view(1, 1, C * c, D)
    n = torch.tensor([C])
    for landmark, want in [("mean", [0, 2, 3]), ("minmax", [1])]:
        lm, lm_ids, _, _ = landmarks_and_outliers(kc, n, c, 0, landmark)
        k_sel = 3 if landmark == "mean" else 1
        ids = select_chunks(q, lm, lm_ids, n, k_sel, all_valid=True)[0, 0, 0].tolist()
        assert ids == want
        top = top_chunks(q, lm, None, k_sel).indices[0, 0].sort().values.tolist()
        assert top == want
