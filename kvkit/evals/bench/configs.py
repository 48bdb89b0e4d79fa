"""The policies a bench measures and the checks of its numeric arguments.

A config is a ``(policy name, options dict)`` pair; :func:`check_configs` builds each once (so an unknown name or
option fails before any model work) and puts ``full``, the baseline of every ratio, first. :func:`config_label`
is the config's name in rows and tables (``"streaming budget=32"``).
"""

from __future__ import annotations

from kvkit.registry import get_policy


def positive_int(value, what: str) -> int:
    """``value`` when it is a positive ``int`` (not a bool), else ``ValueError`` naming the flag ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_configs(configs) -> list[tuple[str, dict]]:
    """``[(policy, options)]`` with every policy built once (unknown names / options raise ``ValueError`` listing
    the known ones) and duplicates dropped; ``full`` is always first (the baseline of every ratio)."""
    out = [("full", {})]
    for name, opts in configs:
        get_policy(name, **dict(opts or {}))  # raises a clear ValueError for unknown policies / options
        if (name, dict(opts or {})) not in out:
            out.append((name, dict(opts or {})))
    return out


def config_label(name: str, opts: dict) -> str:
    return name + (" " + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
