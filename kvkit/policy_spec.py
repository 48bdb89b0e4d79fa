"""A policy as the command line writes it, ``NAME[:KEY=VALUE,...]`` (standard library only): :class:`PolicySpec`,
:func:`parse_policy` (values as JSON -- ``512``, ``0.5``, ``true``, ``[1,2]`` --, ``True``/``False``/``None`` as
Python's, anything else as text; commas inside brackets belong to the value) and :func:`with_shared` (``--budget`` /
``--compression-ratio`` added to a policy's options). The one parser of a policy for every command."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvkit import catalog
from kvkit.options import _PY_LITERALS, _split_pairs


@dataclass(frozen=True)
class PolicySpec:
    """One ``NAME[:KEY=VALUE,...]``: the policy (or peer / bench row) name and its options as given."""

    name: str
    options: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={_text(v)}" for k, v in self.options.items()) if self.options else "")

    def label(self) -> str:
        """A file-name-safe label of the spec (``snapkv-budget512-window32``): a run folder's default name."""
        parts = [self.name] + [f"{k}{_text(v)}" for k, v in self.options.items()]
        return "-".join("".join(c if c.isalnum() or c in "._" else "_" for c in p) for p in parts)


def _text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def parse_value(text: str):
    """An option value: JSON (``512``, ``0.5``, ``true``, ``null``, ``[1,2]``), Python's ``True``/``False``/``None``,
    else the text itself."""
    t = text.strip()
    if t in _PY_LITERALS:
        return _PY_LITERALS[t]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_pairs(text: str, what: str = "option") -> dict:
    """``key=value,key=value`` -> ``{key: value}`` (:func:`parse_value`); ValueError naming ``what`` otherwise."""
    out = {}
    for pair in _split_pairs(text):
        if not pair.strip():
            continue
        if "=" not in pair or not pair.split("=", 1)[0].strip():
            raise ValueError(f"{what} {pair.strip()!r} must look like key=value")
        k, v = pair.split("=", 1)
        out[k.strip()] = parse_value(v)
    return out


def parse_policy(spec: str) -> PolicySpec:
    """``NAME[:KEY=VALUE,...]`` -> :class:`PolicySpec` (the one parser of a policy setting in every command).
    ValueError when the name is missing or a pair is not ``key=value``."""
    if not isinstance(spec, str):
        raise ValueError(f"a policy is written NAME[:KEY=VALUE,...], got {spec!r}")
    name, _, opts = spec.partition(":")
    name = name.strip()
    if not name or any(c.isspace() or c in "=,/" for c in name):
        raise ValueError(f"{spec!r} must look like NAME or NAME:key=value,key=value (e.g. snapkv:budget=512)")
    return PolicySpec(name, parse_pairs(opts, f"option of {name}"))


def has_option(policy: str, option: str) -> bool:
    """Whether the policy catalog (:mod:`kvkit.catalog`, no torch) lists ``option`` for ``policy``; True for a policy
    it does not know (a plugin's: the registry decides)."""
    try:
        entry = catalog.entry(policy)
    except ValueError:
        return True
    return any(o["name"] == option for o in entry["options"])


def with_shared(spec: PolicySpec, budget=None, compression_ratio=None, extra: dict | None = None) -> PolicySpec:
    """``spec`` with ``extra`` (options given apart, e.g. ``--opt``), ``--budget`` and ``--compression-ratio`` added
    to its options (the spec's own value wins over ``extra``; ``full`` takes none of them, and ``--budget`` goes to
    the policies that have a ``budget`` option: with several policies, duo or zipcache beside snapkv)."""
    if spec.name == "full":
        return spec
    opts = dict(extra or {})
    opts.update(spec.options)
    if budget is not None and "budget" not in spec.options and has_option(spec.name, "budget"):
        opts["budget"] = budget
    if compression_ratio is not None:
        opts["compression_ratio"] = compression_ratio
    return PolicySpec(spec.name, opts)
