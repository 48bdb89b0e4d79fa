"""Per-forward costs of batched self-speculation on CPU, interleaved so load drift hits every variant alike.

At batch B x L tokens of the default model (fp32): a plain batched decode step (B x 1 token, kvkit ``full``);
a batched draft step (B x 1 token over a streaming-512 and a retrieval-1024 view); a verification forward of
gamma + 1 = 5 tokens per row through ``kvkit.speculative``'s path, once with every row aligned (no holes: the
prefix + causal-suffix attention) and once with holes (a 4-D mask: the masked kernel). ``--rounds`` rounds;
each times every variant 3 times; the median over all of them is printed, in ms and in plain steps.

Usage: .venv/bin/python benchmarks/speculative/profile_batch.py --batch 8 --length 6144 --threads 1 \
           > results/speculative/profile_batch_cpu.txt
"""

import argparse
import statistics
import time

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.models import load
from kvkit.speculative import batch_cache
from kvkit.speculative.draft import DraftCache, make_view
from kvkit.speculative.forward import logits
from kvkit.speculative.rows import Rows

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--length", type=int, default=6144)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(args.threads)
model, _ = load("default")
kvkit.patch(model, "full")
B, L = args.batch, args.length
ids = torch.randint(100, 20000, (B, L))
cache = batch_cache(model)
kvkit.prefill(model, ids, chunk_size=max(256, 4096 // B), cache=cache)
windows = {info.layer_type: None for info in cache.infos}
aligned = Rows(ids, torch.ones_like(ids), 64, set())
holes = Rows(ids, torch.ones_like(ids), 64, set())
holes.token_pos[1::2, -3:] = -1  # odd rows: 3 rejected drafts of an earlier round
holes.next_pos = holes.next_pos - torch.tensor([0, 3] * (B // 2) + [0] * (B % 2))
drafts = {name: DraftCache(cache, make_view(name, opts))
          for name, opts in (("streaming", {"budget": 512, "sink": 16}), ("retrieval", {"budget": 1024}))}


def step(tokens: int, rows=None, draft=None) -> None:
    x = torch.randint(100, 20000, (B, tokens))
    with torch.no_grad():
        if draft is not None:
            draft.begin_round()
            logits(model, 1, input_ids=x, **cache_kw(draft))
            return
        if rows is None:  # plain decode step: the model's own head, as plain decoding runs it
            model(input_ids=x, **cache_kw(cache), use_cache=True)
        else:
            with cache.verification():
                logits(model, tokens, input_ids=x, position_ids=rows.positions(tokens),
                       attention_mask=rows.mask(tokens, windows), **cache_kw(cache))
    cache.rollback(tokens)


variants = {
    "plain step (B x 1 token)": lambda: step(1),
    "draft step, streaming 512": lambda: step(1, draft=drafts["streaming"]),
    "draft step, retrieval 1024": lambda: step(1, draft=drafts["retrieval"]),
    "verify 5 tokens, rows aligned": lambda: step(5, aligned),
    "verify 5 tokens, rows with holes": lambda: step(5, holes),
}
times = {k: [] for k in variants}
cpu = {k: [] for k in variants}  # process CPU seconds: with 1 thread, what the forward costs without other load
for fn in variants.values():  # warm-up (retrieval builds its selection once)
    fn()
for _ in range(args.rounds):
    for name, fn in variants.items():
        for _ in range(3):
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
plain = statistics.median(times["plain step (B x 1 token)"])
plain_cpu = statistics.median(cpu["plain step (B x 1 token)"])
print(f"default model fp32, CPU {torch.get_num_threads()} threads, batch {B} x {L} tokens; "
      f"medians of {3 * args.rounds} interleaved runs; wall clock and process CPU time")
for name, ts in times.items():
    m, c = statistics.median(ts), statistics.median(cpu[name])
    print(f"{name:<36} wall {1e3 * m:8.1f} ms {m / plain:5.2f} plain steps | cpu {1e3 * c:8.1f} ms {c / plain_cpu:5.2f} plain steps")
