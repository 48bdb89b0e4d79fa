"""The policy contract: a frozen dataclass of hyper-parameters that builds one store per layer.

A policy answers three questions (docs/DESIGN.md): what to store (``new_layer`` returns its store), what
to read at decode (the store's ``decode``/``visible``), and which kernel reads it. Adding a method is
one file in this package: a ``@register("name")`` dataclass plus its store.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvkit.policies.knobs import check_common
from kvkit.stores import LayerInfo


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base of every kvkit policy (subclasses are frozen dataclasses registered by name).

    Parameters
    ----------
    compression_ratio : float or None
        Fraction of full's KV bytes a decode step no longer reads (and, for a policy that evicts or quantizes, the
        memory saved), in (0, 1); mapped to the policy's native knobs (:mod:`kvkit.policies.knobs`). None: the
        native knobs as given.
    preset : str
        ``"kvkit"`` (kvkit's defaults) or ``"paper"`` (the paper's own settings for the options left at their
        defaults).
    """

    compression_ratio: float | None = None  # one knob for every policy; None = the native knobs as given
    preset: str = "kvkit"  # kvkit's defaults keep the answer; "paper" reproduces the published settings

    name: ClassVar[str] = "base"
    #: one line for ``kvkit policies`` and the README table
    description: ClassVar[str] = ""
    #: what the policy saves: "nothing", "memory", "reads" or "memory+reads"
    saves: ClassVar[str] = "nothing"
    #: needs rotary position embeddings in the model
    needs_rope: ClassVar[bool] = True
    #: options under which the policy keeps and reads everything of a short (<= 256 tokens) context, so its
    #: output equals ``full``'s; None when no setting is lossless (e.g. quantisation)
    covering_options: ClassVar[dict | None] = None
    #: why self-speculative decoding over this policy's target would not reproduce its own one-token decoding
    #: (``kvkit.speculative`` refuses it with this reason); None: lossless
    speculative_refusal: ClassVar[str | None] = None
    #: its stores have a static variant (``KVCache(..., static=True)``: fixed-capacity buffers, a decode step that
    #: ``torch.compile(fullgraph=True)`` captures whole); ``new_layer`` builds it when ``info.static``
    static_capable: ClassVar[bool] = False
    #: options a static cache needs on a GPU, which the benchmark's compiled rows add unless the user set them
    #: (shadowkv: ``offload=False``, as a CUDA graph reads no host memory); empty: none
    static_options: ClassVar[dict] = {}
    #: the options a per-model calibration (:mod:`kvkit.calibration`) may set, applied only when the user left all
    #: of them at their defaults (written by the policy's calibrator, ``kvkit/calibrate/<name>.py``); empty: none
    calibrated_options: ClassVar[tuple[str, ...]] = ()
    #: the native options ``compression_ratio`` sets (giving one of them away from its default with it is refused);
    #: empty: the policy compresses nothing
    ratio_knobs: ClassVar[tuple[str, ...]] = ()
    #: ``compression_ratio``'s knobs depend on the context length (a static cache then needs ``prompt_length``:
    #: :func:`kvkit.policies.knobs.static_prompt`); False: on the model alone (zipcache's bit widths)
    ratio_needs_length: ClassVar[bool] = True
    #: ``preset="paper"``: the options that differ from kvkit's defaults, at the paper's values
    paper: ClassVar[dict] = {}

    def __post_init__(self):
        check_common(self)

    def new_layer(self, info: LayerInfo):
        """Return the store for one full-attention layer."""
        raise NotImplementedError

    def new_shared(self, infos: list[LayerInfo]):
        """Cross-layer state of one cache (a typed object, e.g. TidalDecode's selection), created once per
        ``KVCache`` before its stores and handed to every store as ``info.shared``; None when not needed."""
        return None

    def after_forward(self, base_model, cache, input_ids, attention_mask) -> None:
        """Called by kvkit's hook after every forward of the patched base model that used a ``KVCache`` of this
        policy (``input_ids`` / ``attention_mask`` as the forward received them, either may be None); e.g.
        KVzip's reconstruction pass. Default: nothing."""

    def validate(self, config) -> None:
        """Raise ValueError when the policy cannot run on this model config."""

    def uses_calibration(self) -> bool:
        """Whether a per-model calibration (:mod:`kvkit.calibration`) may fill this policy's calibrated options
        (with ``calibrated`` True and none of them given); e.g. Chelsea's only with ``protect`` > 0."""
        return True

    def options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __str__(self) -> str:
        # the shared knobs appear only when set, so a policy reads (and a run's record stays) as its own options
        unset = {"compression_ratio": None, "preset": "kvkit"}
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items() if k not in unset or unset[k] != v)
        return f"{self.name}({opts})" if opts else self.name


def check_positive_int(policy: str, name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{policy}: {name} must be a positive integer, got {value!r}")


def check_choice(policy: str, name: str, value, choices, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"{policy}: {name} must be one of {', '.join(choices)}, got {value!r}")


def check_odd_kernel(policy: str, name: str, value) -> None:
    """A pooling kernel: None (the calibrated / the paper's) or a positive odd integer (pooling pads ``kernel // 2``
    on each side, or ``kernel - 1`` before each token, and keeps the length)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 2 == 0:
        raise ValueError(f"{policy}: {name} must be a positive odd integer (pooling keeps the sequence length only "
                         f"with an odd kernel), got {value!r}")


def check_fraction(policy: str, name: str, value, low_open=True, high_closed=True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > 0 if low_open else value >= 0) and (value <= 1 if high_closed else value < 1)
    if not ok:
        lo = "(0" if low_open else "[0"
        hi = "1]" if high_closed else "1)"
        raise ValueError(f"{policy}: {name} must be in {lo}, {hi}, got {value!r}")
