"""The byte arithmetic of a shaped-model bench: what a decode step must read, how fast that could be at the
measured copy bandwidth, and how far each row got from kvkit ``full`` towards that bound.

``weights`` (:func:`weight_read_bytes`) = the parameter bytes a decode step reads, each tensor once; the input
embedding table only when it is tied to the output head (else only ``B`` of its rows are read, not counted).
``byte bound ms`` (:func:`byte_bound_ms`) = (weights + KV read/step) / bandwidth. Per row (:func:`add_ratios`):
``speed-up`` = ``t_full / t_row``; ``fraction`` (:func:`fraction_to_bound`) = ``(t_full - t_row) / (t_full -
t_bound_row)`` with no clamping (1: the row runs at its byte bound; 0: as fast as kvkit ``full``; negative: slower
than ``full``; None when ``t_full`` is at or under the row's bound). ``t_full`` is the median of the ``full`` steps
interleaved with that row when there are any, else ``full``'s own median. ``vs full compiled`` / ``fraction (vs full
compiled)``: the same with ``t_full`` = the median step of ``full static+compile``.
"""

from __future__ import annotations

from kvkit.evals.gpu.plan import compiled_name


def weight_read_bytes(model) -> int:
    """Parameter bytes one decode step reads: every tensor once (tied tensors once); the input embedding table
    is left out unless it is tied to the output head (a step then reads it whole as the head)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key in seen or (p is emb and not tied):
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total


def byte_bound_ms(weights: int, kv_read: int, bandwidth: float) -> float:
    """Milliseconds to move ``weights + kv_read`` bytes at ``bandwidth`` bytes/s (the step's byte floor)."""
    return (weights + kv_read) / bandwidth * 1e3


def fraction_to_bound(t_full: float | None, t_row: float | None, t_bound: float | None) -> float | None:
    """``(t_full - t_row) / (t_full - t_bound)``, not clamped: 1 = the row runs at its byte bound, 0 = as fast as
    kvkit ``full``, < 0 = slower than ``full``; None when a time is missing or ``t_full <= t_bound``."""
    if t_full is None or t_row is None or t_bound is None or t_full <= t_bound:
        return None
    return (t_full - t_row) / (t_full - t_bound)


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def add_ratios(rows: list[dict], weights: int, bandwidth: float) -> None:
    """Byte bound, speed-up and fraction of every measured row (``status == "ok"``), in place, against kvkit
    ``full`` (eager) and against ``full static+compile`` (when measured)."""
    full = next((r for r in rows if r["name"] == "full" and r.get("status") == "ok"), None)
    fullc = next((r for r in rows if r["name"] == compiled_name("full") and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["weights_bytes"] = weights
        r["bandwidth_bytes_s"] = round(bandwidth)
        r["byte_bound_ms"] = sig(byte_bound_ms(weights, r["kv_read_step"], bandwidth), 5)
        t_full = r.get("full_ms_paired") or (full["step_ms"] if full else None)
        r["t_full_ms"] = t_full
        r["speedup_vs_full"] = sig(t_full / r["step_ms"]) if t_full else None
        f = fraction_to_bound(t_full, r["step_ms"], r["byte_bound_ms"])
        r["fraction_to_bound"] = None if f is None else sig(f)
        t_fc = fullc["step_ms"] if fullc else None
        r["t_full_compiled_ms"] = t_fc
        r["speedup_vs_full_compiled"] = sig(t_fc / r["step_ms"]) if t_fc else None
        f = fraction_to_bound(t_fc, r["step_ms"], r["byte_bound_ms"])
        r["fraction_to_bound_vs_full_compiled"] = None if f is None else sig(f)
