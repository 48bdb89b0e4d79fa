"""Which heads a TidalDecode selection starves, on one fresh needle.

Teacher-forced: the needle prompt is prefilled with exact attention, then the reference answer is fed one token per
forward (``output_attentions``, eager attention, nothing sparse). At every answer step it builds the selection that
tidal would make at each selection layer from that layer's exact attention (``--selection``: ``q_head`` the paper's
per-query-head top-k, ``kv_head`` per KV head from its query group's probabilities reduced as tidal does,
``shared`` the round-robin union of every query head's ranking, :func:`kvkit.policies.tidal.union_ranks`). It then prints, per reuse layer, the
attention mass each head's read would capture: the least-served heads and where their attention went. Offsets are
from the current token (``-1``: the token itself); the needle sits about ``-2950`` back on held-out sample 3.
``sel`` says whether the selection holds that token.

    python benchmarks/needles/tidal_heads.py --sample 3 --budget 1169 --selection kv_head
    python benchmarks/needles/tidal_heads.py --sample 3 --budget 1169 --selection shared

Defaults: the held-out set of ``results/needles/heldout-squad-4k-agnostic`` (SQuAD haystack, seed 7919, digits and
UUIDs, 4,096 tokens), the default model with its calibrated tidal layers and shares.
"""

from __future__ import annotations

import argparse

import torch

from kvkit import models
from kvkit.calibration import resolve
from kvkit.compat import cache_kw
from kvkit.evals import needles
from kvkit.evals.generation import encode
from kvkit.policies.tidal import Tidal, group_score, union_ranks


def selection_masks(att, layer, pol, L, H, mode):
    """``[Hq, n]`` 0/1: the slots each query head of the layers after selection layer ``layer`` would read."""
    Hq, n = att.shape
    G = Hq // H
    k = min(pol.select_budget(L, layer), n - 1)
    if mode == "kv_head":
        top = group_score(att.view(1, H, G, n)[..., : n - 1], pol.kv_reduce)[0].topk(k, -1).indices  # [H, k]
        return top.repeat_interleave(G, 0)
    top = att[:, : n - 1].topk(k, -1).indices  # [Hq, k]
    if mode == "shared":
        return union_ranks(top.view(1, Hq, 1, k), None, n - 1, 1)[0].view(1, k).expand(Hq, k)
    return top


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=3)
    ap.add_argument("--budget", type=int, default=1169)
    ap.add_argument("--selection", choices=["q_head", "kv_head", "shared"], default="kv_head")
    ap.add_argument("--steps", type=int, default=12, help="answer steps to print")
    ap.add_argument("--below", type=float, default=0.2, help="print heads whose read captures less than this mass")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = models.load("default", attn_implementation="eager")
    samples = needles.generate_samples(tok, [4096], args.sample + 1, seed=7919, formats=["digits", "uuid"],
                                       haystack="squad")
    s = samples[args.sample]
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    pol = resolve(Tidal(budget=args.budget, selection=args.selection), cfg)
    layers = pol.selection_layers(L)
    ks = pol.layer_budgets(L)
    answer = tok(" " + s["outputs"][0], add_special_tokens=False)["input_ids"]
    print(f"sample {args.sample}: {s['outputs'][0]!r}; selection layers {list(layers)}, budget {args.budget}, "
          f"{args.selection}")
    with torch.no_grad():
        past = model(encode(tok, s["prompt"]), use_cache=True).past_key_values
        for t, a in enumerate(answer[: args.steps]):
            o = model(torch.tensor([[a]]), **cache_kw(past), use_cache=True, output_attentions=True)
            past = o.past_key_values
            att = [x[0, :, 0].float() for x in o.attentions]  # per layer [Hq, n]
            n = att[0].shape[-1]
            worst = []
            for i in range(layers[0], L):
                if i in layers:
                    sel = selection_masks(att[i], i, pol, L, H, args.selection)
                    continue
                mask = torch.zeros_like(att[i])
                mask.scatter_(1, sel[:, : ks[i]], 1.0)
                mask[:, -1] = 1.0  # the current token is always read
                cap = (att[i] * mask).sum(-1)
                h = int(cap.argmin())
                if cap[h] < args.below:
                    tp = att[i][h].topk(3)
                    where = [(int(j) - n, round(float(p), 2), int(mask[h, j])) for p, j in zip(tp.values, tp.indices)]
                    worst.append(f"L{i} h{h} captures {cap[h]:.2f}, attends (offset, p, sel) {where}")
            print(f"step {t} (fed {tok.decode([a])!r}): {len(worst)} starved heads")
            for w in worst:
                print("   ", w)


if __name__ == "__main__":
    main()
