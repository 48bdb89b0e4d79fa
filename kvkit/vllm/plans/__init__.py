"""The vLLM plugin's plans, one per policy, by name: ``@register("name")`` on a :class:`~kvkit.vllm.plans.base.Plan`.

Each plan lives in its own module of this package, ``kvkit/vllm/plans/<policy>.py``; every module here (but
``base`` and names starting with ``_``) is imported when the registry is first read, in file-name order, so adding a
plan is adding its file: a frozen dataclass subclassing :class:`~kvkit.vllm.plans.base.Plan`, its options as fields,
decorated with ``@register("<policy>")``, overriding the hooks its policy needs (see :mod:`kvkit.vllm.plans.base`).

A kvkit policy (``kvkit.registry``) with no plan here is not run by the plugin: :func:`plan_class` says so.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from kvkit.registry import available_policies, registrar
from kvkit.vllm.plans.base import LayerContext, Plan  # noqa: F401

_PLANS: dict[str, type[Plan]] = {}


#: ``@register("name")``: register a plan dataclass under the policy ``name``
register = registrar(_PLANS, "kvkit.vllm: plan")


@functools.cache
def _load_builtin() -> None:
    for m in pkgutil.iter_modules(__path__):
        if m.name != "base" and not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")


def plans() -> dict[str, type[Plan]]:
    """Every registered plan class by policy name (the built-in ones imported first)."""
    _load_builtin()
    return dict(_PLANS)


def names() -> tuple[str, ...]:
    """The policies the vLLM plugin runs."""
    return tuple(plans())


def options() -> dict[str, tuple[str, ...]]:
    """The options each plan reads (any other key in a switch is refused, naming these)."""
    return {name: cls.options() for name, cls in plans().items()}


def transformers_only() -> tuple[str, ...]:
    """kvkit policies (``kvkit.registry``) that the vLLM plugin does not run."""
    return tuple(p for p in available_policies() if p not in plans())


def plan_class(name: str) -> type[Plan]:
    """The plan class of policy ``name``; ValueError naming the policies the plugin runs otherwise (and saying so
    when ``name`` is a kvkit policy for transformers only)."""
    found = plans()
    if isinstance(name, str) and name in found:
        return found[name]
    hint = ""
    if name in transformers_only():
        hint = f" ({name!r} is a kvkit policy for transformers; the vLLM plugin does not run it yet)"
    raise ValueError(f"kvkit.vllm: unknown policy {name!r}{hint}; the vLLM plugin runs: {', '.join(found)}")
