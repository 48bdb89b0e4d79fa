r"""Eager step of a static ZipCache cache against the room reserved for decoding (``max_length``): before and after
the eager read skips the unwritten slot segments, interleaved in one run.

    OMP_NUM_THREADS=2 python benchmarks/zipcache/static_room.py --batch 4 --prompt 2048 --rooms 64 1024 4096

A static ZipCache store preallocates one slot segment per ``requant_interval`` tokens of the room. ``before`` reads
every one of them each step, as a compiled step does (``QuantizedSegmentStore._read``); ``after`` is the eager read
(``_read_eager``: the prompt's segment and the written slot segments). Random token ids on the bundled default model,
fp32, the CPU; per room, ``--repeats`` rounds of ``--steps`` timed steps per variant, alternating; prints the median
step of each variant and their ratio.
"""

import argparse
import statistics
import time

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.models import load
from kvkit.stores.quantized import QuantizedSegmentStore


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rooms", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    model, _ = load("default")
    ids = torch.randint(100, 20000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    kvkit.patch(model, "zipcache", static=True)
    eager = QuantizedSegmentStore._segments_read

    def every_slot(self):  # the read before: every reserved slot segment, as a compiled step reads
        eager(self)
        return self._read

    print("| room (tokens) | slot segments per layer | before ms/step | after ms/step | after / before |")
    print("|---|---|---|---|---|")
    for room in args.rooms:
        cache = kvkit.KVCache(model, max_length=args.prompt + room)
        times = {"before": [], "after": []}
        with torch.no_grad():
            out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            model(input_ids=nxt, **cache_kw(cache), use_cache=True)  # warm-up
            for _ in range(args.repeats):
                for name in ("before", "after"):
                    QuantizedSegmentStore._segments_read = every_slot if name == "before" else eager
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        model(input_ids=nxt, **cache_kw(cache), use_cache=True)
                        times[name].append(time.perf_counter() - t)
        QuantizedSegmentStore._segments_read = eager
        slots = sum(s.slot for s in cache.layers[0].segments)
        b, a = (statistics.median(times[k]) * 1e3 for k in ("before", "after"))
        print(f"| {room} | {slots} | {b:.1f} | {a:.1f} | {a / b:.2f} |", flush=True)
    kvkit.unpatch(model)


if __name__ == "__main__":
    main()
