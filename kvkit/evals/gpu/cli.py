"""``kvkit bench --shape NAME ...``: the command-line entry of the shaped-model bench (called by
:func:`kvkit.evals.commands.bench.cmd_bench`).

The arguments are checked before anything runs (:func:`_settings`): the shape exists, no option of the bundled-model
bench is given (``--budget``, ``--compression-ratio``, ``--memory``, ...; the rows and their options come with
``--policy ROW[:KEY=VALUE,...]``, repeated, or the older ``--policies ROW ...``), the rows parse, the device and dtype are usable. Defaults: bf16 on CUDA and fp32
on the CPU, ``--lengths 16384``, ``--batch 16`` (2 on ``tiny``), 20 timed steps. One :class:`~kvkit.evals.gpu.runner.
Bench` runs per length, the model built once and reused; each writes ``results/speed-gpu/<shape>-b<B>-<L>/`` (or
``--out``; ``--out/<label>`` with several lengths) after every row, and its table is printed at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kvkit.evals.gpu.plan import REFERENCE_LENGTH, compiled_name, parse_rows
from kvkit.evals.gpu.production import run_bench_args
from kvkit.evals.gpu.report import environment, write
from kvkit.evals.gpu.runner import Bench
from kvkit.evals.gpu.shapes import SHAPES, shape_config
from kvkit.evals.report import SCHEMA


def _settings(args) -> dict:
    """The checked settings of ``args`` (ValueError for anything that does not apply or cannot run here)."""
    shape_config(args.shape)  # unknown shape: clear error before anything runs
    for flag, bad in (("--budget", args.budget is not None),
                      ("--compression-ratio", getattr(args, "compression_ratio", None) is not None),
                      ("--opt", getattr(args, "opt", None)), ("--policy-options", getattr(args, "policy_options", None)),
                      ("--memory", args.memory is not None), ("--profile", args.profile),
                      ("--prefill-cache", args.prefill_cache), ("--model", args.model != "default")):
        if bad:
            raise ValueError(f"{flag} does not apply to --shape (random weights of a named shape); give the rows "
                             "and their options with --policy ROW[:KEY=VALUE,...] (repeatable)")
    given = [*(args.policy or []), *(getattr(args, "shape_rows", None) or [])]
    rows_spec = parse_rows([str(s) for s in given] or None)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype_name!r}")
    lengths = args.lengths if isinstance(args.lengths, list) else \
        [int(x) for x in (args.lengths or str(REFERENCE_LENGTH)).split(",") if x.strip()]
    batch = args.batch or (16 if args.shape != "tiny" else 2)
    if args.threads:
        torch.set_num_threads(args.threads[0] if isinstance(args.threads, list) else
                              int(str(args.threads).split(",")[0]))
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    steps = 20 if args.steps is None else args.steps
    return dict(rows_spec=rows_spec, device=device, dtype=dtype, dtype_name=dtype_name, lengths=lengths, batch=batch,
                steps=steps)


def run_cli(args, command: str = "") -> int:
    """``kvkit bench --shape NAME ...`` (called by :func:`kvkit.evals.commands.bench.cmd_bench`)."""
    if getattr(args, "grid", False):
        shape_config(args.shape)  # unknown shape: clear error before anything runs
        return run_bench_args(args, command)
    t0 = time.perf_counter()
    s = _settings(args)
    rows_spec, device, batch, steps, lengths = s["rows_spec"], s["device"], s["batch"], s["steps"], s["lengths"]
    env = environment(device)
    model = None
    for L in lengths:
        label = f"{args.shape}-b{batch}-{L}"
        out = Path(args.out) / (label if len(lengths) > 1 else "") if args.out else Path("results/speed-gpu") / label
        bench = Bench(args.shape, str(device), s["dtype"], rows_spec, batch, L, steps=steps,
                      warmup=args.warmup, rounds=args.rounds, prefill_chunk=args.prefill_chunk,
                      compile_mode=None if args.no_compile else "auto", interleave=not args.no_interleave,
                      time_limit=args.time_limit, seed=args.seed, t0=t0, model=model,
                      compiled=getattr(args, "compiled", True),
                      compile_backend=getattr(args, "compile_backend", None) or "inductor")
        config = dict(schema=SCHEMA, benchmark="bench --shape", command=command, shape=args.shape, shape_config=SHAPES[args.shape],
                      batch=batch, length=L, dtype=s["dtype_name"], device=str(device), steps=steps,
                      warmup=args.warmup, rounds=bench.rounds, time_limit_s=args.time_limit, seed=args.seed,
                      no_cudnn_sdpa=bool(args.no_cudnn_sdpa),
                      rows_requested=[[n, o] for n, o in rows_spec],
                      rows_planned=[compiled_name(n) if c else n for n, _, c in bench.plan], **env)
        config.update(bench.setup())

        def on_row(rows, o=out, c=config, b=bench):
            c.update(b.info)  # what the run learnt so far (e.g. the policies without a static store)
            write(o, c, rows)

        bench.on_row = on_row
        rows = bench.run()
        config.update(bench.info)
        md = write(out, config, rows)
        print(md, flush=True)
        print(f"wrote {out}/config.json, rows.jsonl, summary.md", file=sys.stderr)
        model = bench.model
    return 0
