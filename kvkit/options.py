"""Command-line option parsing shared by every ``kvkit`` subcommand (``kvkit run``, ``kvkit eval``, ``kvkit bench``,
``kvkit speculate``): policy options from ``--policy-options`` JSON and ``--opt key=value`` pairs, and byte counts
for display. Imports no kvkit module, so CLIs at any layer use it without importing :mod:`kvkit.cli`."""

from __future__ import annotations

import json


def _split_pairs(item: str) -> list[str]:
    """``a=1,b=[2,3],c=x`` -> ``["a=1", "b=[2,3]", "c=x"]``: commas inside brackets belong to the value."""
    out, depth, cur = [], 0, []
    for ch in item:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


#: values of ``key=value`` pairs read as Python literals (JSON's own ``true``/``false``/``null`` parse as JSON)
_PY_LITERALS = {"True": True, "False": False, "None": None}


def parse_options(pairs: list[str] | None, json_opts: str | None = None) -> dict:
    """``--policy-options '{"budget": 512}'`` plus ``--opt budget=512,sink=4`` (repeatable). A value is read as
    JSON (``512``, ``0.5``, ``true``, ``[1,2]``), ``True``/``False``/``None`` as Python's, anything else as text."""
    out = {}
    if json_opts:
        try:
            loaded = json.loads(json_opts)
        except json.JSONDecodeError as e:
            raise ValueError(f"--policy-options is not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(loaded, dict):
            raise ValueError("--policy-options must be a JSON object")
        out.update(loaded)
    for item in pairs or []:
        for pair in _split_pairs(item):
            if not pair.strip():
                continue
            if "=" not in pair:
                raise ValueError(f"--opt {pair!r} must look like key=value")
            k, v = pair.split("=", 1)
            if v.strip() in _PY_LITERALS:  # Python's spelling of true / false / null
                out[k.strip()] = _PY_LITERALS[v.strip()]
                continue
            try:
                out[k.strip()] = json.loads(v)
            except json.JSONDecodeError:
                out[k.strip()] = v
    return out


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
