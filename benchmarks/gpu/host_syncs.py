"""Host synchronisations per single-token decode step, per policy (kvkit.hostsync.HostSyncCounter), on the
3-layer tiny Llama of the tests: a left-padded batch (90 and 70 tokens) and one unpadded prompt, 12 steps after
the prefill. Prints a markdown table: the median over the steps between compression events, the largest count in
a compression step, and unpatched transformers' count for the same steps.

    .venv/bin/python benchmarks/gpu/host_syncs.py > results/bench/gpu/host-syncs.md
"""
import statistics
import sys

import torch

import kvkit
from kvkit.compat import cache_kw, output_cache
from kvkit.hostsync import HostSyncCounter
from kvkit.registry import policy_class
from kvkit.testing import left_padded_batch, tiny_model


def marks(cache):
    return [o.committed for layer in cache.layers for o in (layer, *vars(layer).values())
            if hasattr(o, "committed") and hasattr(o, "seen")]


@torch.no_grad()
def per_step(policy, lengths, steps=12):
    model = tiny_model("llama")
    if policy:
        opts = dict(policy_class(policy).test_options)
        if "pattern" in opts:
            opts["pattern"] = [opts["pattern"][i % len(opts["pattern"])] for i in range(3)]
        kvkit.patch(model, policy, **opts)
    ids, mask, _ = left_padded_batch(lengths, seed=4)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = output_cache(out)
    rows = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        before = marks(cache)
        with HostSyncCounter() as c:
            out = model(input_ids=nxt, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1)[:, -1:],
                        **cache_kw(cache), use_cache=True)
        rows.append((c.count, marks(cache) != before))
    return rows


def main():
    policies = sys.argv[1:] or kvkit.available_policies()
    print("| policy | batch | syncs per step (median, steps without compression) | max in a compression step | "
          "unpatched transformers |")
    print("|---|---|---|---|---|")
    for lengths, label in (((90, 70), "2 rows, left-padded"), ((80,), "1 row")):
        base = statistics.median(c for c, _ in per_step(None, lengths))
        for p in policies:
            rows = per_step(p, lengths)
            plain = [c for c, ev in rows if not ev]
            events = [c for c, ev in rows if ev]
            print(f"| {p} | {label} | {statistics.median(plain) if plain else '-'} | "
                  f"{max(events) if events else '-'} | {base} |")


if __name__ == "__main__":
    main()
