"""DuoAttention head patterns (``duo``): reading, checking and writing pattern files, and the ones kvkit ships.

A pattern gives one gate value alpha in [0, 1] per KV head per layer ``[L, H]`` (how much the head needs the full
context); :class:`~kvkit.policies.duo.Duo` binarises it into retrieval and streaming heads.

Pattern files
-------------
* kvkit JSON: ``{"format": "kvkit-duo-pattern", "version": 1, "model": {"name", "model_type", "num_layers",
  "num_heads", "num_kv_heads", "hidden_size"}, "alpha": [[...per KV head...] per layer], "calibration": {...}}``
  (a bare ``[[...]]`` matrix is read too);
* the reference implementation's TSV (``full_attention_heads.tsv``): one row per layer, one tab-separated column per
  KV head.

Values are clipped to [0, 1] like the reference does. A file is read as a regular file of at most
:data:`MAX_PATTERN_BYTES` (checked before it is read), its JSON fields type-checked and its matrix checked to be
rectangular, numeric and finite; every problem is a ``ValueError`` naming the file. :func:`read_pattern` reads one
once into a :class:`PatternFile` (the path with its content and sha256).

Shipped patterns (:data:`SHIPPED_PATTERNS`, in ``kvkit/data``) are found from a model's config
(:func:`shipped_pattern`).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path

import torch

from kvkit.fileio import FileReadError, read_file_bytes

PATTERN_FORMAT = "kvkit-duo-pattern"

#: The config fields that identify a model, in the order of :data:`SHIPPED_PATTERNS`' rows.
_IDENTITY_FIELDS = ("model_type", "num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size",
                    "vocab_size")

#: Shipped patterns: file name in ``kvkit/data`` -> the config fields that identify the model.
SHIPPED_PATTERNS = {name: dict(zip(_IDENTITY_FIELDS, row)) for name, row in {
    # SmolLM2-135M-Instruct, the default model
    "duo_smollm2-135m-instruct.json": ("llama", 30, 3, 9, 576, 49152),
    # Gemma-3-270m (base): 15 sliding-window layers keep the model's own 512-token window; only the gates
    # of the 3 global layers (5, 11, 17) were calibrated (the sliding layers' stay at 1 and are never used)
    "duo_gemma-3-270m.json": ("gemma3_text", 18, 1, 4, 640, 262144),
    # Qwen2.5-Coder-0.5B-Instruct (results/calibration/README.md). Qwen2.5-0.5B(-Instruct) has the same config shape and
    # would match too; calibrate your own pattern for it (`kvkit calibrate duo`)
    "duo_qwen2.5-coder-0.5b-instruct.json": ("qwen2", 24, 2, 14, 896, 151936),
}.items()}


def model_identity(config, name: str | None = None) -> dict:
    """The fields of a (text) config a pattern is tied to."""
    tc = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = tc.num_attention_heads
    return {
        "name": name or getattr(tc, "_name_or_path", "") or getattr(tc, "name_or_path", "") or tc.model_type,
        "model_type": tc.model_type,
        "num_layers": tc.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "hidden_size": tc.hidden_size,
    }


def _describe(ident: dict) -> str:
    """A model as a pattern's ``model`` object (or :func:`model_identity`) names it: name, type and shape."""
    shape = ", ".join(f"{v} {k.replace('num_', '').replace('_', ' ')}" for k in _MODEL_INT_FIELDS
                      if (v := ident.get(k)) is not None)
    head = " ".join(repr(ident[k]) if k == "name" else str(ident[k]) for k in ("name", "model_type") if ident.get(k))
    return f"{head or 'an unnamed model'} ({shape})" if shape else head or "an unnamed model"


def check_pattern_model(meta: dict, ident: dict, source: str) -> None:
    """Refuse a pattern whose ``model`` object (``meta``) describes another model than ``ident``
    (:func:`model_identity` of the model it is used on): a model type, head count, KV head count, layer count or
    hidden size that differs. The name is not compared (a local copy of a checkpoint has another path). A pattern
    with no ``model`` object (values, a bare matrix, TSV) is checked by its shape only."""
    diff = [k for k in ("model_type", *_MODEL_INT_FIELDS) if meta.get(k) is not None and meta[k] != ident.get(k)]
    if diff:
        raise ValueError(
            f"duo: pattern {source!r} was calibrated for {_describe(meta)}, but this model is {_describe(ident)} "
            f"({', '.join(diff)} differ): its gates belong to the other model's heads. Calibrate a pattern for this "
            "model with `kvkit calibrate duo --model <model> --out pattern.json` and pass pattern='pattern.json'"
        )


def _bad(path, what: str) -> ValueError:
    return ValueError(f"duo: pattern file {str(path)!r} is not a valid DuoAttention pattern: {what}")


#: The largest pattern file read (a 128-layer x 128-KV-head pattern is about 0.2 MB of JSON).
MAX_PATTERN_BYTES = 16 << 20
#: ``model`` fields of a kvkit JSON pattern that must be positive integers / strings (or absent / null).
_MODEL_INT_FIELDS = ("num_layers", "num_kv_heads", "num_heads", "hidden_size")
_MODEL_STR_FIELDS = ("name", "model_type")


