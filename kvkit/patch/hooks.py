"""The hooks and wrappers a patch installs, and the weak model reference they reach their model through.

* :func:`model_pre_hook` (forward pre-hook of the base model): checks the inputs and the context, hands a forward
  without a cache a new ``KVCache`` and splits the first forward of an assisted generation
  (:func:`_split_first_forward`);
* :func:`model_post_hook` (forward hook of the base model): the policy's ``after_forward``, and the split
  forward's outputs joined again (:func:`_join_outputs`);
* :func:`attn_pre_hook` (forward pre-hook of each attention module): binds the call's layer store;
* :func:`compiled_call` / :func:`_compiled_step`: ``model.get_compiled_call`` while patched.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers.cache_utils import Cache

from kvkit.cache import KVCache
from kvkit.compat import get_cache, set_cache
from kvkit.patch.checks import check_context, check_foreign_cache, check_inputs, forward_new_tokens
from kvkit.policies.base import Policy


class ModelRef:
    """A weak reference to the patched model (its hooks and wrappers hold no strong one: ``del model`` frees it) that
    a deep copy re-targets at the copy: ``copy.deepcopy(model)`` copies the model first (``copy`` records it in
    ``memo`` before copying its attributes), so the copied hooks / wrappers find the copied model, never the
    original. Copying a part of a patched model that holds such a reference (its base model) without the model
    is refused: the copy's hooks would belong to no patched model."""

    __slots__ = ("_ref",)

    def __init__(self, model):
        self._ref = weakref.ref(model)

    def __call__(self):
        return self._ref()

    def __deepcopy__(self, memo):
        model = self._ref()
        twin = memo.get(id(model)) if model is not None else None
        if twin is None:
            raise TypeError(
                "copy.deepcopy of a part of a kvkit-patched model (its base model carries kvkit's hooks, which "
                "belong to the whole model): deep-copy the whole model (copy.deepcopy(model) is an independent "
                "patched model), or kvkit.unpatch(model) before copying the part"
            )
        return ModelRef(twin)

    def __reduce__(self):
        raise TypeError("a kvkit-patched model cannot be pickled: kvkit.unpatch(model) first, patch the loaded one")


def model_pre_hook(model_ref, module, args, kwargs):
    """Check the inputs and the context length; give a forward without a cache a new ``KVCache``; refuse a
    transformers cache under a compressing policy (:func:`check_foreign_cache`); split the first forward of an
    assisted generation (:func:`_split_first_forward`).

    Under ``torch.compile`` (a compiled decode step) it only checks what costs no host read: the cache was built
    and checked by the eager prefill, and the context length of a ``generate`` request by ``model.generate``
    before it ran (a compiled loop of one's own is checked by nobody: keep it within the context)."""
    check_inputs(args, kwargs)
    pkv = get_cache(kwargs)
    if torch.compiler.is_compiling() and isinstance(pkv, KVCache):
        return None
    model = model_ref()
    check_foreign_cache(model, pkv)
    if isinstance(pkv, KVCache) and pkv.infos and model is not None:
        tc = model.config.get_text_config(decoder=True)
        want = (tc.num_hidden_layers, tc.num_key_value_heads or tc.num_attention_heads)
        have = (len(pkv.layers), pkv.infos[0].num_kv_heads)
        if want != have:
            raise ValueError(
                f"this KVCache was built for another model ({have[0]} layers, {have[1]} KV heads; this model has "
                f"{want[0]} and {want[1]}): build it with kvkit.KVCache(model, ...) for the model you run"
            )
    cached = pkv.get_seq_length() if isinstance(pkv, Cache) else 0
    if not getattr(pkv, "scoring_pass", False):  # a policy's scoring forward is rolled back (KVzip)
        check_context(model, cached, forward_new_tokens(args, kwargs))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if use_cache is False:
        return None
    if pkv is None:  # this forward is the new cache's first: a static one resolves a ratio for its length
        set_cache(kwargs, KVCache(model, prompt_length=forward_new_tokens(args, kwargs) or None))
        return args, kwargs
    if isinstance(pkv, KVCache):
        prompt = pkv.__dict__.pop("_kvkit_prompt", None)  # only the first forward into it
        if prompt is not None and cached == 0 and 0 < prompt < forward_new_tokens(args, kwargs):
            return _split_first_forward(module, args, kwargs, pkv, prompt)
    return None


#: the forward's per-token inputs (their token dimension: 1, or 0 for a 1-d ``cache_position``), cut at the
#: prompt's end by :func:`_split_first_forward`
_PER_TOKEN = ("input_ids", "inputs_embeds", "position_ids", "cache_position", "token_type_ids")


