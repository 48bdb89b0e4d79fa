"""The per-engine switch of the kvkit vLLM plugin: which policy, with which options.

Two ways to switch the plugin on (the first found wins); without either it is off and vLLM runs
exactly its own CPU attention:

* per engine: ``LLM(..., additional_config={"kvkit": "streaming:budget=1024,sink=4"})``
  (packed 4-bit pages: ``{"kvkit": "quant:bits=4"}``; DuoAttention: ``{"kvkit": "duo"}``)
  (or ``{"kvkit": {"policy": "streaming", "budget": 1024, "sink": 4}}``; ``vllm serve
  --additional-config '{"kvkit": "tidal:budget=2048"}'`` on the command line);
* per process: the environment variable ``KVKIT_VLLM_POLICY=streaming:budget=1024,sink=4``.

A switch parses into the plan of its policy (:mod:`kvkit.vllm.plans`: one class per policy, registered by name; the
policies it lists are the ones the plugin runs). The switch is checked as ``kvkit.patch`` checks the same values
(:func:`parse_policy`, the plan's own checks, then the transformers policy of the same name built from it): an
option the policy does not read, an option given twice, a dict naming two policies, a value the transformers policy
refuses, a ``reselect_layer`` or duo pattern that does not fit the engine's model, and an ``additional_config`` key
that looks meant for the plugin but is not ``"kvkit"`` are errors naming the bad key.

This module imports nothing from vLLM, so it is testable (and importable) without it.
"""

from __future__ import annotations

import difflib
import os
import re

from kvkit import env
from kvkit.vllm import plans
from kvkit.vllm.plans import plan_class
from kvkit.vllm.plans.base import Plan

ENV_VAR = "KVKIT_VLLM_POLICY"
CONFIG_KEY = "kvkit"

#: The policies the vLLM plugin runs, and the options each reads (any other key is refused, naming these): the plan
#: registry's at import (:func:`kvkit.vllm.plans.names`, :func:`kvkit.vllm.plans.options` read it live).
VLLM_POLICIES = plans.names()
POLICY_OPTIONS = plans.options()
#: Keys of a dict switch that give the policy name (one of them, once).
NAME_KEYS = ("policy", "name")

#: A parsed switch: the plan of one policy (every plan class subclasses it; the name is kept for the callers).
PluginPolicy = Plan


def _unknown_options(name: str, keys) -> str:
    every = plans.options()
    allowed = every[name]
    hints = []
    for key in keys:
        owners = [p for p, opts in every.items() if key in opts]
        if owners:
            hints.append(f"{key!r} is an option of {', '.join(owners)}")
        else:
            close = difflib.get_close_matches(key.lower(), allowed, n=1, cutoff=0.6)
            if close:
                hints.append(f"{key!r}: did you mean {close[0]!r}?")
    bad = ", ".join(map(repr, keys))
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (f"kvkit.vllm: unknown option{'s' if len(keys) > 1 else ''} {bad} for {name!r}{hint}; "
            f"{name}'s options: {', '.join(allowed) or 'none'}")


