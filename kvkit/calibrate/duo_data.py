"""DuoAttention calibration's training data: the reference's multi-passkey retrieval samples (:class:`PasskeyData`):
passkeys of random NATO-alphabet words at sorted depths of Paul Graham essays, followed by the
questions for them and their answers.

The haystack is :func:`kvkit.calibrate.haystack.calibration_text`, the essay text no evaluation reads. ``task``
picks the needles (:class:`DuoCalibration`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkit.calibrate.haystack import calibration_text
from kvkit.calibrate.needles import WORDS, make_samples

NATO = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
ORDINALS = "first second third fourth fifth sixth seventh eighth ninth tenth".split()
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
#: ``task="keyed"``: each passkey is named by a key word, and the questions come in another order than the needles
KEYED_NEEDLE = "Remember this sequence of words, it's the passkey to the {key} vault: "
KEYED_QUESTION = "Based on the content of the book, what is the passkey to the {key} vault?\nPasskey: "
TASKS = ("passkey", "keyed", "needles")
PROMPT_START = "This is a very long story book: <book> "
PROMPT_END = " </book>.\n\n"
SEPARATOR = "\n\n"


class PasskeyData:
    """The reference's multi-passkey retrieval samples, tokenised with the model's tokenizer."""

    def __init__(self, tokenizer, cfg: DuoCalibration, haystack_chars: int = 400_000):
        self.tok, self.cfg = tokenizer, cfg
        self.hay = self._enc(calibration_text()[:haystack_chars])
        self.sep = self._enc(SEPARATOR)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.start = bos + self._enc(PROMPT_START)
        self.end = self._enc(PROMPT_END)
        self.needles = [self._enc(NEEDLE.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        self.questions = [self._enc(QUESTION.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        if cfg.task == "keyed":
            # kvkit's key words (the fresh-needle evaluation never uses them); a key is never a passkey word
            self.key_words = [w for w in WORDS if w not in NATO]
        lo = cfg.min_length if cfg.min_length is not None else 3 * cfg.length // 4
        self.lengths = [round(lo + (cfg.length - lo) * i / max(1, cfg.steps - 1)) for i in range(cfg.steps)]
        self.depths = torch.linspace(0.05, 0.95, 20)

    def _enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i``: ``(input_ids [1, n], labels mask [1, n] bool)``, deterministic in (seed, i)."""
        cfg = self.cfg
        if cfg.task == "needles":
            return self._needle_sample(i)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
        keys = []
        for _ in range(cfg.num_passkeys):
            words = torch.randint(0, len(NATO), (cfg.passkey_words,), generator=g).tolist()
            keys.append(self._enc(" ".join(NATO[w] for w in words)))
        needles, questions, order = self.needles, self.questions, range(cfg.num_passkeys)
        if cfg.task == "keyed":  # named passkeys, asked for in a random order: retrieval by the key, not by position
            names = [self.key_words[j] for j in torch.randperm(len(self.key_words), generator=g)[: cfg.num_passkeys]]
            needles = [self._enc(KEYED_NEEDLE.format(key=w)) for w in names]
            questions = [self._enc(KEYED_QUESTION.format(key=w)) for w in names]
            order = torch.randperm(cfg.num_passkeys, generator=g).tolist()
        qa = []
        for j in order:
            qa += questions[j] + keys[j] + self.sep
        needle_len = sum(len(self.sep) * 2 + len(n) + len(k) for n, k in zip(needles, keys))
        fixed = len(self.start) + len(self.end) + needle_len + len(qa)
        n_hay = self.lengths[i % len(self.lengths)] - fixed
        if n_hay < 16:
            raise ValueError(
                f"duo calibration: {self.lengths[i % len(self.lengths)]} tokens leave only {n_hay} tokens of "
                f"haystack around {cfg.num_passkeys} passkeys of {cfg.passkey_words} words; raise --length or "
                "lower --passkeys/--passkey-words"
            )
        off = int(torch.randint(0, max(1, len(self.hay) - n_hay), (1,), generator=g))
        hay = self.hay[off : off + n_hay]
        depths = self.depths[torch.randperm(len(self.depths), generator=g)[: cfg.num_passkeys]].sort().values
        ctx, last = [], 0
        for d, n, k in zip(depths.tolist(), needles, keys):
            cut = int(len(hay) * d)
            ctx += hay[last:cut] + self.sep + n + k + self.sep
            last = cut
        ctx += hay[last:]
        prefix = self.start + ctx + self.end
        ids = torch.tensor([prefix + qa])
        labels = torch.zeros_like(ids, dtype=torch.bool)
        labels[0, len(prefix) :] = True
        return ids, labels

    def _needle_sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``task="needles"``: sample ``i`` of :func:`kvkit.calibrate.needles.make_samples` (the knob calibrations'
        needles, in the model's chat template; kinds cycle over 1 needle / 3 needles x number / code), followed by
        its answer; labels: the question, the answer prefix and the answer."""
        n = self.lengths[i % len(self.lengths)]
        s = make_samples(self.tok, i % 4 + 1, n, seed=self.cfg.seed * 1_000_003 + i)[-1]
        ctx = self._enc(s.prompt[: s.context_end])
        rest = self._enc(s.prompt[s.context_end:] + " " + s.answer)
        ids = torch.tensor([ctx + rest])
        labels = torch.zeros_like(ids, dtype=torch.bool)
        labels[0, len(ctx):] = True
        return ids, labels


@dataclass
class DuoCalibration:
    """Calibration settings (paper values in the comments; defaults sized for a 2-core CPU).

    Parameters
    ----------
    steps : int
        Optimiser steps (paper: 2000 on 8 GPUs; CPU default 60). Per-step times of the shipped calibration on
        a CPU: results/calibration/README.md.
    length : int
        Longest sample in tokens (paper: contexts up to the model's limit, 32K). Sample lengths are
        spread linearly from ``min_length`` to ``length``.
    min_length : int or None
        Shortest sample (paper: 1000 context tokens); None: ``3 * length // 4``.
    sink, recent : int
        Streaming window used in training (paper: 128 / 256). The CPU default keeps the paper's
        recent 256 but a 64-token sink, so a 1-2K sample still has most of its context outside the window.
    num_passkeys, passkey_words : int
        Passkeys per sample and NATO words per passkey (paper: 10 and 32; the CPU default uses 5 and 8
        so the haystack is not crowded out at 1K tokens: 10 x 32-word passkeys alone take ~1.7K tokens).
    lr, reg : float
        AdamW learning rate (paper 0.02) and weight of mean|alpha| (paper 0.05).
    task : str
        ``"passkey"`` (the reference's data: the k-th passkey, asked for in order) or ``"keyed"`` (each passkey named
        by a key word of :data:`kvkit.calibrate.needles.WORDS`, "the passkey to the <key> vault", asked for in a
        random order, so answering means matching the question's key to the context's: the retrieval a key-value
        needle asks for, which the ordinal questions never exercise) or ``"needles"`` (the knob calibrations' needles
        of :mod:`kvkit.calibrate.needles` in the model's chat template, one or three per sample, numbers or
        UUID-shaped codes; ``num_passkeys`` and ``passkey_words`` unused).
    """

    steps: int = 60  # paper: 2000
    length: int = 1024  # paper: up to 32000
    min_length: int | None = None  # paper: 1000 (+ needles); None = 3 * length // 4
    sink: int = 64  # paper training window: 128
    recent: int = 256  # paper: 256
    num_passkeys: int = 5  # paper: 10
    passkey_words: int = 8  # paper: 32
    lr: float = 0.02  # paper
    reg: float = 0.05  # paper
    seed: int = 0
    task: str = "passkey"  # paper

    def check(self) -> None:
        for name in ("steps", "length", "recent", "num_passkeys", "passkey_words"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"duo calibration: {name} must be a positive integer, got {v!r}")
        if not 0 <= self.sink or not isinstance(self.sink, int):
            raise ValueError(f"duo calibration: sink must be an integer >= 0, got {self.sink!r}")
        if self.task not in TASKS:
            raise ValueError(f"duo calibration: task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.num_passkeys > len(ORDINALS):
            raise ValueError(f"duo calibration: at most {len(ORDINALS)} passkeys, got {self.num_passkeys}")
        lo = self.min_length if self.min_length is not None else 3 * self.length // 4
        if lo <= 0 or lo > self.length:
            raise ValueError(f"duo calibration: min_length must be in [1, length={self.length}], got {lo}")
