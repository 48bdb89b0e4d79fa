"""KV removed by duo on the default model's shape (30 layers x 3 KV heads, head_dim 64) at a context
length, measured with the real stores' nbytes() (random KV, no model forward): which sparsity removes
~50% / ~75% of the full cache. Usage: python benchmarks/duo/kv_budget.py [context=4096]"""

import sys
from types import SimpleNamespace

import torch

import kvkit
from kvkit.testing import tiny_config

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
cfg = tiny_config("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  hidden_size=576, head_dim=64, vocab_size=49152)
alpha = torch.rand(30, 3, generator=torch.Generator().manual_seed(0))  # only the head count matters here
full_bytes = 30 * 2 * 3 * ctx * 64 * 4  # fp32 K+V of a full cache
print(f"context {ctx}: full cache {full_bytes / 2**20:.1f} MiB")
print("sparsity | streaming heads | KV held (MiB) | removed")
for sp in (0.5, 0.54, 0.55, 0.6, 0.75, 0.8, 0.81, 0.82, 0.85):
    cache = kvkit.KVCache(SimpleNamespace(config=cfg), "duo", pattern=alpha, sparsity=sp)  # sink 64, recent 256
    for store in cache.layers:
        store.update(torch.zeros(1, 3, ctx, 64), torch.zeros(1, 3, ctx, 64))
        if store.stream is not None:  # what the prefill does after its exact attention
            store.stream.first_pos = torch.zeros(1, dtype=torch.int32)
            store.stream.on_prefill(None, None)
    n_stream = sum(len(s.retrieval) - sum(s.retrieval) for s in cache.layers)
    print(f"{sp:8.2f} | {n_stream:15d} | {cache.nbytes() / 2**20:13.1f} | {1 - cache.nbytes() / full_bytes:6.1%}")
