"""Fresh needles: single-needle retrieval on needles, keys, templates and haystack text no calibration has seen.

Why a separate set: kvkit's calibrations (DuoAttention patterns, the knob sweeps of ``kvkit calibrate``) are fitted
on needles (:mod:`kvkit.calibrate.needles`: "access code of the <word> vault" needles, keys from its own word
list, 7-digit numbers / UUID-shaped codes, haystacks from the *last third* of the Paul Graham essays), and RULER's
NIAH tasks use one fixed haystack (the essays from their first word). A score on either can flatter a calibrated
policy. Here, disjoint by construction:

* **haystack**: ``essay`` - text from the first 66% of the essays (calibration starts at 66%) at a random word
  offset per sample (RULER always starts at word 0); or ``squad`` - SQuAD paragraphs in a random order (no
  calibration reads them);
* **needle**: "The <key> ledger lists the <kind> <value>." with a pseudo-word key made of random syllables (never a
  word of the calibration list) and a value in one of :data:`FORMATS`: ``digits`` (a 7-digit number), ``uuid`` (a
  random UUID, 36 characters) or ``words`` (two wonderwords words, adjective-noun);
* **seed**: :data:`DEFAULT_SEED` (the calibrations draw from seeds 0-99 of their own generator; RULER uses 42);
  every sample's generator is ``crc32("needles/<seed>/<length>/<index>")``.

Sample ``i`` of a length takes format ``FORMATS[i % 3]`` (of those asked for) and depth ``depths[i % len(depths)]``
(percent of the haystack's characters; the needle goes to the nearest sentence boundary). The prompt is the model's
chat template over "context, then question", with the answer prefix "The <key> ledger lists the <kind>"; the
haystack is sized by bisection so that prompt + generation is within 2% below the target length. Scored with
RULER's ``string_match_all`` (the value must appear in the answer). The sample dicts are RULER's (``context_end``
splits context and question), so ``kvkit.evals.runner.run_samples`` runs them under either protocol.
"""

from __future__ import annotations

import random
import uuid
import zlib

from kvkit.evals.haystack import SENTENCE_END, essay_words, insert_at_depths, qa_data, word_lists
from kvkit.evals.niah import depth_grid
from kvkit.evals.runner import progress
from kvkit.workloads.prompts import build_prompt, count_tokens

FORMATS = ("digits", "uuid", "words")
HAYSTACKS = ("essay", "squad")
DEFAULT_SEED = 20261126
#: tokens generated per format (the answer plus slack)
GENERATE = {"digits": 12, "uuid": 40, "words": 12}
KIND = {"digits": "number", "uuid": "code", "words": "phrase"}
NEEDLE = "The {key} ledger lists the {kind} {value}."
QUESTION = "Which {kind} does the {key} ledger list? Answer with the {kind} only."
PREFIX = "The {key} ledger lists the {kind}"
INTRO = "Read the text below. Somewhere in it, a ledger lists a value; you will be asked for it.\n\n"
ESSAY_SPAN = 0.66  # haystacks come from the essays' words [0, 66%); calibration haystacks start at 66%
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ar", "en", "ol")]


def sample_seed(seed: int, length: int, index: int) -> int:
    return zlib.crc32(f"needles/{seed}/{length}/{index}".encode())


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable non-word of 3 syllables (e.g. ``"tovarke"``): 14 x 8 = 112 syllables, 1.4M words."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(3))


def value_for(rng: random.Random, fmt: str) -> str:
    if fmt == "digits":
        return str(rng.randint(10**6, 10**7 - 1))
    if fmt == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if fmt == "words":
        w = word_lists()
        return f"{rng.choice(w['adjective'])} {rng.choice(w['noun'])}"
    raise ValueError(f"unknown needle format {fmt!r}; use {', '.join(FORMATS)}")


def essay_span() -> int:
    """Words of the essays haystacks may use: ``[0, essay_span())`` (calibration haystacks start there)."""
    return int(len(essay_words()) * ESSAY_SPAN)


def _essay_units(rng: random.Random, words: int) -> tuple[list[str], int]:
    span = essay_span()
    if words > span:
        raise ValueError(f"needles: a haystack of {words} essay words is more than the {span} words kept apart from "
                         "calibration; use a shorter length or --haystack squad")
    start = rng.randrange(0, max(1, span - words))
    return SENTENCE_END.split(" ".join(essay_words()[start:start + words]).strip()), start


