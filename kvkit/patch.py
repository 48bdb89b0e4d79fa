"""``patch``/``unpatch``: install a policy on a loaded transformers model through the official seams.

* registers :func:`kvkit.attention.kvkit_attention` under ``"kvkit"`` with ``AttentionInterface`` and
  transformers' sdpa mask builder under the same name with ``AttentionMaskInterface`` (without it
  padding masks would silently arrive as ``None``), then ``model.set_attn_implementation("kvkit")``;
* a forward pre-hook on the base model swaps in a ``KVCache`` when ``generate()``/the caller gives
  none or an empty transformers cache;
* a forward pre-hook on each attention module hands the attention function its layer store;
* a forward hook on the base model runs the policy's ``after_forward`` (KVzip's reconstruction pass);
* ``model.generate`` checks the request's length first (and hands a static patch's request a cache sized
  for it), ``model.get_compiled_call`` runs each compiled decode step through :func:`_compiled_step`.

No forward is replaced and no modeling file is copied; ``unpatch`` removes the hooks and restores the
previous attention implementation.

Static caches (``patch(model, policy, static=True)``) and ``torch.compile``: the hooks trace without graph
breaks (under ``torch.compiler.is_compiling()`` they skip the checks that read device values; the context
length is checked by the step wrapper and by ``generate`` on host ints), so a single-token decode forward
compiles whole with ``fullgraph=True``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvkit.attention import kvkit_attention
from kvkit.cache import KVCache, check_static
from kvkit.compat import get_cache, set_cache
from kvkit.model_info import context_limit
from kvkit.policies.base import Policy
from kvkit.registry import get_policy

ATTN_NAME = "kvkit"


@dataclass
class PatchState:
    policy: Policy
    old_impl: object
    handles: list = field(default_factory=list)
    attn_modules: list = field(default_factory=list)
    allow_beyond_context: bool = False
    warned_beyond_context: bool = False
    own_generate: bool = False  # patch() set the context-checking model.generate (unpatch removes it)
    own_compiled_call: bool = False  # patch() set model.get_compiled_call (compiled steps through _compiled_step)
    static: bool = False  # the caches it builds are static (``KVCache(..., static=True)``)
    max_length: int | None = None  # their least capacity


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, kvkit_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model) -> list:
    mods = []
    for _, m in model.named_modules():
        if hasattr(m, "layer_idx") and (hasattr(m, "k_proj") or hasattr(m, "qkv_proj")) and hasattr(m, "scaling"):
            mods.append(m)
    return mods


def check_model(model, policy: Policy) -> None:
    """Raise a clear ValueError when kvkit cannot run ``policy`` on ``model``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"kvkit.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    arch = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"kvkit supports decoder-only causal LMs; {arch} ({config.model_type}) is an encoder-decoder model"
        )
    tc = config.get_text_config(decoder=True)
    if getattr(tc, "kv_lora_rank", None):
        raise ValueError(f"kvkit does not support multi-head latent attention (MLA) models such as {arch}")
    if getattr(tc, "attn_logit_softcapping", None):
        raise ValueError(
            f"{arch} ({tc.model_type}) uses attention logit soft-capping, which kvkit's attention kernels "
            "do not implement (transformers has no sdpa path for it either)"
        )
    if policy.needs_rope and not any(n.endswith("rotary_emb") for n, _ in model.named_modules()):
        raise ValueError(
            f"kvkit policies need rotary position embeddings (RoPE); {arch} ({tc.model_type}) has none "
            "(absolute/learned positions are not supported)"
        )
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(
            f"kvkit found no attention modules with q/k/v projections and a layer index in {arch}; "
            "this architecture is not supported"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{arch} does not support custom attention functions (transformers' AttentionInterface); "
            "kvkit cannot patch it"
        )
    policy.validate(tc)


def _check_inputs(args, kwargs) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        if ids.shape[-1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens (give at least one token, e.g. the BOS token)")
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor):
        if emb.shape[1] == 0:
            raise ValueError("empty prompt: inputs_embeds has no positions")
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(emb).all()):  # a sync: eager only
            raise ValueError("inputs_embeds contains NaN or inf values")


