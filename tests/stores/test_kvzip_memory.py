"""The reconstruction scoring in bounded blocks (:func:`kvkit.stores.reconstruct.score_blocks`): the blocked pass
gives the unblocked scores, its tensors stay within the block budget (recorded on a tiny model, planned at
Llama-3.2-1B's shape at 16 x 16K tokens), and it synchronises no more often than the unblocked pass."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvkit
import kvkit.policies.kvzip as kvzip_mod
import kvkit.stores.reconstruct as R
from kvkit.hostsync import HostSyncCounter
from kvkit.policies.kvzip import KVzipStore
from kvkit.stores.scored import window_attention
from kvkit.testing import left_padded_batch, random_ids, reconstruction_scores_reference, tiny_model

OPTS = dict(budget=20, window=4, sink=2, chunk=10, overlap=3, tail=4, adaptive=False)
CHELSEA = dict(chunk_size=8, window=4, merge_interval=4, sink=2, ratio=0.5, protect_score="reconstruct",
               recon_chunk=10)
UNBLOCKED = 1 << 62  # one block: the whole [B, H, G x T, n] computation at once
PAIRS = 1700  # > every (row, KV head) pair of the runs below (G x T x n <= 2 x 13 x 63), < a layer's 6 pairs
RUNS = 200  # pairs cut into runs of query positions: 1 (attention, G x n <= 126), 6-7 (scores, G x C = 20)
_PLAN, _FINISH = R.score_blocks, R.ReconstructionScoring.finish_scoring  # before any test patches them
_ATTEND = KVzipStore.scoring_attend


def _batch(padded: bool):
    if padded:
        ids, mask, _ = left_padded_batch([50, 43, 37])
        return ids, mask
    return torch.cat([random_ids(50, seed=s) for s in range(3)]), None


def _run(monkeypatch, E, *, policy="kvzip", dtype=torch.float32, padded=False):
    """One compressed prefill (chelsea: and a second multi-token forward, scored over merged slots with their
    ``log(size)`` weights) at block budget ``E``: (logits, every pass's per-layer scores, blocks planned)."""
    monkeypatch.setattr(R, "SCORE_BLOCK_ELEMENTS", E)
    blocks = []

    def counted(*a, **k):
        out = list(_PLAN(*a, **k))
        blocks.append(len(out))
        return out

    monkeypatch.setattr(R, "score_blocks", counted)
    accs = []

    def record(self):
        accs.append(None if self.acc is None else self.acc.clone())
        return _FINISH(self)

    monkeypatch.setattr(R.ReconstructionScoring, "finish_scoring", record)
    model = tiny_model("llama", num_hidden_layers=2).to(dtype)  # GQA: 4 query heads over 2 KV heads
    ids, mask = _batch(padded)
    kvkit.patch(model, policy, **(OPTS if policy == "kvzip" else CHELSEA))
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, attention_mask=mask, **kvkit.compat.cache_kw(cache), use_cache=True)
            if policy == "chelsea":
                more = torch.cat([random_ids(12, seed=9 + s) for s in range(3)])
                m2 = None if mask is None else torch.cat([mask, torch.ones_like(more)], dim=1)
                out = model(input_ids=more, attention_mask=m2, **kvkit.compat.cache_kw(cache), use_cache=True)
    finally:
        kvkit.unpatch(model)
    assert accs and all(a is not None for a in accs)
    return out.logits, accs, blocks


PATHS = [  # (model dtype, left padding): which attention the repeat forward runs
    pytest.param(torch.float32, False, id="cpu-prefix-suffix"),  # CPU, no padding: flash prefix + causal suffix
    pytest.param(torch.float32, True, id="cpu-flash-masked"),  # CPU with padding: attend_slots' flash kernel
    pytest.param(torch.float64, True, id="fp32-math"),  # attend_slots' fp32 math, what CUDA runs
]


