"""DuoAttention calibration's resumable checkpoints: a safetensors file next to the pattern file
(:func:`checkpoint_path`) holding the tensors, with everything else as JSON in its header metadata (never a pickle):
written atomically (:func:`save_checkpoint`), read and checked against the run's model and settings
(:func:`load_checkpoint`) and restored into its gates, optimiser and schedule (:func:`restore_checkpoint`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvkit.calibrate.duo_data import DuoCalibration

CHECKPOINT_FORMAT = "kvkit-duo-calibration-checkpoint"
CHECKPOINT_VERSION = 2  # 1: a torch pickle (no longer read: unpickling a planted file runs its code)
_TAGS = ("__tensor__", "__tuple__", "__items__")
#: settings :class:`DuoCalibration` gained after checkpoints of version 2 were first written, with the value that
#: a run made before then used
_ADDED_SETTINGS = {"task": "passkey"}


def checkpoint_path(out) -> Path:
    """Where :func:`calibrate` keeps its resumable state for the pattern file ``out`` (a safetensors file:
    the tensors, and everything else as JSON in its header metadata; never a pickle)."""
    out = Path(out)
    return out.with_name(out.name + ".ckpt.pt")


def _encode(obj, tensors: dict):
    """``obj`` (tensors, dicts, lists, tuples, str/int/float/bool/None) as JSON, its tensors moved to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"duo calibration checkpoint: cannot store a {type(obj).__name__}")


def _decode(obj, tensors: dict):
    """The inverse of :func:`_encode`: ``obj`` (decoded JSON) with its tagged tensors (looked up in ``tensors``),
    tuples and dicts of non-string keys rebuilt; ValueError for a malformed tag."""
    if isinstance(obj, list):
        return [_decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        tag, val = next(iter(obj.items()))
        if tag == "__tensor__":
            if not isinstance(val, str) or val not in tensors:
                raise ValueError(f"names a tensor {val!r} the file does not hold")
            return tensors[val]
        if not isinstance(val, list):
            raise ValueError(f"{tag} must hold a list")
        if tag == "__tuple__":
            return tuple(_decode(x, tensors) for x in val)
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in val):
            raise ValueError("__items__ must hold [key, value] pairs")
        out = {}
        for k, v in val:
            k = _decode(k, tensors)
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise ValueError(f"a dict key of type {type(k).__name__}")
            out[k] = _decode(v, tensors)
        return out
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (a crash leaves the previous whole checkpoint)."""
    tensors: dict = {}
    meta = json.dumps(_encode({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **state}, tensors))
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"kvkit": meta})
    tmp.replace(path)


def _read_checkpoint(path: Path) -> dict:
    """The decoded checkpoint at ``path`` (no code runs: safetensors tensors + JSON); ValueError naming the
    file when it is not a kvkit duo calibration checkpoint of this version."""
    def bad(why: str) -> ValueError:
        return ValueError(f"duo calibration: {path} is not a kvkit duo calibration checkpoint ({why}); "
                          "delete it to start over")

    if not path.is_file():
        raise bad("not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file (an older kvkit's pickle included)
        raise bad(f"not a safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}; kvkit "
                  "before this version wrote pickled checkpoints, which are no longer read") from None
    if "kvkit" not in meta:
        raise bad("a safetensors file without kvkit's metadata")
    try:
        ck = _decode(json.loads(meta["kvkit"]), tensors)
    except (ValueError, TypeError, RecursionError) as e:
        raise bad(f"its metadata is malformed: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise bad(f"'format' is {ck.get('format') if isinstance(ck, dict) else None!r}")
    if ck.get("version") != CHECKPOINT_VERSION:
        raise bad(f"version {ck.get('version')!r}, this kvkit reads {CHECKPOINT_VERSION}")
    return ck


def _check_checkpoint(ck: dict, path: Path, cfg: DuoCalibration, L: int, H: int) -> None:
    """Schema of a checkpoint made with ``cfg`` for a model of ``L`` layers x ``H`` KV heads."""
    def bad(field: str, want: str) -> ValueError:
        got = ck.get(field)
        shown = f"a tensor {tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:80]
        return ValueError(f"duo calibration: the checkpoint {path} is malformed: '{field}' must be {want}, got "
                          f"{shown}; delete it to start over")

    step = ck.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step < cfg.steps:
        raise bad("step", f"an integer in [1, {cfg.steps - 1}]")
    g = ck.get("gates")
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != (L, H) or g.dtype != torch.float32 \
            or not bool(torch.isfinite(g).all()):
        raise bad("gates", f"a finite float32 tensor of shape ({L}, {H})")
    for field in ("optimizer", "scheduler"):
        if not isinstance(ck.get(field), dict):
            raise bad(field, "a state dict")
    h = ck.get("history")
    if not isinstance(h, list) or len(h) != step or not all(isinstance(r, dict) for r in h):
        raise bad("history", f"a list of {step} step records")
    w = ck.get("wall_s")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
        raise bad("wall_s", "a number of seconds >= 0")


def load_checkpoint(path: Path, cfg: DuoCalibration, ident: dict) -> dict | None:
    """The checkpoint at ``path`` (None when there is none), checked to belong to this run: made for the model
    ``ident`` (:func:`model_identity`'s dict) with the settings ``cfg``, in the schema :func:`_check_checkpoint`
    checks; ValueError naming the file otherwise."""
    if not path.exists():
        return None
    ck = _read_checkpoint(path)
    if not isinstance(ck.get("model"), dict) or ck["model"] != ident:
        m = ck["model"] if isinstance(ck.get("model"), dict) else {}
        raise ValueError(f"duo calibration: the checkpoint {path} was made for another model ({m.get('name')}, "
                         f"{m.get('num_layers')} layers); delete it or choose another --out")
    want = asdict(cfg)
    settings = ck.get("settings") if isinstance(ck.get("settings"), dict) else {}
    # a setting added after the checkpoint was written (``task``) reads as its default, which is
    # what that run used; every other key must still match
    settings = {**{k: v for k, v in _ADDED_SETTINGS.items() if k not in settings}, **settings}
    if settings != want:
        diff = sorted(k for k in want if settings.get(k) != want[k])
        raise ValueError(f"duo calibration: the checkpoint {path} was made with other settings ({', '.join(diff)} differ); "
                         "resume with the same options, or delete it to start over")
    _check_checkpoint(ck, path, cfg, ident["num_layers"], ident["num_kv_heads"])
    return ck


def restore_checkpoint(ck: dict, path: Path, gates, opt, sched) -> None:
    """Gates, optimiser and schedule from a checked checkpoint (ValueError naming the file if they do not fit)."""
    try:
        with torch.no_grad():
            gates.copy_(ck["gates"].to(gates.device))
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise ValueError(f"duo calibration: the checkpoint {path} does not fit this run's optimiser ({e}); "
                         "delete it to start over") from None
