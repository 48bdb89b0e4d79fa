"""Which (layer, KV head) pairs keep the value tokens of fresh needle 4096/0 after KVzip compression (budget 2048).
    python benchmarks/needles/kvzip_kept_slots.py"""
import torch

import kvkit
from kvkit.evals import needles, niah
from kvkit.evals.generation import encode
from kvkit.models import load_default

model, tok = load_default()
s = needles.generate_sample(tok, 4096, 0, depths=niah.depth_grid(11))
ce = s["context_end"]
ctx = encode(tok, s["prompt"][:ce])
val = s["outputs"][0]
# token positions of the value inside the context
ids = ctx[0].tolist()
vt = encode(tok, " " + val)[0].tolist()
starts = [i for i in range(len(ids) - len(vt) + 1) if ids[i:i + len(vt)] == vt]
if not starts:
    vt = encode(tok, val)[0].tolist()
    starts = [i for i in range(len(ids) - len(vt) + 1) if ids[i:i + len(vt)] == vt]
print("value", val, "tokens", [tok.decode([t]) for t in vt], "at", starts)
p0 = starts[0]
span = list(range(p0 - 3, p0 + len(vt) + 1))
for opts in (dict(budget=2048), dict(budget=2048, adaptive=False)):
    kvkit.patch(model, "kvzip", **opts)
    with torch.no_grad():
        cache, _ = kvkit.prefill(model, ctx, chunk_size=ctx.shape[1])
    kept = []
    for layer in cache.layers:
        pos = layer.pos[0]  # [Hp, n]
        kept.append([int((pos == p).any(-1).float().mean().item() * 100) for p in span])
    kvkit.unpatch(model)
    print(opts, "tokens", [tok.decode([ids[p]]) for p in span])
    import statistics
    cols = list(zip(*kept))
    print("  % of (layer, head) keeping each token, mean over layers:", [round(statistics.mean(c)) for c in cols])
    print("  layers keeping none of the value's later tokens:", sum(1 for row in kept if all(x == 0 for x in row[4:4+len(vt)-1])))
