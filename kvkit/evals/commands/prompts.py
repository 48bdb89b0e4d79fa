"""``--prompts FILE``: the samples of a ``--dump-prompts`` file (RULER, NIAH), every row checked before anything runs.

A row needs ``id``, ``task``, ``prompt``, ``outputs``, ``tokens_to_generate`` and ``metric`` (NIAH rows also
``target_length`` and ``depth``), each of the right type and range, a RULER metric (:func:`kvkit.evals.metrics.
ruler_metric`) and an id unique in the file; ``context_end`` must be a character offset in the prompt. A bad row is
refused naming the file, the line and the sample, instead of failing after samples ran. :func:`check_prompt_lengths`
checks the longest prompt against the model's context and warns when the tokenizer counts another length than the
one the prompts were made with.
"""

from __future__ import annotations

import sys

from kvkit.evals.files import read_jsonl
from kvkit.evals.generation import check_length, count_tokens
from kvkit.evals.metrics import ruler_metric

PROMPT_FIELDS = ("id", "task", "prompt", "outputs", "tokens_to_generate", "metric")


def read_prompts(path, bench: str = "ruler", need_index: bool = False) -> list[dict]:
    """The samples of a ``--dump-prompts`` file, every row checked (:func:`prompt_checker`) before anything runs:
    a bad row is refused naming the file, the line and the sample, instead of failing after samples ran."""
    rows = read_jsonl(path, required=PROMPT_FIELDS + (("target_length", "depth") if bench == "niah" else ()),
                      check=prompt_checker(need_index))
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return rows


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_checker(need_index: bool):
    """A check of one prompts-file row: field types and ranges, a RULER metric (:func:`kvkit.evals.metrics.
    ruler_metric`), ids unique in the file."""
    seen: set = set()

    def check(row: dict) -> None:
        rid = row["id"]
        if not (_int(rid) or isinstance(rid, str) and rid):
            raise ValueError(f"'id' must be a non-empty string or an integer, got {rid!r}")
        if rid in seen:
            raise ValueError(f"sample id {rid!r} appears twice in the file")
        seen.add(rid)
        what = f"sample {rid!r}:"
        if not isinstance(row["task"], str) or not row["task"]:
            raise ValueError(f"{what} 'task' must be a non-empty string, got {row['task']!r}")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"{what} 'prompt' must be a non-empty string")
        outs = row["outputs"]
        if not isinstance(outs, list) or not outs or not all(isinstance(o, str) for o in outs):
            raise ValueError(f"{what} 'outputs' must be a non-empty list of strings, got {outs!r}")
        n = row["tokens_to_generate"]
        if not _int(n) or n < 1:
            raise ValueError(f"{what} 'tokens_to_generate' must be a positive integer, got {n!r}")
        try:
            ruler_metric(row["metric"])
        except ValueError as e:
            raise ValueError(f"{what} {e}") from None
        if "index" in row and not (_int(row["index"]) and row["index"] >= 0):
            raise ValueError(f"{what} 'index' must be an integer >= 0, got {row['index']!r}")
        if need_index and "index" not in row:
            raise ValueError(f"{what} no 'index' field (--samples takes the first N samples of each task by it)")
        ce = row.get("context_end")
        if ce is not None and not (_int(ce) and 0 <= ce <= len(row["prompt"])):
            raise ValueError(f"{what} 'context_end' must be a character offset in the prompt (0 to "
                             f"{len(row['prompt'])}), got {ce!r}")
        tl = row.get("target_length")
        if tl is not None and not (_int(tl) and tl >= 1):
            raise ValueError(f"{what} 'target_length' must be a positive integer, got {tl!r}")
        d = row.get("depth")
        if d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 100):
            raise ValueError(f"{what} 'depth' must be a percentage from 0 to 100, got {d!r}")
        if "seed" in row and not _int(row["seed"]):
            raise ValueError(f"{what} 'seed' must be an integer, got {row['seed']!r}")

    return check


def check_prompt_lengths(model, tokenizer, samples, what) -> None:
    longest = max(samples, key=lambda s: s.get("target_length") or 0)
    if longest.get("target_length"):
        check_length(model, longest["target_length"], what)
    s = samples[0]
    if "prompt_tokens" in s and count_tokens(tokenizer, s["prompt"]) != s["prompt_tokens"]:
        print(f"warning: prompt {s['id']} has {count_tokens(tokenizer, s['prompt'])} tokens with this tokenizer, "
              f"{s['prompt_tokens']} when it was made (another tokenizer?)", file=sys.stderr)
