"""kvkit: KV-cache compression policies, sparse/quantized decode kernels and self-speculative
decoding for Hugging Face transformers, installed with one line::

    import kvkit
    kvkit.patch(model, policy="streaming", budget=512)
    model.generate(ids, max_new_tokens=64)
    kvkit.unpatch(model)
"""

import kvkit.policies  # noqa: F401  (registers the built-in policies with kvkit.registry)
from kvkit.cache import KVCache
from kvkit.patch import patch, patched_policy, unpatch
from kvkit.prefill import prefill
from kvkit.registry import available_policies, get_policy, policy_options

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "patched_policy", "prefill", "KVCache", "available_policies", "get_policy", "policy_options"]
