"""Helpers shared by kvkit's vLLM tests and benchmarks (in-process engine, offline models)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from kvkit import models

IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def default_model_dir() -> str:
    """An HF folder of the bundled default model (SmolLM2-135M-Instruct) that vLLM can load.

    kvkit.models converts the packaged GGUF once and caches the converted folder (no quantizer
    state) under $KVKIT_CACHE; that folder is what vLLM loads.
    """
    conv = models._converted_dir(models.DEFAULT_MODEL)
    if not ((conv / "config.json").exists() and (conv / "tokenizer_config.json").exists()):
        models.load(models.DEFAULT_MODEL)
    return str(conv)


def tiny_llama_dir(path: str | os.PathLike, heads: int = 4, kv_heads: int = 2, layers: int = 6,
                   head_dim: int = 64, hidden: int = 256, vocab: int = 512, seed: int = 0,
                   max_positions: int = 4096) -> str:
    """A tiny random Llama saved as an HF folder (no tokenizer: use token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def make_llm(model: str, policy=None, max_model_len: int = 4096, kv_gib: int = 1, **kwargs):
    """An in-process vLLM engine (uni executor) with kvkit's switch ``policy`` (None: off)."""
    os.environ.update(IN_PROCESS_ENV)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gib))
    from vllm import LLM

    extra = dict(kwargs.pop("additional_config", {}) or {})
    if policy is not None:
        extra["kvkit"] = policy
    kwargs.setdefault("distributed_executor_backend", "uni")
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("dtype", "bfloat16")
    return LLM(model, max_model_len=max_model_len, additional_config=extra, **kwargs)


def engine_core(llm):
    """The in-process EngineCore (scheduler, executor) behind an ``LLM``."""
    return llm.llm_engine.engine_core.engine_core


def kv_manager(llm):
    return engine_core(llm).scheduler.kv_cache_manager


def num_free_blocks(llm) -> int:
    return kv_manager(llm).block_pool.get_num_free_blocks()


def num_total_blocks(llm) -> int:
    return kv_manager(llm).block_pool.num_gpu_blocks


def request_blocks(llm, request_id: str) -> tuple[int, int]:
    """(blocks a request holds, null placeholders in its table) in the first KV-cache group."""
    mgr = kv_manager(llm).coordinator.single_type_managers[0]
    blocks = mgr.req_to_blocks.get(request_id)
    if blocks is None:  # the engine may suffix the user's request id
        blocks = next((v for k, v in mgr.req_to_blocks.items() if k.startswith(request_id)), [])
    null = mgr._null_block
    held = sum(1 for b in blocks if b is not null)
    return held, len(blocks) - held


def block_size(llm) -> int:
    return kv_manager(llm).coordinator.single_type_managers[0].block_size


def capacity_tokens(llm) -> int:
    """Tokens the engine's KV cache holds: blocks x block size (as vLLM reports it)."""
    return num_total_blocks(llm) * block_size(llm)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def run_probe(args, out: str | os.PathLike, env_extra=None, timeout: float | None = None) -> dict:
    """Run ``python -m kvkit.vllm.probe --out OUT *args`` in its own process (in-process engine there; no
    ``KVKIT_VLLM_POLICY`` inherited) and return the JSON it writes."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, **IN_PROCESS_ENV, **(env_extra or {}))
    env.pop("KVKIT_VLLM_POLICY", None)
    p = subprocess.run([sys.executable, "-m", "kvkit.vllm.probe", "--out", str(out), *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"kvkit.vllm.probe {' '.join(args)} failed ({p.returncode}):\n"
                           + p.stdout[-3000:] + p.stderr[-6000:])
    return json.loads(Path(out).read_text())


def probe_runner(root: str | os.PathLike, timeout: float | None = None):
    """``run(*args) -> dict``: :func:`run_probe` with results cached per argument tuple (one process per engine
    configuration); ``TINY`` in an argument is replaced by a tiny-Llama folder under ``root``."""
    root = Path(root)
    tiny = root / "tiny-llama"
    cache: dict = {}

    def run(*args: str) -> dict:
        key = tuple(a.replace("TINY", str(tiny)) for a in args)
        if key not in cache:
            cache[key] = run_probe(key, root / f"r{len(cache)}.json", timeout=timeout)
        return cache[key]

    return run


def greedy_deltas(van: dict, other: dict) -> tuple[int, list[float]]:
    """(identical leading tokens, |log-prob difference| over them) of one greedy generation against vanilla's;
    both dicts hold ``tokens`` and ``logprobs`` lists."""
    same = 0
    for a, b in zip(van["tokens"], other["tokens"]):
        if a != b:
            break
        same += 1
    return same, [abs(x - y) for x, y in zip(van["logprobs"][:same], other["logprobs"][:same])]


def vllm_decode_op(q, key_cache, value_cache, block_table, seq_lens, isa: str, out=None):
    """vLLM's own CPU decode attention (one query row per request) as a zero-argument call that fills and returns
    ``out [n, Hq, D]``: the reference the kvkit paged kernels are tested and timed against."""
    import torch
    from vllm import _custom_ops as ops

    n, Hq, D = q.shape
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=Hq, num_kv_heads=key_cache.shape[1], head_dim=D, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(n, Hq, D, dtype=torch.bfloat16) if out is None else out

    def run():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0, scheduler_metadata=sched, s_aux=None)
        return out

    return run
