"""KVzip diagnosis: do the heads that read a needle's value while answering keep it under the reconstruction score?
For fresh needle 4096/<index> (default model): per (layer, KV head) the reconstruction score's rank of each value token
(percentile among the context's slots; kept at 50% when above the 50th), against the attention the full model pays
that token while writing the answer (question-aware, teacher-forced on the reference answer).
    python benchmarks/needles/kvzip_heads.py [index, default 0] [normalize, default held]"""
import sys

import torch

import kvkit
from kvkit.evals import needles, niah
from kvkit.evals.generation import encode
from kvkit.models import load_default
from kvkit.policies.kvzip import KVzipStore

index = int(sys.argv[1]) if len(sys.argv) > 1 else 0
norm = sys.argv[2] if len(sys.argv) > 2 else "held"
model, tok = load_default()
s = needles.generate_sample(tok, 4096, index, depths=niah.depth_grid(11))
ce = s["context_end"]
ctx = encode(tok, s["prompt"][:ce])
val = s["outputs"][0]
ids = ctx[0].tolist()
vt = encode(tok, " " + val)[0].tolist()
starts = [i for i in range(len(ids) - len(vt) + 1) if ids[i:i + len(vt)] == vt]
if not starts:
    vt = encode(tok, val)[0].tolist()
    starts = [i for i in range(len(ids) - len(vt) + 1) if ids[i:i + len(vt)] == vt]
p0 = starts[0]
span = list(range(p0, p0 + len(vt)))
print("value", val, [tok.decode([t]) for t in vt], "at", p0, "context", len(ids))

# reconstruction scores of every context slot, before any eviction
saved = {}
orig = KVzipStore.finish_scoring
def keep(self):
    orig(self)
    saved[self.info.layer_idx] = self.rscore[0].clone()  # [H, n]
KVzipStore.finish_scoring = keep
kvkit.patch(model, "kvzip", budget=2048, normalize=norm)
with torch.no_grad():
    kvkit.prefill(model, ctx, chunk_size=ctx.shape[1])
kvkit.unpatch(model)
KVzipStore.finish_scoring = orig

# question-aware attention while writing the answer (full cache, eager attention)
full = encode(tok, s["prompt"])[0].tolist()
ans = encode(tok, " " + val)[0].tolist()
inp = torch.tensor([full + ans])
q_rows = list(range(len(full) - 1, len(full) + len(ans) - 1))  # the queries that predict each answer token
grabbed = []  # per layer [Hq, answer queries, value tokens]: only these rows are kept (not 30 x [Hq, S, S])


def grab(module, args, out):
    grabbed.append(out[1][0][:, q_rows][:, :, span].clone())
    return (out[0], None)


hooks = [layer.self_attn.register_forward_hook(grab) for layer in model.model.layers]
model.config._attn_implementation = "eager"
with torch.no_grad():
    model(inp)
model.config._attn_implementation = "sdpa"
for hk in hooks:
    hk.remove()
L, Hq = len(grabbed), grabbed[0].shape[0]
H = saved[0].shape[0]
G = Hq // H
print("layer head | answer attention on the value (max over answer queries, group) | recon percentile of each value token")
rows = []
for li in range(L):
    a = grabbed[li].view(H, G, len(q_rows), len(span)).amax(dim=(1, 2))  # [H, value tokens]
    sc = saved[li][:, : len(ids)]
    pct = (sc.unsqueeze(-1) < sc[:, span].unsqueeze(1)).float().mean(1)  # [H, value tokens] share of slots below
    for h in range(H):
        rows.append((a[h].max().item(), li, h, a[h].tolist(), pct[h].tolist()))
rows.sort(reverse=True)
for m, li, h, a, p in rows[:15]:
    print(f"L{li:2d} h{h} max {m:.2f} attn", [round(x, 2) for x in a], "pct", [round(x, 2) for x in p])
top = rows[:10]
kept = sum(sum(x >= 0.5 for x in p) for *_, p in top)
print(f"value tokens in the top half of their head's reconstruction scores, over the 10 heads that read the value most: "
      f"{kept}/{10 * len(span)}")
