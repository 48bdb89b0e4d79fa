"""Write ``tests/slow.txt``: the tests that take longer than a threshold, read from a JUnit XML report of a full run.

    .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml=/tmp/full.xml      # the whole suite, ~30 min
    .venv/bin/python scripts/slow_tests.py /tmp/full.xml [--threshold 0.8]            # -> tests/slow.txt

``tests/conftest.py`` marks every test listed there ``slow``, next to the tests marked in their files (the bundled
real model), so ``pytest -m "not slow"`` is the fast loop. A test's time is its setup + call + teardown (a module
fixture's cost falls on the module's first test). The list only selects: CI runs every test.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def node_id(classname: str, name: str) -> str:
    """``tests.core.test_x`` + ``test_y[a]`` -> ``tests/core/test_x.py::test_y[a]`` (test classes: ``...::Class::``)."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = Path(*parts[:i]).with_suffix(".py")
        if (ROOT / path).is_file():
            return "::".join([path.as_posix(), *parts[i:], name])
    raise SystemExit(f"slow_tests: no test file for {classname!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="JUnit XML of a full pytest run (--junitxml)")
    ap.add_argument("--threshold", type=float, default=0.8, help="seconds (default 0.8)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "slow.txt"))
    args = ap.parse_args(argv)
    slow = sorted(node_id(tc.get("classname"), tc.get("name")) for tc in ET.parse(args.report).getroot().iter("testcase")
                  if float(tc.get("time") or 0) > args.threshold and tc.find("skipped") is None)
    head = (f"# tests over {args.threshold:g} s in a full run on 2 CPU cores: marked slow by tests/conftest.py "
            "(pytest -m 'not slow' skips them); regenerate with scripts/slow_tests.py\n")
    Path(args.out).write_text(head + "".join(s + "\n" for s in slow))
    print(f"{len(slow)} slow tests -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
