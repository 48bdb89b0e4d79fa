"""Self-speculative decoding over static caches, compiled: draft and verify times per round, acceptance, and the
speed-up over the compiled plain decode step, at batch 16-64 x 16K (``--dry``: the tiny shape on the CPU).

The target is the shape's random-weight Llama patched with ``full`` (``static=True``); its static cache holds the
whole prompt. The draft is the same model reading a StreamingLLM view of the prompt: a second static cache of the
``streaming`` policy (``--draft-budget`` tokens per row, ``--sink`` sinks; MagicDec's draft KV), prefilled with the
same prompt. Each round, per batch (every row in step):

* draft: ``k + 1`` single-token compiled steps over the draft cache (``model.get_compiled_call``: kvkit's step
  wrapper, CUDA graphs on CUDA) feed the last token and the ``k`` drafts (the last output unused), so the draft
  cache holds them all;
* verify: one forward of the ``k + 1`` tokens over the target's static cache, compiled apart
  (``torch.compile(fullgraph=True)`` of a ``k + 1``-token forward, the stores' eager bookkeeping around it as the
  step wrapper does);
* accept: per row the number ``n_b`` of leading drafts equal to the target's greedy tokens (greedy decoding; the
  acceptance rate is ``mean n_b / k``); the batch keeps ``n = min_b n_b`` drafts plus the target's next token
  (every row's output is still its own greedy output, so rows stay rectangular), and both caches drop their
  ``k - n`` newest tokens (``KVCache.crop``).

The plain baseline is the compiled single-token step over the target's cache, timed over ``--plain-steps`` steps
from the same prompt state (then cropped back); its tokens are the greedy reference the speculative tokens are
compared with (``tokens_equal``: the share of positions equal; fp32 gives 1.0, bf16 may differ at near-ties).
Speed-up = (speculative tokens per second) / (plain tokens per second), both per batch row.

    PYTHONPATH=$PWD python benchmarks/gpu/speculative_gpu.py --out DIR                  # a GPU: 1B shape, 16/32/64 x 16K
    PYTHONPATH=$PWD python benchmarks/gpu/speculative_gpu.py --dry --out DIR            # the CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.gpu.shapes import build_model
from kvkit.evals.gpu.timing import free_memory, sync


def _timer(cuda: bool):
    """``start()`` / ``stop() -> seconds`` around device work (synchronised)."""
    state = {}

    def start():
        sync(cuda)
        state["t"] = time.perf_counter()

    def stop() -> float:
        sync(cuda)
        return time.perf_counter() - state["t"]

    return start, stop


class SpecBench:
    """One shape and prompt length; :meth:`run` measures one batch size (see the module docstring)."""

    def __init__(self, shape: str, device: str, dtype, length: int, gamma: int, draft_budget: int, sink: int,
                 rounds: int, plain_steps: int, backend: str, seed: int = 0, log=None):
        self.shape, self.device, self.dtype, self.length = shape, torch.device(device), dtype, length
        self.cuda = self.device.type == "cuda"
        self.gamma, self.draft_budget, self.sink = gamma, draft_budget, sink
        self.rounds, self.plain_steps, self.backend, self.seed = rounds, plain_steps, backend, seed
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.model = build_model(shape, self.device, dtype, seed)
        self.capacity = length + max(plain_steps, rounds * (gamma + 1)) + 2 * (gamma + 1) + 16
        kvkit.patch(self.model, "full", static=True, max_length=self.capacity)
        mode = "reduce-overhead" if self.cuda and backend == "inductor" else None
        self.mode = mode
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=mode)
        if not self.cuda:
            cc._compile_all_devices = True
        self.step = self.model.get_compiled_call(cc)  # single-token steps (kvkit's wrapper)
        self.verify_fn = torch.compile(lambda **kw: self.model(**kw), fullgraph=True, dynamic=False,
                                       backend=backend, mode=mode)

    def _caches(self, batch: int):
        g = torch.Generator().manual_seed(self.seed + batch)
        ids = torch.randint(0, self.model.config.vocab_size, (batch, self.length), generator=g).to(self.device)
        target = kvkit.KVCache(self.model, "full", static=True, max_length=self.capacity)
        draft = kvkit.KVCache(self.model, "streaming", static=True, budget=self.draft_budget, sink=self.sink)
        chunk = min(self.length, max(256, 16384 // batch))
        t0 = time.perf_counter()
        _, last = kvkit.prefill(self.model, ids, chunk_size=chunk, cache=target)
        sync(self.cuda)
        prefill_s = time.perf_counter() - t0
        kvkit.prefill(self.model, ids, chunk_size=chunk, cache=draft)
        target.ensure_capacity(self.capacity)
        draft.ensure_capacity(self.capacity)  # a bounded store keeps its bound
        return target, draft, last.argmax(-1, keepdim=True), prefill_s

    def _one(self, cache, tok):
        if self.cuda and self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return self.step(input_ids=tok, **cache_kw(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

    def _verify(self, cache, x):
        T = x.shape[1]
        if self.cuda and self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        cache.before_compiled_step(T)
        out = self.verify_fn(input_ids=x, **cache_kw(cache), use_cache=True).logits.argmax(-1)
        cache.after_compiled_step(T)
        return out  # [B, T]: the target's greedy token after each fed token

    @torch.no_grad()
    def run(self, batch: int) -> dict:
        k = self.gamma
        target, draft, nxt, prefill_s = self._caches(batch)
        start, stop = _timer(self.cuda)
        # plain: compiled single-token steps from the prompt state (first steps compile / record: untimed)
        t_compile = time.perf_counter()
        tok = nxt
        for _ in range(3):
            tok = self._one(target, tok)
        sync(self.cuda)
        compile_plain_s = time.perf_counter() - t_compile
        target.crop(-3)
        ref, tok, times = [nxt], nxt, []
        for _ in range(self.plain_steps):
            start()
            tok = self._one(target, tok)
            times.append(stop())
            ref.append(tok)
        target.crop(-self.plain_steps)
        ref = torch.cat(ref, 1)  # [B, plain_steps + 1]: the greedy continuation (nxt first)
        plain_ms = statistics.median(times) * 1e3
        # speculative rounds; the first two compile / record the draft and verify graphs (untimed)
        out, last = [nxt], nxt
        draft_t, verify_t, accepted, rows_accepted, warm = [], [], [], [], 2
        t_compile = time.perf_counter()
        for r in range(self.rounds + warm):
            if r == warm:
                compile_spec_s = time.perf_counter() - t_compile
            start()
            cur, drafts = last, []
            for _ in range(k + 1):
                cur = self._one(draft, cur)
                drafts.append(cur)
            drafts = torch.cat(drafts[:k], 1)  # [B, k]
            td = stop()
            start()
            x = torch.cat([last, drafts], 1)
            p = self._verify(target, x)  # p[:, j]: the target's token after x[:, j]
            match = (drafts == p[:, :k]).int().cumprod(1).sum(1)  # [B] leading drafts accepted per row
            # the one host read of a round: the drafts every row accepted (kept by the batch) and their sum
            n, total = torch.stack([match.min(), match.sum()]).tolist()
            tv = stop()
            if r >= warm:
                draft_t.append(td)
                verify_t.append(tv)
                accepted.append(n)
                rows_accepted.append(total / batch)
            if k - n:
                target.crop(-(k - n))
                draft.crop(-(k - n))
            new = torch.cat([drafts[:, :n], p[:, n:n + 1]], 1)
            out.append(new)
            last = new[:, -1:]
        spec = torch.cat(out, 1)
        m = min(spec.shape[1], ref.shape[1])
        tokens_equal = float((spec[:, :m] == ref[:, :m]).float().mean())
        rounds_s = [a + b for a, b in zip(draft_t, verify_t)]
        per_round_tokens = [n + 1 for n in accepted]
        spec_tok_s = sum(per_round_tokens) / sum(rounds_s)  # per batch row
        plain_tok_s = 1e3 / plain_ms
        res = dict(batch=batch, length=self.length, gamma=k, draft_budget=self.draft_budget, sink=self.sink,
                   prefill_s=round(prefill_s, 3), plain_ms=round(plain_ms, 4), compile_plain_s=round(compile_plain_s, 2),
                   compile_spec_s=round(compile_spec_s, 2), rounds=len(rounds_s),
                   draft_ms=round(statistics.median(draft_t) * 1e3, 4),
                   draft_step_ms=round(statistics.median(draft_t) * 1e3 / (k + 1), 4),
                   verify_ms=round(statistics.median(verify_t) * 1e3, 4),
                   acceptance_rate=round(statistics.mean(rows_accepted) / k, 4),
                   batch_tokens_per_round=round(statistics.mean(per_round_tokens), 3),
                   tokens_per_s_per_row=round(spec_tok_s, 2), plain_tokens_per_s_per_row=round(plain_tok_s, 2),
                   speedup_vs_plain=round(spec_tok_s / plain_tok_s, 3), tokens_equal=round(tokens_equal, 4),
                   compared_tokens=m)
        if self.cuda:
            res["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
        target = draft = None
        free_memory(self.cuda)
        return res


def table(rows: list[dict]) -> str:
    head = ("| batch | length | gamma | draft budget | plain ms/step | draft ms/round (per step) | verify ms/round | "
            "acceptance | tokens/round (batch) | speed-up vs plain | tokens equal | compile s (plain, spec) |")
    lines = [head, "|---" * 12 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r.get('length', '')} | | | | | | | | | | {r['error'][:160]} |")
            continue
        lines.append(f"| {r['batch']} | {r['length']} | {r['gamma']} | {r['draft_budget']} | {r['plain_ms']:.3f} | "
                     f"{r['draft_ms']:.3f} ({r['draft_step_ms']:.3f}) | {r['verify_ms']:.3f} | "
                     f"{r['acceptance_rate']:.3f} | {r['batch_tokens_per_round']:.2f} | {r['speedup_vs_plain']:.3f} | "
                     f"{r['tokens_equal']:.3f} | {r['compile_plain_s']}, {r['compile_spec_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="the tiny shape on the CPU, short prompts (the dry run)")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 16,32,64; dry: 2,4)")
    ap.add_argument("--length", type=int, default=None, help="prompt tokens (default 16384; dry: 96)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--draft-budget", type=int, default=None, help="draft KV per row (default 1024; dry: 24)")
    ap.add_argument("--sink", type=int, default=None, help="sink tokens of the draft view (default 16; dry: 2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20; dry: 4)")
    ap.add_argument("--plain-steps", type=int, default=None, help="timed plain steps (default 40; dry: 8)")
    ap.add_argument("--compile-backend", default=None, help="inductor (default) or aot_eager (dry default)")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds; batches left when it passes are skipped")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dry = a.dry
    shape = a.shape or ("tiny" if dry else "llama-3.2-1b")
    device = a.device or ("cpu" if dry else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {device}: CUDA is not available here (use --dry on the CPU)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    batches = [int(b) for b in (a.batches or ("2,4" if dry else "16,32,64")).split(",") if b.strip()]
    length = a.length or (96 if dry else 16384)
    budget = a.draft_budget or (24 if dry else 1024)
    sink = a.sink if a.sink is not None else (2 if dry else 16)
    rounds = a.rounds or (4 if dry else 20)
    plain = a.plain_steps or (8 if dry else 40)
    backend = a.compile_backend or ("aot_eager" if dry else "inductor")
    t0 = time.perf_counter()
    bench = SpecBench(shape, device, dtype, length, a.gamma, budget, sink, rounds, plain, backend)
    rows = []
    out = Path(a.out) if a.out else None
    info = dict(shape=shape, device=str(device), dtype=str(dtype).split(".")[-1], backend=backend, mode=bench.mode,
                command="python benchmarks/gpu/speculative_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__,
                device_name=torch.cuda.get_device_name(torch.device(device)) if bench.cuda else "cpu")
    for b in batches:
        el = time.perf_counter() - t0
        if el > a.time_limit:
            rows.append(dict(batch=b, length=length, error=f"skipped: time limit {a.time_limit:.0f} s (elapsed {el:.0f} s)"))
        else:
            bench.log(f"[{el:6.1f}s] batch {b} x {length} ...")
            try:
                rows.append(bench.run(b))
            except Exception as e:  # noqa: BLE001 -- an OOM at a batch is that batch's row
                rows.append(dict(batch=b, length=length, error=f"{type(e).__name__}: {e}".replace("\n", " ")[:300]))
                free_memory(bench.cuda)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "speculative.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
            (out / "speculative.md").write_text(f"`{info['command']}` on {info['device_name']} ({info['dtype']}, "
                                                f"{backend} {bench.mode or ''})\n\n" + table(rows))
    print(table(rows))
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
