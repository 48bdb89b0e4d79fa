"""``kvkit bench``: prefill and decode time, peak memory and KV bytes of policies against the full cache,
measured in the same run on the same prompts.

- :mod:`~kvkit.evals.bench.phases`: per prompt length, a policy's prefill (one-shot or chunked) and decode
  (``kvkit bench``, :func:`run`);
- :mod:`~kvkit.evals.bench.batched`: batched decode of every policy paired with the full cache, memory fit,
  profiles (``kvkit bench --batch``, :func:`decode_bench`), built on
  :mod:`~kvkit.evals.bench.replay` (one recorded prefill, replayed), :mod:`~kvkit.evals.bench.runs` (one
  policy's decode state and steps), :mod:`~kvkit.evals.bench.timing` (interleaved rounds, profiles, rows) and
  :mod:`~kvkit.evals.bench.fit` (byte bound, memory fit);
- :mod:`~kvkit.evals.bench.report`: the batched bench's tables, figure and files;
- :mod:`~kvkit.evals.bench.memory`, :mod:`~kvkit.evals.bench.prompts`, :mod:`~kvkit.evals.bench.configs`: peak
  memory, the essay prompts, the policy configs and argument checks.
"""

from kvkit.evals.bench.batched import decode_bench
from kvkit.evals.bench.configs import check_configs, config_label
from kvkit.evals.bench.fit import (
    HEADROOM_TOKENS,
    byte_bound,
    fraction_of_bound,
    full_token_bytes,
    memory_fit,
    weight_bytes,
)
from kvkit.evals.bench.memory import PeakMemory
from kvkit.evals.bench.phases import BenchRow, bench_one, run, with_ratios
from kvkit.evals.bench.prompts import batch_prompts, bench_prompt
from kvkit.evals.bench.replay import record_prefill_spilled
from kvkit.evals.bench.report import (
    decode_tables,
    profile_summary,
    throughput_figure,
    write_decode_results,
    write_partial,
)
from kvkit.evals.bench.runs import DecodeRun, decode_step, prefill_run
from kvkit.evals.bench.timing import profile_runs

__all__ = [
    "HEADROOM_TOKENS", "BenchRow", "DecodeRun", "PeakMemory", "batch_prompts", "bench_one", "bench_prompt",
    "byte_bound", "check_configs", "config_label", "decode_bench", "decode_step", "decode_tables",
    "fraction_of_bound", "full_token_bytes", "memory_fit", "prefill_run", "profile_runs", "profile_summary",
    "record_prefill_spilled", "run", "throughput_figure", "weight_bytes", "with_ratios", "write_decode_results",
    "write_partial",
]