def _squad_units(rng: random.Random, words: int) -> list[str]:
    _, docs = qa_data("squad")
    order = list(range(len(docs)))
    rng.shuffle(order)
    out, left = [], words
    for i in order:
        if left <= 0:
            break
        ws = docs[i].split()
        out.append(" ".join(ws[:left]))
        left -= len(ws)
    return out


def build(seed: int, fmt: str, haystack: str, words: int, depth: float) -> tuple[str, str, str, str, dict]:
    """(user message, answer prefix, answer, context, meta) of one sample with ``words`` haystack words."""
    rng = random.Random(seed)
    key, value = pseudo_word(rng), value_for(rng, fmt)
    kind = KIND[fmt]
    hay_rng = random.Random(seed + 1)
    offset = None
    if haystack == "essay":
        (units, offset), sep = _essay_units(hay_rng, words), " "
    elif haystack == "squad":
        units, sep = _squad_units(hay_rng, words), "\n\n"
    else:
        raise ValueError(f"unknown haystack {haystack!r}; use {', '.join(HAYSTACKS)}")
    context = sep.join(insert_at_depths(units, [NEEDLE.format(key=key, kind=kind, value=value)], [depth]))
    user = INTRO + context + "\n\n" + QUESTION.format(key=key, kind=kind)
    meta = dict(key=key, format=fmt, haystack=haystack, words=words)
    if offset is not None:
        meta["essay_offset"] = offset  # first essay word of the haystack: offset + words <= essay_span()
    return user, PREFIX.format(key=key, kind=kind), value, context, meta


def generate_sample(tokenizer, length: int, index: int, *, seed: int = DEFAULT_SEED, formats=FORMATS,
                    haystack: str = "essay", depths: list[float] | None = None, chat: bool = True,
                    start_words: int | None = None) -> dict:
    """Sample ``index`` at ``length`` tokens (prompt + generation within 2% below it)."""
    formats = list(formats)
    fmt = formats[index % len(formats)]
    depths = depths or depth_grid(11)
    depth = depths[index % len(depths)]
    s_seed = sample_seed(seed, length, index)
    gen = GENERATE[fmt]

    def measure(words):
        user, prefix, value, context, meta = build(s_seed, fmt, haystack, words, depth)
        prompt = build_prompt(tokenizer, user, prefix, chat=chat)
        return (user, prefix, value, context, meta), prompt, count_tokens(tokenizer, prompt) + gen

    lo, hi = 16, max(64, (start_words or length))  # words: ~0.75 per token; hi starts above the fit
    while measure(hi)[2] <= length:
        lo, hi = hi, hi * 2
    if measure(lo)[2] > length:
        raise ValueError(f"needles: length {length} is too small for a prompt (the shortest is {measure(lo)[2]} "
                         "tokens with its answer)")
    while hi - lo > max(1, lo // 200):  # within ~0.5% of the largest fit
        mid = (lo + hi) // 2
        if measure(mid)[2] <= length:
            lo = mid
        else:
            hi = mid
    (user, prefix, value, context, meta), prompt, total = measure(lo)
    return dict(id=f"{length}/{index}", task=fmt, index=index, prompt=prompt, outputs=[value],
                context_end=prompt.rindex(context) + len(context), prompt_tokens=total - gen, length=total,
                target_length=length, tokens_to_generate=gen, metric="string_match_all", size=lo, seed=seed,
                depth=depth, meta=dict(meta, depth=depth))


def generate_samples(tokenizer, lengths: list[int], samples: int, *, seed: int = DEFAULT_SEED, formats=FORMATS,
                     haystack: str = "essay", depths: int = 11, chat: bool = True) -> list[dict]:
    """``samples`` samples per length (deterministic for a seed)."""
    if samples < 1:
        raise ValueError(f"--samples must be a positive number per length, got {samples}")
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown needle format(s) {bad or formats}; use a subset of {', '.join(FORMATS)}")
    dl = depth_grid(depths)
    out = []
    bar = progress(total=len(lengths) * samples, desc="fresh needles")
    for L in lengths:
        words = None
        for i in range(samples):
            s = generate_sample(tokenizer, L, i, seed=seed, formats=formats, haystack=haystack, depths=dl,
                                chat=chat, start_words=words and int(words * 1.2))
            words = s["size"]
            out.append(s)
            bar.update(1)
    bar.close()
    return out
