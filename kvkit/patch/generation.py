"""``model.generate`` while patched (:func:`generate_checked`): the call bound to ``generate``'s signature
(:func:`_bind`), checked (the trained context, a caller's cache, assisted generation over a lossy policy) and handed
the policy's ``KVCache`` (:func:`_policy_cache`)."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch

from kvkit.cache import KVCache, static_policies
from kvkit.compat import get_cache, set_cache
from kvkit.patch.checks import check_context, check_foreign_cache
from kvkit.state import PatchState, patch_state


def _generation_value(name: str, kwargs: dict, generation_config, model):
    """A generation setting as ``generate`` resolves it: a keyword argument, else the ``generation_config`` passed
    (where set), else the model's ``generation_config``."""
    if name in kwargs:
        return kwargs[name]
    for cfg in (generation_config, getattr(model, "generation_config", None)):
        value = getattr(cfg, name, None) if cfg is not None else None
        if value is not None:
            return value
    return None


#: ``cache_implementation`` values that mean transformers' default cache (5.24 drops a checkpoint's "hybrid" itself)
_DEFAULT_CACHES = (None, "dynamic", "hybrid")


@dataclass
class _Request:
    """A ``generate`` call bound to its signature (:func:`_bind`).

    ``bound``: its arguments (``named`` is ``bound.arguments``); ``var_kw``: the name of ``generate``'s ``**kwargs``
    (None if it has none); ``extra``: a copy of what the call passed through it, which the checks update and
    :func:`generate_checked` writes back; ``gen_cfg``: the ``generation_config`` passed (None if none); ``n``: the
    prompt's tokens (``inputs`` / ``input_ids``' last dimension or ``inputs_embeds``' second, the larger; 0 without
    either); ``max_new`` / ``max_len``: ``max_new_tokens`` and ``max_length`` as ``generate`` resolves them
    (``max_new`` is ``max_len - n``, at least 0, when unset and ``max_len`` is an int; 0 when neither is)."""

    bound: inspect.BoundArguments
    var_kw: str | None
    extra: dict
    gen_cfg: object
    n: int
    max_new: object
    max_len: object

    @property
    def named(self) -> dict:
        """The bound arguments by name (``bound.arguments``, live: writing it changes the call)."""
        return self.bound.arguments

    def value(self, name: str, model):
        """The generation setting ``name`` as ``generate`` resolves it (:func:`_generation_value`)."""
        return _generation_value(name, self.extra, self.gen_cfg, model)


def _bind(generate, args: tuple, kwargs: dict, model) -> _Request | None:
    """``generate(*args, **kwargs)`` bound to ``generate``'s signature, with its prompt length and token budget read
    from every place a call can give them (:class:`_Request`); None when the arguments do not bind (a malformed
    call, which ``generate`` itself then refuses)."""
    sig = inspect.signature(generate)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    named = bound.arguments
    extra = dict(named.get(var_kw, {})) if var_kw else {}
    gen_cfg = named.get("generation_config")

    ids = named.get("inputs")
    if not isinstance(ids, torch.Tensor):
        ids = extra.get("input_ids")
    emb = extra.get("inputs_embeds")
    n = ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else 0
    if isinstance(emb, torch.Tensor) and emb.dim() >= 2:
        n = max(n, emb.shape[1])
    max_new = _generation_value("max_new_tokens", extra, gen_cfg, model)
    max_len = _generation_value("max_length", extra, gen_cfg, model)
    if max_new is None:
        max_new = max(max_len - n, 0) if isinstance(max_len, int) else 0
    return _Request(bound, var_kw, extra, gen_cfg, n, max_new, max_len)


