"""The per-engine switch of the kvkit vLLM plugin: which policy, with which options.

Two ways to switch the plugin on (the first found wins); without either it is off and vLLM runs
exactly its own CPU attention:

* per engine: ``LLM(..., additional_config={"kvkit": "streaming:budget=1024,sink=4"})``
  (packed 4-bit pages: ``{"kvkit": "quant:bits=4"}``; DuoAttention: ``{"kvkit": "duo"}``)
  (or ``{"kvkit": {"policy": "streaming", "budget": 1024, "sink": 4}}``; ``vllm serve
  --additional-config '{"kvkit": "tidal:budget=2048"}'`` on the command line);
* per process: the environment variable ``KVKIT_VLLM_POLICY=streaming:budget=1024,sink=4``.

This module imports nothing from vLLM, so it is testable (and importable) without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

ENV_VAR = "KVKIT_VLLM_POLICY"
CONFIG_KEY = "kvkit"

# Policies the vLLM plugin runs, and the kvkit policies it does not run (yet): named in the error.
VLLM_POLICIES = ("full", "streaming", "tidal", "quest", "quant", "duo")
NOT_IN_VLLM = ("cake", "shadowkv", "zipcache", "chelsea")

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
        the model (``kvkit.policies.duo.shipped_pattern``), an error if none ships.
    sparsity : duo: fraction of KV heads made streaming heads (global quantile of the pattern's gates); None:
        0.5 for GQA models, 0.75 for MHA (the paper's and ``kvkit.patch(model, "duo")``'s default).
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
        if self.reselect_layer is not None and (not isinstance(self.reselect_layer, int) or self.reselect_layer < 3):
            raise ValueError(f"kvkit.vllm: reselect_layer must be an integer >= 3, got {self.reselect_layer!r}")

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
        if num_layers < 3:
            return ()
        if self.name == "quest":
            return tuple(range(2, num_layers))
        layers = [2]
        r = self.reselect_layer
        if r is None and num_layers >= 5:
            r = round(0.4 * num_layers)
        if r is not None and 2 < r < num_layers:
            layers.append(r)
        return tuple(layers)

    def spec(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "name"
                        and getattr(self, f.name) is not None)
        return f"{self.name}:{opts}"


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


def parse_policy(spec) -> PluginPolicy | None:
    """``"streaming:budget=1024,sink=4"`` / ``{"policy": "streaming", "budget": 1024}`` -> PluginPolicy.

    None, "" and "off" switch the plugin off (None is returned).
    """
    if spec is None:
        return None
    if isinstance(spec, PluginPolicy):
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        name = spec.pop("policy", spec.pop("name", None))
        if name is None:
            raise ValueError(f"kvkit.vllm: a dict switch needs a 'policy' key, got {spec!r}")
        kwargs = spec
    else:
        text = str(spec).strip()
        if text.lower() in ("", "off", "none", "0"):
            return None
        name, _, opts = text.partition(":")
        kwargs = {}
        for item in filter(None, (s.strip() for s in opts.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"kvkit.vllm: option {item!r} is not key=value (in {text!r})")
            kwargs[key.strip()] = value.strip()
    name = str(name).strip().lower()
    if name in ("off", "none"):
        return None
    known = {f.name for f in fields(PluginPolicy)} - {"name"}
    unknown = set(kwargs) - known
    if unknown:
        raise ValueError(f"kvkit.vllm: unknown option(s) {sorted(unknown)} for {name!r}; known: {sorted(known)}")
    clean = {k: (_parse_value(k, v) if isinstance(v, str) else v) for k, v in kwargs.items()}
    return PluginPolicy(name=name, **clean)


def policy_from(vllm_config=None) -> PluginPolicy | None:
    """The policy switched on for this engine: ``additional_config["kvkit"]``, else $KVKIT_VLLM_POLICY."""
    extra = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        return parse_policy(extra[CONFIG_KEY])
    return parse_policy(os.environ.get(ENV_VAR))
