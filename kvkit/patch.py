"""``patch``/``unpatch``: install a policy on a loaded transformers model through the official seams.

* registers :func:`kvkit.attention.kvkit_attention` under ``"kvkit"`` with ``AttentionInterface`` and
  transformers' sdpa mask builder under the same name with ``AttentionMaskInterface`` (without it
  padding masks would silently arrive as ``None``), then ``model.set_attn_implementation("kvkit")``;
* a forward pre-hook on the base model hands a forward without a cache a new ``KVCache``; a transformers cache
  the caller passes is used as is under ``full`` (exact attention either way) and refused under a compressing
  policy (it would run without the policy), never replaced;
* a forward pre-hook on each attention module hands the attention function its layer store *through the call's
  keyword arguments* (``kvkit_store``, read from the cache the layer is given): nothing is stored on the shared
  modules, so one patched model serves several threads, each with its own cache;
* a forward hook on the base model runs the policy's ``after_forward`` (KVzip's reconstruction pass);
* ``model.generate`` (every entry point: ``inputs=``, ``input_ids=``, ``inputs_embeds=``, a ``GenerationConfig``)
  checks the request's length first, hands ``generate`` the policy's ``KVCache`` (sized for the request when
  static; ``cache_implementation="static"`` asks for the static one, other cache implementations are refused),
  and refuses assisted generation over a policy that speculation cannot reproduce; ``model.get_compiled_call``
  runs each compiled decode step through :func:`_compiled_step`.

No forward is replaced and no modeling file is copied; ``unpatch`` removes the hooks and restores the
previous attention implementation. The hooks and wrappers reach their model through a :class:`_ModelRef`, a weak
reference that a deep copy of the model re-targets at the copy: ``copy.deepcopy(patched)`` is an independent
patched model (its own policy object, hooks and state).

What a patch installed is the model's :class:`~kvkit.state.PatchState`; every module reads it with
:func:`patch_state` / :func:`is_patched` (:mod:`kvkit.state`, below the cache; re-exported here).

Static caches (``patch(model, policy, static=True)``) and ``torch.compile``: the hooks trace without graph
breaks (under ``torch.compiler.is_compiling()`` they skip the checks that read device values; the context
length is checked by the step wrapper and by ``generate`` on host ints), so a single-token decode forward
compiles whole with ``fullgraph=True``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvkit.attention import kvkit_attention
from kvkit.cache import STATIC_POLICIES, KVCache, check_static
from kvkit.compat import TRANSFORMERS_SUPPORTED, get_cache, set_cache
from kvkit.model_info import context_limit
from kvkit.policies.base import Policy
from kvkit.registry import get_policy
from kvkit.state import PatchState, is_patched, patch_state, set_patch_state

ATTN_NAME = "kvkit"


class _ModelRef:
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
        return _ModelRef(twin)

    def __reduce__(self):
        raise TypeError("a kvkit-patched model cannot be pickled: kvkit.unpatch(model) first, patch the loaded one")


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
    state = patch_state(model)
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


def check_foreign_cache(model, cache) -> None:
    """Refuse a transformers cache (not a ``KVCache``) handed to a model patched with a compressing policy.

    Attention over such a cache is transformers' exact attention over everything it holds: under ``full`` that *is*
    the policy (the cache is used as is), under any other policy the request would silently run without it. It is
    never swapped for a new cache either (the caller's object would stay empty and the next call that passes it
    would run without the context)."""
    state = patch_state(model)
    if state is None or not isinstance(cache, Cache) or isinstance(cache, KVCache) or state.policy.name == "full":
        return
    name = state.policy.name
    raise ValueError(
        f"a transformers {type(cache).__name__} was passed as the cache of a model patched with {name!r}: attention "
        f"over it would be transformers' own, without {name!r}'s compression (kvkit neither fills nor replaces a cache you "
        f"pass). Pass kvkit.KVCache(model) instead (it carries the context from call to call), or no cache (a new "
        "KVCache is made and returned in the output); or kvkit.unpatch(model) to use transformers' caches"
    )


def _model_pre_hook(model_ref, module, args, kwargs):
    """Check the inputs and the context length; give a forward without a cache a new ``KVCache``; refuse a
    transformers cache under a compressing policy (:func:`check_foreign_cache`); split the first forward of an
    assisted generation (:func:`_split_first_forward`).

    Under ``torch.compile`` (a compiled decode step) it only checks what costs no host read: the cache was built
    and checked by the eager prefill, and the context length of a ``generate`` request by ``model.generate``
    before it ran (a compiled loop of one's own is checked by nobody: keep it within the context)."""
    _check_inputs(args, kwargs)
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
        check_context(model, cached, _new_tokens(args, kwargs))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if use_cache is False:
        return None
    if pkv is None:
        set_cache(kwargs, KVCache(model))
        return args, kwargs
    if isinstance(pkv, KVCache):
        prompt = pkv.__dict__.pop("_kvkit_prompt", None)  # only the first forward into it
        if prompt is not None and cached == 0 and 0 < prompt < _new_tokens(args, kwargs):
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
    again by :func:`_model_post_hook`, so the model returns the ``prompt + k`` positions it was asked for."""
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


def _model_post_hook(module, args, kwargs, output):
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


def _generate_checked(model_ref, generate, *args, **kwargs):
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
    sig = inspect.signature(generate)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return generate(*args, **kwargs)  # transformers' own error for a malformed call
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
    if n and isinstance(max_new, int) and max_new > 0:
        check_context(model, 0, n + max_new, where=f"the request (prompt {n} + max_new_tokens {max_new})")
    if state is None:
        return generate(*args, **kwargs)

    user_cache = get_cache(extra)
    check_foreign_cache(model, user_cache)
    custom = named.get("custom_generate") is not None
    assisted = (named.get("assistant_model") is not None
                or any(_generation_value(k, extra, gen_cfg, model) not in (None, False)
                       for k in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")))
    assisted = assisted and (_generation_value("num_beams", extra, gen_cfg, model) or 1) == 1 and not custom
    policy = user_cache.policy if isinstance(user_cache, KVCache) else state.policy
    reason = getattr(policy, "speculative_refusal", None)
    if assisted and reason is not None:
        name = policy.name
        raise ValueError(
            f"assisted generation (assistant_model= / prompt_lookup_num_tokens=) over a model patched with {name!r} "
            f"is not lossless: {reason}. Use the {name!r} model's plain generate, or a policy whose rounds decode as "
            "one-token steps do (e.g. 'streaming' or 'full')"
        )

    impl = _generation_value("cache_implementation", extra, gen_cfg, model)
    use_cache = _generation_value("use_cache", extra, gen_cfg, model)
    cache = user_cache
    if cache is None and use_cache is not False and not custom:
        name = state.policy.name
        static = state.static
        if impl == "static":
            if name not in STATIC_POLICIES:
                raise ValueError(
                    f"cache_implementation='static' on a model patched with {name!r}: transformers' StaticCache would "
                    f"run without {name!r}'s compression, and {name!r} has no static cache (kvkit's static caches: "
                    f"{', '.join(STATIC_POLICIES)}). Drop cache_implementation (kvkit's policy decides the cache)"
                )
            static = True
        elif impl not in _DEFAULT_CACHES and name != "full":
            raise ValueError(
                f"cache_implementation={impl!r} on a model patched with {name!r} asks transformers for its own cache, "
                f"which would run without {name!r}'s compression. Drop it (kvkit's policy decides the cache; "
                f"cache_implementation='static' gives the policy's static cache where it has one: "
                f"{', '.join(STATIC_POLICIES)}), or kvkit.unpatch(model) first"
            )
        if impl in _DEFAULT_CACHES or impl == "static":  # under full, another implementation is transformers' own
            cache = KVCache(model, state.policy, static=static,
                            max_length=state.max_length if state.static else None)
            if static:
                room = max_new if isinstance(max_new, int) and max_new > 0 else (
                    max_len if isinstance(max_len, int) else 0)
                cache.ensure_capacity(n + room)
            set_cache(extra, cache)
            # generate refuses a cache next to a cache_implementation: drop it wherever it was set
            extra.pop("cache_implementation", None)
            if getattr(gen_cfg, "cache_implementation", None) is not None:
                gen_cfg = copy.deepcopy(gen_cfg)
                gen_cfg.cache_implementation = None
                named["generation_config"] = gen_cfg
            if getattr(model.generation_config, "cache_implementation", None) is not None:
                extra["cache_implementation"] = None
    if var_kw:
        named[var_kw] = extra
    if not (assisted and isinstance(cache, KVCache) and cache.get_seq_length() == 0 and n):
        return generate(*bound.args, **bound.kwargs)
    cache.__dict__["_kvkit_prompt"] = n  # the first forward: prompt + candidates (_split_first_forward)
    try:
        return generate(*bound.args, **bound.kwargs)
    finally:
        cache.__dict__.pop("_kvkit_prompt", None)


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


#: the keyword argument that carries a layer's store from kvkit's attention pre-hook to the attention function
STORE_KWARG = "kvkit_store"


def _attn_pre_hook(module, args, kwargs):
    """Bind this call's layer store: ``kvkit_store=cache.layers[layer_idx]`` joins the attention module's keyword
    arguments, which its forward hands on to the registered attention function (:func:`kvkit_attention`). The binding
    lives in the call, not on the module shared by every caller: concurrent forwards (threads) each read their own
    cache's store, and it traces under ``torch.compile(fullgraph=True)`` (a dict entry, no module attribute
    mutation). Without a ``KVCache`` (a transformers cache under ``full``, ``use_cache=False``) nothing is bound and
    the attention is transformers' sdpa."""
    pkv = get_cache(kwargs)
    if not isinstance(pkv, KVCache):
        return None
    if module.layer_idx >= len(pkv.layers):
        raise ValueError(f"this KVCache has {len(pkv.layers)} layers but attention layer {module.layer_idx} ran: it was "
                         "built for another model; build it with kvkit.KVCache(model, ...) for the model you run")
    kwargs[STORE_KWARG] = pkv.layers[module.layer_idx]
    return args, kwargs




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
    if is_patched(model):
        unpatch(model)
    _register()
    state = PatchState(policy=pol, old_impl=model.config._attn_implementation,
                       allow_beyond_context=allow_beyond_context, static=static, max_length=max_length)
    model.set_attn_implementation(ATTN_NAME)
    ref = _ModelRef(model)  # weak, and a deep copy of the model re-targets it at the copy
    hook = functools.partial(_model_pre_hook, ref)
    state.handles.append(model.base_model.register_forward_pre_hook(hook, with_kwargs=True))
    state.handles.append(model.base_model.register_forward_hook(_model_post_hook, with_kwargs=True))
    for m in _attention_modules(model):
        state.handles.append(m.register_forward_pre_hook(_attn_pre_hook, with_kwargs=True))
        state.attn_modules.append(m)
    state.own_generate = "generate" not in vars(model)
    if state.own_generate:
        model.generate = functools.partial(_generate_checked, ref, model.generate)
    state.own_compiled_call = "get_compiled_call" not in vars(model)
    if state.own_compiled_call:
        model.get_compiled_call = functools.partial(_compiled_call, ref, model.get_compiled_call)
    set_patch_state(model, state)
    return model


def unpatch(model):
    """Remove kvkit from ``model``: hooks, attributes and the previous attention implementation."""
    state = patch_state(model)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for m in state.attn_modules:
        if hasattr(m, "_kvkit_store"):  # left by kvkit releases that bound the store on the module
            del m._kvkit_store
    model.set_attn_implementation(state.old_impl)
    if getattr(state, "own_generate", False) and "generate" in vars(model):
        del model.generate
    if getattr(state, "own_compiled_call", False) and "get_compiled_call" in vars(model):
        del model.get_compiled_call
    set_patch_state(model, None)
    return model


def patched_policy(model) -> Policy | None:
    """The policy ``kvkit.patch`` installed on ``model``, or None when it is not patched (:func:`is_patched`)."""
    state = patch_state(model)
    return None if state is None else state.policy


__all__ = ["patch", "unpatch", "patched_policy", "patch_state", "is_patched", "PatchState", "check_model",
           "check_context", "check_foreign_cache", "context_limit", "Cache"]