def _is_assisted(req: _Request, model, custom: bool) -> bool:
    """True when the request is transformers' assisted generation (``assistant_model=``, or prompt lookup, early
    exit or MTP candidates from a keyword or either generation config) with one beam and no ``custom_generate``."""
    assisted = (req.named.get("assistant_model") is not None
                or any(req.value(k, model) not in (None, False)
                       for k in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")))
    return assisted and (req.value("num_beams", model) or 1) == 1 and not custom


def _refuse_lossy_assisted(assisted: bool, policy) -> None:
    """Raise ValueError for assisted generation over ``policy`` when its ``speculative_refusal`` gives a reason (a
    speculative round cannot reproduce its compression); return otherwise."""
    reason = getattr(policy, "speculative_refusal", None)
    if assisted and reason is not None:
        name = policy.name
        raise ValueError(
            f"assisted generation (assistant_model= / prompt_lookup_num_tokens=) over a model patched with {name!r} "
            f"is not lossless: {reason}. Use the {name!r} model's plain generate, or a policy whose rounds decode as "
            "one-token steps do (e.g. 'streaming' or 'full')"
        )


def _wants_static(impl, state: PatchState) -> bool:
    """Whether the policy's cache for a request with ``cache_implementation=impl`` is static: True for
    ``"static"`` (ValueError for a policy without static stores), the patch's ``static`` for transformers' default
    caches; ValueError for any other implementation under a compressing policy (it would run without the policy)."""
    name = state.policy.name
    if impl == "static":
        if not type(state.policy).static_capable:
            raise ValueError(
                f"cache_implementation='static' on a model patched with {name!r}: transformers' StaticCache would "
                f"run without {name!r}'s compression, and {name!r} has no static cache (kvkit's static caches: "
                f"{', '.join(static_policies())}). Drop cache_implementation (kvkit's policy decides the cache)"
            )
        return True
    if impl not in _DEFAULT_CACHES and name != "full":
        raise ValueError(
            f"cache_implementation={impl!r} on a model patched with {name!r} asks transformers for its own cache, "
            f"which would run without {name!r}'s compression. Drop it (kvkit's policy decides the cache; "
            f"cache_implementation='static' gives the policy's static cache where it has one: "
            f"{', '.join(static_policies())}), or kvkit.unpatch(model) first"
        )
    return state.static


def _drop_cache_implementation(req: _Request, model) -> None:
    """Unset ``cache_implementation`` wherever the request would read it (its keywords, a copy of the config it
    passed, the model's config through a keyword ``None``): ``generate`` refuses a cache next to one."""
    req.extra.pop("cache_implementation", None)
    if getattr(req.gen_cfg, "cache_implementation", None) is not None:
        req.gen_cfg = copy.deepcopy(req.gen_cfg)
        req.gen_cfg.cache_implementation = None
        req.named["generation_config"] = req.gen_cfg
    if getattr(model.generation_config, "cache_implementation", None) is not None:
        req.extra["cache_implementation"] = None


def _policy_cache(req: _Request, model, state: PatchState) -> KVCache | None:
    """The patched policy's ``KVCache`` for a request that passed no cache, set in ``req.extra`` (and the request's
    ``cache_implementation`` dropped); static ones (:func:`_wants_static`) are sized for the prompt + the tokens to
    generate (else ``max_length``) and told the first forward's length (``prompt_length``: a ``compression_ratio``
    is resolved for it). None for a transformers cache implementation under ``full`` (transformers'
    own then)."""
    impl = req.value("cache_implementation", model)
    static = _wants_static(impl, state)
    if impl not in _DEFAULT_CACHES and impl != "static":  # under full, another implementation is transformers' own
        return None
    cache = KVCache(model, state.policy, static=static, max_length=state.max_length if state.static else None,
                    prompt_length=_first_forward_length(req, model))
    if static:
        room = req.max_new if isinstance(req.max_new, int) and req.max_new > 0 else (
            req.max_len if isinstance(req.max_len, int) else 0)
        cache.ensure_capacity(req.n + room)
    set_cache(req.extra, cache)
    _drop_cache_implementation(req, model)
    return cache


def _first_forward_length(req: _Request, model) -> int | None:
    """The tokens of ``generate``'s first forward: the prompt (padded), or its first chunk under transformers'
    ``prefill_chunk_size``; None without a prompt. A static cache resolves a ``compression_ratio`` for it."""
    if not req.n:
        return None
    chunk = req.value("prefill_chunk_size", model)
    return min(req.n, chunk) if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 else req.n


def generate_checked(model_ref, generate, *args, **kwargs):
    """``model.generate`` while patched, for every way of calling it (``generate(ids)``, ``inputs=``, ``input_ids=``,
    ``inputs_embeds=``, a ``GenerationConfig`` positional or by keyword, ``max_new_tokens`` / ``max_length`` from
    either): the arguments are bound to ``generate``'s signature first, then

    * a request whose prompt + ``max_new_tokens`` crosses the trained context is refused before anything runs
      (instead of at the crossing step, losing the tokens generated so far);
    * a transformers cache passed under a compressing policy is refused (:func:`check_foreign_cache`);
    * assisted generation (``assistant_model=``, ``prompt_lookup_num_tokens=``, ...) over a policy whose compression
      a speculative round cannot reproduce (``Policy.speculative_refusal``) is refused with the reason;
    * without a cache, ``generate`` is handed the policy's ``KVCache`` (transformers then makes none of its own):
      ``cache_implementation="static"`` (a keyword, the config passed or the model's) asks for the policy's static
      cache, refused for a policy without one; any other transformers cache implementation is refused under a
      compressing policy (it would run without it) and left to transformers under ``full``. A static cache is sized
      for the prompt + the tokens to generate: transformers sees a compileable cache before its loop starts, so it
      compiles the decode forward on CUDA (``GenerationMixin._valid_auto_compile_criteria``), and no compiled step
      needs to grow it. For assisted generation the cache is told the prompt's length, so the first forward (prompt
      + first candidates) prefills the prompt alone (:func:`_split_first_forward`)."""
    model = model_ref()
    state = patch_state(model)
    req = _bind(generate, args, kwargs, model)
    if req is None:
        return generate(*args, **kwargs)  # transformers' own error for a malformed call
    n, max_new = req.n, req.max_new
    if n and isinstance(max_new, int) and max_new > 0:
        check_context(model, 0, n + max_new, where=f"the request (prompt {n} + max_new_tokens {max_new})")
    if state is None:
        return generate(*args, **kwargs)

    user_cache = get_cache(req.extra)
    check_foreign_cache(model, user_cache)
    custom = req.named.get("custom_generate") is not None
    assisted = _is_assisted(req, model, custom)
    _refuse_lossy_assisted(assisted, user_cache.policy if isinstance(user_cache, KVCache) else state.policy)
    cache = user_cache
    if cache is None and req.value("use_cache", model) is not False and not custom:
        cache = _policy_cache(req, model, state)
    if req.var_kw:
        req.named[req.var_kw] = req.extra
    if not (assisted and isinstance(cache, KVCache) and cache.get_seq_length() == 0 and n):
        return generate(*req.bound.args, **req.bound.kwargs)
    cache.__dict__["_kvkit_prompt"] = n  # the first forward: prompt + candidates (_split_first_forward)
    try:
        return generate(*req.bound.args, **req.bound.kwargs)
    finally:
        cache.__dict__.pop("_kvkit_prompt", None)
