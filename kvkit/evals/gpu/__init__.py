"""``kvkit bench --shape NAME``: one decode step of a real architecture's shape, timed for every cache in one run.

What it measures. A ``LlamaForCausalLM`` with random weights of a named shape (:data:`SHAPES`; built directly on
the device, then ``.to(dtype)``: bf16 on CUDA, fp32 on the CPU; nothing is downloaded) gets a batch of ``B`` rows of
``L`` random token ids, and one decode step (one query token per row, ``input_ids [B, 1]``, the previous step's
greedy token fed back) is timed for each row of the table:

* ``hf-dynamic``: transformers unpatched, eager, its ``DynamicCache``;
* ``hf-static``: transformers' ``StaticCache`` with the decode forward compiled (CUDA graphs on CUDA; eager with
  ``--no-compile``);
* ``full``: kvkit's ``full`` policy (the reference of the ratios);
* every compressed kvkit policy with settings that make sense at this length (:func:`default_options`);
* ``<policy> static+compile`` (``--compiled``, the default), right after each kvkit policy with a static store:
  a static cache, the prefill eager, every step through ``model.get_compiled_call``. A policy without a static
  store gets no such row; the summary's first line names it with ``KVCache.compile_refusal``'s reason.

Modules, in the order a run uses them:

- :mod:`~kvkit.evals.gpu.cli`: the command's arguments checked, one run per length, the files written;
- :mod:`~kvkit.evals.gpu.shapes`: the shapes and the random-weight model;
- :mod:`~kvkit.evals.gpu.plan`: the rows, their order and options (:func:`parse_rows`, :func:`plan_rows`);
- :mod:`~kvkit.evals.gpu.runner`: :class:`Bench`, every row measured in turn (prefill, warm-up, timed rounds
  interleaved with ``full``, one counted step), the time limit, failures as rows;
- :mod:`~kvkit.evals.gpu.rows` (the row base and the transformers baselines) and
  :mod:`~kvkit.evals.gpu.kvkit_rows` (kvkit's eager and compiled rows);
- :mod:`~kvkit.evals.gpu.compiled`: compile settings, the compiled step's bytes, dynamo's counters;
- :mod:`~kvkit.evals.gpu.timing`: timed blocks of steps, percentiles, the copy bandwidth, the step watch;
- :mod:`~kvkit.evals.gpu.bound`: weights read per step, the byte bound, speed-ups and fractions;
- :mod:`~kvkit.evals.gpu.report`: the environment, the table, ``config.json`` / ``rows.jsonl`` / ``summary.md``.
"""

from kvkit.evals.gpu.bound import add_ratios, byte_bound_ms, fraction_to_bound, weight_read_bytes
from kvkit.evals.gpu.cli import run_cli
from kvkit.evals.gpu.compiled import COMPILE_ESTIMATE_S, compile_config, compiled_read_bytes
from kvkit.evals.gpu.plan import (
    DEFAULT_ROWS,
    GPU_OPTIONS,
    HF_ROWS,
    compiled_name,
    default_options,
    parse_rows,
    plan_rows,
)
from kvkit.evals.gpu.report import compiled_summary, summary_md, write
from kvkit.evals.gpu.runner import Bench
from kvkit.evals.gpu.shapes import SHAPES, build_model, shape_config
from kvkit.evals.gpu.timing import measure_bandwidth

__all__ = [
    "COMPILE_ESTIMATE_S", "DEFAULT_ROWS", "GPU_OPTIONS", "HF_ROWS", "SHAPES", "Bench", "add_ratios", "build_model",
    "byte_bound_ms", "compile_config", "compiled_name", "compiled_read_bytes", "compiled_summary",
    "default_options", "fraction_to_bound", "measure_bandwidth", "parse_rows", "plan_rows", "run_cli",
    "shape_config", "summary_md", "weight_read_bytes", "write",
]
