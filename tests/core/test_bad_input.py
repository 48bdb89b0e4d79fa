"""Bad-input sweep: every case gives either the right answer or a clear error."""

import pytest
import torch

import kvkit
from kvkit.testing import greedy, tiny_model


@pytest.fixture(params=["full", "streaming"])
def patched(request):
    model = tiny_model("llama")
    opts = {"budget": 8, "sink": 2, "tail": 4} if request.param == "streaming" else {}
    kvkit.patch(model, request.param, **opts)
    return model


def test_empty_prompt(patched):
    with pytest.raises(ValueError, match="empty prompt"):
        patched(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        patched.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)


def test_wrong_dtype_ids(patched):
    with pytest.raises(ValueError, match="integer token ids"):
        patched(torch.zeros(1, 5))


def test_nan_inputs_embeds(patched):
    with pytest.raises(ValueError, match="NaN"):
        patched(inputs_embeds=torch.full((1, 4, 64), float("nan")))


def test_prompt_of_length_one_matches_unpatched(patched):
    ids = torch.ones(1, 1, dtype=torch.long)
    out = patched.generate(ids, max_new_tokens=6, do_sample=False)
    kvkit.unpatch(patched)
    assert torch.equal(out, patched.generate(ids, max_new_tokens=6, do_sample=False))


def test_max_new_tokens_zero_is_a_clear_error(patched):
    with pytest.raises(ValueError, match="max_new_tokens"):
        patched.generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=0)


def test_inputs_longer_than_budget_keep_the_budget(patched):
    toks, _, cache = greedy(patched, torch.randint(1, 128, (1, 60)), 4)
    assert cache.get_seq_length() == 64
    if str(kvkit.patched_policy(patched)).startswith("streaming"):
        assert max(cache.num_slots()) <= 8 + 4


def test_model_dtype_and_device_moves_after_patch(patched):
    # patching must not put the model object inside its own module tree (recursion in .to())
    patched.to(torch.bfloat16)
    out = patched(torch.ones(1, 12, dtype=torch.long))
    assert out.logits.dtype == torch.bfloat16
    assert isinstance(out.past_key_values, kvkit.KVCache)
    assert out.past_key_values.nbytes() > 0


def test_inputs_embeds_path_uses_kvcache(patched):
    emb = patched.get_input_embeddings()(torch.randint(1, 128, (1, 10)))
    out = patched(inputs_embeds=emb, use_cache=True)
    assert isinstance(out.past_key_values, kvkit.KVCache)


def test_unsupported_transformers_release_is_refused_with_what_to_install():
    from kvkit.patch import check_transformers

    check_transformers("5.23.0")
    check_transformers("5.24.0")
    check_transformers("5.16.0")
    for v in ("5.25.0", "5.15.1", "4.57.6", "6.0.0"):
        with pytest.raises(RuntimeError, match=r"pip install 'transformers>=5.16,<5.25'"):
            check_transformers(v)


@pytest.mark.parametrize("policy", [p for p in kvkit.available_policies() if "calibrated" in kvkit.policy_options(p)])
def test_a_switch_given_as_text_is_refused_and_python_spellings_parse(policy):
    """``--run x=tidal:calibrated=False`` once handed the text "False" to the policy (truthy: the calibration stayed
    on, silently): now ``True``/``False``/``None`` parse as Python's values and a text switch is refused."""
    from kvkit.options import parse_options

    assert parse_options(["calibrated=False,budget=64,name=x"]) == {"calibrated": False, "budget": 64, "name": "x"}
    assert parse_options(["calibrated=false,x=None"]) == {"calibrated": False, "x": None}
    assert kvkit.get_policy(policy, calibrated=False).calibrated is False
    with pytest.raises(ValueError, match="calibrated must be true or false"):
        kvkit.get_policy(policy, calibrated="False")
