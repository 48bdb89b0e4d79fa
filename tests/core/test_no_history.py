"""The product speaks of the product: no tracked file and no tracked path refers to the project's development
history (numbered working sessions, issue numbers, defect numbers). A result is named by what it measures (with its
date, commit and machine), a test by the behaviour it protects; the history lives in git.

Data files are left out by path, each pattern with its reason: their text is model input or model output, not
something the project wrote about itself.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: "session 24", "Sessions 27-31", "issue #36", "defect 11", "issue19_table", "session-28", "defects 7 and 8"
HISTORY = re.compile(r"(?<![a-z])(sessions?|issues?|defects?)[ _-]?#?\d+", re.IGNORECASE)

#: data, not prose: (glob over the repository-relative path, why it is not checked)
DATA = [
    ("*/samples.jsonl", "one row per evaluated sample: the prompt's text and the model's answer"),
    ("*/prompts.jsonl", "evaluation prompts (haystack text)"),
    ("results/*/prompts/*.jsonl", "committed evaluation prompts (haystack text)"),
    ("results/*ruler-*.jsonl", "committed RULER prompts (haystack text)"),
    ("tests/evals/fixtures/*", "LongBench rows in the official format (third-party text)"),
    ("tests/core/test_no_history.py", "this test: its own examples of what the pattern must find"),
]

#: binary files, checked by path only
BINARY = (".png", ".gguf", ".safetensors")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return [p for p in out.stdout.decode().split("\0") if p]


def _is_data(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern, _ in DATA)


def test_no_tracked_path_is_named_after_the_development_history():
    bad = [p for p in _tracked() if HISTORY.search(p)]
    assert not bad, "paths named after the development history (name them by what they hold):\n" + "\n".join(bad)


def test_no_tracked_text_refers_to_the_development_history():
    bad = []
    for path in _tracked():
        if _is_data(path) or path.endswith(BINARY):
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                bad.append(f"{path}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not bad, (f"{len(bad)} lines refer to the development history (say what the code guarantees or what a "
                     "result measures instead; history goes in commit messages):\n" + "\n".join(bad[:60]))


def test_the_data_exclusions_match_tracked_files():
    """Every data pattern still names a tracked file (a stale exclusion would hide nothing, or hide prose later)."""
    tracked = _tracked()
    stale = [pattern for pattern, _ in DATA if not any(fnmatch.fnmatch(p, pattern) for p in tracked)]
    assert not stale, f"data patterns that match no tracked file (remove them): {stale}"


@pytest.mark.parametrize("line", ["see Session 24", "Sessions 27-31", "issue #36", "issue19_table.py", "session-28",
                                  "defects 7 and 8", "the DEFECT 11 case"])
def test_the_pattern_finds_history_words(line):
    assert HISTORY.search(line)


@pytest.mark.parametrize("line", ["a session of decoding", "known issues", "the defect rate", "issue a warning",
                                  "tissue16", "sessions are stateless"])
def test_the_pattern_leaves_ordinary_words(line):
    assert not HISTORY.search(line)
