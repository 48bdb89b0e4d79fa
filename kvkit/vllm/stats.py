"""Per-process counters of the KV blocks the kvkit backend hands vLLM's attention op.

One record per metadata build (one engine step of one KV-cache group): the decode requests in the
step, the blocks a full read of their contexts would touch in one layer (``full_blocks``), the
blocks actually handed to the op summed over layers (``blocks_read``) and the number of layer calls.
Only decode rows (one query token) are counted: prefill is exact full attention and not counted.

Policies that read the same blocks in every KV head count blocks. ``duo`` reads per KV head (a retrieval head
every block, a streaming head sink + recent blocks): it counts (block, KV head) pairs in ``head_blocks_read``
(summed over layers and the rank's ``kv_heads``), and ``blocks_read`` is their mean over the KV heads (a float);
``read_fraction`` is then the mean fraction over heads and layers.
Reachable from tests and benchmarks with the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class StepRecord:
    decode_reqs: int
    full_blocks: int  # blocks of the decode rows' contexts, one layer
    blocks_read: float = 0  # blocks handed to the op for the decode rows, summed over layers (duo: mean over heads)
    layer_calls: int = 0
    kv_heads: int = 0  # duo: KV heads of this rank (reads counted per head); 0: reads counted per block
    head_blocks_read: int = 0  # duo: (block, KV head) pairs read by the decode rows, summed over layers

    @property
    def read_fraction(self) -> float:
        if self.kv_heads:
            denom = self.full_blocks * self.layer_calls * self.kv_heads
            return self.head_blocks_read / denom if denom else 1.0
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
