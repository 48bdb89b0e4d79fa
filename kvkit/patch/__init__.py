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
previous attention implementation. The hooks and wrappers reach their model through a :class:`ModelRef`, a weak
reference that a deep copy of the model re-targets at the copy: ``copy.deepcopy(patched)`` is an independent
patched model (its own policy object, hooks and state).

What a patch installed is the model's :class:`~kvkit.state.PatchState`; every module reads it with
:func:`patch_state` / :func:`is_patched` (:mod:`kvkit.state`, below the cache; re-exported here).

Static caches (``patch(model, policy, static=True)``) and ``torch.compile``: the hooks trace without graph
breaks (under ``torch.compiler.is_compiling()`` they skip the checks that read device values; the context
length is checked by the step wrapper and by ``generate`` on host ints), so a single-token decode forward
compiles whole with ``fullgraph=True``.

The package by job: :mod:`.support` (which models and transformers releases kvkit can patch), :mod:`.checks`
(the checks a forward's inputs get), :mod:`.hooks` (the hooks and the compiled-step wrapper), :mod:`.generation`
(``model.generate`` while patched); here, :func:`patch` / :func:`unpatch`, which install and remove them.
"""

from __future__ import annotations

import contextlib
import functools

from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvkit.attention import kvkit_attention
from kvkit.cache import KVCache, check_static
from kvkit.compat import TRANSFORMERS_SUPPORTED  # noqa: F401  (kvkit.patch.TRANSFORMERS_SUPPORTED: the gate's bounds)
from kvkit.model_info import context_limit
from kvkit.patch.checks import check_context, check_foreign_cache
from kvkit.patch.defaults import PROBE_PROMPT, choose_static
from kvkit.patch.generation import generate_checked
from kvkit.patch.hooks import (
    STORE_KWARG,  # noqa: F401  (kvkit.patch.STORE_KWARG: the keyword that carries a layer's store)
    ModelRef,
    attn_pre_hook,
    compiled_call,
    model_post_hook,
    model_pre_hook,
)
from kvkit.patch.support import attention_modules, check_model, check_transformers
from kvkit.policies.base import Policy
from kvkit.registry import get_policy
from kvkit.state import PatchState, is_patched, patch_state, set_patch_state

ATTN_NAME = "kvkit"


def _register() -> None:
    """Register kvkit's attention function and transformers' sdpa mask builder under :data:`ATTN_NAME`."""
    AttentionInterface.register(ATTN_NAME, kvkit_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def patch(model, policy="full", *, allow_beyond_context: bool = False, static: bool | None = None,
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
    given = static
    static = choose_static(model, pol, static, max_length)
    if static:  # refuses a policy without static stores (each cache is built for its own prompt: a probe length)
        KVCache(model, pol, static=True, max_length=max_length, prompt_length=PROBE_PROMPT)
    if is_patched(model):
        unpatch(model)
    _register()
    state = PatchState(policy=pol, old_impl=model.config._attn_implementation,
                       allow_beyond_context=allow_beyond_context, static=static, max_length=max_length,
                       static_default=given is None and static is True)
    model.set_attn_implementation(ATTN_NAME)
    ref = ModelRef(model)  # weak, and a deep copy of the model re-targets it at the copy
    hook = functools.partial(model_pre_hook, ref)
    state.handles.append(model.base_model.register_forward_pre_hook(hook, with_kwargs=True))
    state.handles.append(model.base_model.register_forward_hook(model_post_hook, with_kwargs=True))
    for m in attention_modules(model):
        state.handles.append(m.register_forward_pre_hook(attn_pre_hook, with_kwargs=True))
        state.attn_modules.append(m)
    state.own_generate = "generate" not in vars(model)
    if state.own_generate:
        model.generate = functools.partial(generate_checked, ref, model.generate)
    state.own_compiled_call = "get_compiled_call" not in vars(model)
    if state.own_compiled_call:
        model.get_compiled_call = functools.partial(compiled_call, ref, model.get_compiled_call)
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


@contextlib.contextmanager
def patched(model, policy="full", **options):
    """``with kvkit.patched(model, "snapkv", compression_ratio=0.5) as m: ...``: :func:`patch` for the body (the
    same arguments), and on exit -- also when the body raises -- the model as it was: unpatched, or patched again
    with the policy and settings it had before."""
    before = patch_state(model)
    patch(model, policy, **options)
    try:
        yield model
    finally:
        unpatch(model)
        if before is not None:  # the previous patch, reinstalled as it was
            patch(model, before.policy, allow_beyond_context=before.allow_beyond_context,
                  static=None if before.static_default else before.static, max_length=before.max_length)


def patched_policy(model) -> Policy | None:
    """The policy ``kvkit.patch`` installed on ``model``, or None when it is not patched (:func:`is_patched`)."""
    state = patch_state(model)
    return None if state is None else state.policy


__all__ = ["patch", "unpatch", "patched", "patched_policy", "patch_state", "is_patched", "PatchState", "check_model",
           "check_context", "check_foreign_cache", "context_limit", "Cache"]
