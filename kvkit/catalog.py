"""The policy catalog: a torch-free description of the registered policies, for ``kvkit policies [NAME]`` and for
checking a policy setting without importing the policies (which import torch).

``kvkit/data/policies.json`` holds, per policy in registry order: ``name``, ``paper`` (arXiv id), ``summary`` (the
class's one-line description), ``saves`` (memory / reads), ``calibrated`` (the options ``kvkit calibrate NAME`` sets
per model), ``ratio_knobs`` (the native knobs ``compression_ratio`` sets), ``paper_preset`` (what ``preset="paper"``
fills in) and ``options``: ``name``, ``default``, ``meaning`` and ``why`` (the reason for the default). The file is
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
    """``kvkit policies NAME``: the policy's summary, paper, what it saves, the knobs ``compression_ratio`` and
    ``preset="paper"`` set, then each option with its default, meaning and why."""
    lines = [f"{e['name']}: {e['summary']}"]
    if e.get("paper"):
        lines.append(f"paper: {e['paper']}")
    lines.append(f"saves: {e['saves']}")
    if e.get("calibrated"):
        lines.append(f"calibrated per model by `kvkit calibrate {e['name']}`: {', '.join(e['calibrated'])}")
    if e.get("ratio_knobs"):
        lines.append(f"compression_ratio sets: {', '.join(e['ratio_knobs'])} (give one or the other)")
    if e.get("paper_preset"):
        pairs = ", ".join(f"{k}={json.dumps(v)}" for k, v in e["paper_preset"].items())
        lines.append(f'preset="paper" sets: {pairs} (the options left at their defaults)')
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


#: ``preset`` values (:data:`kvkit.policies.knobs.PRESETS`; a test keeps the two equal)
PRESETS = ("kvkit", "paper")


def check_options(name: str, options: dict, entries: list[dict] | None = None) -> None:
    """The checks of a policy setting the catalog can make without importing torch, with the messages the policy's
    own construction gives (``kvkit.evals.settings.resolve_policy_options`` and ``Policy.__post_init__``): an unknown
    option, ``preset``, ``compression_ratio`` outside (0, 1) or on a policy with no knob for it, and a native knob
    given beside ``compression_ratio``. ValueError; a policy the catalog does not list (a plugin's, a peer such as
    ``quantized``) passes, for the registry to decide. The checks that need the policy's code (its value ranges,
    files) stay with the construction, which every command runs before its model loads."""
    try:
        e = entry(name, entries)
    except ValueError:
        return
    defaults = {o["name"]: o["default"] for o in e["options"]}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "(none)"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for policy {name!r}; valid options: {listed}")
    if "preset" not in defaults:
        return
    preset, r = options.get("preset", defaults["preset"]), options.get("compression_ratio")
    if preset not in PRESETS:
        raise ValueError(f"{name}: preset must be one of {', '.join(PRESETS)} ('kvkit': kvkit's defaults, 'paper': "
                         f"the paper's own settings), got {preset!r}")
    if r is None:
        return
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
        raise ValueError(f"{name}: compression_ratio must be a fraction in (0, 1) (the share of full's KV reads a "
                         f"decode step saves; 0.5 = half), got {r!r}")
    knobs = e.get("ratio_knobs") or []
    if not knobs:
        raise ValueError(f"{name} compresses nothing: compression_ratio does not apply (use another policy)")
    paper = (e.get("paper_preset") or {}) if preset == "paper" else {}

    def value(k):  # the knob as the built policy holds it: preset="paper" fills the ones left at their defaults
        v = options.get(k, defaults.get(k))
        return paper.get(k, v) if v == defaults.get(k) else v

    given = [k for k in knobs if value(k) != paper.get(k, defaults.get(k))]
    if given:
        raise ValueError(f"{name}: compression_ratio={r} sets {', '.join(knobs)} itself; give compression_ratio or "
                         f"{' / '.join(given)}={value(given[0])!r}, not both")


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
            ratio_knobs=list(cls.ratio_knobs), paper_preset={k: _jsonable(v) for k, v in cls.paper.items()},
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
