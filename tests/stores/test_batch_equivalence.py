"""A left-padded batch decodes every row as its prompt alone: every registered policy, with its growing and its
static stores, through ``model.generate`` and through a manual decode loop.

``generate`` over a static cache prepares transformers' 4-D bool mask before the forward (the manual loop passes
the 2-D mask): both must give each row the positions and the padding of its own prompt, in every store and in a
policy's own passes (KVzip's reconstruction). Tiny random models, few tokens: the whole matrix runs in CI."""

import pytest
import torch
from transformers import CompileConfig

import kvkit
from kvkit.cache import static_policies
from kvkit.testing import greedy, left_padded_batch, policy_test_options, tiny_model

POLICIES = kvkit.available_policies()
STEPS = 6
LENGTHS = (36, 23)  # both above the test options' budgets: compression events in the prefill and while decoding


@torch.no_grad()
def _generate(model, ids, mask, steps=STEPS, **kwargs):
    """Greedy ``generate`` (no EOS: every row decodes ``steps`` tokens): ``(tokens [B, steps], logits [B, steps, V])``."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _loop(model, ids, mask=None, steps=STEPS):
    toks, logits, _ = greedy(model, ids, steps, attention_mask=mask)
    return toks, torch.stack(logits[:steps], 1)


def _rows_equal_alone(model, prompts, runs: dict) -> None:
    for row, p in enumerate(prompts):
        ref_toks, ref_logits = _loop(model, p[None])
        for how, (toks, logits) in runs.items():
            assert torch.equal(toks[row], ref_toks[0]), f"{how}: row {row} decodes other tokens than alone"
            torch.testing.assert_close(logits[row], ref_logits[0], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, how=how, row=row: f"{how}, row {row}: {m}")


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("policy", POLICIES)
def test_left_padded_rows_decode_as_their_prompts_alone(policy, static):
    if static and policy not in static_policies():
        pytest.skip(f"{policy} has no static stores")
    model = tiny_model("llama")
    ids, mask, prompts = left_padded_batch(LENGTHS, seed=4)
    kvkit.patch(model, policy, static=static, **policy_test_options(policy))
    try:
        _rows_equal_alone(model, prompts, {"generate": _generate(model, ids, mask), "loop": _loop(model, ids, mask)})
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kvzip_static_generate_repeats_a_padded_row_at_its_own_positions(arch):
    """KVzip over a static cache: ``generate``'s prefill runs under a 4-D mask, and the reconstruction of a padded
    row must still follow its real tokens (positions from its own length), so its scores, the slots it keeps and
    its logits are those of the prompt alone."""
    model = tiny_model(arch)
    ids, mask, prompts = left_padded_batch((30, 17, 24), seed=7)
    kvkit.patch(model, "kvzip", static=True, **policy_test_options("kvzip"))
    try:
        _rows_equal_alone(model, prompts, {"generate": _generate(model, ids, mask)})
    finally:
        kvkit.unpatch(model)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
def test_kvzip_static_generate_with_a_compile_config_decodes_a_padded_row_as_alone():
    """The same through ``generate``'s compiled decode step (``aot_eager``: the CPU compiles the step whole); the
    prefill and its reconstruction run eagerly under the 4-D mask."""
    model = tiny_model("qwen2")
    ids, mask, prompts = left_padded_batch((30, 17), seed=7)
    cc = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # transformers' switch for compiling generate's decode step off CUDA
    kvkit.patch(model, "kvzip", static=True, **policy_test_options("kvzip"))
    try:
        _rows_equal_alone(model, prompts, {"compiled generate": _generate(model, ids, mask, compile_config=cc)})
    finally:
        kvkit.unpatch(model)
