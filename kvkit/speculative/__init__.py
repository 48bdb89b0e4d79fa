"""Lossless self-speculative decoding: the target drafts from a sparse view of its own KV cache.

``kvkit.speculative.generate(model, ids, attention_mask=mask, draft_policy="streaming", gamma=4)`` or
``model.generate(ids, attention_mask=mask, custom_generate=kvkit.speculative.generate, gamma=4)`` on
left-padded batches (each row accepts its own drafts); optionally a tiny ``assistant=``
model drafting for the self-draft (TriForce's hierarchy). See :mod:`.generate`.
"""

from kvkit.speculative.draft import DraftCache, DraftView, RetrievalView, StreamingView, make_view
from kvkit.speculative.generate import SpeculativeOutput, SpeculativeStats, generate
from kvkit.speculative.request import check_assistant, check_target_policy
from kvkit.speculative.rows import batch_cache

__all__ = [
    "generate",
    "SpeculativeStats",
    "SpeculativeOutput",
    "DraftCache",
    "DraftView",
    "StreamingView",
    "RetrievalView",
    "make_view",
    "check_assistant",
    "check_target_policy",
    "batch_cache",
]
