"""Whether ``kvkit.patch`` builds static caches when the caller does not say: :func:`choose_static`, the one place
that decides it.

On a CUDA model a static cache is the fast path: ``generate`` hands transformers a compileable cache sized for the
request (prompt + ``max_new_tokens``, as transformers sizes its own ``cache_implementation="static"``), which
transformers compiles and replays as a CUDA graph; the growing (dynamic) cache leaves every step bound by the
host's kernel launches. So ``static=None`` (``kvkit.patch``'s default) means:

* ``static=True`` / ``static=False`` given: that, unchanged;
* ``max_length`` given without ``static``: not static, so :func:`kvkit.cache.check_static` asks for
  ``static=True`` with it on every device (a capacity is an explicit choice of the static path);
* otherwise static when the model's parameters are all on CUDA devices (``device`` overrides where they are, for
  tests), not spread over CPU / disk offload by ``hf_device_map``, the policy has static stores
  (``static_capable``) with the options they need (``static_options``: shadowkv keeps its values offloaded
  unless ``offload=False``) and a static ``KVCache`` of it builds for this model and is compileable (a model
  with sliding-window layers is not; the probe is built for :data:`PROBE_PROMPT` tokens, so a ``compression_ratio``
  resolved from the prompt length keeps the static path: each request's cache resolves it for its own prompt);
  else the growing cache, as on the CPU.

The first time the default picks the static path in a process it says so once (a :class:`StaticDefaultWarning`),
with the way out: ``kvkit.patch(model, policy, static=False)``.
"""

from __future__ import annotations

import warnings

import torch

from kvkit.cache import KVCache

#: said once per process (:func:`choose_static`)
_said: set[str] = set()
#: the prompt length :func:`static_fits`' probe cache is built for: a policy resolving ``compression_ratio`` from the
#: prompt length needs one (each request's cache is then built for its own prompt: ``generate`` passes it)
PROBE_PROMPT = 1024


class StaticDefaultWarning(UserWarning):
    """``kvkit.patch`` chose static caches on a CUDA model because ``static`` was not given."""


def model_device(model) -> torch.device:
    """The device of ``model``'s parameters: ``cuda`` only when all of them are on CUDA devices (else the first
    non-CUDA one; ``cpu`` for a model without parameters)."""
    devices = {p.device for p in model.parameters()}
    if not devices:
        return torch.device("cpu")
    other = sorted((d for d in devices if d.type != "cuda"), key=str)
    return other[0] if other else sorted(devices, key=str)[0]


def _offloaded(model) -> bool:
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    return bool(devices & {"cpu", "disk"})


def static_fits(model, policy) -> str | None:
    """Why ``policy`` (a built :class:`~kvkit.policies.base.Policy`) gets no static cache on ``model`` (None when
    it does): no static stores, options its static stores do not take (``static_options``: shadowkv's default
    ``offload=True``), or the static ``KVCache`` refuses this model / is not compileable."""
    if not type(policy).static_capable:
        return f"{policy.name!r} has no static stores"
    need = {k: v for k, v in type(policy).static_options.items() if getattr(policy, k, v) != v}
    if need:  # e.g. shadowkv's offloaded values: a CUDA graph cannot read host memory
        return f"{policy.name!r}'s static cache needs " + ", ".join(f"{k}={v!r}" for k, v in need.items())
    try:
        cache = KVCache(model, policy, static=True, prompt_length=PROBE_PROMPT)
    except Exception as e:  # noqa: BLE001 -- any refusal means: keep the growing cache
        return f"{type(e).__name__}: {e}"
    return cache.compile_refusal if not cache.is_compileable else None


def choose_static(model, policy, static: bool | None, max_length: int | None = None, device=None) -> bool | None:
    """The ``static`` a patch of ``model`` with ``policy`` (a built policy) uses (see the module docstring).

    ``static``: the caller's value (True / False returned as is; anything else but None is returned as is too,
    for :func:`kvkit.cache.check_static` to refuse). ``device``: where the model runs (default
    :func:`model_device`)."""
    if static is not None:
        return static
    if max_length is not None:
        return False
    device = torch.device(device) if device is not None else model_device(model)
    if device.type != "cuda" or _offloaded(model) or static_fits(model, policy) is not None:
        return False
    if "static" not in _said:
        _said.add("static")
        warnings.warn(
            f"kvkit.patch: {policy.name!r} on a CUDA model uses static caches (sized for each generate request; "
            "transformers compiles the decode step and replays it as a CUDA graph). Pass static=False to keep the "
            "growing cache (eager decode steps).", StaticDefaultWarning, stacklevel=3)
    return True
