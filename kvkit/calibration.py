"""Per-model calibration files: where they live, how a model's file is found, how a policy reads it.

A calibration file is JSON, one per model::

    {
      "format": "kvkit-calibration", "version": 1,
      "model": {"name": ..., "model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576, "vocab_size": 49152, ...},
      "policies": {
        "shadowkv": {"options": {"rank": 96}, "command": "kvkit calibrate shadowkv ...",
                     "date": "2026-11-23T23:40Z", "evidence": {...}},
        "tidal": {"options": {"select_layers": [2, 15]}, ...},
        ...
      }
    }

A model's file is the one whose ``model`` fields all equal the model's (text) config (the way
:func:`kvkit.policies.duo_patterns.shipped_pattern` finds a duo pattern): the architecture and its sizes, never the
path it was loaded from, so a GGUF, a converted copy and a hub checkout of the same model share it.
Searched, first match per policy wins: ``$KVKIT_CALIBRATION_DIR`` (``os.pathsep``-separated folders),
then the user's folder ``~/.cache/kvkit/calibration`` (``kvkit calibrate`` writes there by default), then
the files shipped in ``kvkit/data/calibration``.

How a policy uses it (:func:`resolve`): when the policy's ``calibrated`` option is True (default) and the
user left every option the calibration sets (the policy class's ``calibrated_options``) at its default, those
options take the calibrated values; ``calibrated=False`` gives the paper's settings. A malformed file is refused
with a ValueError that names the file and what is wrong (also a file of another model in a searched folder: it
cannot be matched).

This module sits below the policies (they import :func:`resolve` at module top): it imports only :mod:`kvkit.env`,
:mod:`kvkit.fileio` and :mod:`kvkit.registry` (the policy classes a file's sections are checked against). The
calibrators (``kvkit/calibrate/<policy>.py``) write the sections.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from importlib import resources
from pathlib import Path

from kvkit import env
from kvkit.fileio import read_text_file
from kvkit.registry import available_policies, policy_class

FORMAT = "kvkit-calibration"
VERSION = 1
MAX_FILE_BYTES = 16 << 20  # a calibration file is a few KiB; its evidence a few hundred at most


def calibrated_options() -> dict[str, tuple[str, ...]]:
    """The options each policy's calibration may set (policy name -> its class's ``calibrated_options``, in registry
    order; policies without any left out). The calibration applies only when the user left all of them at their
    defaults (so it never mixes with a setting the user chose)."""
    classes = {name: policy_class(name) for name in available_policies()}
    return {name: cls.calibrated_options for name, cls in classes.items() if cls.calibrated_options}


def __getattr__(name: str):
    # ``CALIBRATED_OPTIONS``: the same table as a module attribute, computed from the policies' declarations
    if name == "CALIBRATED_OPTIONS":
        return calibrated_options()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The config fields that identify a model (all must be equal; a file may omit the optional ones).
IDENTITY_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "hidden_size", "intermediate_size", "vocab_size")
REQUIRED_IDENTITY = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "hidden_size")


class CalibrationError(ValueError):
    """A calibration file that cannot be used (the message names the file and the problem)."""


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def identity(config, name: str | None = None) -> dict:
    """The identity fields of a model config (what a calibration file is matched on), plus ``name``."""
    tc = _text_config(config)
    heads = tc.num_attention_heads
    out = {
        "name": name or getattr(tc, "_name_or_path", "") or tc.model_type,
        "model_type": tc.model_type,
        "num_hidden_layers": tc.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        "hidden_size": tc.hidden_size,
    }
    for k in ("intermediate_size", "vocab_size"):
        v = getattr(tc, k, None)
        if isinstance(v, int):
            out[k] = v
    return out


def file_stem(name: str) -> str:
    """A file name for a model name or path (``./models/My Model`` -> ``my-model``)."""
    stem = Path(str(name).rstrip("/")).name or str(name)
    if stem.endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in stem.lower()).strip("-") or "model"


def shipped_dir() -> Path:
    return Path(str(resources.files("kvkit") / "data" / "calibration"))


def user_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvkit" / "calibration"


def search_dirs() -> list[Path]:
    dirs = [Path(p).expanduser() for p in env.calibration_dirs()]
    return [*dirs, user_dir(), shipped_dir()]


def default_out(name: str) -> Path:
    """Where ``kvkit calibrate`` writes without ``--out``: the first ``$KVKIT_CALIBRATION_DIR`` folder, else
    the user folder (both are searched before the shipped files)."""
    dirs = env.calibration_dirs()
    return (Path(dirs[0]).expanduser() if dirs else user_dir()) / f"{file_stem(name)}.json"


# ---- reading and checking ------------------------------------------------------------------------------
def _bad(path, what: str) -> CalibrationError:
    return CalibrationError(f"kvkit calibration file {str(path)!r} is malformed: {what}")


def check_section(policy: str, section, path) -> dict:
    """A policy's section -> its options (checked: known policy, options it may set, values it accepts)."""
    table = calibrated_options()
    if policy not in table:
        raise _bad(path, f"policy {policy!r} has no calibrated options (known: {', '.join(table)})")
    if not isinstance(section, dict):
        raise _bad(path, f"policies.{policy} must be an object with an 'options' object, got {type(section).__name__}")
    opts = section.get("options")
    if not isinstance(opts, dict) or not opts:
        raise _bad(path, f"policies.{policy}.options must be a non-empty object of option values")
    allowed = table[policy]
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise _bad(path, f"policies.{policy}.options sets {', '.join(unknown)}; a calibration may set only "
                         f"{', '.join(allowed)}")
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
    try:
        policy_class(policy)(**opts)
    except (TypeError, ValueError) as e:
        raise _bad(path, f"policies.{policy}.options {json.dumps(section['options'])} are refused by the policy: {e}") from None
    return opts


