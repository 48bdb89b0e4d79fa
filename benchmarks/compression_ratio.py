"""``compression_ratio`` against what a decode step reads: every compressing policy at each ratio ``r`` on one prompt.

For each policy and ratio the default model (``kvkit.models.load_default()``, offline) is patched with
``compression_ratio=r`` (``kvkit.patched``), a fresh ``KVCache`` prefills the prompt and decodes one greedy token, and
the table gives ``KVCache.read_nbytes()`` (the K/V bytes that decode step read) divided by ``full``'s on the same
prompt -- the target is ``1 - r``, met when ``|measured - (1 - r)| <= 0.05 (1 - r)`` -- and ``KVCache.nbytes()`` (the
bytes held on the device, scoring state included) divided by ``full``'s. A ratio a policy cannot reach on this model
is refused by the policy (ValueError); the table prints the range it names.

The prompt is ``--tokens`` tokens of the Paul Graham essays (:func:`kvkit.evals.haystack.essay_words`), a few more
than ShadowKV's ``min_prompt`` (4096: shorter prompts it runs as ``full``).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/compression_ratio.py [--tokens 4160]
        [--ratios 0.25,0.5,0.75] [--policies snapkv,cake] [--dtype float32] [--opt preset=paper]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import warnings

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.haystack import essay_words
from kvkit.models import load_default
from kvkit.options import parse_options


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    words = essay_words()
    ids = tokenizer(" ".join(words[: tokens]), return_tensors="pt").input_ids  # about 1.3 tokens per word
    if ids.shape[1] < tokens:
        raise SystemExit(f"the essays give only {ids.shape[1]} tokens; ask for fewer --tokens")
    return ids[:, :tokens]


@torch.no_grad()
def measure(model, policy: str, ids: torch.Tensor, **options) -> tuple[int, int]:
    """``(read bytes of one decode step, bytes held)`` of a fresh cache after the prompt and one greedy token."""
    with kvkit.patched(model, policy, **options):
        cache = kvkit.KVCache(model)
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
        model(input_ids=out.logits[:, -1:].argmax(-1), **cache_kw(cache), use_cache=True)
        return int(cache.read_nbytes()), int(cache.nbytes())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4160)
    ap.add_argument("--ratios", default="0.25,0.5,0.75")
    ap.add_argument("--policies", default=None, help="comma-separated; default: every policy but full")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--opt", action="append", default=[], help="key=value options for every policy (e.g. preset=paper)")
    args = ap.parse_args(argv)
    ratios = [float(x) for x in args.ratios.split(",")]
    extra = parse_options(args.opt)
    policies = args.policies.split(",") if args.policies else [p for p in kvkit.available_policies() if p != "full"]
    torch.manual_seed(0)
    model, tok = load_default(dtype=getattr(torch, args.dtype))
    ids = prompt_ids(tok, args.tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit or '?'}; "
          f"machine: {platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(f"model: SmolLM2-135M-Instruct ({args.dtype}), prompt {ids.shape[1]} tokens of the essays, one decode step"
          + (f"; options {extra}" if extra else "") + "\n")
    full_read, full_held = measure(model, "full", ids)
    print(f"full: {full_read} bytes read per decode step, {full_held} bytes held\n")
    head = " | ".join(f"r={r:g}: read / held (target {1 - r:g})" for r in ratios)
    print(f"| policy | {head} |")
    print("|---|" + "---|" * len(ratios))
    misses = 0
    for name in policies:
        cells = []
        for r in ratios:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    read, held = measure(model, name, ids, compression_ratio=r, **extra)
                except ValueError as e:
                    m = re.search(r"reaches compression ratios in (\[[^]]*\])", str(e))
                    cells.append(f"out of reach (reaches {m.group(1)})" if m else f"refused: {e}")
                    continue
            f = read / full_read
            ok = abs(f - (1 - r)) <= 0.05 * (1 - r)
            misses += not ok
            cells.append(f"{f:.3f} / {held / full_held:.3f}{'' if ok else ' (MISS)'}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{misses} measured cell(s) outside 5% of 1 - r")
    return 0


if __name__ == "__main__":
    sys.exit(main())
