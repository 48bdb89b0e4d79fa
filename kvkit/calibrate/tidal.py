"""``kvkit calibrate tidal``: TidalDecode's selection layers from a needle sweep, then the reuse layers' shares.

:func:`calibrate_tidal` returns ``(options, evidence)``: ``select_layers`` (the layout answering the most calibration
needles, each layout at the budget that puts its decode reads at a fraction of full attention's) and, with shares,
``layer_shares`` (:func:`calibrate_tidal_shares`: the reuse layers' budgets that equalise the attention mass their
reads capture, their mean unchanged); written by :func:`kvkit.calibration.write_section`. The read arithmetic
(:func:`tidal_read_fraction`, :func:`tidal_budget_for`) is what a tidal decode step reads
(:func:`kvkit.policies.tidal.decode_read_bytes`).
"""

from __future__ import annotations

import math
import time

import torch

import kvkit
from kvkit import calibration
from kvkit.calibrate import needles
from kvkit.calibrate.parsers import tidal_command
from kvkit.calibrate.registry import calibrator
from kvkit.calibrate.search import mean_logprob
from kvkit.compat import cache_kw
from kvkit.policies.tidal import Tidal, TidalStore, group_score, union_ranks
from kvkit.stores import attend_slots
from kvkit.workloads.prompts import encode


# ---- layouts and their reads ----------------------------------------------------------------------------------
def tidal_candidates(num_layers: int) -> list[tuple[int, ...]]:
    """Selection-layer layouts to try: layer 2 plus one re-selection layer at 0.2 .. 0.8 of depth (the
    paper's is 0.4), layer 2 plus several re-selection layers from 0.4 of depth on, and evenly spaced
    re-selection (every 2nd .. 8th layer from layer 2: small models need fresher selections)."""
    L = num_layers
    singles = sorted({min(L - 1, max(4, round(f * L))) for f in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)})
    out = [(2, r) for r in singles]
    multi = tuple(sorted({2, *(min(L - 1, max(3, round(f * L))) for f in (0.4, 0.5, 0.6, 0.7))}))
    if multi not in out:
        out.append(multi)
    multi2 = tuple(sorted({2, *(min(L - 1, max(3, round(f * L))) for f in (0.5, 0.7))}))
    if multi2 not in out:
        out.append(multi2)
    for stride in (8, 6, 5, 4, 3, 2):
        even = tuple(range(2, L, stride))
        if len(even) > 1 and even not in out:
            out.append(even)
    return out


def tidal_read_fraction(layout, num_layers: int, held: int, budget: int, layer_shares=None) -> float:
    """K/V read per decode step by tidal with ``layout`` as selection layers, as a fraction of full attention's,
    at ``held`` tokens: the layers before the first selection layer read everything, the reuse layers ``budget + 1``
    rows (kv_head selection; with ``layer_shares`` each its own budget, :meth:`Tidal.layer_budgets`), the selection
    layers everything."""
    f = min(1.0, (budget + 1) / held)
    reuse = num_layers - layout[0] - len(layout)
    if layer_shares is None:
        reuse_reads = reuse * f
    else:
        ks = Tidal(budget=budget, select_layers=tuple(layout), layer_shares=layer_shares).layer_budgets(num_layers)
        reuse_reads = sum(min(1.0, (ks[i] + 1) / held) for i in range(layout[0], num_layers) if i not in layout)
    return (layout[0] + len(layout) + reuse_reads) / num_layers


def tidal_budget_for(layout, num_layers: int, held: int, read_fraction: float) -> int | None:
    """The largest budget whose decode reads stay within ``read_fraction`` of full attention's at ``held``
    tokens (None: the layout's full-read layers alone exceed it, or no reuse layer is left)."""
    S = len(layout)
    reuse = num_layers - layout[0] - S
    if reuse <= 0:
        return None
    f = (read_fraction * num_layers - layout[0] - S) / reuse
    b = int(f * held) - 1
    return b if b >= 16 else None


