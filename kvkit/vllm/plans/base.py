"""The base class of the vLLM plugin's plans: a policy as the plugin runs it, at vLLM's KV-block granularity.

A plan is a frozen dataclass whose fields are its policy's switch options (named as in the transformers policy of
the same name, ``kvkit/policies/<name>.py``, where that policy has the option; plugin-only options are listed in
:attr:`Plan.plugin_options`), registered by name (:func:`kvkit.vllm.plans.register`). It owns all that the backend
(:mod:`kvkit.vllm.backend`) does differently for its policy:

* its options: a switch value parsed by the field's type (:meth:`Plan.parse_option`), checked (:meth:`Plan.check`,
  run when the plan is built), the transformers policy built from them (:meth:`Plan.hf_options`, whose own checks
  run then), and what needs the model (:meth:`Plan.check_layers`, :meth:`Plan.check_model`);
* the engine hooks the backend calls, whose defaults are vLLM's own code paths:

  - :meth:`Plan.customize_spec` (the backend's ``customize_spec``): the KV-cache spec the allocator gets;
  - :meth:`Plan.plan_step` (the metadata builder, once per step and KV-cache group): what the step's rows read; the
    result is attached to vLLM's metadata as ``md.kvkit`` and shared by every layer of the group (None: vLLM's code);
  - :meth:`Plan.layer_state` (each attention layer's impl, once): buffers the layer keeps across steps;
  - :meth:`Plan.write` (the impl's ``do_kv_cache_update``) and :meth:`Plan.forward` (its ``forward``, on steps with
    a ``md.kvkit``).

What the hooks may use of the backend: the builder's ``block_size``, ``num_layers``, ``num_heads``,
``num_kv_heads``, ``head_dim``, ``dtype``, ``isa``, ``policy`` and ``sched(md, seq_lens)`` (vLLM's scheduler
metadata for other sequence lengths); the impl's ``vllm_forward(layer, query, key, value, kv_cache, md, output,
output_scale, output_block_scale)`` and ``vllm_write(layer, key, value, kv_cache, slot_mapping)`` (vLLM's own
attention and KV write), ``kvkit_layer(layer)`` (the layer's index), ``kvkit_policy`` (this plan) and vLLM's impl
attributes (``num_kv_heads``, ``num_queries_per_kv``, ``head_size``, ``scale``, ``sinks``, ...).

This module and the plan modules import nothing from vLLM at import time (hooks import it inside), so a switch is
parsed and checked without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from kvkit.registry import get_policy

_NONE = ("none", "")


@dataclass(frozen=True)
class LayerContext:
    """What :meth:`Plan.layer_state` gets besides the impl."""

    vllm_config: object | None  # the engine's VllmConfig (None: the impl was built outside vLLM's config context)
    num_layers: int  # decoder layers of the model (0 without a config)
    decoder: bool  # the layer is decoder self-attention (vLLM's AttentionType.DECODER)
    tp: object  # this process's tensor-parallel group: size(), rank(), max_(t) (kvkit.vllm.backend.TensorParallel)


def require_int(plan, *keys: str, minimum: int = 0) -> None:
    """Raise ValueError unless each option ``keys`` of ``plan`` is an integer (not a bool) >= ``minimum``."""
    for key in keys:
        v = getattr(plan, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"kvkit.vllm: {key} must be an integer >= {minimum}, got {v!r}")


def set_default(plan, key: str, value) -> None:
    """Fill option ``key`` of a frozen plan with ``value`` when it is None (an option whose default the plan sets)."""
    if getattr(plan, key) is None:
        object.__setattr__(plan, key, value)


@dataclass(frozen=True)
class Plan:
    """A policy as the vLLM plugin runs it; subclasses declare the options as fields (see the module doc).

    Plans of the same class and options are equal; :attr:`kvkit_policy` (not compared) keeps the transformers policy
    built from the options, e.g. a duo pattern as read when the switch was parsed.
    """

    #: the policy name (set by ``@register``)
    name: ClassVar[str] = ""
    #: options the transformers policy of the same name does not have (the others reuse its option names)
    plugin_options: ClassVar[tuple[str, ...]] = ()
    #: runs on models with a sliding window (the others are refused: the window already bounds the reads)
    sliding_window_ok: ClassVar[bool] = False

    def __post_init__(self):
        self.check()
        object.__setattr__(self, "_kvkit", self._build_kvkit_policy())

    # --- options ---------------------------------------------------------------------------------------------------
    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The switch options this plan reads, in the order :meth:`spec` writes them."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def parse_option(cls, key: str, text: str):
        """A switch value given as text -> the option's value, by the field's declared type: ``int`` / ``int | None``
        (``none`` or empty: None, which the checks refuse where None is no default), ``float | None``, ``str |
        None`` (``none`` or empty: None) and ``str`` (as given)."""
        t = {f.name: f.type for f in fields(cls)}[key]
        kind = t if isinstance(t, str) else getattr(t, "__name__", str(t))  # "int | None" (postponed) or a type
        if kind == "str":
            return text
        if text.lower() in _NONE:
            return None
        if kind.startswith("str"):
            return text
        number, what = (float, "a number") if kind.startswith("float") else (int, "an integer")
        try:
            return number(text)
        except ValueError:
            raise ValueError(f"kvkit.vllm: option {key}={text!r} is not {what}") from None

    def check(self) -> None:
        """Raise ValueError for an option value ``kvkit.patch`` would refuse (or the plugin cannot run); fill the
        defaults that depend on the policy (:func:`set_default`). Runs when the plan is built."""

    def hf_options(self) -> dict | None:
        """Options of the transformers policy of the same name (built by ``kvkit.registry.get_policy`` so that its
        own checks run), or None for a plugin-only plan."""
        return None

    def _build_kvkit_policy(self):
        opts = self.hf_options()
        if opts is None:
            return None

        try:
            return get_policy(self.name, **opts)
        except ValueError as e:
            raise ValueError(f"kvkit.vllm: {e}") from None

    @property
    def kvkit_policy(self):
        """The transformers policy these options build (``kvkit.registry.get_policy``), or None (plugin-only)."""
        return self.__dict__.get("_kvkit")

    @property
    def pattern_sha256(self) -> str | None:
        """sha256 of the pattern file its transformers policy read when this was parsed (duo), else None."""
        return getattr(self.kvkit_policy, "pattern_sha256", None)

    def check_layers(self, num_layers: int) -> None:
        """Raise ValueError when the plan cannot run on a model of ``num_layers`` decoder layers."""

    def check_model(self, hf_config) -> None:
        """Raise ValueError when this plan cannot run on the model of ``hf_config`` as asked, as ``kvkit.patch``
        would refuse it: :meth:`check_layers`, then the transformers policy's ``validate``."""
        tc = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        n = getattr(tc, "num_hidden_layers", None)
        if isinstance(n, int):
            self.check_layers(n)
        pol = self.kvkit_policy
        if pol is not None:
            try:
                pol.validate(tc)
            except ValueError as e:
                msg = str(e)
                raise ValueError(msg if msg.startswith("kvkit.vllm") else f"kvkit.vllm: {msg}") from None

    def spec(self) -> str:
        """The switch text of this plan (its own options only: ``parse_policy(p.spec()) == p``)."""
        opts = ",".join(f"{k}={getattr(self, k)}" for k in self.options() if getattr(self, k) is not None)
        return f"{self.name}:{opts}" if opts else self.name

    # --- engine hooks (vLLM's own code paths unless a plan overrides them) -----------------------------------------
    def customize_spec(self, spec):
        """The KV-cache spec vLLM's allocator gets for a layer whose backend spec is ``spec``."""
        return spec

    def plan_step(self, builder, md, num_reqs: int, force_full: bool):
        """What the ``num_reqs`` rows of the step described by vLLM's metadata ``md`` read; attached as ``md.kvkit``
        and handed to :meth:`forward` in every layer. ``force_full``: the benchmark switch asks for vLLM's full reads
        this step (:class:`kvkit.vllm.backend.BenchSwitches`). None: the step runs vLLM's code."""
        return None

    def layer_state(self, impl, ctx: LayerContext):
        """State one attention layer keeps across steps (handed to :meth:`write` and :meth:`forward`), or None."""
        return None

    def write(self, impl, state, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write the step's new ``key`` / ``value`` rows ``[tokens, kv_heads, D]`` into the layer's paged cache."""
        impl.vllm_write(layer, key, value, kv_cache, slot_mapping)

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        """The layer's attention for a step planned by :meth:`plan_step` (``step``): fills and returns ``output``."""
        return impl.vllm_forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
