"""One exact prefill, replayed into many policies' caches: policy sweeps without re-running the model.

Every kvkit policy runs the prompt's prefill with *exact* attention and compresses afterwards
(``SlotStore.attend``: ``hf_sdpa`` then ``on_prefill``). The hidden states entering each layer during
prefill are therefore the same for every policy, and so are the query / key / value tensors each
layer's attention receives. :func:`record_prefill` runs the prompt once and keeps, per layer, what
``cache.update`` and the attention function were called with; :func:`replay_prefill` feeds those
calls, in layer order, into a fresh ``KVCache`` of whatever policy the model is patched with. The
result is the cache (and the policy's compression decisions) that the policy's own prefill would have
left: this only skips the projections and MLPs, which do not depend on the policy.

Policies whose prefill is *not* exact for every query would diverge; ``replayable(policy)`` says
which ones qualify (`tests/evals/test_shared_prefill.py` checks each against a real prefill, token for token).

A sweep over P policies then costs one prefill + P x (replayed attention + decoding) per sample instead
of P full prefills, which matters wherever the prefill is most of a sample's time (long contexts on a CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kvkit
from kvkit.cache import KVCache
from kvkit.compat import cache_kw
from kvkit.registry import available_policies, policy_class

#: policies whose prefill is not exact attention into the cache with some options: name -> a function of the built
#: policy giving why its recorded prefill cannot be replayed, or None where it can. Every other policy prefills with
#: exact attention and hands the store the prompt's K/V unchanged (``SlotStore.attend``: ``hf_sdpa``, then
#: ``on_prefill``), so a recorded prefill replays into its cache; ``tests/evals/test_shared_prefill.py`` checks
#: each policy replayed here against its own prefill, token for token.
NOT_REPLAYABLE: dict[str, Callable[[object], str | None]] = {
    "kvzip": lambda policy: "its reconstruction pass runs after the prefill (a forward of the repeated context)",
    "chelsea": lambda policy: ("its reconstruction-scored protection runs a pass after the prefill"
                               if policy.reconstructs() else None),
}


def replay_refusal(policy, options: dict | None = None) -> str | None:
    """Why a recorded prefill cannot be replayed into ``policy``'s cache (a name, built with ``options``, or a built
    policy), or None when it can (:data:`NOT_REPLAYABLE`)."""
    if isinstance(policy, str):
        policy = policy_class(policy)(**(options or {}))
    why = NOT_REPLAYABLE.get(policy.name)
    return None if why is None else why(policy)


def replayable(policy, options: dict | None = None) -> bool:
    """Whether a recorded prefill replays into ``policy``'s cache (a name, with ``options`` when given, or a built
    policy): its prefill is exact attention into a store that receives the prompt's K/V unchanged."""
    return replay_refusal(policy, options) is None


def replayable_policies() -> list[str]:
    """The registered policies whose prefill (with their default options) can be replayed."""
    return [name for name in available_policies() if replayable(name)]


@dataclass
class LayerCall:
    key: torch.Tensor
    value: torch.Tensor
    cache_kwargs: dict | None
    module: torch.nn.Module | None = None
    query: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    scaling: float | None = None
    dropout: float = 0.0
    kwargs: dict = field(default_factory=dict)


@dataclass
class PrefillRecording:
    """The per-layer attention inputs of one exact prefill of ``tokens`` prompt tokens (batch ``B``)."""

    calls: dict  # layer_idx -> LayerCall
    tokens: int
    batch: int
    logits: torch.Tensor  # [B, V] logits of the last prompt token
    seconds: float


