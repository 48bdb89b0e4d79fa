"""A run's settings: the model loaded by name and dtype, the policy options checked against the policy, what the
run's config records about them beyond their values, and the run's folder label.

:func:`resolve_policy_options` merges ``--opt`` / ``--policy-options`` with ``--budget`` and refuses an option the
policy does not have (listing the ones it has). A run's config records the content of file-valued options
(:func:`option_files`: duo's ``pattern``, by sha256; :func:`policy_files`: also a shipped pattern the policy picks
for the model) and the values a per-model calibration sets
(:func:`calibration_used`), so ``--resume`` refuses a folder made with another file or calibration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from kvkit.calibration import CALIBRATED_OPTIONS, lookup, resolve
from kvkit.models import load
from kvkit.policies.duo_patterns import PatternFile
from kvkit.policies.protect_heads import pattern_hashes
from kvkit.registry import policy_class, policy_options
from kvkit.workloads.peers import is_peer


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def option_files(options: dict) -> dict:
    """``{option: sha256}`` of the policy options that name a file (duo's ``pattern``): the run depends on the
    file's content, not its name, so the content is what ``--resume`` checks."""
    return {k: file_sha256(v) for k, v in sorted(options.items())
            if isinstance(v, (str, os.PathLike)) and str(v) and os.path.isfile(v)}


def build_policy(policy: str, options: dict):
    """The kvkit policy ``policy`` with ``options`` (its files read once, here), or None for a peer
    (:mod:`kvkit.workloads.peers`: no kvkit policy)."""
    return None if is_peer(policy) else policy_class(policy)(**options)


def policy_files(model, policy: str, options: dict, built=None) -> dict:
    """``{option: sha256}`` of the files ``policy`` with ``options`` reads on ``model``, the ones it picks by itself
    included (duo's shipped pattern for the model when no ``pattern`` is given): a run that used a shipped file is
    recorded by that file's content, so replacing the file makes ``--resume`` refuse the old folder. A peer
    (:mod:`kvkit.workloads.peers`, e.g. ``quantized``: transformers' cache, no kvkit policy) reads none: {}.
    ``built``: the policy already made from ``options`` (made here when None), so one read of its files serves
    every record."""
    if is_peer(policy):
        return {}
    return file_hashes(built if built is not None else policy_class(policy)(**options), model.config)


def file_hashes(policy, config=None) -> dict[str, str]:
    """``{option: sha256}`` of the files the built ``policy`` read, and froze, when it was built (an option holding a
    :class:`~kvkit.policies.duo_patterns.PatternFile`: duo's ``pattern``, the ``protect_pattern`` of the policies with
    ``protect_heads``): the content its caches use, which a run's record names rather than the path. Given the model's
    ``config``, also the DuoAttention pattern shipped for the model where the policy ranks heads by it on its own
    (duo without ``pattern``; ``protect_heads`` > 0 without ``protect_pattern``), so a run's record changes when a
    shipped file does. A policy that reads no file: {}."""
    out = {k: v.sha256 for k, v in policy.options().items() if isinstance(v, PatternFile)}
    if config is None:
        return out
    if policy.name == "duo" and policy.pattern is None:
        sha = policy.pattern_sha256_for(config)
        out.update({"pattern": sha} if sha is not None else {})
    if hasattr(policy, "protect_heads") and getattr(policy, "protect_pattern", ...) is None:
        out.update(pattern_hashes(policy, config))  # the protection in effect (None: on where a pattern ships)
    return out


def load_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """``kvkit.models.load`` with a dtype given by name."""
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown --dtype {dtype!r}; use float32, bfloat16 or float16")
    return load(name, dtype=dt, device=device)


def resolve_policy_options(policy: str, options: dict | None = None, budget: int | None = None) -> dict:
    """Policy options from ``--opt``/``--policy-options`` plus ``--budget`` (which sets the policy's
    ``budget`` option; a policy without one is an error listing its options), checked by building the policy once:
    its own refusals (a native knob given with ``compression_ratio``, a value out of range, a missing file) come
    here, before any model loads, as a ValueError naming the policy."""
    valid = policy_options(policy)  # unknown policy: ValueError listing the known ones
    opts = dict(options or {})
    if budget is not None:
        if "budget" not in valid:
            listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
            raise ValueError(f"--budget: policy {policy!r} has no option named 'budget'; its options: {listed}")
        opts["budget"] = budget
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for policy {policy!r}; valid options: {listed}")
    policy_class(policy)(**opts)
    return opts


def calibration_used(model, policy: str, options: dict, built=None) -> dict | None:
    """The options a per-model calibration (:mod:`kvkit.calibration`) sets for ``policy`` with ``options`` on
    this model, with the file they come from; None when none applies. Recorded in a run's config, so a run resumed
    after a recalibration is refused instead of mixing rows of two settings. ``built``: as in
    :func:`policy_files`."""
    if policy not in CALIBRATED_OPTIONS:
        return None
    pol = built if built is not None else policy_class(policy)(**options)
    resolved = resolve(pol, model.config)
    if resolved is pol:
        return None
    changed = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(pol)
               if getattr(resolved, f.name) != getattr(pol, f.name)}
    changed = {k: list(v) if isinstance(v, tuple) else v for k, v in changed.items()}
    found = lookup(model.config, policy)
    return {"options": changed, "file": found[1].name if found else None} if changed else None


def run_label(model: str, policy: str, options: dict, length) -> str:
    parts = [Path(str(model)).name or str(model), policy]
    parts += [f"{k}{v}" for k, v in sorted(options.items())]
    parts.append(f"{length}")
    return "-".join(str(p).replace("/", "_") for p in parts)
