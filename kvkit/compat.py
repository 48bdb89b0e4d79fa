"""What differs between the transformers releases kvkit supports (``kvkit.patch.TRANSFORMERS_SUPPORTED``).

transformers 5.24 renamed the cache argument: models, their attention layers and ``generate`` take the cache as
``cache=`` (``past_key_values=`` still works with a deprecation warning until 5.40, and is renamed to ``cache`` by
a decorator *inside* ``forward``, after forward pre-hooks ran), outputs carry it as ``.cache``, and attention calls
``cache.update(key, value, layer_idx, kwargs=...)``. kvkit's hooks read either name and kvkit's own forwards pass
the one this release expects (:func:`cache_kw`), so neither release warns.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

#: the name of the cache argument of a model's / attention layer's forward in the installed release
CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
_NAMES = ("cache", "past_key_values")


def cache_kw(cache) -> dict:
    """``{CACHE_ARG: cache}``: splat into a model call (``model(ids, **cache_kw(cache), use_cache=True)``)."""
    return {CACHE_ARG: cache}


def get_cache(kwargs: dict):
    """The cache a forward's keyword arguments carry, under either name (None when absent)."""
    for k in _NAMES:
        if kwargs.get(k) is not None:
            return kwargs[k]
    return None


def set_cache(kwargs: dict, cache) -> None:
    """Put ``cache`` into a forward's keyword arguments under the name already used (else :data:`CACHE_ARG`),
    dropping the other name (a release that renames refuses both at once)."""
    key = next((k for k in _NAMES if kwargs.get(k) is not None), CACHE_ARG)
    for k in _NAMES:
        if k != key:
            kwargs.pop(k, None)
    kwargs[key] = cache


def output_cache(out):
    """The cache a model output returns (``out.cache`` from 5.24 on, ``out.past_key_values`` before)."""
    return getattr(out, CACHE_ARG, None)