def check_context(model, cached: int, new: int, where: str = "this forward") -> None:
    """Refuse ``cached + new`` tokens beyond the model's trained context, unless the patch allowed it (warn then).

    Positions past ``max_position_embeddings`` were never trained: RoPE extrapolates and the output degrades
    silently, whatever the policy keeps in its cache (it still uses the true positions).
    """
    limit = context_limit(model)
    total = cached + new
    if limit is None or total <= limit:
        return
    state = getattr(model, "_kvkit_state", None)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if state is not None and state.allow_beyond_context:
        if not state.warned_beyond_context:
            state.warned_beyond_context = True
            warnings.warn(
                f"kvkit: {total} tokens exceed the trained context of {limit} tokens of {name} "
                "(config.max_position_embeddings); running anyway because of allow_beyond_context=True, "
                "expect degraded output beyond it",
                stacklevel=3,
            )
        return
    have = f"the cache holds {cached} tokens and {where} adds {new}" if cached else f"{where} has {new} tokens"
    raise ValueError(
        f"{total} tokens exceed the trained context of {limit} tokens of {name} (config.max_position_embeddings): "
        f"{have}. Positions beyond it were never trained and output degrades silently. Shorten the prompt so "
        f"prompt + max_new_tokens <= {limit} (e.g. keep its last tokens), or opt in with "
        "kvkit.patch(model, policy, allow_beyond_context=True, ...) to run anyway (a warning is issued)"
    )


def _new_tokens(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return ids.shape[-1]
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor) and emb.dim() >= 2:
        return emb.shape[1]
    return 0


def _model_pre_hook(model_ref, module, args, kwargs):
    """Check the inputs and the context length; swap an absent or empty transformers cache for a ``KVCache``.

    Under ``torch.compile`` (a compiled decode step) it only checks what costs no host read: the cache was built
    and checked by the eager prefill, and the context length of a ``generate`` request by ``model.generate``
    before it ran (a compiled loop of one's own is checked by nobody: keep it within the context)."""
    _check_inputs(args, kwargs)
    pkv = get_cache(kwargs)
    if torch.compiler.is_compiling() and isinstance(pkv, KVCache):
        return None
    model = model_ref()
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
        check_context(model, cached, _new_tokens(args, kwargs))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if use_cache is False:
        return None
    if pkv is None or (type(pkv) is DynamicCache and pkv.get_seq_length() == 0):
        set_cache(kwargs, KVCache(model))
        return args, kwargs
    return None


def _model_post_hook(module, args, kwargs, output):
    """After a forward of the base model: the policy's ``after_forward`` (only policies that define one)."""
    pkv = get_cache(kwargs)
    if isinstance(pkv, KVCache) and type(pkv.policy).after_forward is not Policy.after_forward:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pkv.policy.after_forward(module, pkv, ids if isinstance(ids, torch.Tensor) else None,
                                 kwargs.get("attention_mask"))
    return None


def _generate_checked(model_ref, generate, *args, **kwargs):
    """``model.generate`` while patched: refuse a request whose prompt + ``max_new_tokens`` crosses the trained
    context before anything runs (instead of at the crossing step, losing the tokens generated so far).

    With a static patch and no cache given, it hands ``generate`` a static ``KVCache`` with room for the prompt +
    the tokens to generate: transformers sees a compileable cache before its loop starts, so it compiles the decode
    forward on CUDA (``GenerationMixin._valid_auto_compile_criteria``), and no compiled step needs to grow it."""
    model = model_ref()
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    n = ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else 0
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_len = kwargs.get("max_length", getattr(gc, "max_length", None))
    max_new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None) if "max_length" not in kwargs else None)
    if max_new is None:
        max_new = max(max_len - n, 0) if isinstance(max_len, int) else 0
    if n and isinstance(max_new, int) and max_new > 0:
        check_context(model, 0, n + max_new, where=f"the request (prompt {n} + max_new_tokens {max_new})")
    state = getattr(model, "_kvkit_state", None)
    if (state is not None and state.static and get_cache(kwargs) is None and kwargs.get("use_cache") is not False
            and kwargs.get("cache_implementation") is None and kwargs.get("custom_generate") is None):
        emb = kwargs.get("inputs_embeds")
        n = n or (emb.shape[1] if isinstance(emb, torch.Tensor) and emb.dim() >= 2 else 0)
        room = max_new if isinstance(max_new, int) and max_new > 0 else (max_len if isinstance(max_len, int) else 0)
        cache = KVCache(model)
        cache.ensure_capacity(n + room)
        set_cache(kwargs, cache)
    return generate(*args, **kwargs)


def _compiled_call(model_ref, get_compiled_call, compile_config=None):
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
    T = _new_tokens(args, kwargs)
    model = model_ref()
    if T != 1 or cache.get_seq_length() == 0:  # a prefill (chunk) or a verification forward: eager, as always
        return model(*args, **kwargs)
    if not cache.scoring_pass:
        check_context(model, cache.get_seq_length(), T)
    cache.before_compiled_step(T)
    out = compiled(*args, **kwargs)
    cache.after_compiled_step(T)
    return out