@pytest.mark.parametrize("policy", ["kvzip", "chelsea"])
@pytest.mark.parametrize(("dtype", "padded"), PATHS)
def test_blocked_scores_are_the_unblocked_scores(monkeypatch, policy, dtype, padded):
    """Blocks of whole (row, KV head) pairs give bit-identical scores and logits (the same matrices per pair);
    runs of query positions give them to rounding (the matmul kernels see fewer rows: a kernel chosen for
    another shape may round a dot product differently in the last bit)."""
    logits, accs, blocks = _run(monkeypatch, UNBLOCKED, policy=policy, dtype=dtype, padded=padded)
    assert set(blocks) == {1}
    p_logits, p_accs, p_blocks = _run(monkeypatch, PAIRS, policy=policy, dtype=dtype, padded=padded)
    assert max(p_blocks) > 1
    assert torch.equal(p_logits, logits)
    assert len(p_accs) == len(accs) and all(torch.equal(a, b) for a, b in zip(p_accs, accs))
    r_logits, r_accs, r_blocks = _run(monkeypatch, RUNS, policy=policy, dtype=dtype, padded=padded)
    assert max(r_blocks) > max(p_blocks)
    torch.testing.assert_close(r_logits, logits, rtol=1e-5, atol=1e-6)
    assert len(r_accs) == len(accs)
    for a, b in zip(r_accs, accs):
        assert torch.equal(a < 0, b < 0)  # the same slots scored
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocked_scores_match_the_eager_reference(monkeypatch, dtype):
    """Cut into runs of query positions, each row's prefill scores are still the largest attention probability
    any repeat query of its KV group pays a slot in transformers' eager attention, row by row."""
    _, accs, blocks = _run(monkeypatch, RUNS, dtype=dtype)
    assert max(blocks) > 1
    ids, _ = _batch(False)
    model = tiny_model("llama", num_hidden_layers=2).to(dtype)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            ref = reconstruction_scores_reference(model, ids[b : b + 1], OPTS["chunk"], OPTS["overlap"])
            for li, acc in enumerate(accs):
                torch.testing.assert_close(acc[b].double(), ref[li].double(), rtol=1e-4, atol=1e-6)


def test_decode_window_scores_blocked(monkeypatch):
    """The decode queries' scores of the slots added after a reconstruction (``KVzipStore._window_scores``) in
    blocks: the same as the maximum of one ``[B, Hq, w, n]`` window attention over queries and KV groups."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids, mask = _batch(True)
    kvkit.patch(model, "kvzip", **OPTS)
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, attention_mask=mask, **kvkit.compat.cache_kw(cache), use_cache=True)
            for _ in range(3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask,
                            **kvkit.compat.cache_kw(cache), use_cache=True)
    finally:
        kvkit.unpatch(model)
    for st in cache.layers:
        q, qpos = st.observed()
        B, Hq, w, _ = q.shape
        H, n = st.keys.shape[1], st.keys.shape[2]
        want = window_attention(q, st.keys, st.pos, qpos, st.scaling).amax(2).view(B, H, Hq // H, n).amax(2)
        for E, exact in ((UNBLOCKED, True), (Hq // H * w * n, True), (Hq // H * n * 2, False)):
            monkeypatch.setattr(R, "SCORE_BLOCK_ELEMENTS", E)
            got = st._window_scores(q, qpos)
            if exact:
                assert torch.equal(got, want), E
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class _Allocations(TorchDispatchMode):
    """Every tensor the wrapped code allocates (not a view of an argument): ``shapes``, and ``peak``, the most
    bytes of them alive at once (a storage counts until it is freed)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.live, self.peak, self.ptrs = [], 0, 0, set()

    def _free(self, ptr, nbytes):
        self.ptrs.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in given or ptr in self.ptrs or s.nbytes() == 0:
                continue
            self.shapes.append(tuple(t.shape))
            self.ptrs.add(ptr)
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(s, self._free, ptr, s.nbytes())
        return out


def _scoring_allocations(monkeypatch, E):
    """A batch of 4 left-padded ~300-token rows, chunks of 40, in fp64 (attend_slots' fp32 math: the path every
    non-CPU device runs); per repeat forward of the one layer: (B, Hq, H, T, n, C, D, allocations)."""
    monkeypatch.setattr(R, "SCORE_BLOCK_ELEMENTS", E)
    calls = []

    def recorded(self, query, attention_mask, scaling, log_weight=None):
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        C = min(self.score_range[1] - self.score_range[0], n)
        with _Allocations() as rec:
            out = _ATTEND(self, query, attention_mask, scaling, log_weight)
        calls.append((B, Hq, H, T, n, C, D, rec))
        return out

    monkeypatch.setattr(KVzipStore, "scoring_attend", recorded)
    model = tiny_model("llama", num_hidden_layers=1).to(torch.float64)
    ids, mask, _ = left_padded_batch([300, 290, 280, 300])
    kvkit.patch(model, "kvzip", **dict(OPTS, budget=40, chunk=40))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True)
    finally:
        kvkit.unpatch(model)
    assert len(calls) == 8  # 300 tokens in chunks of 40
    return calls


