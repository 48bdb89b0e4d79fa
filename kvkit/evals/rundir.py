"""An eval's run folder (``--out``): its config, its rows written after every sample, ``--resume``, and the lock
that keeps a second writer out.

:class:`RunDir` writes ``config.json`` first, then appends each finished sample's row to ``samples.jsonl`` (one
line, flushed and synced, under the folder's lock; rows another process appended meanwhile are read from where this
one last looked and merged in), so the work per sample does not grow with the rows already written; a line cut
short by a crash is dropped on ``--resume`` and ``--resume`` skips finished samples. A sample id is counted once
(the last row of an id wins: :func:`kvkit.evals.files.read_rows`). On ``--resume`` every row-changing setting of the config must equal the
folder's (:func:`config_diff`: all keys but where it ran, which subset of the samples, the command line and the
kvkit version), and a finished row whose sample content changed (:func:`sample_digest`: prompt, split, generation
length, references, metric) is refused.

Provenance: every row carries the ``commit`` that wrote it. A resumed folder keeps the ``command`` and
``kvkit_version`` of the run that made it in ``config.json``; a resume that adds rows appends its own (``resumed``:
command, commit, kvkit version), and one that adds none leaves them as they were. :meth:`RunDir.provenance` gives a
summary the commit of its rows, so a summary rewritten by a resume still names the commit that made its samples.
:class:`RunLock`: a ``flock`` on ``<folder>/.lock`` for the whole run,
shared by writers of the same settings that pass ``--resume``, refused (naming the holder's process) otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvkit.cli_grammar import check_out_folder
from kvkit.evals.files import atomic_write_json, atomic_write_jsonl, read_rows
from kvkit.evals.report import commit as current_commit

#: config keys that do not change a row: where it ran (device), which subset of the samples this process runs
#: (samples, tasks), the command line and the kvkit version. Every other key (model, dtype, seed, policy, options,
#: option_files, calibration, length, chat, max_new_tokens, ...) changes the rows and is checked on ``--resume``.
#: (dtype is not free: rows of float32 and bfloat16 must not mix under one summary.)
_FREE_KEYS = {"device", "samples", "command", "tasks", "kvkit_version", "resume"}
#: keys an older run folder may lack: a folder without one still resumes (nothing to compare it with)
_RECORDED_LATER = {"calibration", "option_files"}
#: config keys that say who made a folder's rows: a resume keeps the folder's (and records its own under
#: ``resumed`` once it adds a row)
_MAKER_KEYS = ("command", "kvkit_version", "resumed")


def config_diff(old: dict, new: dict) -> dict:
    """``{key: (old value, new value)}`` of the row-changing settings in which ``new`` differs from ``old``
    (``new`` is compared as it reads back from JSON: a tuple equals the list it is written as)."""
    new = json.loads(json.dumps(new))
    return {k: (old.get(k), v) for k, v in new.items()
            if k not in _FREE_KEYS and old.get(k) != v and not (k in _RECORDED_LATER and k not in old)}


def diff_text(diff: dict, theirs: str = "the folder has", ours: str = "this run asks for") -> str:
    return "; ".join(f"{k}: {theirs} {a!r}, {ours} {b!r}" for k, (a, b) in diff.items())


def sample_digest(sample: dict) -> str:
    """The identity of a sample's content: what the model is given and how it is scored (the prompt text, the
    context/question split, the generation length, the references and the metric). Two rows with the same
    ``id`` but another digest come from other prompts (another seed, tokenizer, chat template, data or prompts
    file, ``--max-new-tokens``): ``--resume`` and ``compare --matched`` never take one for the other."""
    key = {k: sample.get(k) for k in ("prompt", "context_end", "tokens_to_generate", "outputs", "all_classes", "metric")}
    return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


LOCK_NAME = ".lock"


class RunLock:
    """A writer's hold on an eval folder for its whole run: a ``flock`` on ``<folder>/.lock``.

    A second writer is refused with the folder and the holder's process id (otherwise two runs of other
    settings into one ``--out`` would both exit 0, one run's rows and summary lost). The kernel drops the lock
    when its process ends, however it ends, so the file a killed run leaves behind blocks nothing. Runs of the
    *same* settings may share a folder when the later ones pass ``--resume`` (one job split over processes by
    ``--tasks``; their rows are merged by :meth:`RunDir.add`): the holders then hold the lock shared. Every
    take and release happens under the folder's own flock (:class:`_folder_lock`), so no one sees the lock
    file half-written or half-removed. The last holder to leave removes the file. No-op where ``fcntl`` is
    missing."""

    def __init__(self, folder, config: dict, join: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd = None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with _folder_lock(self.folder):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fresh = True
                except BlockingIOError:
                    fresh = False
                if fresh:
                    info = {"pids": [os.getpid()], "host": socket.gethostname(), "config": config}
                else:
                    info = _read_lock(fd)
                    diff = config_diff(info.get("config") or {}, config) if "config" in info else None
                    if not join or diff is None or diff:
                        raise ValueError(_held_message(self.folder, info, diff, join))
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the holders hold it shared: this succeeds
                    info["pids"] = [*info.get("pids", []), os.getpid()]
                _write_lock(fd, info)
                if fresh:  # shared from now on, so a --resume of the same settings can join; nobody can take
                    fcntl.flock(fd, fcntl.LOCK_SH)  # it between (every taker waits on the folder lock we hold)
            except BaseException:
                os.close(fd)
                raise
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        import fcntl

        try:
            with _folder_lock(self.folder):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # others still write here: leave the file, take our pid off it
                    info = _read_lock(fd)
                    pids = list(info.get("pids", []))
                    if os.getpid() in pids:
                        pids.remove(os.getpid())
                    _write_lock(fd, dict(info, pids=pids))
                else:  # the last holder: remove the file (if it is still ours)
                    try:
                        if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                            os.unlink(self.path)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(fd)


def _read_lock(fd) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
        info = json.loads(data.decode("utf-8")) if data.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_lock(fd, info: dict) -> None:
    data = (json.dumps(info, ensure_ascii=False) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)


def _held_message(folder: Path, info: dict, diff: dict | None, join: bool) -> str:
    pids = info.get("pids") or []
    who = (f"process {', '.join(map(str, pids))}" + (f" on {info['host']}" if info.get("host") and
                                                     info["host"] != socket.gethostname() else "")
           if pids else "another process")
    msg = f"{folder} is being written by another kvkit eval run ({who}; lock file {folder / LOCK_NAME})"
    if diff:
        msg += f" with other settings ({diff_text(diff, 'it runs', 'this run asks for')})"
    if diff or diff is None or join:
        return msg + "; wait for it to finish or choose another --out"
    return (msg + "; wait for it to finish or choose another --out (a run of the same settings may share the folder, "
            "e.g. one job split by --tasks over several processes: pass --resume)")


@dataclass
class RunDir:
    """An ``--out`` folder: ``config.json`` first, then one line appended to ``samples.jsonl`` per finished sample
    (:meth:`add`), so a crash loses at most the sample under way and ``--resume`` skips finished samples.

    The folder is locked (:class:`RunLock`) from here until :meth:`close` (``with RunDir(...) as run:``), so a
    second run cannot write into it meanwhile; on ``--resume`` every row-changing setting of ``config`` must
    equal the folder's (:func:`config_diff`), and :meth:`check_samples` refuses finished rows made from other
    prompts."""

    path: Path
    config: dict
    resume: bool = False
    rows: list = field(default_factory=list)

    def __post_init__(self):
        self.path = Path(self.path)
        check_out_folder(self.path)
        self._lock = None
        self._pos = 0  # bytes of samples.jsonl this run has read or written
        self._unstamped_commit = None  # rows written before rows named their commit: their folder summary's
        self._maker = None  # this run's own command / commit / version, recorded under "resumed" at its first row
        self._lock = RunLock(self.path, self.config, join=self.resume)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        cfg_path = self.path / "config.json"
        samples = self.path / "samples.jsonl"
        if self.resume and cfg_path.exists():
            old = json.loads(cfg_path.read_text())
            diff = config_diff(old, self.config)
            if diff:
                raise ValueError(f"--resume: {self.path} was made with a different configuration ({diff_text(diff)}); "
                                 f"resume it with the folder's settings or choose another --out")
            if samples.exists():
                _drop_cut_line(samples)
                self.rows = read_rows(samples)
                if sum(1 for line in samples.open(encoding="utf-8") if line.strip()) != len(self.rows):
                    atomic_write_jsonl(samples, self.rows)  # a repeated id kept once on disk too (once per resume)
                self._pos = samples.stat().st_size
            if self.rows:  # the rows are another run's: config.json keeps its maker, this one is added if it writes
                self._maker = {k: self.config.get(k) for k in ("command", "kvkit_version")}
                self.config = {**self.config, **{k: old[k] for k in _MAKER_KEYS if k in old}}
                summary = self.path / "summary.json"
                if summary.is_file():
                    try:
                        self._unstamped_commit = json.loads(summary.read_text(encoding="utf-8")).get("commit")
                    except (ValueError, AttributeError):
                        pass
        elif not self.resume and samples.exists():
            raise ValueError(f"{self.path} already holds results; pass --resume to continue it or choose another --out")
        atomic_write_json(cfg_path, self.config)

    def close(self) -> None:
        """Release the folder (idempotent)."""
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def done(self) -> set:
        return {r["id"] for r in self.rows}

    def check_samples(self, samples: list[dict]) -> None:
        """Refuse (ValueError) when a finished row has the id of one of ``samples`` but was made from another
        sample (:func:`sample_digest`): the prompts file, data, tokenizer, seed or generation length changed since."""
        digest = {s["id"]: sample_digest(s) for s in samples}
        bad = [r["id"] for r in self.rows if r["id"] in digest and "sample_sha" in r and r["sample_sha"] != digest[r["id"]]]
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(f"--resume: {self.path}: {len(bad)} finished row(s) ({shown}) were made from other prompts "
                             f"than this run's samples of the same id (another prompts or data file, tokenizer, chat "
                             f"template, seed or --max-new-tokens); resume with the folder's inputs or choose another --out")

    def add(self, row: dict) -> None:
        """Append ``row`` to ``samples.jsonl`` (one line, flushed and synced). Rows another process appended to the
        same folder since this one last looked (e.g. a second ``kvkit eval sweep --resume --tasks ...`` splitting
        the work) are read from there and merged into :attr:`rows`, under the folder's lock; a row of an id already
        held replaces it (in :attr:`rows`, and for readers of the file, the last row of an id wins)."""
        samples = self.path / "samples.jsonl"
        if "commit" not in row:
            row = {**row, "commit": current_commit()}
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        with _folder_lock(self.path):
            if self._maker is not None:  # a resume's first row: config.json names this run beside the folder's maker
                maker, self._maker = self._maker, None
                entry = dict(command=maker["command"], commit=current_commit(), kvkit_version=maker["kvkit_version"])
                # read back under the lock: another resume sharing the folder may have added its own entry
                on_disk = json.loads((self.path / "config.json").read_text(encoding="utf-8")).get("resumed", [])
                self.config = {**self.config, "resumed": [*on_disk, entry]}
                atomic_write_json(self.path / "config.json", self.config)
            theirs = self._read_new(samples)
            with open(samples, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
                self._pos = f.tell()
        held = self.done()
        for r in (*theirs, row):
            if r["id"] in held:  # (rare: the same sample run twice) the last row of an id wins
                self.rows = [x for x in self.rows if x["id"] != r["id"]]
            held.add(r["id"])
            self.rows.append(r)

    def provenance(self, rows: list[dict] | None = None) -> dict:
        """What a summary of ``rows`` (default: every row held) names as their maker: ``commit``, the commit that
        wrote the last of them (the current one when there are none), and ``row_commits``, how many of them each
        commit wrote (rows from before rows were stamped count under the commit their folder's summary.json named,
        ``"unknown"`` when it named none)."""
        ids = None if rows is None else {r["id"] for r in rows}
        held = [r for r in self.rows if ids is None or r["id"] in ids]  # in the order they were written
        counts: dict = {}
        for r in held:
            c = r.get("commit", self._unstamped_commit)
            counts[c or "unknown"] = counts.get(c or "unknown", 0) + 1
        last = held[-1].get("commit", self._unstamped_commit) if held else current_commit()
        return {"commit": last, "row_commits": counts}

    def _read_new(self, samples: Path) -> list[dict]:
        """The whole rows other writers appended to ``samples`` after byte :attr:`_pos` (all rows again when the
        file shrank: it was replaced)."""
        if not samples.exists():
            return []
        size = samples.stat().st_size
        if size == self._pos:
            return []
        if size < self._pos:
            self._pos = 0
            self.rows = []
        with open(samples, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is left for later
        out = [json.loads(x) for x in data[:end].decode("utf-8").splitlines() if x.strip()]
        self._pos += end
        return out


def _drop_cut_line(samples: Path) -> None:
    """Remove a last line a crash left without its newline (an appended row cut short), with a warning."""
    with open(samples, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
    import warnings

    warnings.warn(f"{samples}: dropped an unfinished last row ({len(data) - keep} bytes, cut short when a run "
                  "stopped); that sample runs again", UserWarning, stacklevel=3)


class _folder_lock:
    """An exclusive ``fcntl`` lock on the folder itself, held briefly (leaves no lock file behind; no-op where fcntl
    is missing)."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        self.path.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
