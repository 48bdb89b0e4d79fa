"""The per-engine switch of the kvkit vLLM plugin: which policy, with which options.

Two ways to switch the plugin on (the first found wins); without either it is off and vLLM runs
exactly its own CPU attention:

* per engine: ``LLM(..., additional_config={"kvkit": "streaming:budget=1024,sink=4"})``
  (packed 4-bit pages: ``{"kvkit": "quant:bits=4"}``; DuoAttention: ``{"kvkit": "duo"}``)
  (or ``{"kvkit": {"policy": "streaming", "budget": 1024, "sink": 4}}``; ``vllm serve
  --additional-config '{"kvkit": "tidal:budget=2048"}'`` on the command line);
* per process: the environment variable ``KVKIT_VLLM_POLICY=streaming:budget=1024,sink=4``.

The switch is checked as ``kvkit.patch`` checks the same values (:class:`PluginPolicy`, :func:`parse_policy`): an
option the policy does not read, an option given twice, a dict naming two policies, a value the transformers
policy of the same name refuses, a ``reselect_layer`` or duo pattern that does not fit the engine's model, and an
``additional_config`` key that looks meant for the plugin but is not ``"kvkit"`` are errors naming the bad key.

This module imports nothing from vLLM, so it is testable (and importable) without it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass

from kvkit import env

ENV_VAR = "KVKIT_VLLM_POLICY"
CONFIG_KEY = "kvkit"

# Policies the vLLM plugin runs, and the kvkit policies it does not run (yet): named in the error.
VLLM_POLICIES = ("full", "streaming", "tidal", "quest", "quant", "duo")
NOT_IN_VLLM = ("cake", "shadowkv", "zipcache", "chelsea")

#: The options each plugin policy reads (any other key is refused, naming these).
POLICY_OPTIONS = {
    "full": (),
    "streaming": ("budget", "sink", "free"),
    "tidal": ("budget", "sink", "reselect_layer", "score"),
    "quest": ("budget", "sink"),
    "quant": ("bits",),
    "duo": ("sink", "recent", "pattern", "sparsity"),
}
#: Keys of a dict switch that give the policy name (one of them, once).
NAME_KEYS = ("policy", "name")

SINK_DEFAULT = 4  # streaming / tidal: leading tokens always read
DUO_SINK_DEFAULT = 64  # duo: DuoAttention's deploy setting (sink 64, recent 256; arXiv:2410.10819)


@dataclass(frozen=True)
class PluginPolicy:
    """A policy as the vLLM plugin runs it, at the granularity of vLLM's KV blocks.

    name : "full" (the plugin's backend with nothing changed), "streaming", "tidal" or "quest"
        (Quest, arXiv:2406.10774: every layer from 2 on picks its own top-k blocks from its own query
        and per-block key min/max summaries, before reading; layers 0-1 read everything).
    budget : tokens read per decoded token (streaming: also tokens held); rounded up to whole blocks.
    sink : streaming / tidal: leading tokens always read (rounded up to whole blocks; 0: none).
    reselect_layer : tidal: the re-selection layer (None: round(0.4 * num_layers), TidalDecode).
    free : streaming: free the middle blocks during decoding (1, default) or only skip reading them (0).
    score : tidal: how a selection layer scores blocks: "exact" (TidalDecode: softmax of q.k over every
        token, from a copy of the selection layers' keys, max over a block's tokens and over heads) or
        "quest" (Quest's upper bound from per-block key min/max summaries: no key copy, coarser).
    bits : quant: bits per K/V code in the packed pages (4 or 8); see ``kvkit/vllm/quant.py``. Every token is
        kept and read (``budget``/``sink`` do not apply).
    recent : duo: tokens a streaming head reads at the end of its context (DuoAttention's deploy setting 256).
        A streaming head reads the blocks covering the first ``sink`` tokens (default 64 for duo) and the last
        ``recent`` tokens; a retrieval head reads every block.
    pattern : duo: a DuoAttention pattern file (kvkit JSON or the reference TSV); None: the one kvkit ships for
        the model (``kvkit.policies.duo_patterns.shipped_pattern``), an error if none ships.
    sparsity : duo: fraction of KV heads made streaming heads (global quantile of the pattern's gates); None:
        0.5 for GQA models, 0.75 for MHA (the paper's and ``kvkit.patch(model, "duo")``'s default).

    The options are checked as ``kvkit.patch`` checks them: the plugin's own checks, then the transformers policy of
    the same name is built from them (``kvkit.registry.get_policy``: ``streaming``, ``tidal``, ``duo``, ``full``),
    whose checks run too (duo: the pattern file is read and checked now; :attr:`kvkit_policy` keeps it). What
    needs the model (a ``reselect_layer`` past its last layer, a pattern of another shape) is checked by
    :meth:`check_model`, which :func:`policy_from` runs when the engine's config names the model.
    """

    name: str = "full"
    budget: int = 1024
    sink: int | None = None  # None: 4 (streaming, tidal), 64 (duo)
    reselect_layer: int | None = None
    free: int = 1
    score: str = "exact"
    bits: int = 4
    recent: int = 256
    pattern: str | None = None
    sparsity: float | None = None

    def __post_init__(self):
        if self.name not in VLLM_POLICIES:
            hint = ""
            if self.name in NOT_IN_VLLM:
                hint = f" ({self.name!r} is a kvkit policy for transformers; the vLLM plugin does not run it yet)"
            raise ValueError(
                f"kvkit.vllm: unknown policy {self.name!r}{hint}; the vLLM plugin runs: {', '.join(VLLM_POLICIES)}"
            )
        if self.sink is None:
            object.__setattr__(self, "sink", DUO_SINK_DEFAULT if self.name == "duo" else SINK_DEFAULT)
        for key in ("budget", "sink", "free", "bits"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kvkit.vllm: {key} must be an integer >= 0, got {v!r}")
        if self.budget < 1:
            raise ValueError(f"kvkit.vllm: budget must be >= 1, got {self.budget}")
        if self.name == "streaming" and self.sink >= self.budget:
            raise ValueError(f"kvkit.vllm: streaming sink ({self.sink}) must be smaller than budget ({self.budget})")
        if self.bits not in (4, 8):
            raise ValueError(f"kvkit.vllm: bits must be 4 or 8, got {self.bits!r}")
        if self.score not in ("exact", "quest"):
            raise ValueError(f"kvkit.vllm: score must be 'exact' or 'quest', got {self.score!r}")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 1:
            raise ValueError(f"kvkit.vllm: recent must be an integer >= 1, got {self.recent!r}")
        sp = self.sparsity
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 <= sp <= 1):
            raise ValueError(f"kvkit.vllm: sparsity must be a fraction in [0, 1], got {sp!r}")
        if self.pattern is not None and not isinstance(self.pattern, str):
            raise ValueError(f"kvkit.vllm: pattern must be a file path, got {type(self.pattern).__name__}")
        r = self.reselect_layer
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 3):
            raise ValueError(f"kvkit.vllm: reselect_layer must be an integer >= 3, got {r!r}")
        if self.free not in (0, 1):
            raise ValueError(f"kvkit.vllm: free must be 0 or 1, got {self.free!r}")
        object.__setattr__(self, "_kvkit", self._build_kvkit_policy())

    def _build_kvkit_policy(self):
        """The transformers policy of the same name and options, built by ``kvkit.registry.get_policy`` so that its
        own checks run (None for the plugin-only ``quest`` / ``quant``)."""
        opts = {
            "full": {},
            "streaming": dict(budget=self.budget, sink=self.sink),
            # the plugin runs TidalDecode's layout: no per-model calibration of the selection layers
            "tidal": dict(budget=self.budget, reselect_layer=self.reselect_layer, calibrated=False),
            "duo": dict(pattern=self.pattern, sparsity=self.sparsity, sink=self.sink, recent=self.recent),
        }.get(self.name)
        if opts is None:
            return None
        from kvkit.registry import get_policy

        try:
            return get_policy(self.name, **opts)
        except ValueError as e:
            raise ValueError(f"kvkit.vllm: {e}") from None

    @property
    def kvkit_policy(self):
        """The transformers policy these options build (``kvkit.registry.get_policy``), or None (quest, quant).
        duo: it holds the pattern as read when this was parsed (``kvkit.policies.duo_patterns.PatternFile``)."""
        return self.__dict__.get("_kvkit")

    @property
    def pattern_sha256(self) -> str | None:
        """duo: sha256 of the pattern file as read when this was parsed (None: the shipped one, or not duo)."""
        return getattr(self.kvkit_policy, "pattern_sha256", None) if self.name == "duo" else None

    def check_model(self, hf_config) -> None:
        """Raise ValueError when this policy cannot run on the model of ``hf_config`` as asked, as ``kvkit.patch``
        would refuse it: tidal / quest on fewer than 3 layers, a ``reselect_layer`` past the last layer, a duo
        pattern of another shape (or none shipped for the model)."""
        tc = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        n = getattr(tc, "num_hidden_layers", None)
        if isinstance(n, int) and self.name in ("tidal", "quest"):
            if n < 3:
                raise ValueError(f"kvkit.vllm: {self.name} needs at least 3 layers (layers 0-1 read everything, "
                                 f"layer 2 is the first selection layer); this model has {n}")
            self.select_layers(n)
        pol = self.kvkit_policy
        if pol is not None:
            try:
                pol.validate(tc)
            except ValueError as e:
                msg = str(e)
                raise ValueError(msg if msg.startswith("kvkit.vllm") else f"kvkit.vllm: {msg}") from None

    # --- block geometry -------------------------------------------------------------------------
    def sink_blocks(self, block_size: int) -> int:
        return math.ceil(self.sink / block_size) if self.sink > 0 else 0

    def budget_blocks(self, block_size: int) -> int:
        """Blocks read per decoded token (sinks + the rest), at least sinks + 1."""
        return max(math.ceil(self.budget / block_size), self.sink_blocks(block_size) + 1)

    def recent_blocks(self, block_size: int) -> int:
        return self.budget_blocks(block_size) - self.sink_blocks(block_size)

    def recent_start_block(self, seq_len: int, block_size: int) -> int:
        """duo: the first block of a streaming head's recent window (it reads blocks ``[0, sink_blocks)`` and
        ``[max(sink_blocks, this), ceil(seq_len / block_size))``)."""
        return max(self.sink_blocks(block_size), max(0, seq_len - self.recent) // block_size)

    def select_layers(self, num_layers: int) -> tuple[int, ...]:
        """tidal: the layers that read everything and (re)select the blocks the next layers read;
        quest: the layers that select (from layer 2 on) and read only what they selected."""
        r = self.reselect_layer if self.name == "tidal" else None
        if r is not None and not 2 < r < num_layers:
            # the selection would silently run without it (and without the default one): refuse instead
            raise ValueError(
                f"kvkit.vllm: tidal reselect_layer must be in [3, {num_layers - 1}] for a model with {num_layers} "
                f"layers (layer 2 is the first selection layer); got {r}"
            )
        if num_layers < 3:
            return ()
        if self.name == "quest":
            return tuple(range(2, num_layers))
        layers = [2]
        if r is None and num_layers >= 5:
            r = round(0.4 * num_layers)
        if r is not None and 2 < r < num_layers:
            layers.append(r)
        return tuple(layers)

    def spec(self) -> str:
        """The switch text of this policy (its own options only: ``parse_policy(p.spec()) == p``)."""
        opts = ",".join(f"{k}={getattr(self, k)}" for k in POLICY_OPTIONS[self.name] if getattr(self, k) is not None)
        return f"{self.name}:{opts}" if opts else self.name


def _int_or_none(key: str, value: str):
    if value.lower() in ("none", ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"kvkit.vllm: option {key}={value!r} is not an integer") from None


def _parse_value(key: str, value: str):
    if key == "score":
        return value
    if key == "pattern":
        return None if value.lower() in ("none", "") else value
    if key == "sparsity":
        if value.lower() in ("none", ""):
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"kvkit.vllm: option sparsity={value!r} is not a number") from None
    return _int_or_none(key, value)


def _unknown_options(name: str, keys) -> str:
    allowed = POLICY_OPTIONS[name]
    hints = []
    for key in keys:
        owners = [p for p, opts in POLICY_OPTIONS.items() if key in opts]
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
        key = key.strip()
        if key in kwargs:
            raise ValueError(f"kvkit.vllm: option {key!r} is given twice in {text!r} ({key}={kwargs[key]} and "
                             f"{key}={value.strip()}); give it once")
        kwargs[key] = value.strip()
    return name, kwargs


def parse_policy(spec, *, source: str | None = None) -> PluginPolicy | None:
    """``"streaming:budget=1024,sink=4"`` / ``{"policy": "streaming", "budget": 1024}`` -> PluginPolicy.

    None, "" and "off" switch the plugin off (None is returned). Refused, with a message naming the bad key and
    the policy's options: an option the policy does not read, an option given twice, a dict naming two policies
    (``policy`` and ``name``), and every value ``kvkit.patch`` would refuse (see :class:`PluginPolicy`).
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
        if name not in POLICY_OPTIONS:
            return PluginPolicy(name=name)  # raises: unknown policy, or a transformers-only one
        unknown = [k for k in kwargs if k not in POLICY_OPTIONS[name]]
        if unknown:
            raise ValueError(_unknown_options(name, unknown))
        clean = {}
        for k, v in kwargs.items():
            if isinstance(v, os.PathLike):
                v = os.fspath(v)
            clean[k] = _parse_value(k, v) if isinstance(v, str) else v
        return PluginPolicy(name=name, **clean)
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
    checked against it (:meth:`PluginPolicy.check_model`).
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