def _type_name(x) -> str:
    return {str: "a string", bool: "a boolean", type(None): "null", list: "a list", dict: "an object"}.get(
        type(x), type(x).__name__)


def as_matrix(rows, path) -> torch.Tensor:
    """Nested sequence -> float64 ``[L, H]``, checking it is rectangular, numeric (no strings or booleans) and
    finite."""
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().cpu().double().tolist()
    elif hasattr(rows, "tolist") and not isinstance(rows, (list, tuple)):
        rows = rows.tolist()
    if not isinstance(rows, (list, tuple)) or not rows:
        raise _bad(path, "expected a non-empty list of layers, each a list of per-KV-head values")
    if not all(isinstance(r, (list, tuple)) for r in rows):
        raise _bad(path, "expected one list of per-KV-head values per layer (got a flat list?)")
    widths = {len(r) for r in rows}
    if len(widths) != 1 or 0 in widths:
        raise _bad(path, f"rows have different or zero lengths {sorted(widths)} (one value per KV head per layer)")
    values = []
    for i, r in enumerate(rows):
        row = []
        for j, x in enumerate(r):
            bad = isinstance(x, (str, bytes, bool)) or x is None
            if not bad:
                try:
                    row.append(float(x))
                except (TypeError, ValueError):
                    bad = True
            if bad:
                raise _bad(path, f"non-numeric value {x!r} ({_type_name(x)}) at layer {i}, KV head {j}: "
                                 "each gate must be a number")
        values.append(row)
    alpha = torch.tensor(values, dtype=torch.float64)
    if not bool(torch.isfinite(alpha).all()):
        raise _bad(path, "contains NaN or infinite values")
    return alpha


def _parse_tsv(text: str, path) -> torch.Tensor:
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append([float(x) for x in line.replace(",", "\t").split()])
        except ValueError:
            raise _bad(path, f"line {lineno} has a non-numeric value: {line.strip()[:60]!r}") from None
    return as_matrix(rows, path)


def _read_bytes(path) -> bytes:
    """The bytes of a pattern file: a regular file of at most :data:`MAX_PATTERN_BYTES`, checked before it is read
    (``/dev/zero``, a FIFO, a directory or a symlink loop is refused by what it is, not as missing)."""
    try:
        return read_file_bytes(path, "duo: pattern file", MAX_PATTERN_BYTES)
    except FileReadError as e:
        if e.reason == "missing":
            raise ValueError(f"duo: pattern file {str(path)!r} does not exist") from None
        raise


#: what a pattern file may be, for the messages that refuse another kind of file
_FORMATS_READ = ("duo reads kvkit JSON patterns (.json, written by `kvkit calibrate duo --out pattern.json`) and the "
                 "reference implementation's TSV (full_attention_heads.tsv)")


