"""Host synchronisations per single-token decode step, per policy (kvkit.hostsync.HostSyncCounter), on the
3-layer tiny Llama of the tests: a left-padded batch (90 and 70 tokens) and one unpadded prompt, 12 steps after
the prefill. Prints a markdown table: the median over the steps between compression events, the largest count in
a compression step, and unpatched transformers' count for the same steps.

    .venv/bin/python benchmarks/gpu/host_syncs.py > results/speed-gpu/host-syncs-tiny-llama-DATE/host-syncs.md
"""
import statistics
import sys

import kvkit
from kvkit.testing import decode_step_syncs, policy_test_options, tiny_model


def per_step(policy, lengths, steps=12):
    """``(syncs, compressed)`` per decode step of ``policy`` (None: unpatched transformers)."""
    model = tiny_model("llama")
    if policy:
        kvkit.patch(model, policy, **policy_test_options(policy))
    return [(s.count, event) for s, event in decode_step_syncs(model, lengths, steps)]


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
