"""The state ``kvkit.patch`` leaves on a patched model, and the functions that read it.

It sits below :mod:`kvkit.cache` (``KVCache(model)`` builds the patched policy's cache, with the patch's
``static`` / ``max_length``) and :mod:`kvkit.patch` (which writes it), and imports neither: every module reads
the state through :func:`patch_state` / :func:`is_patched`, and only :mod:`kvkit.patch` sets it
(:func:`set_patch_state`). The attribute that holds it on the model is this module's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvkit.policies.base import Policy

#: the model attribute that holds its :class:`PatchState` (read and written here only)
_STATE_ATTR = "_kvkit_state"


@dataclass
class PatchState:
    """What ``kvkit.patch`` installed on a model: its policy and options, and what ``unpatch`` undoes."""

    policy: Policy
    old_impl: object
    handles: list = field(default_factory=list)
    attn_modules: list = field(default_factory=list)
    allow_beyond_context: bool = False
    warned_beyond_context: bool = False
    own_generate: bool = False  # patch() set the context-checking model.generate (unpatch removes it)
    own_compiled_call: bool = False  # patch() set model.get_compiled_call (compiled steps through _compiled_step)
    static: bool = False  # the caches it builds are static (``KVCache(..., static=True)``)
    #: ``static`` was kvkit's default (a CUDA model, :func:`kvkit.patch.defaults.choose_static`), not the caller's:
    #: a ``KVCache(model)`` that cannot be static without a ``prompt_length`` is then the growing cache
    static_default: bool = False
    max_length: int | None = None  # their least capacity


def patch_state(model) -> PatchState | None:
    """The :class:`PatchState` of ``model`` while it is patched (``kvkit.patch``), else None (never patched, or
    unpatched since). The object is the live state, not a copy: read it; ``kvkit.patch`` / ``kvkit.unpatch``
    change it. Any object is accepted (None for one that is not a patched model)."""
    return getattr(model, _STATE_ATTR, None)


def is_patched(model) -> bool:
    """True while ``model`` is patched by ``kvkit.patch`` (``patch_state(model) is not None``)."""
    return patch_state(model) is not None


def set_patch_state(model, state: PatchState | None) -> None:
    """Record ``state`` as ``model``'s patch state, or remove it (None; nothing to remove is fine). For
    :mod:`kvkit.patch` only: ``kvkit.patch`` / ``kvkit.unpatch`` install and remove the hooks it describes."""
    if state is not None:
        setattr(model, _STATE_ATTR, state)
    elif hasattr(model, _STATE_ATTR):
        delattr(model, _STATE_ATTR)