def _is_safetensors(raw: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then that many bytes of JSON header."""
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 10 else 0
    return 2 <= n <= len(raw) - 8 and raw[8:9] == b"{"


def _decode(raw: bytes, path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if _is_safetensors(raw):
            raise _bad(path, "it is a safetensors file (a `kvkit calibrate duo --resume` checkpoint, <out>.ckpt.pt?), "
                             f"not a pattern; {_FORMATS_READ}. A checkpoint is the state of an unfinished calibration: "
                             "rerun its command with the same options and --out (the checkpoint next to it as "
                             "<out>.ckpt.pt, --resume; --time-limit 0 stops after one more step) and it writes the "
                             "pattern to --out (kvkit.calibrate.duo_checkpoint)") from None
        raise _bad(path, f"not a text file (not UTF-8 at byte {e.start}); {_FORMATS_READ}") from None


def read_tsv(path) -> torch.Tensor:
    """The reference's ``full_attention_heads.tsv``: one row per layer, one column per KV head."""
    return _parse_tsv(_decode(_read_bytes(path), path), path)


def _check_model_meta(data: dict, path) -> dict:
    """The ``model`` object of a kvkit JSON pattern, its fields type-checked (and ``format`` / ``version`` /
    ``calibration``)."""
    fmt = data.get("format")
    if fmt is not None and fmt != PATTERN_FORMAT:
        raise _bad(path, f"'format' is {fmt!r}, expected {PATTERN_FORMAT!r}")
    version = data.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise _bad(path, f"'version' must be an integer, got {version!r} ({_type_name(version)})")
    cal = data.get("calibration")
    if cal is not None and not isinstance(cal, dict):
        raise _bad(path, f"'calibration' must be an object, got {_type_name(cal)}")
    meta = data.get("model")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise _bad(path, f"'model' must be an object, got {_type_name(meta)}")
    for key in _MODEL_INT_FIELDS:
        v = meta.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise _bad(path, f"model.{key} must be a positive integer, got {v!r} ({_type_name(v)})")
    for key in _MODEL_STR_FIELDS:
        v = meta.get(key)
        if v is not None and not isinstance(v, str):
            raise _bad(path, f"model.{key} must be a string, got {v!r} ({_type_name(v)})")
    return meta


def _parse_pattern(raw: bytes, path) -> tuple[torch.Tensor, dict, dict]:
    """The bytes of a pattern file -> ``(alpha [L, H] float64 in [0, 1], meta, settings)`` (kvkit JSON by a
    ``.json`` name, else reference TSV). ``settings``: the JSON's ``calibration.settings`` object ({} when the
    file has none, or for TSV)."""
    text = _decode(raw, path)
    meta: dict = {}
    settings: dict = {}
    if Path(path).suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _bad(path, f"not valid JSON ({e})") from None
        except RecursionError:
            raise _bad(path, "not valid JSON (nested too deeply)") from None
        if isinstance(data, list):  # a bare matrix
            alpha = as_matrix(data, path)
        elif isinstance(data, dict):
            if "alpha" not in data:
                raise _bad(path, f"no 'alpha' entry (keys: {', '.join(map(str, data)) or 'none'})")
            meta = _check_model_meta(data, path)
            alpha = as_matrix(data["alpha"], path)
            cal = data.get("calibration")
            if isinstance(cal, dict) and isinstance(cal.get("settings"), dict):
                settings = cal["settings"]
            for key, got in (("num_layers", alpha.shape[0]), ("num_kv_heads", alpha.shape[1])):
                if meta.get(key) is not None and meta[key] != got:
                    raise _bad(path, f"model.{key} is {meta[key]} but 'alpha' has {got}")
        else:
            raise _bad(path, f"expected a JSON object with an 'alpha' matrix, got {_type_name(data)}")
    else:
        alpha = _parse_tsv(text, path)
    return alpha.clamp(0.0, 1.0), meta, settings


class PatternFile(str):
    """A pattern file's path (this string, as given) with what was read from it, once: ``alpha`` (a tuple of per-layer
    tuples of gates in [0, 1]), ``meta`` (the file's ``model`` object), ``sha256`` (of the file's bytes) and
    ``settings`` (its ``calibration.settings``: what made it, recorded by ``kvkit calibrate duo-merge``).

    ``Duo(pattern="p.json")`` reads the file when the policy is built and holds one of these as its ``pattern``:
    every KVCache of a patched model then uses the heads of the file as it was at ``kvkit.patch`` / ``get_policy``
    time (rewriting the file later changes nothing), and ``dataclasses.replace`` / copies / pickles keep the content.
    It compares, prints and serialises (JSON) as the path."""

    alpha: tuple
    meta: dict
    sha256: str
    settings: dict

    def __new__(cls, path: str, alpha: tuple, meta: dict, sha256: str, settings: dict | None = None):
        self = super().__new__(cls, path)
        self.alpha, self.meta, self.sha256, self.settings = alpha, meta, sha256, dict(settings or {})
        return self

    def __reduce__(self):
        return (PatternFile, (str(self), self.alpha, self.meta, self.sha256, self.settings))


def read_pattern(path) -> PatternFile:
    """Read and check a pattern file (kvkit JSON or reference TSV) once: a :class:`PatternFile` (the path as given,
    with ``alpha``, ``meta``, ``settings`` and ``sha256`` of its bytes). The path must name a regular file of at most
    :data:`MAX_PATTERN_BYTES`, checked before anything is read."""
    given = os.fspath(path)
    if not isinstance(given, str):
        raise ValueError(f"duo: pattern must be a file path (str), got {type(given).__name__}")
    real = os.path.expanduser(given)
    raw = _read_bytes(real)
    alpha, meta, settings = _parse_pattern(raw, real)
    return PatternFile(given, tuple(tuple(r) for r in alpha.tolist()), meta, hashlib.sha256(raw).hexdigest(),
                       settings)


def load_pattern(path) -> tuple[torch.Tensor, dict]:
    """Read a pattern file (kvkit JSON or reference TSV): ``(alpha [L, H] float64 in [0, 1], meta)``."""
    pf = path if isinstance(path, PatternFile) else read_pattern(path)
    return torch.tensor(pf.alpha, dtype=torch.float64), dict(pf.meta)


def save_pattern(path, alpha, model: dict, calibration: dict | None = None) -> Path:
    """Write ``alpha [L, H]`` as kvkit JSON (or as reference TSV when ``path`` ends in ``.tsv``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    alpha = as_matrix(alpha, path).clamp(0.0, 1.0)
    if path.suffix.lower() == ".tsv":
        path.write_text("".join("\t".join(f"{x:.6e}" for x in row) + "\n" for row in alpha.tolist()))
        return path
    data = {
        "format": PATTERN_FORMAT,
        "version": 1,
        "model": model,
        "alpha": [[round(x, 6) for x in row] for row in alpha.tolist()],
        "calibration": calibration or {},
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def shipped_pattern(config) -> Path | None:
    """The pattern kvkit ships for this model (matched by its config), or None."""
    tc = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name, fields in SHIPPED_PATTERNS.items():
        if all(getattr(tc, k, None) == v for k, v in fields.items()):
            return Path(str(resources.files("kvkit") / "data" / name))
    return None