# ---- the layout sweep -----------------------------------------------------------------------------------------
def calibrate_tidal(model, tokenizer, length: int = 4096, samples: int = 12, budget_fraction: float | None = None,
                    read_fraction: float | None = 0.5, selection: str = "shared", seed: int = 0,
                    values: str = "mixed", log=print, layout=None, shares: bool = True) -> tuple[dict, dict]:
    """The selection layers that answer the most calibration needles, then (``shares``, with ``read_fraction``) the
    reuse layers' ``layer_shares`` for them (:func:`calibrate_tidal_shares`, on the same samples). ``layout``: skip
    the needle sweep and take these selection layers (e.g. a model's earlier calibration), computing only the shares.

    ``read_fraction`` (default): every layout is given the budget that makes its decode reads that fraction of
    full attention's (more selection layers -> fresher selections but a smaller budget). ``budget_fraction``
    instead: one budget ``budget_fraction * length`` for every layout (denser layouts then read more). Ties:
    the higher mean teacher-forced log-probability of the answers
    (:func:`kvkit.calibrate.needles.answer_logprob`), then fewer selection layers (less ranking work).
    ``values``: the needles' values (:data:`kvkit.calibrate.needles.VALUE_KINDS`)."""
    t0 = time.perf_counter()
    L = model.config.get_text_config(decoder=True).num_hidden_layers
    _check_fractions(L, budget_fraction, read_fraction)
    if shares and read_fraction is not None and selection not in SHARE_SELECTIONS:
        raise ValueError(f"tidal calibration: layer shares are measured for selection {' or '.join(SHARE_SELECTIONS)} "
                         f"(one ranking per KV head); got selection={selection!r}: pass --no-shares, or another "
                         "--selection")
    kw = dict(length=length, samples=samples, seed=seed, values=values, log=log)
    if layout is not None:
        return _given_layout(model, tokenizer, tuple(layout), L, read_fraction, shares, selection=selection, **kw)
    data = needles.make_samples(tokenizer, samples, length, seed=seed, values=values)
    held = length  # the calibration prompts' length (within 3%)
    specs = _layout_specs(L, held, length, budget_fraction, read_fraction, selection)
    res = needles.score_policies(model, tokenizer, data, specs, log=log, margin=True)
    table = _layout_table(res, specs, L, held)
    best = max(range(len(specs)), key=lambda i: (table[specs[i][0]]["answered"],
                                                 table[specs[i][0]].get("answer_logprob", 0.0),
                                                 -len(specs[i][2]["select_layers"]), -i))
    chosen = specs[best][2]
    evidence = {
        "criterion": _criterion(read_fraction, length, selection, specs),
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "full_answer_logprob": mean_logprob(res, "full"),
        "per_layout": table,
        "paper_layout": [2, round(0.4 * L)],
        "chosen_budget_fraction": round(chosen["budget"] / held, 4),
        "predictions": res["predictions"],
        "data": needles.describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    opts = {"select_layers": list(chosen["select_layers"])}
    if shares and read_fraction is not None:
        opts, evidence["shares"] = calibrate_tidal_shares(model, tokenizer, chosen["select_layers"],
                                                          read_fraction=read_fraction, selection=selection, **kw)
        evidence["seconds"] = round(time.perf_counter() - t0, 1)
    return opts, evidence


def _check_fractions(num_layers: int, budget_fraction, read_fraction) -> None:
    if num_layers < 5:
        raise ValueError(f"tidal calibration needs a model with at least 5 layers, this one has {num_layers}")
    if (budget_fraction is None) == (read_fraction is None):
        raise ValueError("tidal calibration: give read_fraction or budget_fraction, not both")
    frac = read_fraction if read_fraction is not None else budget_fraction
    if not 0 < frac < 1:
        raise ValueError(f"tidal calibration: the fraction must be in (0, 1); got {frac}")


def _given_layout(model, tokenizer, layout: tuple, num_layers: int, read_fraction, shares: bool,
                  **kw) -> tuple[dict, dict]:
    """``calibrate_tidal`` with the selection layers given: only their shares (refused without a read fraction)."""
    Tidal(select_layers=layout).selection_layers(num_layers)  # a malformed layout is refused before any forward
    if not shares or read_fraction is None:
        raise ValueError("tidal calibration: a given layout (--select-layers) calibrates only the layer shares, "
                         "which need --read-fraction (not --budget-fraction or --no-shares)")
    opts, ev = calibrate_tidal_shares(model, tokenizer, layout, read_fraction=read_fraction, **kw)
    return opts, {"layout": "given (not swept)", "shares": ev, "seconds": ev["seconds"]}


def _layout_specs(num_layers: int, held: int, length: int, budget_fraction, read_fraction, selection: str) -> list:
    """``(label, "tidal", options)`` per candidate layout that has a budget (at the read fraction, else one
    ``budget_fraction * length`` for all); refused when none has."""
    specs = []
    for c in tidal_candidates(num_layers):
        if read_fraction is None:
            b = max(1, int(budget_fraction * length))
        else:
            b = tidal_budget_for(c, num_layers, held, read_fraction)
        if b is not None:
            specs.append((",".join(map(str, c)), "tidal", dict(budget=b, selection=selection, select_layers=c)))
    if not specs:
        raise ValueError(f"tidal calibration: no selection layout reads at most {read_fraction} of full attention")
    return specs


def _layout_table(res: dict, specs: list, num_layers: int, held: int) -> dict:
    """Per layout: needles answered, its budget, its decode reads and (when scored) the answers' log-probability."""
    table = needles.summarize(res, [s[0] for s in specs])
    for lab, _, o in specs:
        row = table[lab]
        row["budget"] = o["budget"]
        row["read_fraction"] = round(tidal_read_fraction(o["select_layers"], num_layers, held, o["budget"]), 3)
        lp = mean_logprob(res, lab)
        if lp is not None:
            row["answer_logprob"] = lp
    return table


def _criterion(read_fraction, length: int, selection: str, specs: list) -> str:
    if read_fraction is not None:
        return (f"most needles answered with decode reads at {read_fraction} of full attention's at ~{length} tokens "
                f"(each layout's budget set to match; selection={selection}); ties: the higher mean teacher-forced "
                "log-probability of the answers (answer_logprob), then fewer selection layers")
    return (f"most needles answered at budget {specs[0][2]['budget']} of ~{length} tokens (selection={selection}); "
            "ties: the higher answer_logprob, then fewer selection layers")


# ---- the reuse layers' shares ---------------------------------------------------------------------------------
TIDAL_SHARE_GRID = 64  # budget fractions 1/64 .. 64/64 of the held tokens for the per-layer shares
SHARE_SELECTIONS = ("shared", "kv_head")  # selections with one ranking per KV head, whose reads shares can size


@torch.no_grad()
def tidal_capture_curves(model, tokenizer, layout, data, grid: int = TIDAL_SHARE_GRID, kv_reduce: str = "max",
                         selection: str = "shared"):
    """Per layer, the attention mass a reuse layer's read would capture at each budget fraction ``j / grid``.

    Each sample's context is prefilled exactly, then its question and answer are fed one token per forward (decode
    steps); at each step a selection layer ranks the tokens before the current one as tidal's ``selection`` does
    ("shared": the round-robin union of its query heads' rankings, one list for every head; "kv_head": softmax over
    each query group, reduced by ``kv_reduce``) and every reuse layer after it records how much of
    its own exact attention probability falls on the top ``ceil(j / grid * (n - 1))`` of that ranking plus the
    current token (averaged over its query heads). The model runs exact attention throughout (the reads are only
    measured). Returns ``{layer: [captured mass at fraction 1/grid, ..., 1]}`` for the reuse layers."""
    if selection not in SHARE_SELECTIONS:
        raise ValueError(f"tidal capture curves: selection must be one of {SHARE_SELECTIONS}, got {selection!r}")

    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    ranking = {}

    def measure(self, query, qpos, scaling):
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        if T == 1 and self.role != "full" and n > 2:
            G = Hq // H
            s = torch.matmul(query.float().reshape(B, H, G, D), self.keys.float().transpose(-1, -2)) * scaling
            p = torch.softmax(s, dim=-1)  # [B, H, G, n]; the last slot is the current token
            if self.role == "select":
                if selection == "shared":
                    heads = s[..., : n - 1].reshape(B, Hq, 1, n - 1).argsort(dim=-1, descending=True)
                    order = union_ranks(heads, None, n - 1, H)[0][:, :, 0]  # [B, H, n-1], the same for every head
                else:
                    order = group_score(p[..., : n - 1], kv_reduce).argsort(dim=-1, descending=True)
                ranking["order"], ranking["seen"] = order, self.seen
            elif ranking.get("seen") == self.seen:
                order = ranking["order"].unsqueeze(2).expand(B, H, G, n - 1)
                cum = p[..., : n - 1].gather(-1, order).cumsum(dim=-1) + p[..., n - 1 :]
                ks = [max(1, math.ceil(j / grid * (n - 1))) - 1 for j in range(1, grid + 1)]
                got = cum[..., ks].mean(dim=(0, 1, 2)).double()
                i = self.info.layer_idx
                sums[i] = sums.get(i, 0) + got
                counts[i] = counts.get(i, 0) + 1
        return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling)

    orig = TidalStore.decode
    TidalStore.decode = measure
    try:
        kvkit.patch(model, "tidal", budget=1, selection=selection, select_layers=list(layout), calibrated=False)
        try:
            for smp in data:
                ctx = encode(tokenizer, smp.prompt[: smp.context_end])
                rest = encode(tokenizer, smp.prompt[smp.context_end:] + " " + smp.answer)[0]
                cache = kvkit.KVCache(model)
                model(ctx.to(model.device), **cache_kw(cache), use_cache=True)
                for t in rest.tolist():
                    model(torch.tensor([[t]], device=model.device), **cache_kw(cache), use_cache=True)
        finally:
            kvkit.unpatch(model)
    finally:
        TidalStore.decode = orig
    return {i: (sums[i] / counts[i]).tolist() for i in sorted(sums)}


