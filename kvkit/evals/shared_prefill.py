"""The evals' import path of :mod:`kvkit.workloads.shared_prefill` (one exact prefill, replayed into many
policies' caches), shared with the calibrations."""

from kvkit.workloads.shared_prefill import (
    NOT_REPLAYABLE,
    LayerCall,
    PrefillRecording,
    record_prefill,
    replay_prefill,
    replay_refusal,
    replayable,
    replayable_policies,
)

__all__ = ["LayerCall", "NOT_REPLAYABLE", "PrefillRecording", "record_prefill", "replay_prefill", "replay_refusal",
           "replayable", "replayable_policies"]