def _split_first_forward(base_model, args, kwargs, cache: KVCache, prompt: int):
    """The first forward of transformers' assisted / prompt-lookup generation carries the prompt *and* the first
    candidates (``prompt + k`` tokens into the empty cache). A policy prefills whatever its first forward carries
    and compresses it, so the candidates would be compressed with the prompt and could not be cropped when rejected.
    Here that forward runs as plain ``generate`` runs it: the prompt alone first (a nested forward of the base
    model: the policy's prefill and compression over exactly the prompt), then the candidates as a verification
    forward over the cache (croppable: compression only runs at the start of a forward). The two outputs are joined
    again by :func:`model_post_hook`, so the model returns the ``prompt + k`` positions it was asked for."""
    if args:  # the ids given positionally: as a keyword, to cut them like the rest
        kwargs = {"input_ids": args[0], **kwargs}
        args = ()
    head, tail = dict(kwargs), dict(kwargs)
    for name in _PER_TOKEN:
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            dim = 0 if x.dim() == 1 else 1
            head[name], tail[name] = x.narrow(dim, 0, prompt), x.narrow(dim, prompt, x.shape[dim] - prompt)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # [B, past + new]: the tail keeps it whole
        head["attention_mask"] = mask[:, :prompt]
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:  # [B, 1, new, past + new]
        head["attention_mask"], tail["attention_mask"] = mask[..., :prompt, :prompt], mask[..., prompt:, :]
    elif mask is not None:
        raise ValueError(f"kvkit cannot split a first forward whose attention_mask is a {type(mask).__name__}")
    cache.__dict__["_kvkit_prefix_output"] = base_model(**head)
    return args, tail


def _join_outputs(first, output):
    """``first`` (the prompt's forward) and ``output`` (the candidates') as one output over all their positions."""
    def cat(a, b):
        return b if a is None or b is None else torch.cat([a, b], dim=1)

    if isinstance(output, tuple):
        return (cat(first[0], output[0]), *output[1:])
    output.last_hidden_state = cat(first.last_hidden_state, output.last_hidden_state)
    hidden = getattr(output, "hidden_states", None)
    if hidden is not None and getattr(first, "hidden_states", None) is not None:
        output.hidden_states = tuple(cat(a, b) for a, b in zip(first.hidden_states, hidden))
    return output


def model_post_hook(module, args, kwargs, output):
    """After a forward of the base model: the policy's ``after_forward`` (only policies that define one); the
    outputs of a split first forward joined (:func:`_split_first_forward`)."""
    pkv = get_cache(kwargs)
    if not isinstance(pkv, KVCache):
        return None
    if type(pkv.policy).after_forward is not Policy.after_forward:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pkv.policy.after_forward(module, pkv, ids if isinstance(ids, torch.Tensor) else None,
                                 kwargs.get("attention_mask"))
    first = pkv.__dict__.pop("_kvkit_prefix_output", None) if not torch.compiler.is_compiling() else None
    return None if first is None else _join_outputs(first, output)


def compiled_call(model_ref, get_compiled_call, compile_config=None):
    """``model.get_compiled_call`` while patched (what ``generate`` decodes with when it compiles): transformers'
    compiled ``__call__``, run through :func:`_compiled_step`."""
    return functools.partial(_compiled_step, model_ref, get_compiled_call(compile_config))


def _compiled_step(model_ref, compiled, *args, **kwargs):
    """One compiled single-token forward over a ``KVCache``, with the eager work around it: the context check and
    the stores' ``before_compiled_step`` (due compression events, room) before, ``after_compiled_step`` (the host
    copies of the lengths) after, all on host copies (no synchronisation). Forwards of several tokens and the
    first forward into an empty cache (prefill, chunked prefill, speculative verification) run eagerly. Also the
    entry point of a compiled loop of one's own: ``step = model.get_compiled_call(CompileConfig(fullgraph=True))``,
    then ``step(input_ids=..., cache=..., use_cache=True)``."""
    cache = get_cache(kwargs)
    if not isinstance(cache, KVCache):
        return compiled(*args, **kwargs)
    T = forward_new_tokens(args, kwargs)
    model = model_ref()
    if T != 1 or cache.get_seq_length() == 0:  # a prefill (chunk) or a verification forward: eager, as always
        return model(*args, **kwargs)
    if not cache.scoring_pass:
        check_context(model, cache.get_seq_length(), T)
    cache.before_compiled_step(T)
    out = compiled(*args, **kwargs)
    cache.after_compiled_step(T)
    return out


#: the keyword argument that carries a layer's store from kvkit's attention pre-hook to the attention function
STORE_KWARG = "kvkit_store"


def attn_pre_hook(module, args, kwargs):
    """Bind this call's layer store: ``kvkit_store=cache.layers[layer_idx]`` joins the attention module's keyword
    arguments, which its forward hands on to the registered attention function
    (:func:`kvkit.attention.kvkit_attention`). The binding lives in the call, not on the module shared by every
    caller: concurrent forwards (threads) each read their own cache's store, and it traces under
    ``torch.compile(fullgraph=True)`` (a dict entry, no module attribute mutation). Without a ``KVCache`` (a
    transformers cache under ``full``, ``use_cache=False``) nothing is bound and the attention is transformers'
    sdpa."""
    pkv = get_cache(kwargs)
    if not isinstance(pkv, KVCache):
        return None
    if module.layer_idx >= len(pkv.layers):
        raise ValueError(f"this KVCache has {len(pkv.layers)} layers but attention layer {module.layer_idx} ran: it was "
                         "built for another model; build it with kvkit.KVCache(model, ...) for the model you run")
    kwargs[STORE_KWARG] = pkv.layers[module.layer_idx]
    return args, kwargs