def check(data, path) -> dict:
    """Validate a parsed calibration file; returns it with each section's options normalised."""
    if not isinstance(data, dict):
        raise _bad(path, f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _bad(path, f"'format' must be {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != VERSION:
        raise _bad(path, f"unsupported 'version' {data.get('version')!r} (this kvkit reads {VERSION})")
    model = data.get("model")
    if not isinstance(model, dict):
        raise _bad(path, "'model' must be an object of config fields (model_type, num_hidden_layers, ...)")
    missing = [k for k in REQUIRED_IDENTITY if k not in model]
    if missing:
        raise _bad(path, f"'model' lacks {', '.join(missing)} (needed to match a model's config)")
    pols = data.get("policies")
    if not isinstance(pols, dict):
        raise _bad(path, "'policies' must be an object: policy name -> {'options': {...}, 'command': ..., 'date': ...}")
    out = dict(data)
    out["policies"] = {}
    for name, section in pols.items():
        opts = check_section(name, section, path)
        out["policies"][name] = {**section, "options": opts}
    return out


_CACHE: dict = {}


def read(path) -> dict:
    """Read and check one calibration file (cached on its modification time)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise CalibrationError(f"kvkit calibration file {str(path)!r} cannot be read: {e}") from None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        _CACHE[key] = check(_parse(path), path)
    return _CACHE[key]


def _parse(path):
    """The JSON of a calibration file: a regular UTF-8 file of at most :data:`MAX_FILE_BYTES` (checked before it is
    read), parsed with every number finite (``1e999`` / ``NaN`` / ``Infinity`` are refused by their path)."""
    try:
        text = read_text_file(path, "kvkit calibration file", MAX_FILE_BYTES)
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    try:
        data = json.loads(text, parse_constant=_constant)
        where = _non_finite(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(path, f"not valid JSON ({e})") from None
    except ValueError as e:  # a constant
        raise _bad(path, str(e)) from None
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit
        raise _bad(path, "not valid JSON for a calibration file (nested too deeply)") from None
    if where is not None:
        raise _bad(path, f"{where} is not a finite number")
    return data


def _constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def _non_finite(obj, where: str = "") -> str | None:
    """The dotted path of the first non-finite float in ``obj`` (``1e999`` parses as inf), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "the file"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


def matches(model: dict, ident: dict) -> bool:
    return all(model.get(k) == ident.get(k) for k in IDENTITY_FIELDS if k in model)


def files() -> list[Path]:
    out = []
    for d in search_dirs():
        if d.is_dir():
            out += sorted(p for p in d.glob("*.json") if p.is_file())
    return out


def lookup(config, policy: str) -> tuple[dict, Path] | None:
    """``(options, file)`` of the first calibration of ``policy`` for this model config, or None."""
    if config is None:
        return None
    try:
        ident = identity(config)
    except AttributeError:
        return None
    for path in files():
        data = read(path)
        if matches(data["model"], ident) and policy in data["policies"]:
            return dict(data["policies"][policy]["options"]), path
    return None


def resolve(policy, config):
    """The policy with its calibrated options filled in for this model (itself when nothing applies)."""
    group = policy.calibrated_options
    if not group or not getattr(policy, "calibrated", False) or not policy.uses_calibration():
        return policy
    defaults = {f.name: f.default for f in dataclasses.fields(policy)}
    if any(getattr(policy, k) != defaults.get(k) for k in group):
        return policy  # the user chose (part of) the setting: no calibration
    found = lookup(config, policy.name)
    if found is None:
        return policy
    opts, path = found
    try:
        resolved = dataclasses.replace(policy, **opts)
    except (TypeError, ValueError) as e:
        raise _bad(path, f"policies.{policy.name}.options do not combine with the other options: {e}") from None
    check_fits(policy, resolved, opts, path, config)
    return resolved


_ERRORS = (TypeError, ValueError, ArithmeticError)


def _fits(policy, config) -> Exception | None:
    """The error the policy's model checks raise for ``config`` (None when it runs there). ``calibrated=False``:
    the checks see the policy as it is (they resolve the calibration themselves otherwise)."""
    try:
        dataclasses.replace(policy, calibrated=False).validate(_text_config(config))
    except _ERRORS as e:
        return e
    return None


def check_fits(policy, resolved, opts: dict, path, config) -> None:
    """Refuse, naming the file and the field, calibrated options (``opts`` from ``path``, giving ``resolved``) that
    fail the policy's checks against this model (layers that do not exist, a rank wider than the keys, shares
    whose budgets overflow, ...) where the policy with its own options passes them: otherwise the failure would
    surface later, inside a cache, without the file that caused it."""
    err = _fits(resolved, config)
    if err is None or _fits(policy, config) is not None:
        return  # fits; or the policy fails there anyway (its own checks report it, not the file's fault)
    bad = []
    for k in opts:
        try:
            alone = dataclasses.replace(policy, **{k: opts[k]})
        except _ERRORS:
            continue
        if _fits(alone, config) is not None:
            bad.append(k)
    fields = ", ".join(f"policies.{policy.name}.options.{k}" for k in (bad or opts))
    msg = (str(err).splitlines() or [""])[0] or type(err).__name__
    if getattr(resolved, "compression_ratio", None) is not None and _fits(
            dataclasses.replace(resolved, compression_ratio=None), config) is None:
        # the file fits the model; the ratio is what its calibrated setting cannot reach: say that, not "malformed"
        raise ValueError(f"{msg}, with the setting calibrated for this model ({fields} in {str(path)!r}); give "
                         "another ratio, or those options yourself (preset='paper': the paper's)") from None
    raise _bad(path, f"{fields} {'does' if len(bad or opts) == 1 else 'do'} not fit this model "
                     f"({_text_config(config).model_type}, {_text_config(config).num_hidden_layers} layers): {msg}")


def describe(policy, config) -> str:
    """One line: which calibrated options a policy would use for this model, and from which file."""
    found = lookup(config, policy.name)
    if found is None:
        return f"{policy.name}: no calibration for this model"
    opts, path = found
    return f"{policy.name}: {', '.join(f'{k}={v}' for k, v in opts.items())} from {path}"


# ---- writing ---------------------------------------------------------------------------------------------
def write_section(path, model: dict, policy: str, options: dict, command: str, evidence: dict | None = None) -> Path:
    """Add or replace ``policy``'s section of the calibration file ``path`` (created when missing)."""
    path = Path(path)
    if path.exists():
        data = _parse(path)
        check(data, path)
        if not matches(data["model"], model):
            raise CalibrationError(f"{str(path)!r} belongs to another model ({data['model'].get('name')!r}); "
                                   "choose another --out")
    else:
        data = {"format": FORMAT, "version": VERSION, "model": model, "policies": {}}
    section = {
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }
    if evidence:
        section["evidence"] = evidence
    check_section(policy, section, path)
    data["policies"][policy] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    _CACHE.clear()
    return path
