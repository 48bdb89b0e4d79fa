"""``kvkit calibrate duo``: learn a DuoAttention head pattern for a model and write it as JSON (or TSV).
``kvkit calibrate shadowkv|tidal|cake|snapkv|chelsea|zipcache``: a per-model knob, written as one section of the model's
calibration file (:mod:`kvkit.calibrate.store`), which the policy then finds from the model's config."""

from __future__ import annotations

import json
from pathlib import Path


def add_commands(subparsers) -> None:
    cal = subparsers.add_parser("calibrate", help="per-model calibration of a policy (duo, shadowkv, tidal, cake, snapkv, chelsea, zipcache)")
    sub = cal.add_subparsers(dest="calibrate_policy", required=True)
    d = sub.add_parser(
        "duo",
        help="DuoAttention gate optimisation: which KV heads need the full context (retrieval) vs sink+recent",
        description="Optimise one gate per KV head per layer on synthetic multi-passkey retrieval (paper: "
        "arXiv:2410.10819); writes the continuous gates as a pattern for kvkit.patch(model, 'duo', pattern=...).",
    )
    d.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    d.add_argument("--out", required=True, help="output pattern: .json (kvkit) or .tsv (reference format)")
    d.add_argument("--steps", type=int, default=60, help="optimiser steps (paper: 2000)")
    d.add_argument("--length", type=int, default=1024, help="longest sample in tokens (paper: up to 32K)")
    d.add_argument("--min-length", type=int, default=None, help="shortest sample (default: 3/4 of length)")
    d.add_argument("--sink", type=int, default=64, help="training sink tokens (paper: 128)")
    d.add_argument("--recent", type=int, default=256, help="training recent window (paper: 256)")
    d.add_argument("--passkeys", type=int, default=5, help="passkeys per sample (paper: 10)")
    d.add_argument("--passkey-words", type=int, default=8, help="NATO words per passkey (paper: 32)")
    d.add_argument("--lr", type=float, default=0.02)
    d.add_argument("--reg", type=float, default=0.05, help="weight of mean|alpha|")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.add_argument("--time-limit", type=float, default=None,
                   help="stop after the first step that ends past this many seconds (the pattern is still written)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    d.add_argument("--resume", action="store_true",
                   help="keep the state after every step next to --out (<out>.ckpt.pt) and continue from it when it "
                        "exists (same options): with --time-limit, a long schedule over several runs")
    d.set_defaults(func=cmd_calibrate_duo)
    _add_knob_commands(sub)