def _split(spec) -> tuple[str | None, dict]:
    """A switch -> (policy name or None for off, raw options), refusing duplicate keys and two policy names."""
    if isinstance(spec, dict):
        spec = dict(spec)
        bad_keys = [k for k in spec if not isinstance(k, str)]
        if bad_keys:
            raise ValueError(f"kvkit.vllm: a dict switch's keys must be strings, got {bad_keys!r}")
        given = {k: v for k in NAME_KEYS if k in spec and (v := spec.pop(k)) is not None}
        if not given:
            raise ValueError(f"kvkit.vllm: a dict switch needs a 'policy' key (the policy name), got keys "
                             f"{sorted(spec)}; e.g. {{'policy': 'streaming', 'budget': 1024}}")
        if len({str(v).strip().lower() for v in given.values()}) > 1:
            raise ValueError(f"kvkit.vllm: the dict switch names two policies, 'policy': {given['policy']!r} and "
                             f"'name': {given['name']!r}; give the policy once, as 'policy'")
        return str(next(iter(given.values()))), spec
    text = str(spec).strip()
    if text.lower() in ("", "off", "none", "0"):
        return None, {}
    name, _, opts = text.partition(":")
    kwargs: dict = {}
    for item in filter(None, (s.strip() for s in opts.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"kvkit.vllm: option {item!r} is not key=value (in {text!r})")
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError(f"kvkit.vllm: option {item!r} has no name (in {text!r}); write key=value")
        if key in kwargs:
            raise ValueError(f"kvkit.vllm: option {key!r} is given twice in {text!r} ({key}={kwargs[key]} and "
                             f"{key}={value}); give it once")
        kwargs[key] = value
    return name, kwargs


def parse_policy(spec, *, source: str | None = None) -> PluginPolicy | None:
    """``"streaming:budget=1024,sink=4"`` / ``{"policy": "streaming", "budget": 1024}`` -> the policy's plan
    (``kvkit.vllm.plans.streaming.StreamingPlan(budget=1024, sink=4, free=1)``).

    None, "" and "off" switch the plugin off (None is returned). Refused, with a message naming the bad key and
    the policy's options: a policy the plugin does not run, an option the policy does not read, an option given
    twice, a dict naming two policies (``policy`` and ``name``), and every value ``kvkit.patch`` would refuse (the
    plan's checks, then the transformers policy's: :class:`kvkit.vllm.plans.base.Plan`). Text values are parsed by
    the option's type (:meth:`~kvkit.vllm.plans.base.Plan.parse_option`).
    ``source`` (e.g. ``"$KVKIT_VLLM_POLICY"``) is named in the error.
    """
    if spec is None:
        return None
    if isinstance(spec, PluginPolicy):
        return spec
    try:
        name, kwargs = _split(spec)
        if name is None:
            return None
        name = name.strip().lower()
        if name in ("off", "none"):
            return None
        cls = plan_class(name)  # raises: unknown policy, or a transformers-only one
        unknown = [k for k in kwargs if k not in cls.options()]
        if unknown:
            raise ValueError(_unknown_options(name, unknown))
        clean = {}
        for k, v in kwargs.items():
            if isinstance(v, os.PathLike):
                v = os.fspath(v)
            if isinstance(v, str) and not v.strip():
                raise ValueError(f"kvkit.vllm: option {k!r} of {name!r} has an empty value; give {k}=<value> "
                                 f"({k}=none where None is allowed), or leave {k} out for its default")
            clean[k] = cls.parse_option(k, v) if isinstance(v, str) else v
        return cls(**clean)
    except ValueError as e:
        if source:
            raise ValueError(f"{e} (from {source})") from None
        raise


def _near_miss_keys(extra: dict) -> list[str]:
    """Keys of ``additional_config`` that look meant for the plugin but are not ``CONFIG_KEY`` (``"KVKIT"``,
    ``"kv_kit"``, ``"kvkit_policy"``, ``"kvkt"``, ...)."""
    out = []
    for key in extra:
        if not isinstance(key, str) or key == CONFIG_KEY:
            continue
        norm = re.sub(r"[^a-z0-9]", "", key.lower())
        if CONFIG_KEY in norm or difflib.SequenceMatcher(None, norm, CONFIG_KEY).ratio() >= 0.8:
            out.append(key)
    return out


def _model_config(vllm_config):
    mc = getattr(vllm_config, "model_config", None)
    return getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)


def policy_from(vllm_config=None) -> PluginPolicy | None:
    """The policy switched on for this engine: ``additional_config["kvkit"]``, else $KVKIT_VLLM_POLICY.

    A key of ``additional_config`` that looks meant for the plugin but is not ``"kvkit"`` (``"KVKIT"``, ``"kv_kit"``)
    is an error (it would leave the plugin off without a word). When ``vllm_config`` names the model, the policy is
    checked against it (:meth:`~kvkit.vllm.plans.base.Plan.check_model`).
    """
    extra = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    if isinstance(extra, dict):
        near = _near_miss_keys(extra)
        if near:
            keys = ", ".join(map(repr, near))
            raise ValueError(
                f"kvkit.vllm: additional_config has the key {keys}, not {CONFIG_KEY!r}: the kvkit plugin reads only "
                f"additional_config[{CONFIG_KEY!r}] (lower case), so this would run vLLM without kvkit; rename it "
                f"to {CONFIG_KEY!r}"
            )
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        policy = parse_policy(extra[CONFIG_KEY], source=f"additional_config[{CONFIG_KEY!r}]")
        source = f"additional_config[{CONFIG_KEY!r}]"
    else:
        policy = parse_policy(env.vllm_policy(), source=f"${ENV_VAR}")
        source = f"${ENV_VAR}"
    model = _model_config(vllm_config) if vllm_config is not None else None
    if policy is not None and model is not None:
        try:
            policy.check_model(model)
        except ValueError as e:
            raise ValueError(f"{e} (from {source})") from None
    return policy
