"""Input checks and shape canonicalisation shared by the launchers and the torch references.

Every public kernel function validates here *before* dispatching, so a bad call fails the same way on
the Triton and the reference path, with a message that says what was wrong.
"""

from __future__ import annotations

import math

import torch

from kvkit import env

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)


def debug() -> bool:
    """``KVKIT_DEBUG=1``: check index ranges on the host (costs a device sync, so off by default)."""
    return env.debug()


def fail(fn: str, msg: str):
    raise ValueError(f"kvkit.kernels.{fn}: {msg}")


def check_tensor(fn, name, t, ndim=None, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        fail(fn, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(fn, f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        fail(fn, f"{name} is on {t.device} but q is on {device}; move all inputs to one device")


def check_qkv(fn, q, k, v):
    """q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; k, v ``[B, Hkv, N, D]``. Returns (q4, squeeze, B, Hq, Tq, Hkv, N, D)."""
    check_tensor(fn, "q", q, (3, 4), FLOATS)
    check_tensor(fn, "k", k, 4, FLOATS, q.device)
    check_tensor(fn, "v", v, 4, FLOATS, q.device)
    if not (q.dtype == k.dtype == v.dtype):
        fail(fn, f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(2) if squeeze else q
    B, Hq, Tq, D = q4.shape
    if k.shape != v.shape:
        fail(fn, f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [B, Hkv, N, D]")
    if k.shape[0] != B or k.shape[3] != D:
        fail(fn, f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (batch and head_dim must agree)")
    Hkv, N = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        fail(fn, f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    return q4, squeeze, B, Hq, Tq, Hkv, N, D


def check_valid(fn, valid, B, N, device):
    """``valid``: None, lengths ``[B]`` (int: keys ``n >= valid[b]`` are ignored) or a key mask ``[B, N]`` (bool).
    Returns a bool mask ``[B, N]`` or None."""
    if valid is None:
        return None
    check_tensor(fn, "valid", valid, (1, 2), None, device)
    if valid.dim() == 1:
        if valid.dtype not in INTS or valid.shape[0] != B:
            fail(fn, f"valid as lengths must be an int tensor [B={B}], got {valid.dtype} {tuple(valid.shape)}")
        return torch.arange(N, device=device)[None, :] < valid[:, None]
    if valid.dtype != torch.bool or tuple(valid.shape) != (B, N):
        fail(fn, f"valid as a key mask must be bool [B={B}, N={N}], got {valid.dtype} {tuple(valid.shape)}")
    return valid


def check_indices(fn, indices, B, Hq, Hkv, Tq, index_mode, device, name="indices"):
    """indices ``[B, Hidx, K]`` or ``[B, Hidx, Tq, K]`` (Hidx = Hkv for index_mode='kv_head', Hq for 'q_head').
    Returns the canonical ``[B, Hidx, Ti, K]`` view (Ti in {1, Tq})."""
    check_tensor(fn, name, indices, (3, 4), INTS, device)
    if index_mode not in ("kv_head", "q_head"):
        fail(fn, f"index_mode must be 'kv_head' or 'q_head', got {index_mode!r}")
    Hidx = Hkv if index_mode == "kv_head" else Hq
    idx = indices.unsqueeze(2) if indices.dim() == 3 else indices
    if idx.shape[0] != B or idx.shape[1] != Hidx or idx.shape[2] not in (1, Tq):
        want = f"[B={B}, {'Hkv' if index_mode == 'kv_head' else 'Hq'}={Hidx}, K] or [B, {Hidx}, Tq={Tq}, K]"
        fail(fn, f"{name} has shape {tuple(indices.shape)}; with index_mode={index_mode!r} expected {want}")
    return idx


def check_range(fn, name, idx, hi):
    """KVKIT_DEBUG only: every entry must be -1 (padding) or in [0, hi)."""
    if idx.numel() == 0:
        return
    lo_v, hi_v = int(idx.min()), int(idx.max())
    if lo_v < -1 or hi_v >= hi:
        raise IndexError(
            f"kvkit.kernels.{fn}: {name} out of range: found values in [{lo_v}, {hi_v}], allowed -1 (padding) "
            f"or [0, {hi}); out-of-range entries are otherwise silently treated as padding"
        )


def default_scale(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)
