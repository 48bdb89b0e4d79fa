"""Greedy speculative output == plain greedy output on the default (or any) model, N long prompts.

    python benchmarks/speculative/check_greedy.py > results/speculative/check_greedy.txt
    python benchmarks/speculative/check_greedy.py --device cuda --dtype float32 --prompts 20 \
        --min-length 2000 --max-length 8000 --new-tokens 64 --all-settings

Prints one line per prompt and setting and a final ``K/N identical`` line; exits 1 on any mismatch.
Prompts alternate between needle questions and raw essay continuations; settings (draft policy,
budget, gamma) are cycled over the prompts, or all run on every prompt with ``--all-settings``.
"""

import argparse
import sys
import time

import torch

from kvkit.models import load
from kvkit.speculative.check import SETTINGS, check_prompt, format_result, make_prompt, prompt_lengths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int, default=10, help="number of prompts")
    p.add_argument("--min-length", type=int, default=600, help="shortest prompt in tokens")
    p.add_argument("--max-length", type=int, default=1200, help="longest prompt in tokens")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generated per prompt and setting")
    p.add_argument("--all-settings", action="store_true", help="run every setting on every prompt")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} but torch sees no CUDA device")
    try:
        lengths = prompt_lengths(args.prompts, args.min_length, args.max_length)
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    print(f"model {args.model}, {args.device} {args.dtype}, {args.prompts} prompts of {args.min_length}-"
          f"{args.max_length} tokens, {args.new_tokens} new tokens each", flush=True)
    ok = total = 0
    t0 = time.perf_counter()
    for i, length in enumerate(lengths):
        kind, ids = make_prompt(tok, i, length)
        if limit and ids.shape[1] + args.new_tokens > limit:
            p.error(f"prompt {i} has {ids.shape[1]} tokens: + {args.new_tokens} new exceeds the model's context {limit}")
        settings = SETTINGS if args.all_settings else [SETTINGS[i % len(SETTINGS)]]
        for r in check_prompt(model, ids.to(args.device), args.new_tokens, settings, prompt=i, kind=kind):
            ok += r.identical
            total += 1
            print(format_result(r), flush=True)
    print(f"{ok}/{total} identical: speculative greedy output == plain greedy output "
          f"({args.new_tokens} new tokens each, {time.perf_counter() - t0:.0f}s)")
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
