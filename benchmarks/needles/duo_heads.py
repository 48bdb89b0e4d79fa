"""Which KV heads DuoAttention's streaming window starves, on one fresh needle.

Teacher-forced and exact: the needle's context is prefilled, then its question, then the reference answer one token
per forward, all with exact attention. At every answer step it measures, per query head, the attention mass on
the needle's value tokens in the context (which a streaming head, reading the first ``--sink`` tokens and the last
``--recent``, never sees) and prints the KV heads that need them: some query head of theirs puts at least ``--above``
of its mass there (``outside``: that head's mass anywhere outside the window, for comparison). Step 0 is the question's last token,
which predicts the answer's first token. It also lists the KV heads whose attention output at that token a window
would change most: what DuoAttention's distillation loss is about.
For each it gives the gate of every ``--pattern`` given, the gate's rank among the model's KV heads (0 = the most
retrieval-like) and whether that pattern's binarisation at ``--sparsity`` streams the head (``S``) or keeps it whole
(``R``). A head marked ``S`` under a pattern is one that pattern starves on this needle.

    python benchmarks/needles/duo_heads.py --set essay --sample 11
    python benchmarks/needles/duo_heads.py --set essay --sample 11 --pattern shipped --pattern .duo-cal/duo4k.json

Defaults: the default model at 4,096 tokens, the shipped pattern, sparsity 0.5, sink 64, recent 256 (the policy's),
the sets of :mod:`benchmarks.needles.screen`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface

from kvkit import models
from kvkit.compat import cache_kw
from kvkit.policies.duo import Duo

sys.path.insert(0, str(Path(__file__).parent))
from screen import SETS, set_samples, split_sample  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

CAPTURE: dict = {}


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """sdpa; when capturing, also the last query token's exact probabilities over every key and the attention
    output a streaming head would give it instead (``CAPTURE[layer] = (p [Hq, n], rel [Hq])``, ``rel`` = ``|o_full
    - o_window| / |o_full|``, the window ``CAPTURE["sink"]`` first + ``CAPTURE["recent"]`` last keys)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
    if CAPTURE.get("on"):
        G = query.shape[1] // key.shape[1]
        k = key[0].repeat_interleave(G, 0).float()  # [Hq, n, D]
        v = value[0].repeat_interleave(G, 0).float()
        logits = torch.einsum("hd,hnd->hn", query[0, :, -1].float(), k) * scaling  # the last query sees every key
        n = logits.shape[-1]
        inside = torch.zeros(n, dtype=torch.bool)
        inside[: CAPTURE["sink"]] = True
        inside[max(0, n - CAPTURE["recent"]):] = True
        p = torch.softmax(logits, -1)
        pw = torch.softmax(logits.masked_fill(~inside, float("-inf")), -1)
        o, ow = torch.einsum("hn,hnd->hd", p, v), torch.einsum("hn,hnd->hd", pw, v)
        CAPTURE[module.layer_idx] = (p, (o - ow).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-9))
    return out


