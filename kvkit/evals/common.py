"""Shared plumbing for the evals: atomic output files, jsonl reading, prompts, generation, resume."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kvkit import env
from kvkit.compat import cache_kw

# --------------------------------------------------------------------------------------------- I/O


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


# ------------------------------------------------------------------------------------------ prompts


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, user: str, answer_prefix: str = "", chat: bool = True) -> str:
    """The full prompt text: the chat template around ``user`` (when the model has one), then the
    answer prefix after the generation prompt, as RULER does. Tokenize it with ``add_special_tokens=False``."""
    if chat and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return text + answer_prefix.lstrip(" ")
    return _default_prefix(tokenizer) + user + answer_prefix


def _default_prefix(tokenizer) -> str:
    """The special tokens the tokenizer itself puts in front of a plain text (e.g. Llama's BOS), as text."""
    ids = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(ids) - len(bare)
    return tokenizer.decode(ids[:n]) if n > 0 and ids[n:] == bare else ""


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode(tokenizer, text: str):
    import torch

    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


# --------------------------------------------------------------------------------------- generation


def model_context(model) -> int | None:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def check_length(model, length: int, what: str = "--length") -> None:
    ctx = model_context(model)
    if ctx is not None and length > ctx:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise ValueError(f"{what} {length} is above the model's context of {ctx} tokens ({name})")


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    kv_bytes: int
    kv_offloaded: int


def generate(model, tokenizer, prompt: str, max_new_tokens: int, context_end: int | None = None,
             replay=None, peer: tuple[str, dict] | None = None) -> Generation:
    """Greedy ``model.generate`` on one prompt with an explicit ``kvkit.KVCache`` (when patched).

    With ``context_end`` (a character offset), the context ``prompt[:context_end]`` is prefilled first
    and compressed by the policy; the rest (question, answer prefix) is then fed on top of what the
    policy kept, as kvpress evaluates (question-agnostic compression). Without the split, the
    question would be read with full attention during prefill and eviction would cost nothing.

    ``replay``: a :class:`kvkit.evals.shared_prefill.PrefillRecording` of the context (``prompt[:context_end]``):
    the policy's cache is rebuilt from it instead of running the context through the model again
    (policy sweeps; identical result, see ``shared_prefill``). ``seconds`` then excludes the shared prefill.

    ``peer``: ``(name, options)`` of a :mod:`kvkit.evals.peers` cache (transformers' ``QuantizedCache``) used on the
    unpatched model instead, with the same split; its ``kv_bytes`` are :func:`kvkit.evals.peers.cache_nbytes`.
    """
    import torch

    import kvkit

    patched = kvkit.patched_policy(model) is not None
    if context_end is not None and 0 < context_end < len(prompt):
        ctx = encode(tokenizer, prompt[:context_end])
        ids = torch.cat([ctx, encode(tokenizer, prompt[context_end:])], dim=1).to(model.device)
    else:
        ctx = None
        ids = encode(tokenizer, prompt).to(model.device)
    kwargs = {}
    cache = None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    with torch.no_grad():
        if peer is not None:
            from kvkit.evals import peers

            if patched:
                raise ValueError(f"the peer row {peer[0]!r} runs on the unpatched model; kvkit.unpatch(model) first")
            cache = peers.make_cache(model, *peer)
            if ctx is not None:
                model(input_ids=ids[:, : ctx.shape[1]], **cache_kw(cache), use_cache=True)
            kwargs.update(cache_kw(cache))
        elif patched:
            cache = kvkit.KVCache(model)
            if ctx is not None and replay is not None:
                from kvkit.evals.shared_prefill import replay_prefill

                if replay.tokens != ctx.shape[1]:
                    raise ValueError(f"replay: the recording holds {replay.tokens} context tokens, this prompt's "
                                     f"context has {ctx.shape[1]}")
                cache = replay_prefill(model, replay, cache=cache)
            elif ctx is not None:
                n = ctx.shape[1]
                cache, _ = kvkit.prefill(model, ids[:, :n], chunk_size=n, cache=cache)
            kwargs.update(cache_kw(cache))
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **kwargs,
        )
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(ids.shape[1]),
        new_tokens=int(new.shape[0]),
        seconds=dt,
        kv_bytes=(peers.cache_nbytes(cache) if peer is not None else int(cache.nbytes())) if cache is not None else 0,
        kv_offloaded=int(cache.offloaded_nbytes()) if cache is not None and peer is None else 0,
    )


# ------------------------------------------------------------------------------------- run folders

