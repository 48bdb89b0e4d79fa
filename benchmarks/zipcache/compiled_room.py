r"""A static ZipCache cache's decode step against the room reserved for decoding (``max_length``): the compiled
step's compile time and step time, and the eager step, on the CPU.

    OMP_NUM_THREADS=2 python benchmarks/zipcache/compiled_room.py --batch 2 --prompt 1024 --rooms 1024 4096

Bundled default model, fp32, random token ids. Per room: a fresh static cache and prefill; the compiled step is
``model.get_compiled_call(CompileConfig(fullgraph=True, dynamic=False))`` (inductor), its first call timed as
``compile s`` (trace + compile + one step), then ``--steps`` steps (median); then ``--steps`` eager steps on the
same cache (median). Every process compiles cold (inductor's cache in a fresh temporary folder). Also printed: the ``packed_decode`` operators in the traced graph (one dynamo trace with a
counting backend, separate from the timed compile). Run it with ``PYTHONPATH=<another checkout>`` to time another
version of kvkit with the same script (results/zipcache/README.md).
"""

import argparse
import os
import statistics
import tempfile
import time

# a cold compile: inductor's caches (FX graphs, generated kernels) in a fresh folder of this process, set before
# torch is imported
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvkit-inductor-")

import torch  # noqa: E402
from transformers import CompileConfig  # noqa: E402

import kvkit  # noqa: E402
from kvkit.compat import cache_kw  # noqa: E402
from kvkit.models import load  # noqa: E402


def _config(backend="inductor"):
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True  # transformers' switch for compiling the decode step off CUDA
    return cc


def _steps(fn, nxt, cache, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn(input_ids=nxt, **cache_kw(cache), use_cache=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--rooms", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    model, _ = load("default")
    ids = torch.randint(100, 20000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    kvkit.patch(model, "zipcache", static=True)
    print(f"kvkit {kvkit.__file__}")
    print("| room (tokens) | slot segments per layer | packed_decode ops in the graph | compile s | compiled ms/step "
          "| eager ms/step |\n|---|---|---|---|---|---|")
    for room in args.rooms:
        with torch.no_grad():
            ops = []

            def counting(gm, example_inputs, ops=ops):
                ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return gm.forward

            torch._dynamo.reset()
            cache = kvkit.KVCache(model, max_length=args.prompt + room)
            out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            model.get_compiled_call(_config(counting))(input_ids=nxt, **cache_kw(cache), use_cache=True)
            torch._dynamo.reset()
            cache = kvkit.KVCache(model, max_length=args.prompt + room)
            model(input_ids=ids, **cache_kw(cache), use_cache=True)
            step = model.get_compiled_call(_config())
            t = time.perf_counter()
            step(input_ids=nxt, **cache_kw(cache), use_cache=True)
            compile_s = time.perf_counter() - t
            compiled = _steps(step, nxt, cache, args.steps)
            eager = _steps(model, nxt, cache, args.steps)
        slots = sum(s.slot for s in cache.layers[0].segments)
        print(f"| {room} | {slots} | {sum('packed_decode' in o for o in ops)} | {compile_s:.1f} | {compiled:.1f} | "
              f"{eager:.1f} |", flush=True)
    kvkit.unpatch(model)


if __name__ == "__main__":
    main()
