"""Decode step time of ``duo`` (DuoAttention, kvkit's shipped pattern) against vLLM's own full reads, in one engine.

    .venv-vllm/bin/python benchmarks/vllm/bench_duo.py --batch 4 --context 3800 --steps 12 \
        --out results/vllm/duo/decode_4x4k.json

One in-process engine on the default model (SmolLM2-135M-Instruct) with ``additional_config={"kvkit": POLICY}``
serves ``--batch`` needle requests of ``--context`` haystack tokens (needle depths spread over the batch). The
first ``--answer-tokens`` decode steps run with duo's reads (the answers are read from them); then steps alternate
between duo's reads and vLLM's full reads (``kvkit.vllm.backend.force_full_reads``: the metadata builder plans
nothing, every layer hands vLLM's op its own tables -- vanilla decode, same engine, batch and cache), so both are
timed under the same machine load; medians of ``--steps`` steps each are reported, with the read fraction from
``kvkit.vllm.stats`` (mean over KV heads) and the layer kinds of the pattern (how many layers run the per-head
kernel, vLLM's op on streaming tables, vLLM's op on full tables).

``--profile N``: N more steps per mode with the attention forward of each layer timed (wall time inside the
backend's ``forward``, by layer kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _needle_requests(tok, n: int, context: int, seed0: int = 100):
    from kvkit.demo import needle_prompt

    reqs = []
    for i in range(n):
        ids, value = needle_prompt(tok, context_tokens=context, depth=(i + 0.5) / n, seed=seed0 + i)
        reqs.append((f"n{i}", ids[0].tolist(), value))
    return reqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="duo")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=3800)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    from vllm import SamplingParams

    from kvkit.vllm import backend
    from kvkit.vllm import testing as T
    from kvkit.vllm.stats import STATS

    t0 = time.perf_counter()
    llm = T.make_llm(T.default_model_dir(), policy=a.policy, max_model_len=a.max_model_len, kv_gib=a.kv_gib)
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    expected, lens = {}, {}
    max_tokens = a.answer_tokens + 2 * a.steps + 2 * a.profile + 64
    for key, ids, value in _needle_requests(tok, a.batch, a.context):
        expected[key], lens[key] = value, len(ids)
        eng.add_request(key, {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    texts = {k: [] for k in expected}
    step_times = {"duo": [], "full": []}
    reads = {"duo": [], "full": []}
    n_decode, answered, mode = 0, False, None

    def step():
        outs = eng.step()
        for o in outs:
            key = next(k for k in expected if o.request_id.startswith(k))
            texts[key] = o.outputs[0].token_ids

    while eng.has_unfinished_requests():
        mode = None
        if answered:
            mode = "full" if n_decode % 2 else "duo"
            backend.force_full_reads(mode == "full")
        STATS.reset()
        t = time.perf_counter()
        step()
        dt = time.perf_counter() - t
        ds = STATS.decode_steps()
        if not (ds and ds[-1].decode_reqs == a.batch):
            continue  # prefill (or a mixed step) still running
        n_decode += 1
        if mode is not None:
            step_times[mode].append(dt)
            reads[mode].append(ds[-1].read_fraction)
            if len(step_times["full"]) >= a.steps:
                break
        elif n_decode >= a.answer_tokens:
            answered = True
    backend.force_full_reads(False)

    # layer kinds of the pattern (rank 0 = the whole model here)
    impls = [m.impl for m in _attention_layers(llm)]
    kinds = {"kernel (mixed heads)": 0, "vllm op, streaming tables": 0, "vllm op, full tables": 0}
    for impl in impls:
        r = getattr(impl.kvkit_state, "retrieval", None)  # the duo plan's layer state (plans.duo.DuoLayer)
        if r is None:
            continue
        m = r[impl._layer_idx if impl._layer_idx is not None else 0]
        k = "vllm op, full tables" if bool(m.all()) else ("vllm op, streaming tables" if not bool(m.any())
                                                           else "kernel (mixed heads)")
        kinds[k] += 1

    profile = _profile(eng, impls, a.profile, backend) if a.profile else None
    answers = {k: tok.decode(list(texts[k])[: a.answer_tokens]) for k in expected}
    found = sum(expected[k] in answers[k] for k in expected)
    med = {m: statistics.median(v) for m, v in step_times.items()}
    res = {
        "policy": a.policy, "batch": a.batch, "prompt_lens": sorted(lens.values()), "startup_s": round(startup, 1),
        "threads": torch.get_num_threads(),
        "step_ms_median": {m: round(1000 * v, 1) for m, v in med.items()},
        "step_ms_all": {m: [round(1000 * x, 1) for x in v] for m, v in step_times.items()},
        "read_fraction_median": {m: statistics.median(v) for m, v in reads.items()},
        "speedup_vs_full_reads": round(med["full"] / med["duo"], 3),
        "layer_kinds": kinds,
        "needle_found_duo_reads": f"{found}/{a.batch}", "answers": answers, "expected": expected,
    }
    if profile:
        res["profile"] = profile
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    T.shutdown(llm)


def _attention_layers(llm):
    from vllm.model_executor.layers.attention import Attention

    core = llm.llm_engine.engine_core.engine_core
    model = core.model_executor.driver_worker.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


def _profile(eng, impls, n: int, backend) -> dict:
    """``n`` decode steps per mode with each layer's attention forward timed (wall, ms per step, by layer kind)."""
    totals = {}
    orig = type(impls[0]).forward

    def timed_forward(self, layer, *args, **kw):
        t = time.perf_counter()
        out = orig(self, layer, *args, **kw)
        r = getattr(self.kvkit_state, "retrieval", None)
        m = r[self.kvkit_layer(layer)] if r is not None else None
        kind = "full" if m is None or bool(m.all()) else ("streaming" if not bool(m.any()) else "mixed")
        key = (_MODE[0], kind)
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - t
        return out

    _MODE[0] = None
    type(impls[0]).forward = timed_forward
    steps = {"duo": 0, "full": 0}
    step_total = {"duo": 0.0, "full": 0.0}
    try:
        for i in range(2 * n):
            mode = "full" if i % 2 else "duo"
            backend.force_full_reads(mode == "full")
            _MODE[0] = mode
            t = time.perf_counter()
            eng.step()
            step_total[mode] += time.perf_counter() - t
            steps[mode] += 1
    finally:
        type(impls[0]).forward = orig
        backend.force_full_reads(False)
    out = {m: {"step_ms": round(1000 * step_total[m] / max(1, steps[m]), 2)} for m in steps}
    for (m, kind), v in totals.items():
        out[m][f"attention_{kind}_layers_ms"] = round(1000 * v / max(1, steps[m]), 2)
    for m in out:
        out[m]["attention_ms"] = round(sum(v for k, v in out[m].items() if k.startswith("attention_")), 2)
    return out


_MODE = [None]

if __name__ == "__main__":
    main()
