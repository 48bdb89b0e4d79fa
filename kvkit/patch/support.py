"""Which models and transformers releases kvkit can patch: :func:`check_transformers`, :func:`check_model` and the
attention modules a patch hooks (:func:`attention_modules`)."""

from __future__ import annotations

import transformers
from packaging.version import Version

from kvkit.compat import TRANSFORMERS_SUPPORTED
from kvkit.policies.base import Policy


def attention_modules(model) -> list:
    """The attention modules of ``model`` kvkit hooks: every module with a ``layer_idx``, q/k/v projections
    (``k_proj`` or a fused ``qkv_proj``) and a ``scaling``, in ``named_modules`` order."""
    mods = []
    for _, m in model.named_modules():
        if hasattr(m, "layer_idx") and (hasattr(m, "k_proj") or hasattr(m, "qkv_proj")) and hasattr(m, "scaling"):
            mods.append(m)
    return mods


def check_model(model, policy: Policy) -> None:
    """Raise a clear ValueError when kvkit cannot run ``policy`` on ``model``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"kvkit.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    arch = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"kvkit supports decoder-only causal LMs; {arch} ({config.model_type}) is an encoder-decoder model"
        )
    tc = config.get_text_config(decoder=True)
    if getattr(tc, "kv_lora_rank", None):
        raise ValueError(f"kvkit does not support multi-head latent attention (MLA) models such as {arch}")
    if getattr(tc, "attn_logit_softcapping", None):
        raise ValueError(
            f"{arch} ({tc.model_type}) uses attention logit soft-capping, which kvkit's attention kernels "
            "do not implement (transformers has no sdpa path for it either)"
        )
    if policy.needs_rope and not any(n.endswith("rotary_emb") for n, _ in model.named_modules()):
        raise ValueError(
            f"kvkit policies need rotary position embeddings (RoPE); {arch} ({tc.model_type}) has none "
            "(absolute/learned positions are not supported)"
        )
    mods = attention_modules(model)
    if not mods:
        raise ValueError(
            f"kvkit found no attention modules with q/k/v projections and a layer index in {arch}; "
            "this architecture is not supported"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{arch} does not support custom attention functions (transformers' AttentionInterface); "
            "kvkit cannot patch it"
        )
    policy.validate(tc)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers release outside :data:`TRANSFORMERS_SUPPORTED` with what to install (``version``:
    the installed release when None)."""
    if version is None:
        version = transformers.__version__
    low, high = TRANSFORMERS_SUPPORTED
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"kvkit supports transformers >= {low}, < {high}; this environment has {version} (a release can change "
            f"the attention layers' cache API, as 5.24 did). Install a supported one: "
            f"pip install 'transformers>={low},<{high}'"
        )
