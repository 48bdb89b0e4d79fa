"""Run one vLLM engine configuration and write what the tests and benchmarks compare, as JSON.

``python -m kvkit.vllm.probe --model default --policy streaming:budget=256 --out r.json [tasks]``

One process per configuration: vLLM's plugins load once per process, so vanilla vLLM (no plugin:
``--vanilla`` sets ``VLLM_PLUGINS`` to a name that matches none), kvkit registered but off, and
each policy each run in their own process. The engine is in-process (uni executor) unless
``--tp 2`` (multiprocessing executor; counters are then not reachable and not reported).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from kvkit.demo import needle_prompt
from kvkit.vllm import testing as T
from kvkit.vllm.stats import STATS


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 13 * i)] for i in range(n)]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny:<dir>' or an HF folder")
    ap.add_argument("--policy", default=None, help="kvkit switch, e.g. streaming:budget=256,sink=4 (omit: off)")
    ap.add_argument("--vanilla", action="store_true", help="load no vLLM plugin at all")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gen", default=None, help="N,LEN,TOKENS: N random-token prompts of ~LEN tokens, greedy TOKENS each")
    ap.add_argument("--trace", default=None, help="LEN,TOKENS: one request, free/held blocks after every step")
    ap.add_argument("--needle", default=None, help="CONTEXT[,DEPTH]: the demo needle question on the default model")
    ap.add_argument("--needle-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _engine(a, T):
    """The engine of this configuration (in-process unless ``--tp`` > 1) and what the results report of it."""
    if a.model == "default":
        model = T.default_model_dir()
    elif a.model.startswith("tiny:"):
        model = T.tiny_llama_dir(a.model[5:])
    else:
        model = a.model
    kw = {"kv_cache_dtype": a.kv_cache_dtype, "seed": a.seed}
    if a.block_size:
        kw["block_size"] = a.block_size
    if a.tp > 1:
        kw.update(tensor_parallel_size=a.tp, distributed_executor_backend="mp")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if a.model.startswith("tiny:"):
        kw["skip_tokenizer_init"] = True
    t0 = time.perf_counter()
    llm = T.make_llm(model, policy=a.policy, max_model_len=a.max_model_len, kv_gib=a.kv_gib, **kw)
    res: dict = {"config": vars(a), "startup_s": round(time.perf_counter() - t0, 1)}
    if a.tp == 1:
        res["capacity_tokens"] = T.capacity_tokens(llm)
        res["block_size"] = T.block_size(llm)
        res["num_blocks"] = T.num_total_blocks(llm)
        res["manager"] = type(T.kv_manager(llm).coordinator.single_type_managers[0]).__name__
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        res["cpu_attn_backend"] = AttentionBackendEnum.CPU_ATTN.get_path()
    return llm, res


def _gen(a, llm) -> dict:
    """``--gen N,LEN,TOKENS``: greedy tokens and log-probs of N random prompts (and the decode steps' reads)."""
    from vllm import SamplingParams

    n, length, tokens = (int(x) for x in a.gen.split(","))
    vocab = 500 if a.model.startswith("tiny:") else 49000
    prompts = _prompts(n, length, vocab, a.seed)
    sp = SamplingParams(max_tokens=tokens, temperature=0, logprobs=1, ignore_eos=True)
    STATS.reset()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    gen = {"seconds": round(time.perf_counter() - t, 2), "tokens": [], "logprobs": []}
    for o in outs:
        c = o.outputs[0]
        gen["tokens"].append(list(c.token_ids))
        gen["logprobs"].append([float(lp[tid].logprob) for tid, lp in zip(c.token_ids, c.logprobs)])
    gen["prompt_lens"] = [len(p) for p in prompts]
    if a.tp == 1:
        ds = STATS.decode_steps()
        gen["decode_steps"] = len(ds)
        gen["blocks_read"] = [s.blocks_read for s in ds]
        gen["blocks_full"] = [s.full_blocks * s.layer_calls for s in ds]
        gen["layer_calls"] = [s.layer_calls for s in ds]
    return gen


def _trace(a, llm, T) -> dict:
    """``--trace LEN,TOKENS``: one request stepped to the end, free / held blocks after every step."""
    from vllm import SamplingParams

    length, tokens = (int(x) for x in a.trace.split(","))
    eng = llm.llm_engine
    prompt = _prompts(1, length, 500 if a.model.startswith("tiny:") else 49000, a.seed + 1)[0]
    eng.add_request("trace", {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    free, held = [], []
    STATS.reset()
    while eng.has_unfinished_requests():
        eng.step()
        free.append(T.num_free_blocks(llm))
        h, _ = T.request_blocks(llm, "trace")
        held.append(h)
    ds = STATS.decode_steps()
    return {"prompt_len": length, "tokens": tokens, "free_blocks": free, "held_blocks": held,
            "blocks_read_per_layer": [s.blocks_read // max(1, s.layer_calls) for s in ds],
            "full_blocks": [s.full_blocks for s in ds]}


def _needle(a, llm) -> dict:
    """``--needle CONTEXT[,DEPTH]``: the demo needle question, its greedy answer and the read fractions."""
    from vllm import SamplingParams

    parts = a.needle.split(",")
    context, depth = int(parts[0]), float(parts[1]) if len(parts) > 1 else 0.5
    tok = llm.get_tokenizer()
    ids, expected = needle_prompt(tok, context_tokens=context, depth=depth, seed=a.seed + 3)
    ids = ids[0].tolist()
    STATS.reset()
    sp = SamplingParams(max_tokens=a.needle_tokens, temperature=0, logprobs=1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    c = out[0].outputs[0]
    ds = STATS.decode_steps() if a.tp == 1 else []
    return {"prompt_len": len(ids), "expected": expected, "answer": c.text, "found": expected in c.text,
            "tokens": list(c.token_ids),
            "logprobs": [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)],
            "read_fraction": [round(s.read_fraction, 3) for s in ds]}


def main(argv=None) -> dict:
    a = _args(argv)
    if a.vanilla:
        os.environ["VLLM_PLUGINS"] = "__none__"
    if a.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(a.tp)))
    import vllm  # noqa: F401  (imported before _engine changes the environment, as it always was)

    llm, res = _engine(a, T)
    if a.gen:
        res["gen"] = _gen(a, llm)
    if a.trace:
        res["trace"] = _trace(a, llm, T)
    if a.needle:
        res["needle"] = _needle(a, llm)
    with open(a.out, "w") as f:
        json.dump(res, f)
    T.shutdown(llm)
    return res


if __name__ == "__main__":
    main()