def _common(p, length: int, samples: int) -> None:
    p.add_argument("--model", default="default", help="default | packaged name | local dir | .gguf file")
    p.add_argument("--out", default=None,
                   help="calibration file to add this policy's section to (default: "
                        "$KVKIT_CALIBRATION_DIR or ~/.cache/kvkit/calibration/<model>.json, found automatically)")
    p.add_argument("--length", type=int, default=length, help="tokens per calibration sample")
    p.add_argument("--samples", type=int, default=samples, help="calibration samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _values(p) -> None:
    from kvkit.calibrate.needles import VALUE_KINDS

    p.add_argument("--values", default=VALUE_KINDS[0], choices=VALUE_KINDS,
                   help="needle values: 'mixed' (half of the samples hold UUID-shaped codes, which need every token "
                        "kept; default) or 'number' (7-digit numbers only, as calibrations before 2026-11-24)")


def _sweep_parser(sub, name: str, help: str, description: str):
    """A needle-sweep calibration at a budget fraction of the context (2048 tokens, 8 samples by default)."""
    p = sub.add_parser(name, help=help, description=description)
    _common(p, 2048, 8)
    p.add_argument("--budget-fraction", type=float, default=0.5, help=f"{name} budget as a fraction of --length")
    _values(p)
    p.set_defaults(func=cmd_calibrate_knob, knob=name)
    return p


def _add_knob_commands(sub) -> None:
    s = sub.add_parser("shadowkv", help="ShadowKV SVD rank from the spectral energy of the pre-RoPE keys",
                       description="Smallest SVD rank whose rebuilt pre-RoPE keys stay within --max-error "
                       "(relative Frobenius error) in every layer, on essay text; records the error per rank.")
    _common(s, 2048, 3)
    s.add_argument("--max-error", type=float, default=0.10, help="relative key error bound (0.10 = 99%% energy)")
    s.set_defaults(func=cmd_calibrate_knob, knob="shadowkv")
    t = sub.add_parser("tidal", help="TidalDecode selection layers from a needle sweep",
                       description="Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text; every "
                       "candidate layout of selection layers decodes them from one shared prefill per sample, each "
                       "at the budget that puts its decode reads at --read-fraction of full attention's; the layout "
                       "answering most needles is kept (ties: the answers' teacher-forced log-probability, then "
                       "fewer selection layers).")
    _common(t, 4096, 12)
    t.add_argument("--read-fraction", type=float, default=None,
                   help="decode reads as a fraction of full attention's; each layout gets the budget that matches "
                        "(default 0.5)")
    t.add_argument("--budget-fraction", type=float, default=None,
                   help="instead: one tidal budget for every layout, as a fraction of --length")
    t.add_argument("--selection", default="kv_head", choices=["kv_head", "q_head"])
    t.add_argument("--select-layers", default=None,
                   help="skip the layout sweep: these selection layers (comma-separated, e.g. 2,6,10), only their "
                        "layer shares are calibrated (an earlier calibration's evidence for the same layers is kept)")
    t.add_argument("--no-shares", action="store_true",
                   help="uniform budgets over the reuse layers (the paper): no layer_shares")
    _values(t)
    t.set_defaults(func=cmd_calibrate_knob, knob="tidal")
    c = _sweep_parser(
        sub, "cake", "CAKE layer-preference temperatures tau1/tau2, then its pooling kernel",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text; CAKE at --budget-fraction of the context with "
        "each candidate (tau1, tau2) decodes them from one shared prefill per sample; the pair answering most "
        "needles is kept (ties: the paper's). Then, at those taus and with the question in the prefill, the "
        "indicator's pooling kernel (--kernels).")
    c.add_argument("--kernels", default=None,
                   help="pooling kernels (odd; a 't' suffix: kvkit's trailing window, the token and the kernel - 1 "
                        "before it) for the second, question-aware stage at the chosen taus; '' skips it (default: "
                        "kvkit.calibrate.knobs.CAKE_KERNELS, the paper's 5 and wider, centered and trailing)")
    _sweep_parser(
        sub, "snapkv", "SnapKV pooling kernel (and avg/max) from a question-aware needle sweep",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text, the question in the prefill (SnapKV's "
        "setting), half of them with the value a dozen words after its key; SnapKV at --budget-fraction of the "
        "context with each candidate pooling (kernel 5 avg = the paper's, wider avg, max, and kvkit's trailing window) decodes them; the one "
        "answering most needles is kept (ties: the answers' teacher-forced log-probability, then the paper's first).")
    _sweep_parser(
        sub, "chelsea", "Chelsea chunk size and protection score from a question-aware needle sweep",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text, the question in the prefill, "
        "half of them with the value a dozen words after its key; Chelsea at ratio --budget-fraction with protect = "
        "0.8 x ratio (kvkit: the highest-attention tokens of each chunk kept exact) and each candidate chunk size and "
        "protection pooling (kernel, max/avg, centered/trailing) decodes them; the one answering most needles is kept "
        "(ties: the answers' teacher-forced log-probability, then kvkit's fallback, 64-token chunks with kernel 7 max "
        "centered, first).")
    z = sub.add_parser("zipcache", help="ZipCache bit widths: the cheapest that keeps calibration needles",
                       description="Candidate (high_ratio, high_bits, low_bits, key_bits) settings in order of "
                       "bytes; the first that answers every needle the full cache answers is kept.")
    _common(z, 2048, 8)
    _values(z)
    z.set_defaults(func=cmd_calibrate_knob, knob="zipcache")


def _parse_kernels(text: str) -> tuple:
    """``--kernels``: odd kernels separated by commas, a ``t`` suffix for kvkit's trailing window ("31t")."""
    kernels = []
    for item in (k.strip() for k in text.split(",")):
        if not item:
            continue
        trailing = item.endswith("t")
        try:
            k = int(item[:-1] if trailing else item)
        except ValueError:
            raise SystemExit(f"--kernels: expected odd integers (a 't' suffix: trailing window) separated by "
                             f"commas, got {text!r}") from None
        if k <= 0 or k % 2 == 0:
            raise SystemExit(f"--kernels: every kernel must be a positive odd integer, got {text!r}")
        kernels.append((k, "trailing") if trailing else k)
    return tuple(kernels)


def _parse_layers(text: str) -> tuple:
    """--select-layers "2,6,10" -> (2, 6, 10): strictly increasing layer indices >= 0 (checked before the model loads)."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--select-layers: expected layer indices separated by commas, e.g. 2,6,10; got {text!r}") from None
    if not layers or any(x < 0 for x in layers) or any(b <= a for a, b in zip(layers, layers[1:])):
        raise SystemExit(f"--select-layers: expected strictly increasing layer indices >= 0, e.g. 2,6,10; got {text!r}")
    return layers


def cmd_calibrate_knob(args) -> int:
    import shlex
    import sys

    import torch

    from kvkit.calibrate import knobs, store
    from kvkit.models import load, resolve_name

    # --kernels (cake's parser only) is checked before the model loads: a typo costs no minutes
    kernels = None if getattr(args, "kernels", None) is None else _parse_kernels(args.kernels)
    layout = None if getattr(args, "select_layers", None) is None else _parse_layers(args.select_layers)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model {args.model!r} ...", flush=True)
    model, tok = load(args.model, device=args.device)
    model.eval()
    name = resolve_name(args.model)
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.knob == "shadowkv":
        opts, ev = knobs.calibrate_shadowkv(model, tok, length=args.length, samples=args.samples,
                                            max_error=args.max_error, seed=args.seed, log=log)
    elif args.knob == "tidal":
        opts, ev = knobs.calibrate_tidal(model, tok, length=args.length, samples=args.samples,
                                         budget_fraction=args.budget_fraction,
                                         read_fraction=(args.read_fraction if args.read_fraction is not None else
                                                        None if args.budget_fraction is not None else 0.5),
                                         selection=args.selection,
                                         seed=args.seed, values=args.values, log=log, layout=layout,
                                         shares=not args.no_shares)
        out = args.out or store.default_out(name)
        old = store.read(out)["policies"].get("tidal") if layout is not None and Path(out).exists() else None
        if old is not None and tuple(old["options"].get("select_layers") or ()) == layout:
            # keep the sweep that chose these layers (the file's section is about to be replaced)
            ev["layout_command"] = old.get("evidence", {}).get("layout_command", old.get("command"))
            ev["layout_evidence"] = old.get("evidence", {}).get("layout_evidence", old.get("evidence"))
    elif args.knob == "cake":
        kernels = knobs.CAKE_KERNELS if kernels is None else kernels
        opts, ev = knobs.calibrate_cake(model, tok, length=args.length, samples=args.samples,
                                        budget_fraction=args.budget_fraction, seed=args.seed, kernels=kernels,
                                        values=args.values, log=log)
    elif args.knob == "chelsea":
        opts, ev = knobs.calibrate_chelsea(model, tok, length=args.length, samples=args.samples,
                                           budget_fraction=args.budget_fraction, seed=args.seed,
                                           values=args.values, log=log)
    elif args.knob == "snapkv":
        opts, ev = knobs.calibrate_snapkv(model, tok, length=args.length, samples=args.samples,
                                          budget_fraction=args.budget_fraction, seed=args.seed,
                                          values=args.values, log=log)
    else:
        opts, ev = knobs.calibrate_zipcache(model, tok, length=args.length, samples=args.samples, seed=args.seed,
                                            values=args.values, log=log)
    out = args.out or store.default_out(name)
    argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("kvkit") else ["calibrate", args.knob, *getattr(args, "_argv", [])]
    command = "kvkit " + " ".join(shlex.quote(a) for a in argv)
    path = store.write_section(out, store.identity(model.config, name), args.knob, opts, command, ev)
    print(f"{args.knob}: {json.dumps(opts)} -> {path} ({ev.get('seconds')} s)")
    return 0


def cmd_calibrate_duo(args) -> int:
    import torch

    from kvkit.calibrate.duo import calibrate
    from kvkit.models import load, resolve_name

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model {args.model!r} ...", flush=True)
    model, tok = load(args.model, device=args.device)
    res = calibrate(
        model,
        tok,
        steps=args.steps,
        out=args.out,
        model_name=resolve_name(args.model),
        length=args.length,
        min_length=args.min_length,
        sink=args.sink,
        recent=args.recent,
        num_passkeys=args.passkeys,
        passkey_words=args.passkey_words,
        lr=args.lr,
        reg=args.reg,
        seed=args.seed,
        time_limit=args.time_limit,
        resume=args.resume,
    )
    last = res["history"][-1]
    print(
        f"wrote {res['path']} ({res['model']['num_layers']} layers x {res['model']['num_kv_heads']} KV heads) in "
        f"{res['wall_s']:.0f} s; final distill loss {last['distill']:.5f}, mean alpha {last['reg']:.3f}"
    )
    print("retrieval KV heads per layer at the default sparsity:",
          json.dumps(res["retrieval_heads_at_default_sparsity"]))
    return 0


def main_calibrate(argv: list[str] | None = None) -> int:
    """``kvkit calibrate ...`` as a function (for scripts and tests)."""
    import argparse

    p = argparse.ArgumentParser(prog="kvkit")
    add_commands(p.add_subparsers(dest="command"))
    args = p.parse_args(["calibrate", *(argv or [])])
    args._argv = list(argv or [])[1:]
    return args.func(args) or 0
