"""Per-process counters of the KV blocks the kvkit backend hands vLLM's attention op.

One record per metadata build (one engine step of one KV-cache group): the decode requests in the
step, the blocks a full read of their contexts would touch in one layer (``full_blocks``), the
blocks actually handed to the op summed over layers (``blocks_read``) and the number of layer calls.
Only decode rows (one query token) are counted: prefill is exact full attention and not counted.
Reachable from tests and benchmarks with the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class StepRecord:
    decode_reqs: int
    full_blocks: int  # blocks of the decode rows' contexts, one layer
    blocks_read: int = 0  # blocks handed to the op for the decode rows, summed over layers
    layer_calls: int = 0

    @property
    def read_fraction(self) -> float:
        denom = self.full_blocks * self.layer_calls
        return self.blocks_read / denom if denom else 1.0


class Stats:
    def __init__(self, maxlen: int = 100_000):
        self.steps: deque[StepRecord] = deque(maxlen=maxlen)

    def reset(self) -> None:
        self.steps.clear()

    def new_step(self, decode_reqs: int, full_blocks: int) -> StepRecord:
        rec = StepRecord(decode_reqs, full_blocks)
        self.steps.append(rec)
        return rec

    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.decode_reqs > 0 and s.layer_calls > 0]


STATS = Stats()
