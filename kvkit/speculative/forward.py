"""One forward of the target that returns the logits of its last ``keep`` positions, with the head applied by us.

Speculative decoding needs the logits of several positions per forward (``gamma + 1`` per row in a
verification, one per row in a batched draft step): 2 to a few hundred rows against the vocabulary
head. On CPU, MKL runs ``h @ W.T`` with a few rows of ``h`` against SmolLM2's 49152 x 576 head at a
fraction of its memory bandwidth, while the tall-skinny ``W @ h.T`` streams ``W`` once
(``benchmarks/speculative/profile_verify.py``). So the forward runs the decoder (``model.base_model``)
and multiplies by the head's weight explicitly: no module's ``forward`` is replaced.

Same math as the model's own head, different summation order (~1e-6 relative in fp32). Falls back to
the model's own forward when the head is not a plain ``nn.Linear`` or the model post-processes its
logits (a final soft-cap, a logit scale).
"""

from __future__ import annotations

import torch

#: text-config attributes that make a model post-process its logits after the head
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def explicit_head(model) -> torch.nn.Linear | None:
    """The head to apply by hand, or None when the model's own forward must run."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", model)
    if not isinstance(head, torch.nn.Linear) or base is model:
        return None
    tc = model.config.get_text_config(decoder=True)
    for name in LOGIT_POSTPROCESSING:
        value = getattr(tc, name, None)
        if value is not None and value != 1:
            return None
    return head


def logits(model, keep: int, **inputs) -> torch.Tensor:
    """Run ``model`` on ``inputs`` (``input_ids [B, T]``, cache, positions, mask); logits ``[B, keep, V]`` fp32."""
    head = explicit_head(model)
    if head is None:
        return model(**inputs, use_cache=True, logits_to_keep=keep).logits[:, -keep:].float()
    h = model.base_model(**inputs, use_cache=True).last_hidden_state[:, -keep:]  # [B, keep, hidden]
    x = h.reshape(-1, h.shape[-1])
    if x.device.type == "cpu" and x.shape[0] > 1:
        y = (head.weight @ x.T).T  # tall-skinny: W streamed once
        if head.bias is not None:
            y = y + head.bias
    else:
        y = torch.nn.functional.linear(x, head.weight, head.bias)  # what the head's own forward computes
    return y.view(h.shape[0], keep, -1).float()
