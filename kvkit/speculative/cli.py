"""``kvkit speculate``: acceptance rate and decode speed of self-speculative decoding vs plain decoding.

One run loads the model, prefills a batch of ``--batch`` long prompts once (each prompt minus its last
token; every setting continues from a copy of that cache), then decodes ``--max-new-tokens`` tokens per
row with plain batched greedy decoding and with each speculative setting (draft view ``--policy NAME[:KEY=VALUE,...]``
x budget x gamma), and prints acceptance rate, decode tokens/s (all rows), speedup and whether every row equals plain
greedy decoding token for token. The arguments are defined in :func:`kvkit.cli.add_speculate` (a parser that imports
no torch); progress goes to stderr, the table to stdout, one JSON line per setting to ``--out``.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache, StaticCache

import kvkit
import kvkit.models
from kvkit.cli_grammar import check_device, extra_options, parse_policy
from kvkit.compat import cache_kw
from kvkit.demo import essay_text, needle_prompt
from kvkit.speculative.generate import SpeculativeStats, generate
from kvkit.speculative.rows import batch_cache


def _log(msg: str) -> None:
    """Progress (loading, prefill, each setting's decode) on stderr; the table goes to stdout."""
    print(msg, file=sys.stderr, flush=True)


def _sync(device) -> None:
    """Wait for ``device``'s queued CUDA work (nothing to wait for off CUDA), so wall-clock timings are right."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def plain_decode(model, cache, ids, new_tokens: int, device, mask=None):
    """Batched greedy decoding continuing ``cache`` (which holds ``ids[:, :-1]``): (tokens per row, decode seconds).

    mask ``[B, n]``: left padding of ``ids`` (None: none); position ids as ``model.generate`` gives them. The
    first forward (the prompt's last token, which gives the first new token) is not timed, as in
    :func:`kvkit.speculative.generate`, which counts it as prefill: the decode seconds cover the
    ``new_tokens - 1`` one-token steps after it.
    """
    toks = [[] for _ in range(ids.shape[0])]
    nxt = ids[:, -1:]
    pos = None if mask is None else mask.long().sum(-1, keepdim=True) - 1
    with torch.no_grad():
        for i in range(new_tokens):
            if i == 1:
                _sync(device)
                t0 = time.perf_counter()
            out = model(input_ids=nxt, **cache_kw(cache), use_cache=True, attention_mask=mask, position_ids=pos)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for row, t in zip(toks, nxt[:, 0].tolist()):
                row.append(t)
            if mask is not None:
                mask, pos = torch.cat([mask, torch.ones_like(nxt)], dim=1), pos + 1
    _sync(device)
    return toks, time.perf_counter() - t0


def plain_decode_hf(kind: str, model, base, ids, new_tokens: int, device, mask=None):
    """:func:`plain_decode` over a transformers ``DynamicCache`` / ``StaticCache`` holding a copy of ``base``'s prompt KV."""
    if kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    else:
        cache = DynamicCache(config=model.config)
    for src, dst in zip(base.layers, cache.layers):
        dst.update(src.keys, src.values)  # both copy: DynamicLayer concatenates, StaticLayer index_copy_s
    return plain_decode(model, cache, ids, new_tokens, device, mask)


def _prompt(tok, task: str, length: int, seed: int):
    """One prompt ``[1, n]``: a needle question (--length counts the whole chat prompt) or essay text from an offset."""
    if task == "needle":
        ids, _ = needle_prompt(tok, context_tokens=length, seed=seed)
        extra = ids.shape[1] - length
        if 0 < extra < length:
            ids, _ = needle_prompt(tok, context_tokens=length - extra, seed=seed)
        return ids
    text_ids = tok(essay_text(), add_special_tokens=False)["input_ids"]
    start = (seed * 7919) % max(1, len(text_ids) - length)
    return torch.tensor([text_ids[start : start + length]])


def _check_args(args) -> tuple[list[int], list[tuple[str, dict]], list, list[str]]:
    """Check ``kvkit speculate``'s arguments (before the model loads); returns ``(gammas, draft views, budgets,
    baselines)`` as lists: each draft view ``(name, options)`` from ``--policy NAME[:KEY=VALUE,...]`` with the hidden
    ``--draft-opt`` and ``--compression-ratio`` folded in; budgets ``[None]`` without ``--budget`` (the view's
    default)."""
    gammas = list(args.gamma)
    budgets = list(args.budget) if args.budget else [None]
    baselines = list(args.baselines or [])
    extra = extra_options(args)
    if getattr(args, "compression_ratio", None) is not None:
        extra["compression_ratio"] = args.compression_ratio
    views = [(s.name, {**extra, **s.options}) for s in (args.policy or [parse_policy("streaming")])]
    if args.max_new_tokens < 2:
        flag = getattr(args, "_flag_max_new_tokens", "--max-new-tokens")
        raise ValueError(f"{flag} must be >= 2 (the first one comes from the prefill), got {args.max_new_tokens}")
    check_device(args.device)
    if args.out:
        _check_out(args.out)
    return gammas, views, budgets, baselines


def _check_out(path: str) -> None:
    """``--out``: a file the JSON lines are appended to (not a folder; its folder exists or can be made)."""
    import os

    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a folder; name a .jsonl file (one JSON line per setting is appended)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {path}: {parent} is a file, not a folder")


def _load(args, dtype):
    """``(model, tokenizer, assistant)`` loaded on ``args.device`` in ``dtype`` (assistant None without
    ``--assistant``)."""
    _log(f"loading model {args.model!r} ...")
    model, tok = kvkit.models.load(args.model, dtype=dtype, device=args.device)
    assistant = None
    if args.assistant:
        _log(f"loading assistant {args.assistant!r} ...")
        assistant, _ = kvkit.models.load(args.assistant, dtype=dtype, device=args.device)
    return model, tok, assistant


def _batch(model, tok, args):
    """The ``--batch`` prompts (:func:`_prompt`, one seed each) left padded into ``(ids [B, n], mask [B, n])`` on
    ``args.device`` (mask None without padding); ValueError when prompt + ``--max-new-tokens`` exceeds the model's
    trained context."""
    rows = [_prompt(tok, args.task, args.length, args.seed * args.batch + b) for b in range(args.batch)]
    width = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):  # left padding
        ids[b, width - r.shape[1] :], mask[b, width - r.shape[1] :] = r[0], 1
    mask = None if bool(mask.all()) else mask.to(args.device)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and ids.shape[1] + args.max_new_tokens > limit:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the model's trained context of "
            f"{limit} tokens; use --length {limit - args.max_new_tokens - 8} or less"
        )
    return ids.to(args.device), mask