def test_scoring_tensors_stay_within_the_block_budget(monkeypatch):
    """Unblocked, the repeat forward allocates ``[B, H, G x T, n]`` fp32 logits and several copies alive at once
    (the allocation that ran out of memory at 16 x 16K); blocked, no tensor with a column per slot holds more than
    ``max(E, G x n)`` elements and the peak of the pass's allocations is within the documented bound, far below
    one unblocked logit tensor."""
    for B, Hq, H, T, n, _, _, rec in _scoring_allocations(monkeypatch, UNBLOCKED):
        assert (B, H, Hq // H * T, n) in rec.shapes  # the culprit, whole
        assert rec.peak >= 3 * 4 * B * Hq * T * n
    E = 8000  # runs of 11 query positions (G x n = 686 per position): 4 blocks per (row, KV head) pair
    for B, Hq, H, T, n, C, D, rec in _scoring_allocations(monkeypatch, E):
        G = Hq // H
        per_slot = [s for s in rec.shapes if len(s) >= 4 and s[-1] in (n, C)]
        assert per_slot and max(torch.Size(s).numel() for s in per_slot) <= max(E, G * n)
        block = 17 * max(E, G * n) + 8 * n * D  # attend_slots' tensors of one block + its K/V in fp32
        whole = (B * Hq * T * D * 8 + B * Hq * T * 4  # the call's output (fp64 model) and fp32 log-sum-exp
                 + 12 * B * H * C * D + 32 * B * H * n)  # the chunk's keys (fp64 and fp32), per-slot indices / scores
        assert rec.peak <= block + whole, (rec.peak, block, whole)
        assert rec.peak < 4 * B * Hq * T * n / 2


def test_blocked_pass_synchronises_as_often_as_the_unblocked_one(monkeypatch):
    """Blocks are planned from shapes: cutting the pass adds no host synchronisation."""
    counts = {}
    for E in (UNBLOCKED, RUNS):
        monkeypatch.setattr(R, "SCORE_BLOCK_ELEMENTS", E)
        model = tiny_model("llama", num_hidden_layers=2)
        ids, mask = _batch(True)
        kvkit.patch(model, "kvzip", **OPTS)
        try:
            with torch.no_grad(), HostSyncCounter() as sync:
                model(input_ids=ids, attention_mask=mask, use_cache=True)
        finally:
            kvkit.unpatch(model)
        counts[E] = sync.count
    assert counts[RUNS] == counts[UNBLOCKED]


@pytest.mark.parametrize(("B", "H", "G", "T", "n", "E"), [
    (3, 2, 2, 13, 63, 1), (3, 2, 2, 13, 63, 600), (3, 2, 2, 13, 63, 1700), (3, 2, 2, 13, 63, 10**9),
    (5, 3, 4, 7, 11, 100), (2, 8, 1, 520, 16904, 1 << 24), (1, 1, 7, 1, 5, 3),
])
def test_score_blocks_tile_the_computation_once(monkeypatch, B, H, G, T, n, E):
    monkeypatch.setattr(R, "SCORE_BLOCK_ELEMENTS", E)
    seen = torch.zeros(B, H, T, dtype=torch.int32)
    for rows, h0, h1, ts in R.score_blocks(B, H, G, T, n):
        seen[rows, h0:h1, ts] += 1
        elements = (rows.stop - rows.start) * (h1 - h0) * G * (ts.stop - ts.start) * n
        assert 0 < elements <= max(E, G * n)
    assert bool((seen == 1).all())
    runs = {ts.stop - ts.start for *_, ts in R.score_blocks(B, H, G, T, n)}
    assert max(runs) - min(runs) <= 1  # evened out


def test_the_plan_at_llama_1b_16x16k_stays_within_a_few_hundred_mib():
    """Llama-3.2-1B (32 query / 8 KV heads, head size 64), 16 rows of 16,384 tokens, chunks of 512 + overlap 8:
    unblocked, one fp32 logit tensor of the first repeat forward is 16 x 32 x 512 x 16,896 x 4 bytes = 16.5 GiB
    (the allocation that failed on an 80 GB H100); blocked (the shipped budget), no block of the attention or of
    the scoring exceeds ``E`` elements, and by the documented bounds neither exceeds 300 MiB. Planned, not run."""
    B, Hq, H, D, S, chunk, overlap = 16, 32, 8, 64, 16384, 512, 8
    G = Hq // H
    assert 4 * B * Hq * chunk * (S + chunk) == 16.5 * 2**30
    E = R.SCORE_BLOCK_ELEMENTS
    for T in (chunk, chunk + overlap):  # the first chunk, the others
        n = S + T
        attn = list(R.score_blocks(B, H, G, T, n))
        biggest = max((r.stop - r.start) * (h1 - h0) * G * (t.stop - t.start) * n for r, h0, h1, t in attn)
        pairs = max((r.stop - r.start) * (h1 - h0) for r, h0, h1, t in attn)
        assert biggest <= E and 17 * biggest + 8 * pairs * n * D < 300 * 2**20
        score = list(R.score_blocks(B, H, G, T, chunk))
        biggest = max((r.stop - r.start) * (h1 - h0) * G * (t.stop - t.start) * chunk for r, h0, h1, t in score)
        assert biggest <= E and 12 * biggest + 4 * B * H * chunk * D < 300 * 2**20
    # the decode queries' scores (window 64) over the whole context, should the budget hold it all
    window = list(kvzip_mod.score_blocks(B, H, G, 64, S))
    assert max((r.stop - r.start) * (h1 - h0) * G * (t.stop - t.start) * S for r, h0, h1, t in window) <= E