class _RecordingCache(KVCache):
    """A full-attention ``KVCache`` that keeps what each layer's update and attention were called with."""

    def __init__(self, model):
        super().__init__(model, "full")
        self.calls: dict[int, LayerCall] = {}
        for idx, layer in enumerate(self.layers):
            orig = layer.attend

            def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, _i=idx, _orig=orig, **kw):
                c = self.calls[_i]
                c.module, c.query, c.attention_mask, c.scaling, c.dropout, c.kwargs = (
                    module, query, attention_mask, scaling, dropout, dict(kw))
                return _orig(module, query, key, value, attention_mask, scaling, dropout, **kw)

            layer.attend = attend  # instance attribute: only this cache's stores record

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.calls:
            raise RuntimeError("record_prefill records one forward; the cache was updated twice for a layer")
        # transformers < 5.24 pass cache_kwargs (a dict, positional, or nothing); 5.24 passes the attention's
        # kwargs as kwargs=..., which no kvkit store reads and is not recorded
        ck = args[0] if args else kwargs.get("cache_kwargs")
        self.calls[layer_idx] = LayerCall(key_states, value_states, None if ck is None else dict(ck))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def record_prefill(model, input_ids: torch.Tensor, **forward_kwargs) -> PrefillRecording:
    """Run ``input_ids`` through the kvkit-patched ``model`` once, with exact attention, and record it.

    The model must be patched (any policy: the recording itself uses a full cache). Extra keyword
    arguments (``attention_mask``, ``position_ids``) go to the forward as they would in a real prefill.
    """
    if kvkit.patched_policy(model) is None:
        raise ValueError("record_prefill needs a kvkit-patched model: call kvkit.patch(model, ...) first")
    if input_ids.shape[-1] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    rec = _RecordingCache(model)
    t0 = time.perf_counter()
    out = model(input_ids=input_ids, **cache_kw(rec), use_cache=True, logits_to_keep=1, **forward_kwargs)
    dt = time.perf_counter() - t0
    missing = [i for i, c in rec.calls.items() if c.query is None]
    if len(rec.calls) != len(rec.layers) or missing:
        raise RuntimeError(f"record_prefill: layers {missing or 'some'} were not recorded (not a kvkit attention path)")
    return PrefillRecording(calls=rec.calls, tokens=input_ids.shape[-1], batch=input_ids.shape[0],
                            logits=out.logits[:, -1], seconds=dt)


@torch.no_grad()
def replay_prefill(model, rec: PrefillRecording, cache: KVCache | None = None, *,
                   skip_prompt_attention: bool = False) -> KVCache:
    """A fresh ``KVCache`` of the policy ``model`` is patched with, in the state its own prefill of the
    recorded prompt would leave (same kept slots, same compression). Raises for non-replayable policies.

    ``skip_prompt_attention``: the prompt's own attention output is discarded here (the stores keep K/V and their
    statistics from the query, never the output), so each layer's exact attention is not computed: the stores'
    prefill attention gets ``output_unused=True`` (:func:`kvkit.stores.attend.hf_sdpa` then returns zeros). The
    cache is the same; only the replay's time changes."""
    pol = kvkit.patched_policy(model)
    if pol is None:
        raise ValueError("replay_prefill needs a kvkit-patched model: call kvkit.patch(model, ...) first")
    why = replay_refusal(pol)
    if why is not None:
        raise ValueError(f"policy {pol.name!r} does not prefill with exact attention ({why}); its prefill cannot be "
                         f"replayed (replayable: {', '.join(replayable_policies())}); run its own prefill instead")
    extra = {"output_unused": True} if skip_prompt_attention else {}
    if cache is None:  # the recorded prefill is the new cache's first forward (a static one's prompt_length)
        n = rec.calls[min(rec.calls)].key.shape[-2] if rec.calls else None
        cache = KVCache(model, prompt_length=n)
    if cache.get_seq_length() != 0:
        raise ValueError("replay_prefill needs an empty cache")
    for idx in sorted(rec.calls):
        c = rec.calls[idx]
        # clones: a store may keep (and later modify in place) the very tensors it is given
        k, v = cache.update(c.key.clone(), c.value.clone(), idx, c.cache_kwargs)
        # the store is called directly, as kvkit's attention function calls it (the binding is per call: nothing
        # is set on the shared attention module, so replays in several threads do not meet)
        cache.layers[idx].attend(c.module, c.query.clone(), k, v, c.attention_mask, c.scaling, c.dropout, **c.kwargs,
                                 **extra)
    return cache


__all__ = ["LayerCall", "NOT_REPLAYABLE", "PrefillRecording", "record_prefill", "replay_prefill", "replay_refusal",
           "replayable", "replayable_policies"]
