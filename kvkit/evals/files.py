"""The evals' result files: written atomically, read back line by line with errors that name the line.

Every write goes to a temporary file in the target's folder, then ``os.replace`` (a reader, or a run killed mid-write,
sees the old file or the new one, never half of one); files are made 0644. :func:`read_jsonl` reads a jsonl file into
dicts, a bad line (not JSON, not an object, missing fields, refused by ``check``) refused with the file and the line
number; :func:`read_rows` reads a run's ``samples.jsonl`` keeping one row per sample id.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path, rows) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def atomic_write_bytes(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_jsonl(path, required: tuple[str, ...] = (), check=None) -> list[dict]:
    """Read a jsonl file; a bad line raises ValueError naming the file and the line number.

    ``check(row)``, when given, is called on every row as it is read; a ValueError it raises is re-raised with
    the file and the line number in front (so a bad row is refused before anything runs on the rows)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}, line {lineno}: missing field(s) {', '.join(missing)}")
            if check is not None:
                try:
                    check(row)
                except ValueError as e:
                    raise ValueError(f"{path}, line {lineno}: {e}") from None
            rows.append(row)
    return rows


def read_rows(path, required: tuple[str, ...] = ("id",)) -> list[dict]:
    """The rows of a run's ``samples.jsonl``, one per sample id: a repeated id (two writers, a hand-merged
    file) is kept once, the last row winning, with a warning naming the ids, so no sample counts twice."""
    rows = read_jsonl(path, required=tuple(dict.fromkeys(("id", *required))))
    by_id: dict = {}
    for r in rows:
        by_id[r["id"]] = r
    if len(by_id) != len(rows):
        seen: set = set()
        dup = list(dict.fromkeys(r["id"] for r in rows if r["id"] in seen or seen.add(r["id"])))
        shown = ", ".join(map(str, dup[:5])) + (f" and {len(dup) - 5} more" if len(dup) > 5 else "")
        warnings.warn(f"{path}: {len(rows) - len(by_id)} repeated row(s) for sample id(s) {shown}; "
                      f"keeping the last row of each", UserWarning, stacklevel=2)
    return list(by_id.values())