def tidal_share_steps(curves: dict, fraction: float, grid: int = TIDAL_SHARE_GRID) -> dict:
    """Grid steps (budget fraction ``steps / grid``) per reuse layer that equalise the attention mass their reads
    capture, the mean held at ``fraction``: from one step each, every step of ``1 / grid`` goes to the reuse layer
    capturing the least (max-min water-filling on the ``curves`` of :func:`tidal_capture_curves`)."""
    layers = sorted(curves)
    steps = max(len(layers), round(fraction * grid * len(layers)))
    at = {i: 1 for i in layers}
    for _ in range(steps - len(layers)):
        open_ = [i for i in layers if at[i] < grid]
        if not open_:
            break
        at[min(open_, key=lambda i: (curves[i][at[i] - 1], i))] += 1
    return at


def tidal_shares_from_curves(curves: dict, num_layers: int, fraction: float, grid: int = TIDAL_SHARE_GRID) -> list:
    """Per-layer shares (one per model layer, 1.0 for the layers that are not reuse layers) from
    :func:`tidal_share_steps`: each reuse layer's steps over their mean. Layers whose attention is spread over
    many tokens gain budget, layers whose attention is concentrated (where a uniform budget misses the least)
    give it up; what this does on the default model: results/ruler/README.md."""
    return _shares_from_steps(tidal_share_steps(curves, fraction, grid), num_layers)