def _attn_pre_hook(module, args, kwargs):
    pkv = get_cache(kwargs)
    module._kvkit_store = pkv.layers[module.layer_idx] if isinstance(pkv, KVCache) else None
    return None


#: transformers releases kvkit's cache and attention hooks are written for (5.24 renamed the cache argument:
#: :mod:`kvkit.compat`)
TRANSFORMERS_SUPPORTED = ("5.0", "5.25")


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers release outside :data:`TRANSFORMERS_SUPPORTED` with what to install."""
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    low, high = TRANSFORMERS_SUPPORTED
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"kvkit supports transformers >= {low}, < {high}; this environment has {version} (a release can change "
            f"the attention layers' cache API, as 5.24 did). Install a supported one: "
            f"pip install 'transformers>={low},<{high}'"
        )


def patch(model, policy="full", *, allow_beyond_context: bool = False, static: bool = False,
          max_length: int | None = None, **options):
    """Install a kvkit policy on ``model`` (in place) and return the model.

    ``kvkit.patch(model, "streaming", budget=512)``; afterwards ``model.generate`` and
    ``model(..., use_cache=True)`` use a ``kvkit.KVCache`` without extra arguments. Patching an
    already-patched model replaces the previous policy.

    A forward whose cached + new tokens exceed the model's trained context (``max_position_embeddings``)
    raises a ``ValueError``; ``allow_beyond_context=True`` runs it anyway with a warning.

    ``static=True``: the caches kvkit builds are static (:class:`kvkit.KVCache`): a decode step of fixed shapes
    that ``torch.compile(fullgraph=True)`` captures whole; ``model.generate`` then hands transformers a cache
    sized to the prompt + ``max_new_tokens`` (at least ``max_length``), which it compiles on CUDA by itself (on
    the CPU with a ``compile_config`` whose ``_compile_all_devices`` is True). Raises ``ValueError`` for a policy
    without static stores.
    """
    if not isinstance(allow_beyond_context, bool):
        raise ValueError(f"allow_beyond_context must be True or False, got {allow_beyond_context!r}")
    check_static(static, max_length)
    check_transformers()
    pol = get_policy(policy, **options)
    check_model(model, pol)
    if static:
        KVCache(model, pol, static=True, max_length=max_length)  # refuses a policy without static stores
    if getattr(model, "_kvkit_state", None) is not None:
        unpatch(model)
    _register()
    state = PatchState(policy=pol, old_impl=model.config._attn_implementation,
                       allow_beyond_context=allow_beyond_context, static=static, max_length=max_length)
    model.set_attn_implementation(ATTN_NAME)
    hook = functools.partial(_model_pre_hook, weakref.ref(model))
    state.handles.append(model.base_model.register_forward_pre_hook(hook, with_kwargs=True))
    state.handles.append(model.base_model.register_forward_hook(_model_post_hook, with_kwargs=True))
    for m in _attention_modules(model):
        m._kvkit_store = None
        state.handles.append(m.register_forward_pre_hook(_attn_pre_hook, with_kwargs=True))
        state.attn_modules.append(m)
    state.own_generate = "generate" not in vars(model)
    if state.own_generate:
        model.generate = functools.partial(_generate_checked, weakref.ref(model), model.generate)
    state.own_compiled_call = "get_compiled_call" not in vars(model)
    if state.own_compiled_call:
        model.get_compiled_call = functools.partial(_compiled_call, weakref.ref(model), model.get_compiled_call)
    model._kvkit_state = state
    return model


def unpatch(model):
    """Remove kvkit from ``model``: hooks, attributes and the previous attention implementation."""
    state = getattr(model, "_kvkit_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for m in state.attn_modules:
        if hasattr(m, "_kvkit_store"):
            del m._kvkit_store
    model.set_attn_implementation(state.old_impl)
    if getattr(state, "own_generate", False) and "generate" in vars(model):
        del model.generate
    if getattr(state, "own_compiled_call", False) and "get_compiled_call" in vars(model):
        del model.get_compiled_call
    del model._kvkit_state
    return model


def patched_policy(model) -> Policy | None:
    state = getattr(model, "_kvkit_state", None)
    return None if state is None else state.policy


__all__ = ["patch", "unpatch", "patched_policy", "check_model", "check_context", "context_limit", "Cache"]
