"""Metrics of RULER (string match) and LongBench (QA F1, ROUGE-L, classification, retrieval, count,
code similarity), each ``metric(prediction, reference, **kw) -> float in [0, 1]``.

RULER: ``string_match_all`` (fraction of the references found in the prediction, case-insensitive)
and ``string_match_part`` (1 when any reference is found), as in RULER's ``eval/synthetic/constants.py``.
LongBench: the definitions of its official ``metrics.py`` (normalisation, jieba for Chinese,
``fuzz.ratio`` of the first code line), with rouge-score for English ROUGE-L and an LCS ROUGE-L over
jieba tokens for Chinese (rouge-score's tokenizer drops non-ASCII text).
"""

from __future__ import annotations

import re
import string
from collections import Counter

# ------------------------------------------------------------------------------------------- RULER


def string_match_all(prediction: str, references: list[str]) -> float:
    pred = prediction.lower()
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    pred = prediction.lower()
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    return float(any(r.lower() in pred for r in references))


# ---------------------------------------------------------------------------------------- LongBench

ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, articles (a/an/the) and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower case, drop Chinese + ASCII punctuation and all whitespace."""
    punct = set(ZH_PUNCTUATION + string.punctuation)
    s = "".join(ch for ch in s.lower() if ch not in punct)
    return "".join(s.split())


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return _f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _jieba_cut(text: str) -> list[str]:
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh(prediction: str, reference: str, **_) -> float:
    p = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(prediction)) if t]
    r = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(reference)) if t]
    return _f1(p, r)


def rouge_l(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F1 (rouge-score, no stemming) for English."""
    from rouge_score import rouge_scorer

    if not prediction.strip() or not reference.strip():
        return 0.0
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(reference, prediction)["rougeL"].fmeasure


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_zh(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F1 over jieba tokens (whitespace dropped) for Chinese."""
    p = [t for t in _jieba_cut(prediction) if t.strip()]
    r = [t for t in _jieba_cut(reference) if t.strip()]
    if not p or not r:
        return 0.0
    lcs = _lcs(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def classification(prediction: str, reference: str, all_classes=None, **_) -> float:
    """LongBench classification: classes named in the prediction; shorter names contained in the
    reference are dropped; 1/#matches when the reference class is among them."""
    if not all_classes:
        raise ValueError("classification needs all_classes (the task's label set)")
    matches = [c for c in all_classes if c in prediction]
    matches = [m for m in matches if not (m in reference and m != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def _id_score(prediction: str, reference: str, pattern: str) -> float:
    found = re.findall(pattern, reference)
    if not found:
        raise ValueError(f"reference {reference!r} does not match {pattern!r}")
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == found[0] for n in numbers) / len(numbers)


def retrieval(prediction: str, reference: str, **_) -> float:
    return _id_score(prediction, reference, r"Paragraph (\d+)")


def retrieval_zh(prediction: str, reference: str, **_) -> float:
    return _id_score(prediction, reference, r"段落(\d+)")


def count(prediction: str, reference, **_) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(reference) for n in numbers) / len(numbers)


def code_sim(prediction: str, reference: str, **_) -> float:
    """Fuzzy ratio between the first code line of the prediction (not a comment or fence) and the reference."""
    from rapidfuzz import fuzz

    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz.ratio(first, reference) / 100


METRICS = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}


#: the metrics a RULER / NIAH sample (``kvkit eval ruler|niah|sweep --prompts``) may name: ``metric(prediction,
#: references: list[str])``. The LongBench metrics score one reference string at a time (``best_of``).
RULER_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def ruler_metric(name):
    """The RULER metric called ``name``; anything else (a LongBench metric, a typo, another attribute of this
    module) is a ValueError listing the known ones."""
    if not isinstance(name, str) or name not in RULER_METRICS:
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(RULER_METRICS)}")
    return RULER_METRICS[name]


def best_of(metric, prediction: str, references: list, **kw) -> float:
    """LongBench scoring: the best score over the reference answers."""
    if not references:
        raise ValueError("no reference answers")
    return max(metric(prediction, r, **kw) for r in references)
