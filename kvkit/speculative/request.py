"""The checks of a :func:`kvkit.speculative.generate` call and the settings read from its arguments: the drafting
arguments, the prompt and its mask, the generation config (sampling, length, EOS / padding), the assistant's
tokenizer (:func:`check_assistant`) and the target's cache and policy (:func:`check_target_policy`)."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvkit.cache import KVCache
from kvkit.speculative.draft import make_view
from kvkit.speculative.rows import batch_cache
from kvkit.stores import FullStore, SlotStore

#: adaptive=True stops drafting when the draft's top probability falls below this
#: (transformers' default ``assistant_confidence_threshold``)
ADAPTIVE_THRESHOLD = 0.4
#: keyword arguments read into the generation config on direct calls
GENERATION_KEYS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                   "pad_token_id", "return_dict_in_generate")


def _vocab_size(model) -> int:
    """The number of token ids ``model`` scores: its output embedding's rows, else the text config's vocab_size."""
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return emb.weight.shape[0]
    return model.config.get_text_config(decoder=True).vocab_size


def check_assistant(model, assistant, tokenizer=None, assistant_tokenizer=None) -> None:
    """Raise ValueError unless ``assistant`` shares ``model``'s tokenizer (vocabulary and special tokens)."""
    va, vt = _vocab_size(assistant), _vocab_size(model)
    name_a = getattr(assistant.config, "_name_or_path", "") or type(assistant).__name__
    if va != vt:
        raise ValueError(
            f"the assistant model ({name_a}) has a vocabulary of {va} tokens but the target has {vt}: the assistant "
            "must share the target's tokenizer (e.g. Qwen2.5-Coder 0.5B for 1.5B)"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        a = getattr(assistant.generation_config, attr, None)
        t = getattr(model.generation_config, attr, None)
        if a is not None and t is not None and a != t:
            raise ValueError(f"the assistant's {attr} ({a}) differs from the target's ({t}): different tokenizers")
    if tokenizer is not None and assistant_tokenizer is not None and tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
        raise ValueError("the assistant's tokenizer differs from the target's; speculative decoding needs the same one")


def check_target_policy(policy) -> None:
    """Refuse target policies under which speculation would not reproduce the patched model's own decoding."""
    reason = getattr(policy, "speculative_refusal", None)
    if reason is not None:
        raise ValueError(
            f"speculative decoding over a {policy.name!r} target is not lossless: {reason}. "
            f"Use the {policy.name!r} model's plain generate, or speculate over a full/streaming target (e.g. "
            "kvkit.patch(model, 'full'))"
        )


def _int_arg(name: str, value) -> int:
    """``value`` when it is an integer >= 1 (not a bool); ValueError naming the argument ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def logits_processors(gc, do_sample) -> LogitsProcessorList:
    """Temperature / top-k / top-p warpers of ``gc`` (direct calls; ``model.generate`` passes its own list)."""
    lp = LogitsProcessorList()
    if not do_sample:
        return lp
    temperature, top_k, top_p = gc.temperature, gc.top_k, gc.top_p
    if temperature is not None and temperature != 1.0:
        lp.append(TemperatureLogitsWarper(temperature))
    if top_k:
        lp.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        lp.append(TopPLogitsWarper(top_p))
    return lp


def target_cache(model, cache, batch: int, prompt_len: int) -> tuple[KVCache, int]:
    """The target's cache and how many prompt columns it already holds: ``cache`` when it is a ``KVCache`` (holding
    fewer than ``prompt_len`` tokens), else a new one of the patched policy (at ``batch`` > 1 one that keeps every
    slot, :func:`batch_cache`, unless the policy's has slot stores); ValueError for another cache, a policy
    speculation cannot reproduce (:func:`check_target_policy`) or, at ``batch`` > 1, a cache that cannot hold holes."""
    if isinstance(cache, KVCache):
        held = cache.get_seq_length()
        if held >= prompt_len:
            raise ValueError(f"past_key_values already holds {held} tokens; input_ids must extend it")
    elif cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
        cache, held = KVCache(model, prompt_length=prompt_len), 0  # the patched policy's, for a prefill of the prompt
        if batch > 1 and not any(isinstance(layer, SlotStore) for layer in cache.layers):
            cache = batch_cache(model)
    else:
        raise ValueError("kvkit.speculative.generate needs a kvkit.KVCache (or no cache) as past_key_values")
    check_target_policy(cache.policy)
    if batch > 1:
        bad = [type(layer).__name__ for layer in cache.layers if not isinstance(layer, FullStore)]
        if bad:
            raise ValueError(
                f"at batch > 1 the target cache must keep every slot (FullStore layers; this one has {bad[0]}): rows "
                "accept different numbers of drafts and the rejected ones stay as masked holes, which a compressing or "
                "sliding-window store cannot hold. Pass no cache, or kvkit.speculative.batch_cache(model); or run "
                "the rows one at a time"
            )
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()  # keep rejected tokens croppable on sliding layers
    return cache, held


def drafting_setup(draft, draft_policy, draft_options, gamma, assistant_gamma):
    """Check :func:`generate`'s drafting arguments; returns ``(view, gamma, assistant_gamma)``: the draft view of
    ``draft_policy`` with ``draft_options`` (:func:`make_view`) and the two draft lengths, integers >= 1
    (``assistant_gamma`` defaults to ``gamma``)."""
    if draft != "self":
        raise ValueError(f"draft must be 'self' (the sparse-KV self-draft), got {draft!r}; pass a small model as assistant=")
    gamma = _int_arg("gamma", gamma)
    assistant_gamma = _int_arg("assistant_gamma", assistant_gamma if assistant_gamma is not None else gamma)
    return make_view(draft_policy, draft_options), gamma, assistant_gamma


def prompt_mask(input_ids, mask, streamer) -> torch.Tensor:
    """Check ``input_ids`` (``[B, T]``, B and T >= 1), its ``attention_mask`` ``mask`` (None: all ones; else a tensor
    of input_ids' shape marking left padding only) and that a ``streamer`` comes with B == 1; returns the mask on
    input_ids' device."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    if mask is None:
        mask = torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
    mask = mask.to(input_ids.device)
    if not bool((mask.long().diff(dim=1) >= 0).all()) or not bool(mask[:, -1].all()):
        raise ValueError("attention_mask must mark left padding only (0s then 1s in every row): pad on the left")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("a streamer takes batch size 1, as in model.generate")
    return mask


def real_token_counts(input_ids, mask):
    """``(prompt, mask)`` to decode: at batch 1 with left padding, the row's real tokens ``[1, n]`` and a mask of
    ones (one row: decode its real tokens only); otherwise ``input_ids`` and ``mask`` as they are."""
    if input_ids.shape[0] == 1 and not bool(mask.all()):
        return input_ids[:, mask[0].bool()], torch.ones_like(input_ids[:, mask[0].bool()])
    return input_ids, mask


def request_generation_config(model, generation_config, model_kwargs: dict):
    """A copy of ``generation_config`` (given by ``model.generate``) or, on a direct call, of the model's, updated
    with the :data:`GENERATION_KEYS` popped from ``model_kwargs``."""
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    gc.update(**{k: model_kwargs.pop(k) for k in GENERATION_KEYS if k in model_kwargs})
    return gc


def adaptive_threshold(adaptive) -> float | None:
    """The draft-confidence threshold of ``adaptive``: :data:`ADAPTIVE_THRESHOLD` for True, None for False / None,
    the value itself in (0, 1); ValueError otherwise."""
    if adaptive is True:
        return ADAPTIVE_THRESHOLD
    if adaptive is False or adaptive is None:
        return None
    if isinstance(adaptive, (int, float)) and 0 < adaptive < 1:
        return float(adaptive)
    raise ValueError(f"adaptive must be a bool or a threshold in (0, 1), got {adaptive!r}")


def request_max_new_tokens(gc, prompt_len: int) -> int:
    """Tokens to generate per row: ``gc.max_new_tokens``, else transformers' default, ``gc.max_length`` (which counts
    the prompt) minus ``prompt_len``; may be < 1 (nothing to generate)."""
    if gc.max_new_tokens is not None:
        return gc.max_new_tokens
    return gc.max_length - prompt_len


def eos_and_pad(gc) -> tuple[list, int]:
    """``(eos, pad_id)``: ``gc``'s EOS token ids as a list (empty without one) and the padding id of rows that stop
    early (``gc.pad_token_id``, else the first EOS id, else 0)."""
    eos = gc.eos_token_id
    eos = [] if eos is None else list(eos if isinstance(eos, (list, tuple)) else [eos])
    return eos, gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
