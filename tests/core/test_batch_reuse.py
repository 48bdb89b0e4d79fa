"""A cache of one row (a shared context) continued by a batch of several rows: every policy, growing and static,
repeats the row for each (as transformers' ``DynamicCache`` broadcasts one), so each row decodes as a batch-1 cache
of the same context would; a cache of another batch size is refused with a message saying what to do."""

import pytest
import torch

import kvkit
from kvkit.registry import policy_class
from kvkit.testing import policy_test_options, random_ids, tiny_model

POLICIES = kvkit.available_policies()


@torch.no_grad()
def _continue(model, ctx, questions, steps: int = 4):
    """Fill a new cache with ``ctx [1, S]``, run ``questions [B, T]`` on it, then ``steps`` greedy tokens: the logits
    ``[B, steps + 1, V]``."""
    cache = kvkit.KVCache(model)
    model(input_ids=ctx, past_key_values=cache, use_cache=True)
    out = model(input_ids=questions, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out = model(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_row_cache_continued_by_three_rows_equals_each_row_alone(policy, static):
    if static and not policy_class(policy).static_capable:
        pytest.skip(f"{policy} has no static stores")
    model = tiny_model("llama")
    ctx = random_ids(40, seed=1)
    questions = torch.cat([random_ids(3, seed=s) for s in (2, 3, 4)])
    kvkit.patch(model, policy, static=static, **policy_test_options(policy))
    try:
        batch = _continue(model, ctx, questions)
        for row in range(questions.shape[0]):
            alone = _continue(model, ctx, questions[row : row + 1])
            torch.testing.assert_close(batch[row], alone[0], rtol=1e-4, atol=1e-4)
    finally:
        kvkit.unpatch(model)


def test_cache_of_another_batch_size_is_refused():
    model = tiny_model("llama")
    kvkit.patch(model, "snapkv", **policy_test_options("snapkv"))
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            model(input_ids=torch.cat([random_ids(20, seed=1), random_ids(20, seed=2)]), past_key_values=cache)
            with pytest.raises(ValueError, match="holds a batch of 2 rows but the forward has 3.*batch_select_indices"):
                model(input_ids=torch.cat([random_ids(2, seed=s) for s in (3, 4, 5)]), past_key_values=cache)
            assert cache.get_seq_length() == 20  # nothing changed
    finally:
        kvkit.unpatch(model)
