"""Which heads ShadowKV's chunk selection starves, on one fresh needle.

Teacher-forced and exact: the needle's context is prefilled, then its question, then the reference answer one token
per forward, all with exact attention (nothing sparse). At every answer step it builds, per layer, the read that
ShadowKV would make from the exact post-RoPE keys (the low-rank keys left out; ``rank=192`` is exact on the default
model and loses the same needles): the context's chunks of ``--chunk`` tokens, the ``outliers`` chunks per KV head,
the local window (the last ``local_chunks`` chunks and the remainder), the landmarks (chunk means) of the rest, and
the top ``budget // chunk`` chunks per KV head under ``--score`` (``landmark``: the paper's softmax of ``q . mean``,
max over the query group; ``bound``: the largest ``q . k`` of any key of the chunk, an oracle the landmark
approximates). Every token after the context (question, answer) is read exactly. It prints, per step, the heads whose
read captures less than ``--below`` of their exact attention, where that attention went (offset from the current
token, probability, selected or not) and the rank of its chunk under the score.

    python benchmarks/needles/shadowkv_heads.py --set heldout --sample 2
    python benchmarks/needles/shadowkv_heads.py --set essay --sample 4 --score bound

Defaults: the default model at 4,096 tokens, budget 2048 and the policy's other defaults (48 outliers, 4 local
chunks), the sets of :mod:`benchmarks.needles.screen`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvkit import models
from kvkit.compat import cache_kw
from kvkit.policies.shadowkv import ShadowKV
from kvkit.policies.tidal import union_ranks
from kvkit.stores.lowrank import bound_query, landmarks_and_outliers

sys.path.insert(0, str(Path(__file__).parent))
from screen import SETS, set_samples, split_sample  # noqa: E402

CAPTURE: dict = {}


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """sdpa, and for one query token also the exact probabilities and the query, kept in ``CAPTURE``."""
    if query.shape[2] != 1 or not CAPTURE.get("on"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kw)
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, 1)
    v = value.repeat_interleave(G, 1)
    p = torch.softmax((query.float() @ k.float().transpose(-1, -2)) * scaling, dim=-1)  # [1, Hq, 1, n]
    CAPTURE[module.layer_idx] = (query[0, :, 0].float(), key[0].float(), p[0, :, 0])
    return (p.to(v.dtype) @ v).transpose(1, 2).contiguous(), None


def chunk_reads(q, keys, S, pol: ShadowKV, score: str, group: str):
    """``[Hq, n]`` 0/1: what ShadowKV reads for query ``q [Hq, D]`` over ``keys [H, n, D]`` whose first ``S``
    are the compressed context; also ``rank [Hq, C]``: each chunk's rank under ``score`` (outliers: -1). The chunks,
    outliers and landmarks are the store's own (:func:`~kvkit.stores.lowrank.landmarks_and_outliers`), scored as
    :func:`~kvkit.stores.lowrank.select_chunks` scores them (softmax over the landmarks, then ``group``)."""
    H, n, D = keys.shape
    Hq = q.shape[0]
    G = Hq // H
    c = pol.chunk()
    C = S // c - pol.local_chunks
    lm, lm_ids, out, _ = landmarks_and_outliers(keys[None, :, : C * c], torch.tensor([C]), c, pol.num_outliers(),
                                                "mean" if score == "landmark" else "minmax")
    lm, lm_ids, out = lm[0], lm_ids[0].long(), out[0]  # [H, Cl, D or 2D], [H, Cl], [H, n_out]
    qg = q.view(H, G, D)
    if score == "bound":  # the oracle: the largest q . k of the chunk's exact keys
        k5 = keys[:, : C * c].view(H, C, c, D).gather(1, lm_ids[..., None, None].expand(-1, -1, c, D))
        b = torch.einsum("hgd,hctd->hgct", qg, k5).amax(-1)  # [H, G, Cl]
    else:
        b = bound_query(qg, lm.shape[-1]) @ lm.transpose(-1, -2)  # [H, G, Cl]
    p = torch.softmax(b * D ** -0.5, -1)
    kk = min(pol.budget // c, lm_ids.shape[-1])
    s = torch.full((H, C), float("-inf"))  # per chunk, for its rank: outliers -inf
    if group == "max":
        g = p.amax(1)  # [H, Cl]
        sel = lm_ids.gather(-1, g.topk(kk, -1).indices)  # chunk ids
        s = s.scatter(-1, lm_ids, g)
    else:  # unselected chunks: no rank order (-inf)
        top = union_ranks(p.topk(kk, -1).indices[:, :, None], None, lm_ids.shape[-1], 1)[0].view(H, kk)
        sel = lm_ids.gather(-1, top)
        s = s.scatter(-1, sel, -torch.arange(kk, dtype=torch.float).expand(H, kk))
    read = torch.ones(H, n)
    chunk_read = torch.zeros(H, C)
    chunk_read.scatter_(-1, sel, 1.0)
    chunk_read.scatter_(-1, out, 1.0)
    read[:, : C * c] = chunk_read.repeat_interleave(c, -1)
    rank = torch.empty(H, C)
    rank.scatter_(-1, s.argsort(-1, descending=True), torch.arange(C, dtype=torch.float).expand(H, C).contiguous())
    rank.scatter_(-1, out, -1.0)
    return read.repeat_interleave(G, 0), rank.repeat_interleave(G, 0), C


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), default="heldout")
    ap.add_argument("--sample", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--score", choices=["landmark", "minmax", "bound"], default="landmark")
    ap.add_argument("--group", choices=["max", "union"], default="max",
                    help="max: the paper's max over the query group; union: round-robin union of its heads' rankings")
    ap.add_argument("--steps", type=int, default=12, help="answer steps to print")
    ap.add_argument("--below", type=float, default=0.5, help="print heads whose read captures less than this mass")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    AttentionInterface.register("kvkit_capture", capture_attention)
    model, tok = models.load("default")
    model.config._attn_implementation = "kvkit_capture"
    s = set_samples(tok, args.set)[args.sample]
    pol = ShadowKV(budget=args.budget, chunk_size=args.chunk, min_prompt=1024)
    ctx, rest, answer = split_sample(tok, s)
    S = ctx.shape[1]
    print(f"{args.set} {args.sample}: {s['outputs'][0]!r}, context {S} tokens, budget {args.budget}, "
          f"chunk {args.chunk}, score {args.score}, group {args.group}")
    with torch.no_grad():
        past = model(ctx, use_cache=True).past_key_values
        past = model(rest, **cache_kw(past), use_cache=True).past_key_values
        CAPTURE["on"] = True
        for t, a in enumerate(answer[: args.steps]):
            past = model(torch.tensor([[a]]), **cache_kw(past), use_cache=True).past_key_values
            worst = []
            total = 0.0
            for i in range(model.config.num_hidden_layers):
                q, keys, p = CAPTURE[i]
                read, rank, C = chunk_reads(q, keys, S, pol, args.score, args.group)
                cap = (p * read).sum(-1)  # [Hq]
                total += float(cap.sum())
                for h in (cap < args.below).nonzero().flatten().tolist():
                    tp = (p[h] * (1 - read[h])).topk(2)
                    n = p.shape[-1]
                    where = [(int(j) - n, round(float(p[h, j]), 2), int(rank[h, int(j) // args.chunk])
                              if int(j) < C * args.chunk else "local") for j in tp.indices]
                    worst.append(f"L{i} h{h} captures {cap[h]:.2f}; unread (offset, p, chunk rank) {where}")
            mean = total / (model.config.num_hidden_layers * model.config.num_attention_heads)
            print(f"step {t} (fed {tok.decode([a])!r}): mean capture {mean:.3f}, {len(worst)} starved heads")
            for w in worst:
                print("   ", w)


if __name__ == "__main__":
    main()
