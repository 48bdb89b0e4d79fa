"""``kvkit bench``: prefill time, decode speed, peak memory and KV bytes of a policy (and the further ``--policy``
settings) against the full cache, measured in the same run on the same essay prompts of the bundled model.

Three modes: per prompt length, one-shot (and with ``--prefill-chunk`` also chunked) prefill and ``--decode-tokens``
decoded tokens (:func:`kvkit.evals.bench.run`, one row per policy and length); ``--batch B``: batched decode of every
policy paired with the full cache in interleaved rounds, memory fit and profiles
(:func:`kvkit.evals.bench.decode_bench`); ``--shape NAME``: random weights of a model shape, the transformers
baselines and every policy (:mod:`kvkit.evals.gpu`). The options of one mode are refused in the others before
anything loads.
"""

from __future__ import annotations

import os
import platform
import sys

import torch

from kvkit.cli_grammar import PolicySpec, check_device, parse_policy
from kvkit.evals import bench, gpu
from kvkit.evals.bench.batched import decoded_tokens
from kvkit.evals.commands import runs
from kvkit.evals.files import atomic_write_json, atomic_write_jsonl
from kvkit.evals.gpu.report import git_state
from kvkit.evals.report import SCHEMA, write_summary
from kvkit.evals.rundir import check_out_folder
from kvkit.evals.settings import run_label
from kvkit.options import fmt_bytes
from kvkit.workloads.prompts import model_context


def cmd_bench(args) -> int:
    args.seed = runs.generate_seed(args)
    if args.out:
        check_out_folder(args.out)
    if args.shape:  # the shaped-model decode benchmark (random weights; kvkit/evals/gpu/)
        return gpu.run_cli(args, runs.command_line())
    check_device(args.device)
    policy, options, lengths, more, threads = _settings(args)
    if args.batch and not args.prefill_chunk:
        return _bench_batch(args, policy, options, lengths, more, threads)
    model, tok = runs.load(args)
    lengths = lengths or fitted_lengths(model, args.decode_tokens)
    if threads:
        torch.set_num_threads(threads[0])
    rows = bench.with_ratios(bench.run(model, tok, policy, options, lengths, args.decode_tokens,
                                       prefill_chunk=args.prefill_chunk, more=more, batch=args.batch or 1,
                                       oneshot=args.oneshot))
    out = runs.out_dir(args, "bench", run_label(args.model, policy, options, max(lengths)))
    cfg = runs.run_config(args, "bench", policy, options, lengths=lengths, decode_tokens=args.decode_tokens,
                          prefill_chunk=args.prefill_chunk)
    atomic_write_json(out / "config.json", cfg)
    atomic_write_jsonl(out / "samples.jsonl", rows)
    header, table = _table(rows)
    write_summary(out, dict(cfg, rows=rows, device_name=_device_name(args.device)), header, table,
                  title=f"kvkit bench - {args.model} - {PolicySpec(policy, options)} - {_device_name(args.device)}")
    print((out / "summary.md").read_text())
    return 0


def _settings(args) -> tuple[str, dict, list[int], list[tuple[str, dict]], list[int] | None]:
    """``(policy, options, lengths, added settings, threads)`` of a bundled-model bench, every argument checked
    (ValueError) before the model loads; sets the mode's defaults of ``--dtype`` and ``--steps``. ``lengths`` is
    None without ``--lengths`` (:func:`fitted_lengths` once the model is loaded)."""
    for flag in ("shape_rows", "no_compile", "no_interleave", "no_cudnn_sdpa"):
        if getattr(args, flag, None):
            raise ValueError(f"--{'policies' if flag == 'shape_rows' else flag.replace('_', '-')} applies to --shape "
                             "only")
    args.dtype = args.dtype or "float32"
    args.steps = 4 if args.steps is None else args.steps
    specs = args.policy or [parse_policy("full")]
    policy, options = runs.resolved(args, specs[0])
    more = [runs.resolved(args, s, strict=False) for s in specs[1:]]  # against the same full-cache rows
    lengths = runs.ints(args.lengths, "--lengths") if args.lengths else None  # None: fitted_lengths, once loaded
    threads = runs.ints(args.threads, "--threads") if args.threads else None
    if (args.memory is not None or args.profile) and not args.batch:
        raise ValueError("--memory and --profile measure batched decode: give --batch B too")
    return policy, options, lengths, more, threads