def _shares_from_steps(at: dict, num_layers: int) -> list:
    mean = sum(at.values()) / len(at)
    return [round(at[i] / mean, 3) if i in at else 1.0 for i in range(num_layers)]


def calibrate_tidal_shares(model, tokenizer, layout, length: int = 4096, samples: int = 6, read_fraction: float = 0.5,
                           seed: int = 0, values: str = "number", log=print,
                           selection: str = "shared") -> tuple[dict, dict]:
    """``layer_shares`` for selection layers ``layout`` and tidal's ``selection`` ("shared" or "kv_head"): the reuse layers' budgets that equalise the attention mass
    their reads capture (:func:`tidal_capture_curves` on kvkit's needle samples) at the budget whose decode reads are
    ``read_fraction`` of full attention's; their mean budget is unchanged, so are the reads."""
    t0 = time.perf_counter()
    L = model.config.get_text_config(decoder=True).num_hidden_layers
    layout = tuple(layout)
    b = tidal_budget_for(layout, L, length, read_fraction)
    if b is None:
        raise ValueError(f"tidal calibration: layout {list(layout)} leaves no budget at read fraction {read_fraction}")
    frac = (b + 1) / length
    data = needles.make_samples(tokenizer, samples, length, seed=seed, values=values)
    curves = tidal_capture_curves(model, tokenizer, layout, data, selection=selection)
    at = tidal_share_steps(curves, frac)
    shares = _shares_from_steps(at, L)
    g = TIDAL_SHARE_GRID
    uni = {i: c[max(0, round(frac * g) - 1)] for i, c in curves.items()}
    got = {i: c[at[i] - 1] for i, c in curves.items()}
    log(f"tidal shares at budget {b} ({frac:.3f} of {length}): captured attention mass, least over the reuse layers "
        f"{min(uni.values()):.4f} -> {min(got.values()):.4f}, mean {sum(uni.values()) / len(uni):.4f} -> "
        f"{sum(got.values()) / len(got):.4f}")
    evidence = {
        "criterion": (f"reuse-layer budgets that equalise the attention mass their reads capture (max-min water-filling "
                      f"in steps of 1/{g} of the held tokens) with their mean held at budget {b} of ~{length} tokens "
                      f"(decode reads {read_fraction} of full attention's); the selection as tidal's {selection}"
                      f"{' max' if selection == 'kv_head' else ''}; "
                      "teacher-forced question and answer tokens as the decode queries"),
        "budget_at_read_fraction": b,
        "captured_uniform": {str(i): round(v, 4) for i, v in uni.items()},
        "captured_shared": {str(i): round(v, 4) for i, v in got.items()},
        "data": needles.describe_data(values),
        "samples": samples,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"select_layers": list(layout), "layer_shares": shares}, evidence


