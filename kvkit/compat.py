"""What differs between the transformers releases kvkit supports (:data:`TRANSFORMERS_SUPPORTED`, the one place
that states them: ``kvkit.patch.check_transformers``, ``pyproject.toml`` and the README agree with it,
``tests/core/test_versions.py``).

transformers 5.16 is the first release kvkit supports: ``AttentionInterface`` / ``AttentionMaskInterface``, cache
layers sized by ``get_max_length`` (5.13), sliding-window layers that can roll back
(``DynamicSlidingWindowLayer.activate_past_recording``, 5.15; ``kvkit.speculative`` needs it on Mistral / Gemma) and
an assisted decoding that crops the assistant's cache to the accepted tokens (5.16; 5.15's ``generate`` with an
``assistant_model`` fails on a rejected candidate, kvkit or not).
The per-layer information is read from the config by kvkit (:func:`kvkit.model_info.layer_types_and_windows`),
not by transformers' ``get_layer_types_and_kwargs`` (absent before 5.14, one dict for all layers before 5.19).
:class:`CacheLayerCompat` gives kvkit's cache layers the layer API of the newest release on older ones.

transformers 5.24 renamed the cache argument: models, their attention layers and ``generate`` take the cache as
``cache=`` (``past_key_values=`` still works with a deprecation warning until 5.40, and is renamed to ``cache`` by
a decorator *inside* ``forward``, after forward pre-hooks ran), outputs carry it as ``.cache``, and attention calls
``cache.update(key, value, layer_idx, kwargs=...)``. kvkit's hooks read either name and kvkit's own forwards pass
the one this release expects (:func:`cache_kw`), so neither release warns.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

#: the transformers releases kvkit supports: ``low <= version < high`` (tested at both ends in CI: ``.ci/run``).
#: ``pyproject.toml``'s dependency and the README state the same range (``tests/core/test_versions.py`` checks)
TRANSFORMERS_SUPPORTED = ("5.16", "5.25")
#: the lowest supported release, exactly: what ``scripts/install_low.sh`` installs and CI tests
TRANSFORMERS_LOWEST = "5.16.0"
#: the oldest torch and Python any run of kvkit has used (the GPU machines' torch 2.11; CI's Python 3.11):
#: ``pyproject.toml`` states exactly these lower bounds (``tests/core/test_versions.py`` checks)
TORCH_LOWEST = "2.11"
PYTHON_LOWEST = "3.11"
#: the one statement of what kvkit supports; README.md and docs/USAGE.md quote it verbatim (a test checks)
SUPPORT_STATEMENT = (
    f"Python >= {PYTHON_LOWEST}, torch >= {TORCH_LOWEST} and transformers {TRANSFORMERS_SUPPORTED[0]} to "
    f"{TRANSFORMERS_SUPPORTED[1].split('.')[0]}.{int(TRANSFORMERS_SUPPORTED[1].split('.')[1]) - 1}: CI runs torch 2.13 "
    f"on CPUs with transformers {TRANSFORMERS_LOWEST} and the newest supported release; the GPU runs used torch "
    f"{TORCH_LOWEST}."
)
#: the installed release, as a tuple of ints (``(5, 24, 0)``)
RELEASE = Version(transformers.__version__).release

#: the name of the cache argument of a model's / attention layer's forward in the installed release
CACHE_ARG = "cache" if RELEASE >= (5, 24) else "past_key_values"
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


# ---- cache layers ----------------------------------------------------------------------------------------------
#: ``CacheLayerMixin.get_max_length`` (5.13; ``get_max_cache_shape`` before, abstract)
_HAS_MAX_LENGTH = hasattr(CacheLayerMixin, "get_max_length")
#: ``DynamicLayer.reset`` drops the tensors and the length (5.19; before, it zeroed them and kept the length)
_RESET_DROPS = "reset" in vars(DynamicLayer)
#: a sliding layer that records its past (speculative rollback) returns only the states the mask spans (5.18;
#: 5.15-5.17 returned all it held, so a forward's keys outgrew its mask)
_SLIDING_RETURNS_VISIBLE = RELEASE >= (5, 18)


class CacheLayerCompat:
    """What a kvkit cache layer needs on top of transformers' ``CacheLayerMixin`` to behave like the newest
    supported release's on every supported one. Empty on a release that needs nothing; list it before the
    transformers layer class among the bases (``StoreMixin`` inherits it, so every kvkit store has it).

    * before 5.13 the layer's capacity was the abstract ``get_max_cache_shape``: it answers ``get_max_length()``
      where the layer defines that (kvkit's stores do), else the transformers base class's answer;
    * before 5.19 ``DynamicLayer.reset`` zeroed the tensors and kept the length (a reset layer still counted its old
      tokens): on ``DynamicLayer`` subclasses ``reset`` drops them, as 5.19 does;
    * before 5.18 a ``DynamicSlidingWindowLayer`` recording its past (``activate_past_recording``, which
      ``kvkit.speculative`` uses for rollback) returned every state it held from ``update``, more keys than the
      sliding mask spans: ``update`` returns the last ``sliding_window - 1 + new`` of them, as 5.18 does.
    """

    __slots__ = ()

    if not _HAS_MAX_LENGTH:

        def get_max_cache_shape(self) -> int:
            own = getattr(self, "get_max_length", None)
            return own() if own is not None else super().get_max_cache_shape()

    if not _RESET_DROPS:

        def reset(self) -> None:
            if isinstance(self, DynamicLayer):
                self.keys = self.values = None
                self.is_initialized = False
                CacheLayerMixin.reset(self)  # cumulative_length of sliding layers, as 5.19's super().reset()
            else:
                super().reset()

    if not _SLIDING_RETURNS_VISIBLE:

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if isinstance(self, DynamicSlidingWindowLayer) and getattr(self, "record_past", False):
                n = self.sliding_window - 1 + key_states.shape[-2]
                return keys[:, :, -n:, :], values[:, :, -n:, :]
            return keys, values