#: the bundled-model bench's prompt lengths without ``--lengths`` (each cut to what fits: :func:`fitted_lengths`)
DEFAULT_LENGTHS = (2048, 4096, 8192)


def fitted_lengths(model, decoded: int) -> list[int]:
    """:data:`DEFAULT_LENGTHS`, each cut to the longest prompt that leaves room for the ``decoded`` tokens in the
    model's context (2048, 4096, 8160 for the bundled model's 8,192 tokens and 32 decoded); a model without a stated
    context keeps them as they are."""
    ctx = model_context(model)
    if ctx is None:
        return list(DEFAULT_LENGTHS)
    if ctx - decoded < 1:
        raise ValueError(f"the model's context of {ctx} tokens leaves no room for a prompt before {decoded} decoded "
                         "tokens: give fewer --decode-tokens (or --steps / --rounds with --batch)")
    return sorted({min(L, ctx - decoded) for L in DEFAULT_LENGTHS})


def _table(rows: list[dict]) -> tuple[list[str], list[list]]:
    header = ["policy", "length", "prefill", "prefill s", "decode tok/s", "peak prefill", "peak decode", "KV after prefill",
              "KV after decode", "KV vs full", "KV read/step", "reads vs full", "prefill vs full", "decode vs full"]
    table = [[str(PolicySpec(r["policy"], r["options"] or {})), r["length"],
              f"chunks of {r['prefill_chunk']}" if r.get("prefill_chunk") else "one-shot", r["prefill_s"],
              r["decode_tok_s"], fmt_bytes(r["peak_prefill_bytes"]), fmt_bytes(r["peak_decode_bytes"]),
              fmt_bytes(r["kv_bytes_prefill"]), fmt_bytes(r["kv_bytes_decode"]), r.get("kv_bytes_decode_vs_full"),
              fmt_bytes(r.get("kv_read_step", 0)), r.get("kv_read_step_vs_full"),
              r.get("prefill_s_vs_full"), r.get("decode_tok_s_vs_full")] for r in rows]
    return header, table


def _bench_batch(args, policy, options, lengths, more, threads) -> int:
    """``kvkit bench --batch B``: :func:`kvkit.evals.bench.decode_bench` at each length."""
    configs = bench.check_configs([(policy, options)] + more)  # unknown policies refused before the model loads
    model, tok = runs.load(args)
    threads = threads or [torch.get_num_threads()]
    lengths = lengths or fitted_lengths(model, decoded_tokens(len(threads), args.rounds, args.steps, args.profile))
    commit, dirty = git_state()
    out_root = runs.out_dir(args, "bench", run_label(args.model, policy, options, max(lengths)) + f"-b{args.batch}")
    cfg = {"schema": SCHEMA, "commit": commit,  # summary.json's layout version and the commit, as every eval's
           **runs.run_config(args, "bench", policy, options, lengths=lengths, added=[list(c) for c in more],
                             git_commit=commit, git_dirty_kvkit=dirty, device_name=_device_name(args.device),
                             cpu_count=os.cpu_count())}
    for L in lengths:
        out = out_root if len(lengths) == 1 else out_root / f"len{L}"
        res = bench.decode_bench(model, tok, configs[1:], batch=args.batch, length=L, threads=threads,
                                 rounds=args.rounds, steps=args.steps, memory_gib=args.memory,
                                 max_batch=args.max_batch, profile=args.profile, spill_dir=args.prefill_cache,
                                 reuse_prefill=args.prefill_cache is not None,
                                 log=lambda m: print(m, file=sys.stderr, flush=True),
                                 on_partial=lambda r, o=out: bench.write_partial(o, r, cfg))
        md = bench.write_decode_results(out, res, cfg, title=f"kvkit bench --batch {args.batch} - {args.model} - "
                                                            f"{L} tokens - {_device_name(args.device)}")
        print(md)
    return 0


def _device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