def _prefill_once(model, ids, mask, args):
    """The shared prefill: a cache of the patched model (a batch cache at ``--batch`` > 1) holding ``ids[:, :-1]``
    (masked by ``mask``), prefilled in chunks; every setting continues from a copy of it."""
    first = min(ids.shape[1] - 1, 4096 // args.batch)  # the prefill's first chunk (a static cache's prompt_length)
    base = batch_cache(model) if args.batch > 1 else kvkit.KVCache(model, prompt_length=first)
    t0 = time.perf_counter()
    kvkit.prefill(model, ids[:, :-1], None if mask is None else mask[:, :-1], chunk_size=4096 // args.batch, cache=base)
    _sync(args.device)
    _log(f"prefill {time.perf_counter() - t0:.1f}s")
    return base


def _run_setting(model, base, ids, mask, args, opts: dict, setting: tuple, plain: list):
    """One speculative run of ``setting`` ``(draft policy, gamma, budget, assistant or None)`` from a copy of
    ``base``, its draft options ``opts`` (with the budget); returns ``(name, stats, equals plain, assistant)``, the
    third comparing its new tokens with ``plain`` (plain greedy's, per row)."""
    (policy, view_opts), gamma, budget, helper = setting
    o = {**opts, **view_opts}
    if budget is not None:
        o["budget"] = budget
    st = SpeculativeStats()
    out = generate(model, ids, attention_mask=mask, past_key_values=copy.deepcopy(base), draft_policy=policy, draft_options=o,
                   gamma=gamma, assistant=helper, assistant_gamma=args.assistant_gamma if helper is not None else None,
                   adaptive=args.adaptive or False, max_new_tokens=args.max_new_tokens, eos_token_id=None, stats=st)
    new = out[:, ids.shape[1]:].tolist()
    name = f"{policy}({', '.join(f'{k}={v}' for k, v in o.items())}) gamma={gamma}"
    if helper is not None:
        name += f" + assistant {args.assistant}"
    _log(f"  {name}: acceptance {st.acceptance_rate:.2f}, {st.decode_tokens_per_second:.2f} tok/s")
    return name, st, new == plain, helper


def _measure(model, base, ids, mask, args, settings: list, opts: dict, baselines: list[str]):
    """``--repeat`` rounds, each plain greedy decoding, then every transformers-cache baseline, then every setting,
    all from copies of ``base``. Returns ``(plain tok/s per round, {baseline: [(tok/s, equals plain)]}, per setting
    [(name, stats, equals plain, assistant)] per round)``."""
    plain_runs, extra_runs, runs = [], {b: [] for b in baselines}, [[] for _ in settings]
    for rep in range(args.repeat):
        if args.repeat > 1:
            _log(f"repeat {rep + 1}/{args.repeat}")
        plain, plain_s = plain_decode(model, copy.deepcopy(base), ids, args.max_new_tokens, args.device, mask)
        steps = args.max_new_tokens - 1
        plain_runs.append(args.batch * steps / plain_s)
        _log(f"  plain greedy: {plain_runs[-1]:.2f} tok/s ({1e3 * plain_s / steps:.0f} ms/step)")
        for b in baselines:
            toks, secs = plain_decode_hf(b, model, base, ids, args.max_new_tokens, args.device, mask)
            extra_runs[b].append((args.batch * steps / secs, toks == plain))
            _log(f"  plain greedy, transformers {b} cache: {extra_runs[b][-1][0]:.2f} tok/s")
        for i, setting in enumerate(settings):
            runs[i].append(_run_setting(model, base, ids, mask, args, opts, setting, plain))
    return plain_runs, extra_runs, runs


def _setting_row(args, reps: list, plain_runs: list, plain_step: float, extra_runs: dict) -> dict:
    """The summary row of one setting from its rounds ``reps`` (:func:`_run_setting`'s tuples): medians of tok/s and
    of the speedups over plain (``plain_runs``) and over each baseline, acceptance, and the cost of one draft step and
    of one verification forward in plain decode steps (``plain_step`` seconds; all rounds pooled)."""
    name, st, _, helper = reps[-1]
    tps = [r[1].decode_tokens_per_second for r in reps]
    ratios = [t / p for t, p in zip(tps, plain_runs)]
    # cost of one draft step and of one verification forward, in plain decode steps (all repeats pooled)
    steps = sum(r[1].draft_steps for r in reps)
    rounds = sum(r[1].rounds for r in reps)
    draft_step = sum(r[1].draft_seconds for r in reps) / steps if steps else None
    verify = sum(r[1].verify_seconds for r in reps) / rounds if rounds else None
    row = dict(setting=name, acceptance=st.acceptance_rate, tokens_per_round=st.tokens_per_round,
               tok_s=statistics.median(tps), speedup=statistics.median(ratios), same=all(r[2] for r in reps),
               assistant=args.assistant if helper is not None else None,
               assistant_acceptance=st.assistant_acceptance_rate if helper is not None else None,
               tok_s_runs=tps, speedup_runs=ratios,
               draft_step_vs_plain=None if draft_step is None or helper is not None else draft_step / plain_step,
               verify_vs_plain=None if verify is None else verify / plain_step)
    for b, breps in extra_runs.items():
        row[f"speedup_vs_{b}"] = statistics.median(t / r[0] for t, r in zip(tps, breps))
    return row


def _summary(args, plain_runs: list, extra_runs: dict, runs: list) -> list[dict]:
    """The summary rows (:func:`_measure`'s results): plain greedy, each transformers-cache baseline, each setting
    (:func:`_setting_row`)."""
    plain_med = statistics.median(plain_runs)
    plain_step = args.batch / plain_med  # seconds of one plain batched decode step
    rows = [dict(setting="plain greedy", acceptance=None, tokens_per_round=1.0, tok_s=plain_med, speedup=1.0, same=True,
                 assistant=None, assistant_acceptance=None, tok_s_runs=plain_runs, speedup_runs=[1.0] * args.repeat,
                 draft_step_vs_plain=None, verify_vs_plain=None)]
    names = {"dynamic": "plain greedy (transformers DynamicCache)", "static": "plain greedy (transformers StaticCache)"}
    for b, reps in extra_runs.items():
        ratios = [r[0] / p for r, p in zip(reps, plain_runs)]
        rows.append(dict(setting=names[b], acceptance=None, tokens_per_round=1.0, tok_s=statistics.median(r[0] for r in reps),
                         speedup=statistics.median(ratios), same=all(r[1] for r in reps), assistant=None,
                         assistant_acceptance=None, tok_s_runs=[r[0] for r in reps], speedup_runs=ratios,
                         draft_step_vs_plain=None, verify_vs_plain=None))
    rows.extend(_setting_row(args, reps, plain_runs, plain_step, extra_runs) for reps in runs)
    return rows


def _print_table(args, ids, rows: list[dict], extra_runs: dict) -> None:
    """Print the summary table of ``rows`` and the speedups over each transformers-cache baseline."""
    print()
    print(f"model {args.model}, task {args.task}, batch {args.batch} x prompt {ids.shape[1]} tokens, {args.max_new_tokens} new "
          f"tokens per row, device {args.device}")
    if args.repeat > 1:
        print(f"medians of {args.repeat} interleaved repeats; speedup = median of per-repeat ratios to plain")
    print(f"{'setting':<58} {'accept':>7} {'tok/round':>9} {'tok/s':>7} {'speedup':>8} {'draft':>6} {'verify':>6}  same as plain")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        d = "-" if r["draft_step_vs_plain"] is None else f"{r['draft_step_vs_plain']:.2f}"
        v = "-" if r["verify_vs_plain"] is None else f"{r['verify_vs_plain']:.2f}"
        print(f"{r['setting'][:58]:<58} {acc:>7} {r['tokens_per_round']:>9.2f} {r['tok_s']:>7.2f} "
              f"{r['speedup']:>7.2f}x {d:>6} {v:>6}  {'yes' if r['same'] else 'NO'}")
    print("draft / verify: seconds of one (batched) draft step / one verification forward, in plain batched decode steps")
    for b in extra_runs:
        print(f"speedup vs plain greedy over transformers' {b} cache: "
              + ", ".join(f"{r['setting'].split(' + ')[0]} {r[f'speedup_vs_{b}']:.2f}x" for r in rows if f"speedup_vs_{b}" in r))


def _write_json(path: str, args, ids, rows: list[dict]) -> None:
    """Append one JSON line per summary row to ``path``, with the run's model, task, shapes, device and command."""
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(dict(r, model=args.model, task=args.task, batch=args.batch, prompt_tokens=ids.shape[1],
                                    new_tokens=args.max_new_tokens,
                                    device=args.device, dtype=args.dtype, threads=torch.get_num_threads(),
                                    command=" ".join(sys.argv))) + "\n")


def cmd_speculate(args) -> int:
    """``kvkit speculate``: prefill the batch once, then plain greedy decoding, the transformers-cache baselines and
    every speculative setting (draft policy x budget x gamma, each also under ``--assistant``) from copies of that
    cache, ``--repeat`` times interleaved; print the summary table (and append it to ``--json``). Returns 0 when every
    row decoded the same tokens as plain greedy decoding, else 1."""
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    gammas, views, budgets, baselines = _check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = {}  # every view's options come with it (--policy NAME:KEY=VALUE,...)
    model, tok, assistant = _load(args, dtype)
    ids, mask = _batch(model, tok, args)
    _log(f"prompt: {args.batch} x {ids.shape[1]} tokens; prefilling once ...")
    kvkit.patch(model, "full")
    base = _prefill_once(model, ids, mask, args)

    # with --assistant every setting runs twice, self-draft alone and under the assistant (TriForce's
    # hierarchy), so the hierarchy's gain over the plain self-draft is measured on the same prefill
    helpers = [None, assistant] if assistant is not None else [None]
    settings = [(v, g, b, a) for v in views for b in budgets for g in gammas for a in helpers]
    plain_runs, extra_runs, runs = _measure(model, base, ids, mask, args, settings, opts, baselines)
    rows = _summary(args, plain_runs, extra_runs, runs)
    kvkit.unpatch(model)

    _print_table(args, ids, rows, extra_runs)
    if args.out:
        _write_json(args.out, args, ids, rows)
    return 0 if all(r["same"] for r in rows) else 1  # (the --baselines rows too: they must decode the same tokens)
