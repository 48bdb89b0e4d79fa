"""LongBench (Bai et al., arXiv:2308.14508): the 21 tasks from the official ``<task>.jsonl`` files.

Prompts, generation lengths and metrics as in the official release (``longbench_config``); prompts
longer than the budget are cut in the middle (head and tail halves kept, in tokens); the chat
template is applied except for the few-shot/completion tasks; trec, triviaqa, samsum and lsht score
the first line of the prediction only.

A sample's id is ``<task>/<line index>`` (the record's ``_id``, which the official files do not promise
to keep unique, is kept as ``source_id``), so every record of a file is run and scored once.
"""

from __future__ import annotations

from pathlib import Path

from kvkit.evals import longbench_config as cfg
from kvkit.evals import metrics
from kvkit.evals.files import read_jsonl
from kvkit.workloads.prompts import build_prompt

FIELDS = ("input", "context", "answers")
#: tokens of ``--length`` left for the chat template around the (truncated) raw prompt
TEMPLATE_TOKENS = 64
DOWNLOAD = ("the official LongBench data: download data.zip from https://huggingface.co/datasets/THUDM/LongBench "
            "(resolve/main/data.zip), unzip it and pass the folder holding the .jsonl files")


def parse_tasks(spec) -> list[str]:
    if spec is None or spec == "all":
        return list(cfg.TASKS)
    names = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [n for n in names if n not in cfg.PROMPTS]
    if unknown or not names:
        raise ValueError(f"unknown LongBench task(s) {', '.join(map(repr, unknown))}; known tasks: {', '.join(cfg.TASKS)}")
    return list(dict.fromkeys(names))


def check_data_dir(data_dir, tasks: list[str]) -> Path:
    """The folder with ``<task>.jsonl`` for every task, or a ValueError that says what to put where."""
    if data_dir is None:
        raise ValueError(f"--data-dir is required: {DOWNLOAD}; it must contain "
                         f"{', '.join(t + '.jsonl' for t in tasks)}")
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"LongBench data folder {d} does not exist. Put {', '.join(t + '.jsonl' for t in tasks)} "
                         f"into {d}: {DOWNLOAD}")
    if (d / "data").is_dir() and not any((d / f"{t}.jsonl").exists() for t in tasks):
        d = d / "data"  # the unzipped archive
    missing = [f"{t}.jsonl" for t in tasks if not (d / f"{t}.jsonl").is_file()]
    if missing:
        raise ValueError(f"LongBench data folder {d} lacks {', '.join(missing)}. Put these files into {d}: {DOWNLOAD}")
    empty = [f"{t}.jsonl" for t in tasks if not _has_record(d / f"{t}.jsonl")]
    if empty:
        raise ValueError(f"LongBench data folder {d}: {', '.join(empty)} holds no records (empty file?); {DOWNLOAD}")
    return d


def _has_record(path: Path) -> bool:
    """Whether the file has a non-blank line (reads only up to the first one)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return any(line.strip() for line in f)


def min_length(task: str) -> int:
    """The smallest ``--length`` that holds ``task``: its generation budget, the chat template and at
    least one prompt token."""
    return cfg.MAX_NEW_TOKENS[task] + TEMPLATE_TOKENS + 1


def check_length(tasks: list[str], length: int) -> None:
    """Refuse a ``--length`` (prompt + generation) too small to hold every task's generation budget."""
    short = [t for t in tasks if length < min_length(t)]
    if short:
        need = max(min_length(t) for t in short)
        listed = ", ".join(f"{t} ({cfg.MAX_NEW_TOKENS[t]} new tokens)" for t in short)
        raise ValueError(f"--length {length} cannot hold {listed} plus the {TEMPLATE_TOKENS}-token template; "
                         f"use --length {need} or more")


def load_task(data_dir: Path, task: str, limit: int | None = None) -> list[dict]:
    """The records of ``<task>.jsonl`` (the first ``limit``, a positive count, when given)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit (--samples) must be a positive number of records, got {limit}")
    path = Path(data_dir) / f"{task}.jsonl"
    rows = read_jsonl(path, required=FIELDS)
    if not rows:
        raise ValueError(f"{path}: no records (empty file?); {DOWNLOAD}")
    for i, r in enumerate(rows):
        if not isinstance(r["answers"], list):
            raise ValueError(f"{Path(data_dir) / f'{task}.jsonl'}: record {i + 1} has 'answers' that is not a list")
    return rows[:limit] if limit is not None else rows


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of an over-long prompt (LongBench);
    ``max_tokens`` must be positive."""
    if max_tokens < 1:
        raise ValueError(f"truncate_middle: max_tokens must be a positive number of tokens, got {max_tokens}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-(max_tokens - half):], skip_special_tokens=True)


def make_samples(tokenizer, data_dir, tasks: list[str], max_length: int, limit: int | None = None,
                 chat: bool = True) -> list[dict]:
    """Prompts of every task; ``max_length`` bounds prompt + generation (64 tokens are left for the chat
    template), so the raw prompt is cut to ``max_length - max_new_tokens - 64`` tokens."""
    check_length(tasks, max_length)
    d = check_data_dir(data_dir, tasks)
    out = []
    for task in tasks:
        for i, r in enumerate(load_task(d, task, limit)):
            raw = cfg.PROMPTS[task].format(context=r["context"], input=r["input"])
            raw = truncate_middle(tokenizer, raw, max_length - cfg.MAX_NEW_TOKENS[task] - TEMPLATE_TOKENS)
            use_chat = chat and task not in cfg.NO_CHAT
            prompt = build_prompt(tokenizer, raw, chat=use_chat)
            tail = r["context"].rstrip()[-200:]
            end = prompt.rfind(tail) if tail else -1
            out.append(dict(
                id=f"{task}/{i}", source_id=r.get("_id"), task=task, index=i, prompt=prompt,
                context_end=end + len(tail) if end > 0 else None,
                outputs=list(r["answers"]), all_classes=r.get("all_classes"),
                tokens_to_generate=cfg.MAX_NEW_TOKENS[task], metric=cfg.METRIC[task],
            ))
    return out


def score(sample: dict, prediction: str) -> float:
    if sample["task"] in cfg.FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = metrics.METRICS[sample["metric"]]
    return metrics.best_of(fn, prediction, sample["outputs"], all_classes=sample.get("all_classes"))