#: config keys that do not change a row: where it ran (device), which subset of the samples this process runs
#: (samples, tasks), the command line and the kvkit version. Every other key (model, dtype, seed, policy, options,
#: option_files, calibration, length, chat, max_new_tokens, ...) changes the rows and is checked on ``--resume``.
#: (dtype is not free: rows of float32 and bfloat16 must not mix under one summary.)
_FREE_KEYS = {"device", "samples", "command", "tasks", "kvkit_version", "resume"}
#: keys an older run folder may lack: a folder without one still resumes (nothing to compare it with)
_RECORDED_LATER = {"calibration", "option_files"}


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


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def option_files(options: dict) -> dict:
    """``{option: sha256}`` of the policy options that name a file (duo's ``pattern``): the run depends on the
    file's content, not its name, so the content is what ``--resume`` checks."""
    return {k: file_sha256(v) for k, v in sorted(options.items())
            if isinstance(v, (str, os.PathLike)) and str(v) and os.path.isfile(v)}


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
    """An ``--out`` folder: ``config.json`` first, then ``samples.jsonl`` rewritten atomically after
    every sample, so a crash leaves only whole files and ``--resume`` skips finished samples.

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
        self._lock = None
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
                self.rows = read_rows(samples)
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
        """Append ``row`` and rewrite ``samples.jsonl``. Rows another process wrote to the same folder
        since (e.g. a second ``kvkit eval sweep --resume --tasks ...`` splitting the work) are merged
        in under a lock instead of being overwritten; a row id already on disk is replaced by ours."""
        samples = self.path / "samples.jsonl"
        with _folder_lock(self.path):
            mine = {r["id"] for r in self.rows} | {row["id"]}
            theirs = [r for r in read_rows(samples) if r["id"] not in mine] if samples.exists() else []
            self.rows = [r for r in self.rows if r["id"] != row["id"]] + theirs + [row]
            atomic_write_jsonl(samples, self.rows)


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


def load_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """``kvkit.models.load`` with a dtype given by name."""
    import torch

    from kvkit.models import load

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown --dtype {dtype!r}; use float32, bfloat16 or float16")
    return load(name, dtype=dt, device=device)


def resolve_policy_options(policy: str, options: dict | None = None, budget: int | None = None) -> dict:
    """Policy options from ``--opt``/``--policy-options`` plus ``--budget`` (which sets the policy's
    ``budget`` option; a policy without one is an error listing its options)."""
    from kvkit.registry import policy_options

    valid = policy_options(policy)  # unknown policy: ValueError listing the known ones
    opts = dict(options or {})
    if budget is not None:
        if "budget" not in valid:
            listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
            raise ValueError(f"--budget: policy {policy!r} has no option named 'budget'; its options: {listed}")
        opts["budget"] = budget
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for policy {policy!r}; valid options: {listed}")
    return opts


def calibration_used(model, policy: str, options: dict) -> dict | None:
    """The options a per-model calibration (:mod:`kvkit.calibration`) sets for ``policy`` with ``options`` on
    this model, with the file they come from; None when none applies. Recorded in a run's config, so a run resumed
    after a recalibration is refused instead of mixing rows of two settings."""
    import dataclasses

    from kvkit.calibration import CALIBRATED_OPTIONS, lookup, resolve
    from kvkit.registry import policy_class

    if policy not in CALIBRATED_OPTIONS:
        return None
    pol = policy_class(policy)(**options)
    resolved = resolve(pol, model.config)
    if resolved is pol:
        return None
    changed = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(pol)
               if getattr(resolved, f.name) != getattr(pol, f.name)}
    changed = {k: list(v) if isinstance(v, tuple) else v for k, v in changed.items()}
    found = lookup(model.config, policy)
    return {"options": changed, "file": found[1].name if found else None} if changed else None


def run_label(model: str, policy: str, options: dict, length) -> str:
    parts = [Path(str(model)).name or str(model), policy]
    parts += [f"{k}{v}" for k, v in sorted(options.items())]
    parts.append(f"{length}")
    return "-".join(str(p).replace("/", "_") for p in parts)


def progress(iterable=None, total=None, desc=None):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, disable=env.no_progress())


# ------------------------------------------------------------------------------------------ runner


def run_samples(model, tokenizer, samples: list[dict], run: RunDir, policy: str, options: dict, score_fn,
                desc: str = "eval", full_prompt_prefill: bool = False) -> list[dict]:
    """Generate and score every sample not yet in ``run`` (``samples[i]`` has ``id``, ``prompt``,
    ``outputs``, ``tokens_to_generate``); returns all rows in sample order."""
    import kvkit

    run.check_samples(samples)
    done = run.done()
    # index-major, as run_sweep: a run stopped early still covers every task with the same count
    todo = sorted((s for s in samples if s["id"] not in done), key=lambda s: s.get("index", 0))
    from kvkit.evals.peers import is_peer

    peer = (policy, options) if is_peer(policy) else None
    if peer is None:
        kvkit.patch(model, policy, **options)
    elif kvkit.patched_policy(model) is not None:
        kvkit.unpatch(model)
    try:
        bar = progress(total=len(samples), desc=desc)
        bar.update(len(samples) - len(todo))
        for s in todo:
            g = generate(model, tokenizer, s["prompt"], s["tokens_to_generate"],
                         None if full_prompt_prefill else s.get("context_end"), peer=peer)
            run.add(_row(s, g, score_fn(s, g.text)))
            bar.update(1)
        bar.close()
    finally:
        if peer is None:
            kvkit.unpatch(model)
    order = {s["id"]: i for i, s in enumerate(samples)}
    return sorted((r for r in run.rows if r["id"] in order), key=lambda r: order[r["id"]])


def _row(s: dict, g: Generation, score: float) -> dict:
    row = {k: s[k] for k in ("id", "task", "index", "seed") if k in s}
    row["sample_sha"] = sample_digest(s)  # what --resume and compare --matched match rows on, with the id
    row.update(
        prediction=g.text,
        reference=s["outputs"],
        score=float(score),
        prompt_tokens=g.prompt_tokens,
        new_tokens=g.new_tokens,
        seconds=round(g.seconds, 4),
        kv_bytes=g.kv_bytes,
        kv_offloaded=g.kv_offloaded,
    )
    for k in ("length", "depth", "target_length", "source_id"):
        if k in s:
            row[k] = s[k]
    return row


def run_sweep(model, tokenizer, samples: list[dict], runs: list, score_fn, desc: str = "sweep") -> None:
    """Several (``RunDir``, policy, options) runs over the same samples, one shared context prefill per sample.

    For each sample that some run has not finished, the context is prefilled once with exact attention
    (:func:`kvkit.evals.shared_prefill.record_prefill`) and replayed into each policy's cache, then the
    question and the answer are decoded by that policy as in :func:`run_samples`. Rows are the same as
    a run of that policy alone (``seconds`` excludes the shared prefill; ``shared_prefill_seconds`` has it).
    """
    import kvkit
    from kvkit.evals.shared_prefill import record_prefill, replayable

    for _, policy, options in runs:
        if not replayable(policy, options):
            raise ValueError(f"policy {policy!r} with {options or 'its defaults'} cannot share a replayed prefill; run "
                             "it alone with `kvkit eval ruler`")
    for run, _, _ in runs:
        run.check_samples(samples)
    done = [run.done() for run, _, _ in runs]
    todo = [s for s in samples if any(s["id"] not in d for d in done)]
    # index-major (every task's sample 0, then every task's sample 1, ...): a sweep stopped early still
    # covers every task with the same number of samples
    todo.sort(key=lambda s: s.get("index", 0))
    bar = progress(total=len(samples), desc=desc)
    bar.update(len(samples) - len(todo))
    try:
        for s in todo:
            ce = s.get("context_end")
            if not ce or not 0 < ce < len(s["prompt"]):
                raise ValueError(f"sample {s['id']}: no context/question split (context_end); a sweep needs one")
            kvkit.patch(model, "full")
            ctx = encode(tokenizer, s["prompt"][:ce]).to(model.device)
            rec = record_prefill(model, ctx)
            for (run, policy, options), d in zip(runs, done):
                if s["id"] in d:
                    continue
                kvkit.patch(model, policy, **options)
                g = generate(model, tokenizer, s["prompt"], s["tokens_to_generate"], ce, replay=rec)
                row = _row(s, g, score_fn(s, g.text))
                row["shared_prefill_seconds"] = round(rec.seconds, 4)
                run.add(row)
            del rec
            bar.update(1)
    finally:
        kvkit.unpatch(model)
        bar.close()


def task_scores(rows: list[dict], tasks: list[str]) -> dict:
    """Mean score x 100 per task (2 decimals) and their average."""
    per = {}
    for t in tasks:
        xs = [r["score"] for r in rows if r.get("task") == t]
        if xs:
            per[t] = round(100 * sum(xs) / len(xs), 2)
    avg = round(sum(per.values()) / len(per), 2) if per else None
    return {"scores": per, "average": avg}
