"""Running an eval's samples: each sample generated and scored once, its row added to the run folder as it
finishes, alone (:func:`run_samples`) or several policies sharing one exact context prefill per sample
(:func:`run_sweep`).

Samples run index-major (every task's sample 0, then every task's sample 1, ...), so a run stopped early still
covers every task with the same count. A row: the sample's id, task, index and seed, its content digest
(:func:`kvkit.evals.rundir.sample_digest`), the prediction, references and score, prompt and generated tokens,
seconds and the KV bytes held at the end (:class:`kvkit.workloads.generation.Generation`).
"""

from __future__ import annotations

from tqdm.auto import tqdm

import kvkit
from kvkit import env
from kvkit.evals.rundir import RunDir, sample_digest
from kvkit.workloads.generation import Generation, generate
from kvkit.workloads.peers import is_peer
from kvkit.workloads.prompts import encode
from kvkit.workloads.shared_prefill import record_prefill, replayable


def progress(iterable=None, total=None, desc=None):
    """A tqdm bar (off with ``KVKIT_NO_PROGRESS``)."""
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, disable=env.no_progress())


def run_samples(model, tokenizer, samples: list[dict], run: RunDir, policy: str, options: dict, score_fn,
                desc: str = "eval", full_prompt_prefill: bool = False) -> list[dict]:
    """Generate and score every sample not yet in ``run`` (``samples[i]`` has ``id``, ``prompt``,
    ``outputs``, ``tokens_to_generate``); returns all rows in sample order."""
    run.check_samples(samples)
    done = run.done()
    # index-major, as run_sweep: a run stopped early still covers every task with the same count
    todo = sorted((s for s in samples if s["id"] not in done), key=lambda s: s.get("index", 0))
    peer = (policy, options) if is_peer(policy) else None
    if peer is None:
        kvkit.patch(model, policy, **options)
    elif kvkit.patched_policy(model) is not None:
        kvkit.unpatch(model)
    try:
        bar = progress(total=len(samples), desc=desc)
        bar.update(len(samples) - len(todo))
        for s in todo:
            g = generate(model, tokenizer, s["prompt"], s["tokens_to_generate"],
                         None if full_prompt_prefill else s.get("context_end"), peer=peer)
            run.add(_row(s, g, score_fn(s, g.text)))
            bar.update(1)
        bar.close()
    finally:
        if peer is None:
            kvkit.unpatch(model)
    return rows_in_order(run, samples)


def _row(s: dict, g: Generation, score: float) -> dict:
    row = {k: s[k] for k in ("id", "task", "index", "seed") if k in s}
    row["sample_sha"] = sample_digest(s)  # what --resume and compare --matched match rows on, with the id
    row.update(
        prediction=g.text,
        reference=s["outputs"],
        score=float(score),
        prompt_tokens=g.prompt_tokens,
        new_tokens=g.new_tokens,
        seconds=round(g.seconds, 4),
        kv_bytes=g.kv_bytes,
        kv_offloaded=g.kv_offloaded,
    )
    if g.kv_read is not None:
        row["kv_read"] = g.kv_read
    for k in ("length", "depth", "target_length", "source_id"):
        if k in s:
            row[k] = s[k]
    return row


def run_sweep(model, tokenizer, samples: list[dict], runs: list, score_fn, desc: str = "sweep") -> list[list[dict]]:
    """Several (``RunDir``, policy, options) runs over the same samples, one shared context prefill per sample;
    returns each run's rows in sample order (as :func:`run_samples` does for one run).

    For each sample that some run has not finished, the context is prefilled once with exact attention
    (:func:`kvkit.workloads.shared_prefill.record_prefill`) and replayed into each policy's cache, then the
    question and the answer are decoded by that policy as in :func:`run_samples`. Rows are the same as
    a run of that policy alone (``seconds`` excludes the shared prefill; ``shared_prefill_seconds`` has it).
    """
    for _, policy, options in runs:
        if not replayable(policy, options):
            raise ValueError(f"policy {policy!r} with {options or 'its defaults'} cannot share a replayed prefill; run "
                             "it alone with `kvkit eval ruler`")
    for run, _, _ in runs:
        run.check_samples(samples)
    done = [run.done() for run, _, _ in runs]
    todo = [s for s in samples if any(s["id"] not in d for d in done)]
    # index-major (every task's sample 0, then every task's sample 1, ...): a sweep stopped early still
    # covers every task with the same number of samples
    todo.sort(key=lambda s: s.get("index", 0))
    bar = progress(total=len(samples), desc=desc)
    bar.update(len(samples) - len(todo))
    try:
        for s in todo:
            ce = s.get("context_end")
            if not ce or not 0 < ce < len(s["prompt"]):
                raise ValueError(f"sample {s['id']}: no context/question split (context_end); a sweep needs one")
            kvkit.patch(model, "full")
            ctx = encode(tokenizer, s["prompt"][:ce]).to(model.device)
            rec = record_prefill(model, ctx)
            for (run, policy, options), d in zip(runs, done):
                if s["id"] in d:
                    continue
                kvkit.patch(model, policy, **options)
                g = generate(model, tokenizer, s["prompt"], s["tokens_to_generate"], ce, replay=rec)
                row = _row(s, g, score_fn(s, g.text))
                row["shared_prefill_seconds"] = round(rec.seconds, 4)
                run.add(row)
            del rec
            bar.update(1)
    finally:
        kvkit.unpatch(model)
        bar.close()
    return [rows_in_order(run, samples) for run, _, _ in runs]


def rows_in_order(run: RunDir, samples: list[dict]) -> list[dict]:
    """The rows of ``run`` that belong to ``samples``, in the samples' order."""
    order = {s["id"]: i for i, s in enumerate(samples)}
    return sorted((r for r in run.rows if r["id"] in order), key=lambda r: order[r["id"]])
