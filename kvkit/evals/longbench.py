"""LongBench (Bai et al., arXiv:2308.14508): the 21 tasks from the official ``<task>.jsonl`` files.

Prompts, generation lengths and metrics as in the official release (``longbench_config``); prompts
longer than the budget are cut in the middle (head and tail halves kept, in tokens); the chat
template is applied except for the few-shot/completion tasks; trec, triviaqa, samsum and lsht score
the first line of the prediction only.
"""

from __future__ import annotations

from pathlib import Path

from kvkit.evals import longbench_config as cfg
from kvkit.evals.common import build_prompt, read_jsonl

FIELDS = ("input", "context", "answers")
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
    return d


def load_task(data_dir: Path, task: str, limit: int | None = None) -> list[dict]:
    rows = read_jsonl(Path(data_dir) / f"{task}.jsonl", required=FIELDS)
    for i, r in enumerate(rows):
        if not isinstance(r["answers"], list):
            raise ValueError(f"{Path(data_dir) / f'{task}.jsonl'}: record {i + 1} has 'answers' that is not a list")
    return rows[:limit] if limit else rows


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of an over-long prompt (LongBench)."""
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
    d = check_data_dir(data_dir, tasks)
    out = []
    for task in tasks:
        for i, r in enumerate(load_task(d, task, limit)):
            raw = cfg.PROMPTS[task].format(context=r["context"], input=r["input"])
            raw = truncate_middle(tokenizer, raw, max_length - cfg.MAX_NEW_TOKENS[task] - 64)
            use_chat = chat and task not in cfg.NO_CHAT
            prompt = build_prompt(tokenizer, raw, chat=use_chat)
            tail = r["context"].rstrip()[-200:]
            end = prompt.rfind(tail) if tail else -1
            out.append(dict(
                id=f"{task}/{r.get('_id', i)}", task=task, index=i, prompt=prompt,
                context_end=end + len(tail) if end > 0 else None,
                outputs=list(r["answers"]), all_classes=r.get("all_classes"),
                tokens_to_generate=cfg.MAX_NEW_TOKENS[task], metric=cfg.METRIC[task],
            ))
    return out


def score(sample: dict, prediction: str) -> float:
    from kvkit.evals import metrics

    if sample["task"] in cfg.FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = metrics.METRICS[sample["metric"]]
    return metrics.best_of(fn, prediction, sample["outputs"], all_classes=sample.get("all_classes"))
