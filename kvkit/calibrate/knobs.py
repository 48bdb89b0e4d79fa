"""Per-model knobs: ShadowKV rank, TidalDecode selection layers, ZipCache bit widths.

Each ``calibrate_*`` returns ``(options, evidence)``: the options the policy's calibration section sets and
what they were chosen from (per-rank key error, per-candidate needle counts), written by
:func:`kvkit.calibrate.store.write_section` with the command that made them.
"""

from __future__ import annotations

import math
import time

import torch


# ---- ShadowKV: rank from the spectral energy of the pre-RoPE keys ------------------------------------------
def _key_modules(model):
    """Per decoder layer (in order): the module whose output is the layer's pre-RoPE keys (``k_norm`` when the
    attention has one, else ``k_proj``)."""
    mods = []
    for name, m in model.named_modules():
        if hasattr(m, "k_proj") and hasattr(m, "layer_idx"):
            mods.append((m.layer_idx, getattr(m, "k_norm", None) or m.k_proj))
    return [m for _, m in sorted(mods, key=lambda x: x[0])]


@torch.no_grad()
def pre_rope_keys(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The pre-RoPE keys of every layer for one sequence: ``[S, Hkv*D]`` fp32 per layer."""
    mods = _key_modules(model)
    if not mods:
        raise ValueError("shadowkv calibration: found no attention modules with k_proj and a layer_idx")
    got: list = [None] * len(mods)

    def hook(i):
        def f(_m, _inp, out):
            got[i] = out.detach().reshape(out.shape[0], out.shape[1], -1)[0].float()
        return f

    hs = [m.register_forward_hook(hook(i)) for i, m in enumerate(mods)]
    try:
        model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in hs:
            h.remove()
    return got


def key_rank_errors(keys: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error of the best rank-r approximation of ``keys [S, W]`` for r = 0..W:
    ``sqrt(sum_{i>r} s_i^2 / sum s_i^2)`` (what ShadowKV's truncated SVD loses)."""
    s2 = torch.linalg.svdvals(keys.double()) ** 2
    tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])  # tail[r] = sum_{i>=r} s_i^2
    err = (tail / s2.sum()).clamp(min=0).sqrt()
    W = keys.shape[1]
    if err.numel() < W + 1:  # S < W: rank >= S is exact
        err = torch.cat([err, err.new_zeros(W + 1 - err.numel())])
    return err.float()


