"""Peer rows of an evaluation: caches users would pick instead of a kvkit policy, run on the unpatched model.

One peer so far, ``quantized``: transformers' own ``QuantizedCache`` (KIVI-style: keys and values quantized in
groups once ``residual_length`` tokens have gathered in a full-precision window) with the ``quanto`` backend
(``pip install optimum-quanto``) or ``hqq``. Options: ``nbits`` (quanto: 2 or 4; default 4), ``backend``
(``quanto``), ``q_group_size`` (64), ``residual_length`` (128), ``axis_key`` / ``axis_value`` (0). Its bytes are
measured like a kvkit cache's (:func:`cache_nbytes`: every tensor the cache holds, the packed codes, scales and
zero points of the quantized part included), so a peer row sits in the same KV-bytes column as the policies.
"""

from __future__ import annotations

#: peer name -> default options
PEERS: dict[str, dict] = {
    "quantized": dict(backend="quanto", nbits=4, q_group_size=64, residual_length=128, axis_key=0, axis_value=0),
}


def is_peer(policy: str) -> bool:
    return policy in PEERS


def peer_options(policy: str, options: dict | None) -> dict:
    """The peer's options with defaults filled in; unknown keys raise ValueError naming the known ones."""
    known = PEERS[policy]
    options = dict(options or {})
    bad = sorted(set(options) - set(known))
    if bad:
        raise ValueError(f"peer {policy!r}: unknown option(s) {', '.join(bad)}; known: {', '.join(known)}")
    out = dict(known, **options)
    if out["backend"] not in ("quanto", "hqq"):
        raise ValueError(f"peer quantized: backend must be 'quanto' or 'hqq', got {out['backend']!r}")
    for k in ("nbits", "q_group_size", "residual_length"):
        if isinstance(out[k], bool) or not isinstance(out[k], int) or out[k] < (0 if k == "residual_length" else 1):
            raise ValueError(f"peer quantized: {k} must be a positive integer, got {out[k]!r}")
    return out


def make_cache(model, policy: str, options: dict):
    """A fresh peer cache for ``model`` (ImportError with the install command when its backend is missing)."""
    from transformers import QuantizedCache

    o = peer_options(policy, options)
    try:
        return QuantizedCache(backend=o["backend"], config=model.config, nbits=o["nbits"], axis_key=o["axis_key"],
                              axis_value=o["axis_value"], q_group_size=o["q_group_size"],
                              residual_length=o["residual_length"])
    except ImportError as e:
        pkg = "optimum-quanto" if o["backend"] == "quanto" else "hqq"
        raise ImportError(f"the peer row 'quantized' (backend {o['backend']}) needs `pip install {pkg}`: {e}") from e


def tensor_nbytes(t) -> int:
    """Bytes of a tensor; a tensor subclass (quanto's packed tensors) counts the inner tensors it is made of."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_nbytes(cache) -> int:
    """Bytes a transformers cache holds: every tensor attribute of every layer (quantized parts included)."""
    import torch

    total = 0
    for layer in getattr(cache, "layers", []):
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor):
                total += tensor_nbytes(v)
    return total
