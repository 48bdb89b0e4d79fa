"""Operators per compiled decode step, per policy: the markdown table of ``results/speed-gpu/ops-per-step.md``.

For each policy with a static store, :func:`kvkit.evals.gpu.ops.ops_per_layer` compiles one decode step
(``fullgraph=True``, a recording backend) of a tiny random Llama at two depths and splits the aten count into a
per-layer and a fixed part; the table adds the operators of a step at the 1B (16 layers) and 8B (32 layers) depths.
Runs on the CPU (the Triton path under ``TRITON_INTERPRET=1``) or on a GPU (the same graph, CUDA tensors).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu/ops_per_step.py --out ops.md [--policies full,streaming]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path on the CPU; a GPU run sets it to 0 itself

import torch  # noqa: E402

from kvkit.cache import STATIC_POLICIES  # noqa: E402
from kvkit.evals.gpu.ops import ops_per_layer, step_ops  # noqa: E402
from kvkit.testing import policy_test_options, tiny_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default=",".join(STATIC_POLICIES))
    ap.add_argument("--kernels", default="triton", choices=["triton", "reference"])
    ap.add_argument("--layers", type=int, default=2, help="the smaller depth (the other is twice it)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    a = ap.parse_args(argv)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in STATIC_POLICIES]
    if bad:
        print(f"error: no static store for {', '.join(bad)}; policies with one: {', '.join(STATIC_POLICIES)}",
              file=sys.stderr)
        return 2

    def make(num_hidden_layers):
        return tiny_model("llama", num_hidden_layers=num_hidden_layers).to(a.device)

    lines = ["| policy | depths | aten ops / layer | compute ops / layer | kvkit ops / layer | fixed aten ops | "
             "aten ops / step, 16 layers | aten ops / step, 32 layers | compile s |", "|---" * 9 + "|"]
    for p in policies:
        t = time.perf_counter()
        depth = max(a.layers, 3) if p == "tidal" else a.layers  # tidal: two full layers before a selecting one
        r = ops_per_layer(make, p, lambda n, p=p: policy_test_options(p, n), layers=depth, kernels=a.kernels)
        per, fixed = r["per_layer"], r["fixed"]
        lines.append(f"| {p} | {depth}, {2 * depth} | {per['aten']:g} | {per['compute']:g} | {per['custom']:g} | {fixed['aten']:g} | "
                     f"{step_ops(per, fixed, 16):g} | {step_ops(per, fixed, 32):g} | "
                     f"{time.perf_counter() - t:.1f} |")
        print(lines[-1], flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = "?"
    head = (f"kernels path: {a.kernels}; device: {a.device}; torch {torch.__version__}; commit {commit}; "
            f"{datetime.date.today().isoformat()}")
    table = "\n".join(lines)
    print(head)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(head + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