def calibrate_shadowkv(model, tokenizer, length: int = 2048, samples: int = 3, max_error: float = 0.10,
                       multiple: int = 8, seed: int = 0, log=print) -> tuple[dict, dict]:
    """Smallest rank (a multiple of ``multiple``) whose rebuilt pre-RoPE keys have a relative error of at most
    ``max_error`` in every layer, averaged over ``samples`` essay excerpts of ``length`` tokens."""
    from kvkit.calibrate.needles import essay_text

    if not 0 < max_error < 1:
        raise ValueError(f"shadowkv calibration: max_error must be in (0, 1), got {max_error!r}")
    t0 = time.perf_counter()
    text = essay_text()
    g = torch.Generator().manual_seed(seed)
    errs = None
    for i in range(samples):
        off = int(torch.randint(0, len(text) - 8 * length, (1,), generator=g))
        ids = tokenizer.encode(text[off: off + 6 * length], add_special_tokens=False)[:length]
        keys = pre_rope_keys(model, torch.tensor([ids]))
        e = torch.stack([key_rank_errors(k) for k in keys])  # [L, W+1]
        errs = e if errs is None else errs + e
        log(f"sample {i}: {len(ids)} tokens, {len(keys)} layers, key width {keys[0].shape[1]}")
    errs /= samples
    L, W = errs.shape[0], errs.shape[1] - 1
    worst = errs.max(dim=0).values  # [W+1]
    ok = [r for r in range(1, W + 1) if worst[r] <= max_error]
    rank = ok[0] if ok else W
    rank = min(W, multiple * math.ceil(rank / multiple))
    paper = max(1, round(160 / 1024 * W))
    grid = sorted({paper, rank, *range(multiple, W + 1, max(multiple, W // 12)), W})
    per_rank = {str(r): {"max_layer_error": round(float(worst[r]), 4), "mean_layer_error": round(float(errs[:, r].mean()), 4)}
                for r in grid}
    evidence = {
        "criterion": f"smallest rank (multiple of {multiple}) with relative key error <= {max_error} in every layer",
        "key_width": W, "layers": L, "samples": samples, "tokens_per_sample": length,
        "paper_rank": paper,
        "paper_rank_error_per_layer": [round(float(x), 3) for x in errs[:, paper]],
        "chosen_rank_error_per_layer": [round(float(x), 3) for x in errs[:, rank]],
        "key_error_per_rank": per_rank,
        "data": "essay excerpts from the last third of PaulGrahamEssays.json (not RULER's haystack start)",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"rank": rank}, evidence


# ---- TidalDecode: selection layers from a needle sweep ----------------------------------------------------
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


def tidal_read_fraction(layout, num_layers: int, held: int, budget: int, select_attention: str = "full",
                        layer_shares=None) -> float:
    """K/V read per decode step by tidal with ``layout`` as selection layers, as a fraction of full attention's,
    at ``held`` tokens: the layers before the first selection layer read everything, the reuse layers ``budget + 1``
    rows (kv_head selection; with ``layer_shares`` each its own budget, :meth:`Tidal.layer_budgets`), the selection
    layers everything (``select_attention="full"``, the paper) or every key and ``budget + 1`` values ("selected")."""
    f = min(1.0, (budget + 1) / held)
    sel = 1.0 if select_attention == "full" else 0.5 + 0.5 * f
    reuse = num_layers - layout[0] - len(layout)
    if layer_shares is None:
        reuse_reads = reuse * f
    else:
        from kvkit.policies.tidal import Tidal

        ks = Tidal(budget=budget, select_layers=tuple(layout), layer_shares=layer_shares).layer_budgets(num_layers)
        reuse_reads = sum(min(1.0, (ks[i] + 1) / held) for i in range(layout[0], num_layers) if i not in layout)
    return (layout[0] + len(layout) * sel + reuse_reads) / num_layers


def tidal_budget_for(layout, num_layers: int, held: int, read_fraction: float,
                     select_attention: str = "full") -> int | None:
    """The largest budget whose decode reads stay within ``read_fraction`` of full attention's at ``held``
    tokens (None: the layout's full-read layers alone exceed it, or no reuse layer is left)."""
    S = len(layout)
    reuse = num_layers - layout[0] - S
    if reuse <= 0:
        return None
    if select_attention == "full":
        f = (read_fraction * num_layers - layout[0] - S) / reuse
    else:
        f = (read_fraction * num_layers - layout[0] - 0.5 * S) / (0.5 * S + reuse)
    b = int(f * held) - 1
    return b if b >= 16 else None


def calibrate_tidal(model, tokenizer, length: int = 4096, samples: int = 12, budget_fraction: float | None = None,
                    read_fraction: float | None = 0.5, selection: str = "kv_head", seed: int = 0,
                    values: str = "mixed", log=print, layout=None, shares: bool = True) -> tuple[dict, dict]:
    """The selection layers that answer the most calibration needles, then (``shares``, with ``read_fraction``) the
    reuse layers' ``layer_shares`` for them (:func:`calibrate_tidal_shares`, on the same samples). ``layout``: skip
    the needle sweep and take these selection layers (e.g. a model's earlier calibration), computing only the shares.

    ``read_fraction`` (default): every layout is given the budget that makes its decode reads that fraction of
    full attention's (more selection layers -> fresher selections but a smaller budget). ``budget_fraction``
    instead: one budget ``budget_fraction * length`` for every layout (the first calibration, which let denser
    layouts read more). Ties: the higher mean teacher-forced log-probability of the answers
    (:func:`kvkit.calibrate.needles.answer_logprob`), then fewer selection layers (less ranking work). ``values``:
    the needles' values (:data:`kvkit.calibrate.needles.VALUE_KINDS`)."""
    from kvkit.calibrate.needles import describe_data, make_samples, score_policies, summarize

    t0 = time.perf_counter()
    L = model.config.get_text_config(decoder=True).num_hidden_layers
    if L < 5:
        raise ValueError(f"tidal calibration needs a model with at least 5 layers, this one has {L}")
    if (budget_fraction is None) == (read_fraction is None):
        raise ValueError("tidal calibration: give read_fraction or budget_fraction, not both")
    frac = read_fraction if read_fraction is not None else budget_fraction
    if not 0 < frac < 1:
        raise ValueError(f"tidal calibration: the fraction must be in (0, 1); got {frac}")
    if layout is not None:
        layout = tuple(layout)
        from kvkit.policies.tidal import Tidal

        Tidal(select_layers=layout).selection_layers(L)  # a malformed layout is refused before any forward
        if not shares or read_fraction is None:
            raise ValueError("tidal calibration: a given layout (--select-layers) calibrates only the layer shares, "
                             "which need --read-fraction (not --budget-fraction or --no-shares)")
        opts, ev = calibrate_tidal_shares(model, tokenizer, layout, length=length, samples=samples,
                                          read_fraction=read_fraction, seed=seed, values=values, log=log)
        return opts, {"layout": "given (not swept)", "shares": ev, "seconds": ev["seconds"]}
    data = make_samples(tokenizer, samples, length, seed=seed, values=values)
    held = length  # the calibration prompts' length (within 3%)
    specs = []
    for c in tidal_candidates(L):
        b = max(1, int(budget_fraction * length)) if read_fraction is None else tidal_budget_for(c, L, held, read_fraction)
        if b is not None:
            specs.append((",".join(map(str, c)), "tidal", dict(budget=b, selection=selection, select_layers=c)))
    if not specs:
        raise ValueError(f"tidal calibration: no selection layout reads at most {read_fraction} of full attention")
    res = score_policies(model, tokenizer, data, specs, log=log, margin=True)
    table = summarize(res, [s[0] for s in specs])
    lp = res.get("logprob", {})
    for lab, _, o in specs:
        row = table[lab]
        row["budget"] = o["budget"]
        row["read_fraction"] = round(tidal_read_fraction(o["select_layers"], L, held, o["budget"]), 3)
        if lp.get(lab):
            row["answer_logprob"] = round(sum(lp[lab]) / len(lp[lab]), 4)
    best = max(range(len(specs)), key=lambda i: (table[specs[i][0]]["answered"],
                                                 table[specs[i][0]].get("answer_logprob", 0.0),
                                                 -len(specs[i][2]["select_layers"]), -i))
    paper = (2, round(0.4 * L))
    if read_fraction is not None:
        crit = (f"most needles answered with decode reads at {read_fraction} of full attention's at ~{length} tokens "
                f"(each layout's budget set to match; selection={selection}); ties: the higher mean teacher-forced "
                "log-probability of the answers (answer_logprob), then fewer selection layers")
    else:
        crit = (f"most needles answered at budget {specs[0][2]['budget']} of ~{length} tokens (selection={selection}); "
                "ties: the higher answer_logprob, then fewer selection layers")
    chosen = specs[best][2]
    evidence = {
        "criterion": crit,
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "full_answer_logprob": (round(sum(lp["full"]) / len(lp["full"]), 4) if lp.get("full") else None),
        "per_layout": table,
        "paper_layout": list(paper),
        "chosen_budget_fraction": round(chosen["budget"] / held, 4),
        "predictions": res["predictions"],
        "data": describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    opts = {"select_layers": list(chosen["select_layers"])}
    if shares and read_fraction is not None:
        opts, evidence["shares"] = calibrate_tidal_shares(model, tokenizer, chosen["select_layers"], length=length,
                                                          samples=samples, read_fraction=read_fraction, seed=seed,
                                                          values=values, log=log)
        evidence["seconds"] = round(time.perf_counter() - t0, 1)
    return opts, evidence


TIDAL_SHARE_GRID = 64  # budget fractions 1/64 .. 64/64 of the held tokens for the per-layer shares


@torch.no_grad()
def tidal_capture_curves(model, tokenizer, layout, data, grid: int = TIDAL_SHARE_GRID, kv_reduce: str = "max"):
    """Per layer, the attention mass a reuse layer's read would capture at each budget fraction ``j / grid``.

    Each sample's context is prefilled exactly, then its question and answer are fed one token per forward (decode
    steps); at each step a selection layer ranks the tokens before the current one as tidal's ``kv_head`` selection
    does (softmax over its query group, reduced by ``kv_reduce``) and every reuse layer after it records how much of
    its own exact attention probability falls on the top ``ceil(j / grid * (n - 1))`` of that ranking plus the
    current token (averaged over its query heads). The model runs exact attention throughout (the reads are only
    measured). Returns ``{layer: [captured mass at fraction 1/grid, ..., 1]}`` for the reuse layers."""
    import kvkit
    from kvkit.compat import cache_kw
    from kvkit.evals.common import encode
    from kvkit.policies.tidal import TidalStore, group_score
    from kvkit.stores import attend_slots

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
                score = group_score(p[..., : n - 1], kv_reduce)
                ranking["order"], ranking["seen"] = score.argsort(dim=-1, descending=True), self.seen
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
        kvkit.patch(model, "tidal", budget=1, selection="kv_head", select_layers=list(layout), calibrated=False)
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
    :func:`tidal_share_steps`: each reuse layer's steps over their mean. On SmolLM2 this lifts the layers that read a
    needle (19, 21) and takes from layers whose attention is concentrated (16, 25), where a uniform budget misses the
    least."""
    return _shares_from_steps(tidal_share_steps(curves, fraction, grid), num_layers)


def _shares_from_steps(at: dict, num_layers: int) -> list:
    mean = sum(at.values()) / len(at)
    return [round(at[i] / mean, 3) if i in at else 1.0 for i in range(num_layers)]


def calibrate_tidal_shares(model, tokenizer, layout, length: int = 4096, samples: int = 6, read_fraction: float = 0.5,
                           seed: int = 0, values: str = "number", log=print) -> tuple[dict, dict]:
    """``layer_shares`` for selection layers ``layout``: the reuse layers' budgets that equalise the attention mass
    their reads capture (:func:`tidal_capture_curves` on kvkit's needle samples) at the budget whose decode reads are
    ``read_fraction`` of full attention's; their mean budget is unchanged, so are the reads."""
    from kvkit.calibrate.needles import describe_data, make_samples

    t0 = time.perf_counter()
    L = model.config.get_text_config(decoder=True).num_hidden_layers
    layout = tuple(layout)
    b = tidal_budget_for(layout, L, length, read_fraction)
    if b is None:
        raise ValueError(f"tidal calibration: layout {list(layout)} leaves no budget at read fraction {read_fraction}")
    frac = (b + 1) / length
    data = make_samples(tokenizer, samples, length, seed=seed, values=values)
    curves = tidal_capture_curves(model, tokenizer, layout, data)
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
                      f"(decode reads {read_fraction} of full attention's); the selection as tidal's kv_head max; "
                      "teacher-forced question and answer tokens as the decode queries"),
        "budget_at_read_fraction": b,
        "captured_uniform": {str(i): round(v, 4) for i, v in uni.items()},
        "captured_shared": {str(i): round(v, 4) for i, v in got.items()},
        "data": describe_data(values),
        "samples": samples,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"select_layers": list(layout), "layer_shares": shares}, evidence


# ---- ZipCache: the cheapest bit widths that keep the needles -----------------------------------------------
def zipcache_bits(o: dict) -> float:
    """Mean code bits per token and KV head element, keys + values (statistics not counted)."""
    hr, hb, lb = o.get("high_ratio", 0.6), o.get("high_bits", 4), o.get("low_bits", 2)
    v = hr * hb + (1 - hr) * lb
    k = o["key_bits"] if o.get("key_bits") else v
    return k + v


ZIPCACHE_CANDIDATES = [
    dict(high_ratio=0.6, high_bits=4, low_bits=2),  # the paper
    dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=4),
    dict(high_ratio=0.8, high_bits=4, low_bits=2, key_bits=4),
    dict(high_ratio=1.0, high_bits=4, low_bits=4, key_bits=4),
    dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=8),
    dict(high_ratio=0.4, high_bits=8, low_bits=4),
    dict(high_ratio=0.6, high_bits=8, low_bits=4),
    dict(high_ratio=0.6, high_bits=8, low_bits=4, key_bits=8),
]


def calibrate_zipcache(model, tokenizer, length: int = 2048, samples: int = 8, seed: int = 0,
                       values: str = "mixed", log=print) -> tuple[dict, dict]:
    """The candidate with the fewest code bits that answers every needle the full cache answers (the most
    expensive candidate if none does). Each sample's context is prefilled once (recorded, kept in memory) and
    answered with the full cache; then the candidates run in order of bytes, each stopping at its first miss,
    and the first that answers every needle ends the sweep (the more expensive ones are not run)."""
    import kvkit
    from kvkit.calibrate.needles import describe_data, make_samples
    from kvkit.evals.common import encode, generate
    from kvkit.evals.shared_prefill import record_prefill

    t0 = time.perf_counter()
    data = make_samples(tokenizer, samples, length, seed=seed, values=values)
    cands = sorted(ZIPCACHE_CANDIDATES, key=zipcache_bits)
    label = lambda o: ",".join(f"{k}={v}" for k, v in o.items())  # noqa: E731
    recs, n_full, per, preds, chosen = [], 0, {}, {}, None
    try:
        for s in data:
            kvkit.patch(model, "full")
            rec = record_prefill(model, encode(tokenizer, s.prompt[: s.context_end]).to(model.device))
            g = generate(model, tokenizer, s.prompt, s.max_new_tokens, s.context_end, replay=rec)
            ok = s.answer in g.text
            log(f"{s.id} ({s.needles} needle(s), depth {s.depth:.2f}, {g.prompt_tokens} tok): full "
                f"{'ok' if ok else 'MISS ' + repr(g.text.strip()[:20])}")
            if ok:
                recs.append((s, rec))
            else:
                del rec
        n_full = len(recs)
        for o in cands:
            kvkit.patch(model, "zipcache", **dict(o, calibrated=False))
            hits = []
            for s, rec in recs:
                gc = generate(model, tokenizer, s.prompt, s.max_new_tokens, s.context_end, replay=rec)
                hits.append(int(s.answer in gc.text))
                preds.setdefault(label(o), {})[s.id] = gc.text.strip()[:40]
                if not hits[-1]:
                    break
            kept = len(hits) == n_full and all(hits)
            per[label(o)] = {"answered": sum(hits), "tried": len(hits), "of": n_full, "kept_all": kept,
                             "bits_per_element_k_plus_v": round(zipcache_bits(o), 2)}
            log(f"zipcache {label(o)}: {sum(hits)}/{len(hits)} tried of {n_full}{' -> kept all' if kept else ''}")
            if kept:
                chosen = o
                break
    finally:
        kvkit.unpatch(model)
    if chosen is None:
        chosen = cands[-1]
    evidence = {
        "criterion": "fewest code bits (keys + values) that answer every needle the full cache answers; "
                     "candidates in order of bits, each stops at its first miss ('tried' < 'of'), the first "
                     "that keeps all ends the sweep (costlier candidates not run)",
        "needles_answered_by_full": f"{n_full}/{len(data)}",
        "per_setting": per,
        "paper_setting": label(ZIPCACHE_CANDIDATES[0]),
        "predictions": preds,
        "data": describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return dict(chosen), evidence


# ---- pooling candidates (CAKE's and SnapKV's calibrations) -------------------------------------------------
def _window_option(window: str) -> dict:
    """A pooling candidate's ``pool_window`` option: none for the papers' centered window (files stay as before)."""
    return {} if window == "centered" else {"pool_window": window}


def _picked(options: dict, names) -> dict:
    """The calibrated options of the chosen candidate (``names`` it sets, in order)."""
    return {k: options[k] for k in names if k in options}


# ---- CAKE: the layer-preference temperatures from a needle sweep --------------------------------------------
CAKE_TAUS = [(1.0, 1.0), (0.5, 0.5), (2.0, 2.0), (1.0, 2.0), (2.0, 1.0), (1.6, 0.4), (0.5, 2.0), (2.0, 0.5), (4.0, 4.0)]


#: the indicator's pooling candidates: kernels with the paper's centered window, then (kernel, "trailing") (kvkit)
CAKE_KERNELS = (5, 15, 21, 31, 41, 61, (15, "trailing"), (31, "trailing"), (61, "trailing"))


def calibrate_cake(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                   seed: int = 0, kernels=CAKE_KERNELS, values: str = "mixed", log=print) -> tuple[dict, dict]:
    """The (tau1, tau2) of CAKE's layer preference ``H^(1/tau1) V^(1/tau2)`` that answers the most calibration
    needles at ``budget = budget_fraction * length``, the context compressed before the question (ties: the
    paper's value for the model first, then the order of ``CAKE_TAUS``); then, at those taus, the indicator's
    pooling kernel by :func:`pooling_sweep` (question in the prefill; the paper's 5 first). ``kernels=()`` skips
    the second stage. ``values``: the needles' values (:data:`kvkit.calibrate.needles.VALUE_KINDS`)."""
    from kvkit.calibrate.needles import describe_data, make_samples, score_policies, summarize
    from kvkit.policies.cake import model_taus

    t0 = time.perf_counter()
    budget = max(2, int(budget_fraction * length))
    paper, source = model_taus(model.config)
    cands = [tuple(paper)] + [t for t in CAKE_TAUS if tuple(t) != tuple(paper)]
    data = make_samples(tokenizer, samples, length, seed=seed, values=values)
    specs = [(f"{t1},{t2}", "cake", dict(budget=budget, tau1=t1, tau2=t2)) for t1, t2 in cands]
    res = score_policies(model, tokenizer, data, specs, log=log)
    table = summarize(res, [s[0] for s in specs])
    best = max(range(len(cands)), key=lambda i: (table[specs[i][0]]["answered"], -i))
    t1, t2 = cands[best]
    pool = None
    if kernels:  # stage 2: the pooling kernel, question-aware, at the chosen taus
        pspecs = []
        for cand in kernels:  # a kernel (centered) or (kernel, pool_window)
            k, win = (cand, "centered") if isinstance(cand, int) else cand
            pspecs.append((f"kernel {k}" + ("" if win == "centered" else f" {win}"), "cake",
                           dict(budget=budget, tau1=t1, tau2=t2, pool_kernel=k, **_window_option(win))))
        pbest, ptable, pev = pooling_sweep(model, tokenizer, pspecs, length, samples, seed=seed, values=values,
                                           log=log)
        pool = {
            "criterion": f"most needles answered at budget {budget} of ~{length} tokens with taus ({t1}, {t2}), "
                         "question in the prefill (CAKE's protocol); ties: the higher mean teacher-forced "
                         "log-probability of the answers, then the candidate order (centered kernels, smallest first, then trailing)",
            "per_kernel": ptable,
            "paper_kernel": 5,
            **pev,
        }
        chosen = pspecs[pbest][2]
    evidence = {
        "criterion": f"most needles answered at budget {budget} of ~{length} tokens, context compressed before the "
                     "question; ties: the paper's taus, then the candidate order",
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "per_taus": table,
        "paper_taus": list(paper),
        "paper_taus_from": source,
        "predictions": res["predictions"],
        "data": describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if pool is not None:
        evidence["pooling"] = pool
        return {"tau1": t1, "tau2": t2, **_picked(chosen, ("pool_kernel", "pool_window"))}, evidence
    return {"tau1": t1, "tau2": t2}, evidence


# ---- SnapKV: the pooling kernel that keeps whole answers ----------------------------------------------------

#: (kernel, pooling[, pool_window]) candidates: the paper's first, then wider average pooling, then max pooling (kernel 9
#: was dropped: at ~2K tokens it answered 3 of 6 needles on SmolLM2-135M, where 15 and wider answered 6).
SNAPKV_POOLING = ((5, "avg"), (15, "avg"), (21, "avg"), (31, "avg"), (41, "avg"), (61, "avg"),
                  (15, "max"), (21, "max"), (31, "max"),
                  # kvkit: the trailing window (a token pooled with the kernel - 1 before it; see POOL_WINDOWS)
                  (15, "avg", "trailing"), (31, "avg", "trailing"), (61, "avg", "trailing"))


def _pool_label(kernel: int, pooling: str, window: str = "centered") -> str:
    return f"{kernel},{pooling}" + ("" if window == "centered" else f",{window}")



def pooling_sweep(model, tokenizer, specs, length: int, samples: int, seed: int = 0, values: str = "mixed",
                  log=print):
    """Score ``(label, policy, options)`` specs on calibration needles with the question in the prefill, half of
    them in the far form (:data:`~kvkit.calibrate.needles.NEEDLE_FAR`: the window's queries find the key, pooling
    must reach from there to the value's last token). Returns ``(best index, table, evidence)``: the most needles
    answered, ties by the higher mean teacher-forced log-probability of the answers, then the order of ``specs``;
    ``evidence`` holds the fields every pooling calibration records (full's needles and log-probability, the
    candidates' predictions, the data)."""
    from kvkit.calibrate.needles import describe_data, make_samples, score_policies, summarize

    data = make_samples(tokenizer, samples, length, seed=seed, far=True, values=values)
    res = score_policies(model, tokenizer, data, specs, log=log, margin=True, question_aware=True)
    table = summarize(res, [s[0] for s in specs])
    lp = res.get("logprob", {})
    for lab, _, _ in specs:
        if lp.get(lab):
            table[lab]["answer_logprob"] = round(sum(lp[lab]) / len(lp[lab]), 4)
    best = max(range(len(specs)), key=lambda i: (table[specs[i][0]]["answered"],
                                                 table[specs[i][0]].get("answer_logprob", float("-inf")), -i))
    evidence = {
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "full_answer_logprob": (round(sum(lp["full"]) / len(lp["full"]), 4) if lp.get("full") else None),
        "predictions": res["predictions"],
        "data": describe_data(values, far=True, question_aware=True),
    }
    return best, table, evidence


def calibrate_snapkv(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                     seed: int = 0, candidates=SNAPKV_POOLING, values: str = "mixed",
                     log=print) -> tuple[dict, dict]:
    """The pooling (kernel, avg|max, centered|trailing window) with which SnapKV at ``budget = budget_fraction * length`` answers the most
    calibration needles, the question in the prefill (SnapKV's setting: the observation window is the question),
    by :func:`pooling_sweep` (ties: log-probability, then the paper's (5, avg) first, narrower kernels first)."""
    t0 = time.perf_counter()
    if not 0 < budget_fraction < 1:
        raise ValueError(f"snapkv calibration: budget_fraction must be in (0, 1); got {budget_fraction}")
    budget = max(2, int(budget_fraction * length))
    specs = []
    for cand in candidates:  # (kernel, pooling) or (kernel, pooling, pool_window)
        k, pool, win = (*cand, "centered")[:3]
        specs.append((_pool_label(k, pool, win), "snapkv", dict(budget=budget, kernel=k, pooling=pool,
                                                                **_window_option(win))))
    best, table, pev = pooling_sweep(model, tokenizer, specs, length, samples, seed=seed, values=values, log=log)
    chosen = specs[best][2]
    evidence = {
        "criterion": f"most needles answered at budget {budget} of ~{length} tokens, question in the prefill; ties: "
                     "the higher mean teacher-forced log-probability of the answers, then the candidate order",
        "per_pooling": table,
        "paper_pooling": [5, "avg"],
        **pev,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return _picked(chosen, ("kernel", "pooling", "pool_window")), evidence


# ---- Chelsea: what the protection scores with and the chunk it protects in -----------------------------------

#: (chunk_size, protect_kernel, protect_pooling, protect_window) candidates: kvkit's fallback first (64-token chunks,
#: SnapKV's max-pooled kernel 7, centered), then wider / trailing protection scores, then larger chunks (a chunk keeps
#: a share of its tokens exact: a needle sentence with a UUID may not fit the share of a 64-token chunk)
CHELSEA_PROTECTION = ((64, 7, "max", "centered"), (64, 31, "max", "trailing"), (64, 61, "avg", "trailing"),
                      (128, 7, "max", "centered"), (128, 31, "max", "trailing"), (128, 61, "avg", "trailing"),
                      (256, 31, "max", "trailing"))
#: the share of a chunk's kept slots the calibration protects (protect = CHELSEA_PROTECT_SHARE * ratio)
CHELSEA_PROTECT_SHARE = 0.8


def calibrate_chelsea(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                      seed: int = 0, candidates=CHELSEA_PROTECTION, values: str = "mixed",
                      log=print) -> tuple[dict, dict]:
    """Chelsea's ``chunk_size`` and protection score (``protect_kernel`` / ``protect_pooling`` / ``protect_window``)
    with which Chelsea at ``ratio = budget_fraction`` and ``protect = 0.8 * ratio`` (kvkit's protection of the
    highest-attention tokens) answers the most calibration needles, the question in the prefill (the protection's
    observation window is then the question), by :func:`pooling_sweep` (ties: log-probability, then the order of
    ``candidates``: kvkit's fallback first)."""
    t0 = time.perf_counter()
    if not 0 < budget_fraction < 1:
        raise ValueError(f"chelsea calibration: budget_fraction must be in (0, 1); got {budget_fraction}")
    protect = round(CHELSEA_PROTECT_SHARE * budget_fraction, 4)
    names = ("chunk_size", "protect_kernel", "protect_pooling", "protect_window")
    specs = []
    for cand in candidates:
        o = dict(zip(names, cand))
        specs.append((f"chunk {o['chunk_size']}, " + _pool_label(*cand[1:]), "chelsea",
                      dict(ratio=budget_fraction, protect=protect, **o)))
    best, table, pev = pooling_sweep(model, tokenizer, specs, length, samples, seed=seed, values=values, log=log)
    chosen = specs[best][2]
    evidence = {
        "criterion": f"most needles answered at ratio {budget_fraction}, protect {protect}, ~{length} tokens, question "
                     "in the prefill; ties: the higher mean teacher-forced log-probability of the answers, then the "
                     "candidate order (kvkit's fallback first)",
        "per_setting": table,
        "fallback": list(candidates[0]),
        **pev,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return _picked(chosen, names), evidence