# ---- the command ----------------------------------------------------------------------------------------------
@calibrator("tidal", command=tidal_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    layout = args.select_layers
    read_fraction = (args.read_fraction if args.read_fraction is not None else
                     None if args.budget_fraction is not None else 0.5)
    opts, ev = calibrate_tidal(model, tokenizer, length=args.length, samples=args.samples,
                               budget_fraction=args.budget_fraction, read_fraction=read_fraction,
                               selection=args.selection, seed=args.seed, values=args.values, log=log, layout=layout,
                               shares=not args.no_shares)
    if layout is not None:
        _keep_layout_evidence(ev, out, layout)
    return opts, ev


def _keep_layout_evidence(ev: dict, out, layout: tuple) -> None:
    """With the layout given, keep the sweep that chose it from the section ``out`` holds for the same layers (that
    section is about to be replaced): its command and evidence as ``layout_command`` / ``layout_evidence``."""
    from pathlib import Path

    old = calibration.read(out)["policies"].get("tidal") if Path(out).exists() else None
    if old is not None and tuple(old["options"].get("select_layers") or ()) == layout:
        ev["layout_command"] = old.get("evidence", {}).get("layout_command", old.get("command"))
        ev["layout_evidence"] = old.get("evidence", {}).get("layout_evidence", old.get("evidence"))
