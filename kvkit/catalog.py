"""The policy catalog: a torch-free description of the registered policies, for ``kvkit policies [NAME]`` and for
checking a policy setting without importing the policies (which import torch).

``kvkit/data/policies.json`` holds, per policy in registry order: ``name``, ``paper`` (arXiv id), ``summary`` (the
class's one-line description), ``saves`` (memory / reads), ``calibrated`` (the options ``kvkit calibrate NAME`` sets
per model) and ``options``: ``name``, ``default``, ``meaning`` and ``why`` (the reason for the default). The file is
generated from the live registry, never edited by hand::

    python -m kvkit.catalog --write      # regenerate kvkit/data/policies.json
    python -m kvkit.catalog --check      # exit 1 when it is out of date (tests/core/test_cli_grammar.py checks it)

Where an option's text comes from (:func:`option_docs`): ``kvkit.registry.describe(name)`` when the registry offers
it (a dict ``{option: {"meaning": ..., "why": ...}}`` or ``{"options": {...}}``), else the class docstring's numpydoc
``Parameters`` section (meaning) and the comment after the field's default in the class body (why).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PATH = Path(__file__).parent / "data" / "policies.json"
FORMAT = 1


def load(path: Path = PATH) -> list[dict]:
    """The catalog's entries (standard library only). ValueError when the file is missing or unreadable (regenerate
    it with ``python -m kvkit.catalog --write``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"the policy catalog {path} cannot be read ({e}); regenerate it with "
                         "`python -m kvkit.catalog --write`") from None
    return data["policies"]


def entry(name: str, entries: list[dict] | None = None) -> dict:
    """The catalog entry of policy ``name`` (ValueError naming the known policies otherwise)."""
    entries = load() if entries is None else entries
    for e in entries:
        if e["name"] == name:
            return e
    raise ValueError(f"unknown kvkit policy {name!r}; known policies: {', '.join(e['name'] for e in entries)}")


def describe_text(e: dict) -> str:
    """``kvkit policies NAME``: the policy's summary, paper, what it saves, then each option with its default, meaning
    and why."""
    lines = [f"{e['name']}: {e['summary']}"]
    if e.get("paper"):
        lines.append(f"paper: {e['paper']}")
    lines.append(f"saves: {e['saves']}")
    if e.get("calibrated"):
        lines.append(f"calibrated per model by `kvkit calibrate {e['name']}`: {', '.join(e['calibrated'])}")
    if not e["options"]:
        lines.append("options: none")
    else:
        lines.append(f"options (--policy {e['name']}:KEY=VALUE,...):")
        width = max(len(o["name"]) for o in e["options"])
        for o in e["options"]:
            lines.append(f"  {o['name']:<{width}}  default {json.dumps(o['default'])}")
            if o.get("meaning"):
                lines.extend(f"  {'':<{width}}  {t}" for t in _wrap(o["meaning"], 100 - width))
            if o.get("why"):
                lines.extend(f"  {'':<{width}}  {t}" for t in _wrap("why: " + o["why"], 100 - width))
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, max(40, width)) or [""]


# ------------------------------------------------------------------------------------------------- generation
def option_docs(name: str) -> dict[str, dict]:
    """``{option: {"meaning": ..., "why": ...}}`` of policy ``name``, from :func:`kvkit.registry.describe` (the class
    docstring's Parameters entry and the comment on the field's line)."""
    from kvkit import registry

    return {d["name"]: {"meaning": d.get("meaning", ""), "why": d.get("why", "")} for d in registry.describe(name)}


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v)


def build() -> dict:
    """The catalog of the live registry (imports the policies)."""
    from kvkit.registry import available_policies, policy_class, policy_options

    out = []
    for name in available_policies():
        cls = policy_class(name)
        docs = option_docs(name)
        paper = re.search(r"\((\d{4}\.\d{4,5})\)", cls.description or "")
        out.append(dict(
            name=name, paper=f"arXiv:{paper.group(1)}" if paper else None,
            summary=re.sub(r"\s*\(\d{4}\.\d{4,5}\)\s*$", "", cls.description or "").strip(),
            saves=cls.saves, calibrated=list(getattr(cls, "calibrated_options", ()) or ()),
            options=[dict(name=k, default=_jsonable(v), meaning=docs.get(k, {}).get("meaning", ""),
                          why=docs.get(k, {}).get("why", "")) for k, v in policy_options(name).items()]))
    return {"format": FORMAT, "generated_by": "python -m kvkit.catalog --write", "policies": out}


def text(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        PATH.write_text(text(build()), encoding="utf-8")
        print(f"wrote {PATH}")
        return 0
    if argv == ["--check"]:
        current = PATH.read_text(encoding="utf-8") if PATH.exists() else ""
        if current != text(build()):
            print(f"{PATH} is out of date: run `python -m kvkit.catalog --write`", file=sys.stderr)
            return 1
        print(f"{PATH} is up to date")
        return 0
    print("usage: python -m kvkit.catalog --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