def gates(spec: str, config, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha [L, H], retrieval [L, H] bool)`` of pattern ``spec`` (``shipped`` or a file) on ``config``."""
    pol = Duo(pattern=None if spec == "shipped" else spec, sparsity=sparsity)
    return pol.load_alpha(config)[0].float(), pol.retrieval_heads(config)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), default="essay")
    ap.add_argument("--sample", type=int, default=11)
    ap.add_argument("--pattern", action="append", help="shipped (default) or a pattern file; repeatable")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12, help="answer steps to print")
    ap.add_argument("--top", type=int, default=15, help="KV heads to list by output change")
    ap.add_argument("--above", type=float, default=0.1, help="print KV heads with a query head this much on the value")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    AttentionInterface.register("kvkit_capture", capture_attention)
    model, tok = models.load("default")
    cfg = model.config
    pats = {}
    for spec in args.pattern or ["shipped"]:
        alpha, ret = gates(spec, cfg, args.sparsity)
        rank = torch.empty(alpha.numel())
        rank[alpha.flatten().argsort(descending=True)] = torch.arange(alpha.numel(), dtype=torch.float)
        pats[spec] = (alpha, ret, rank.view_as(alpha))
    model.config._attn_implementation = "kvkit_capture"
    s = set_samples(tok, args.set)[args.sample]
    ctx, rest, answer = split_sample(tok, s)
    ids = ctx[0].tolist()
    at = [j for j in range(len(ids) - 2) if ids[j: j + 3] == answer[:3]]
    if len(at) != 1:
        raise SystemExit(f"the value's first tokens {answer[:3]} occur {len(at)} times in the context")
    value = slice(at[0], at[0] + len(answer))
    print(f"{args.set} {args.sample}: {s['outputs'][0]!r}, context {ctx.shape[1]} tokens; patterns {list(pats)} "
          f"at sparsity {args.sparsity}; window sink {args.sink} + recent {args.recent}; value at tokens "
          f"{value.start}-{value.stop - 1}")
    H = cfg.num_key_value_heads
    G = cfg.num_attention_heads // H
    needy: dict = {}
    CAPTURE.update(sink=args.sink, recent=args.recent)
    with torch.no_grad():
        past = model(ctx, use_cache=True).past_key_values
        feeds = [("the question", rest)] + [(repr(tok.decode([a])), torch.tensor([[a]])) for a in answer[: args.steps]]
        CAPTURE["on"] = True
        for t, (fed, x) in enumerate(feeds):
            past = model(x, **cache_kw(past), use_cache=True).past_key_values
            lines = []
            dev = torch.stack([CAPTURE[i][1].view(H, G).amax(-1) for i in range(cfg.num_hidden_layers)])  # [L, H]
            if t == 0:
                first_dev = dev
            for i in range(cfg.num_hidden_layers):
                p = CAPTURE[i][0]  # [Hq, n]
                n = p.shape[-1]
                inside = torch.zeros(n)
                inside[: args.sink] = 1
                inside[max(0, n - args.recent):] = 1
                out = (p * (1 - inside)).sum(-1).view(H, G).amax(-1)  # [H]: the neediest query head of each
                on = p[:, value].sum(-1).view(H, G).amax(-1)  # [H]
                for h in (on >= args.above).nonzero().flatten().tolist():
                    needy[(i, h)] = max(needy.get((i, h), 0.0), float(on[h]))
                    marks = " ".join(f"{'R' if r[i, h] else 'S'} gate {al[i, h]:.2f} rank {int(rk[i, h])}"
                                     for al, r, rk in pats.values())
                    lines.append(f"L{i} kv{h} on the value {on[h]:.2f} (outside {out[h]:.2f}, output change "
                                 f"{dev[i, h]:.2f}) | {marks}")
            print(f"step {t} (fed {fed}, predicting answer token {t}): {len(lines)} KV heads read the value")
            for ln in lines:
                print("   ", ln)
    print("summary (KV head: most mass on the value at any step; per pattern: S/R and the gate's rank):")
    for (i, h), m in sorted(needy.items(), key=lambda x: -x[1]):
        print(f"  L{i} kv{h} {m:.2f} " + " ".join(f"{'R' if r[i, h] else 'S'}{int(rk[i, h])}"
                                                  for _, r, rk in pats.values()))
    top = first_dev.flatten().argsort(descending=True)[: args.top].tolist()
    print(f"the {args.top} KV heads whose output at the question's last token a window changes most "
          "(|o_full - o_window| / |o_full|, max over the group; per pattern: S/R and the gate's rank):")
    for j in top:
        i, h = divmod(j, H)
        print(f"  L{i} kv{h} {first_dev[i, h]:.2f} " + " ".join(f"{'R' if r[i, h] else 'S'}{int(rk[i, h])}"
                                                             for _, r, rk in pats.values()))
    for spec, (_, r, _) in pats.items():
        print(f"{spec}: summed output change of the streamed heads {float(first_dev[~r].sum()):.2f}, of the kept "
              f"{float(first_dev[r].sum()):.2f}")


if __name__ == "__main__":
    main()
