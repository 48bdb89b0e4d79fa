"""ShadowKV on the default model (SmolLM2-135M-Instruct) at 8K, on CPU: on-device KV bytes vs full,
pre-RoPE key spectrum, and decode agreement with the full cache for several rank / budget settings.

One chunked prefill of the 8K needle prompt with an uncompressed store (min_prompt huge), then for
each setting the prefilled layers are restored, compressed exactly as at the end of a prefill, and
decoded greedily next to the uncompressed cache.

    python benchmarks/shadowkv/measure_8k.py > results/shadowkv/measure_8k.txt
"""

import time

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.demo import needle_prompt
from kvkit.model_info import inverse_rope
from kvkit.models import load_default
from kvkit.policies.shadowkv import ShadowKVStore

torch.manual_seed(0)
STATE = ("keys", "values", "pos", "rpos", "first_pos", "seen", "committed", "decoding", "compressed")


def snapshot(cache):
    return [{k: getattr(s, k) for k in STATE} for s in cache.layers]


def restore(cache, snap, rank=None, budget=None, outliers=None):
    for s, st in zip(cache.layers, snap):
        s._clear()
        for k, v in st.items():
            setattr(s, k, v)
        if rank is not None:
            s.rank, s.budget, s.n_out = rank, budget, outliers
            s.compress()
            s.committed = s.seen


@torch.no_grad()
def decode(model, cache, first_tok, steps):
    tok, toks, logits = first_tok, [], []
    for _ in range(steps):
        out = model(tok, **cache_kw(cache), use_cache=True)
        logits.append(out.logits[:, -1].float())
        tok = logits[-1].argmax(-1, keepdim=True)
        toks.append(tok)
    return torch.cat(toks, 1), torch.stack(logits, 1)


def main():
    model, tokenizer = load_default()
    ids, answer = needle_prompt(tokenizer, context_tokens=7900, depth=0.5)
    S = ids.shape[1] - 1
    kvkit.patch(model, "shadowkv", min_prompt=10**9)  # prefill stays uncompressed; compressed below
    t0 = time.time()
    cache, _ = kvkit.prefill(model, ids[:, :-1], chunk_size=1024)
    print(f"prompt {S + 1} tokens (needle answer {answer}); chunked prefill {time.time() - t0:.1f} s on CPU")
    stores = [s for s in cache.layers if isinstance(s, ShadowKVStore)]
    info = stores[0].info
    width = info.num_kv_heads * info.head_dim
    full_bytes = sum(s.keys.numel() * s.keys.element_size() * 2 for s in stores)
    print(f"layers {len(stores)}, Hkv*D = {width}, dtype {stores[0].keys.dtype}; full KV bytes {full_bytes}")

    # spectrum of the pre-RoPE keys (energy kept by rank r, mean / min over layers)
    ranks = (16, 24, 30, 32, 48, 64, 96)
    energy = {r: [] for r in ranks}
    for s in stores:
        cos, sin = info.rope(s.rpos.long())
        k = inverse_rope(s.keys.float(), cos[:, None], sin[:, None])
        sv = torch.linalg.svdvals(k.permute(0, 2, 1, 3).reshape(S, width))
        e = (sv**2).cumsum(0) / (sv**2).sum()
        for r in ranks:
            energy[r].append(float(e[r - 1]))
    print("pre-RoPE key energy kept by rank r (mean / min over layers):")
    for r in ranks:
        print(f"  r={r:3d} ({r / width:.3f} of Hkv*D): {sum(energy[r]) / len(energy[r]):.4f} / {min(energy[r]):.4f}")

    snap = snapshot(cache)
    steps = 12
    ref_toks, ref_logits = decode(model, cache, ids[:, -1:], steps)
    print(f"full: {tokenizer.decode(ref_toks[0])!r}")
    print("| rank | budget | outliers | KV read/step | on-device bytes | vs full | offloaded | top-1 agree | "
          "max |dlogit| | answer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rank, budget in [(30, 2048), (48, 2048), (64, 2048), (30, 3424), (30, 1696), (48, 1696)]:
        outliers = round(48 * budget / 2048)
        restore(cache, snap, rank, budget, outliers)
        dev, off = cache.nbytes(), cache.offloaded_nbytes()
        toks, logits = decode(model, cache, ids[:, -1:], steps)
        local = stores[0].keys.shape[-2] - steps
        read = budget + outliers * 8 + local
        agree = float((toks == ref_toks).float().mean())
        text = tokenizer.decode(toks[0])
        print(f"| {rank} | {budget} | {outliers} | {read} ({read / S:.1%}) | {dev} | {full_bytes / dev:.2f}x smaller | "
              f"{off} | {agree:.2f} | {float((logits - ref_logits).abs().max()):.3f} | "
              f"{'found' if answer in text else 'MISSED'} {text!r} |")
        restore(cache, snap)


if __name__ == "__main__":
    main()
