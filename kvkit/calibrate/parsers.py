"""The parsers of ``kvkit calibrate <policy>`` for the built-in calibrators, without their calibration code.

Standard library and :mod:`kvkit.cli_grammar` only: building ``kvkit calibrate``'s parsers, ``--help`` and the refusal
of a bad argument import neither torch nor transformers. Each calibrator module (``kvkit/calibrate/<policy>.py``)
registers its parser function from here with its run (:func:`kvkit.calibrate.registry.calibrator`), and
:data:`COMMANDS` lists them (the registry's order), so the command line is built without importing those modules.
The options every calibrator shares are :func:`common_options`, :func:`needle_values` and :func:`sweep_command`.
"""

from __future__ import annotations

from argparse import ArgumentTypeError

from kvkit.cli_grammar import add_model

#: value kinds of the calibration needles (:func:`kvkit.calibrate.needles.make_samples`): "number" (7-digit numbers
#: only) or "mixed" (half of the samples hold UUID-shaped codes: a 36-character answer, ~20-30 tokens, that a kept
#: number's first digits do not stand in for)
VALUE_KINDS = ("mixed", "number")


# ---- the options every calibrator's command shares ------------------------------------------------------------
def common_options(p, length: int, samples: int) -> None:
    """--model, --device, --threads (:func:`kvkit.cli_grammar.add_model`), --out, --length, --samples, --seed
    (``length`` / ``samples``: the defaults)."""
    add_model(p, threads="torch CPU threads")
    p.add_argument("--out", default=None,
                   help="calibration file to add this policy's section to (default: "
                        "$KVKIT_CALIBRATION_DIR or ~/.cache/kvkit/calibration/<model>.json, found automatically)")
    p.add_argument("--length", type=int, default=length, help="tokens per calibration sample")
    p.add_argument("--samples", type=int, default=samples, help="calibration samples")
    p.add_argument("--seed", type=int, default=0)


def needle_values(p) -> None:
    """--values: the needles' values (:data:`VALUE_KINDS`)."""
    p.add_argument("--values", default=VALUE_KINDS[0], choices=VALUE_KINDS,
                   help="needle values: 'mixed' (half of the samples hold UUID-shaped codes, which need every token "
                        "kept; default) or 'number' (7-digit numbers only, as calibrations before 2026-11-24)")


def sweep_command(sub, name: str, help: str, description: str):
    """Add a needle-sweep calibration's parser (a budget fraction of the context; 2048 tokens, 8 samples by
    default) to ``sub`` and return it."""
    p = sub.add_parser(name, help=help, description=description)
    common_options(p, 2048, 8)
    p.add_argument("--budget-fraction", type=float, default=0.5, help=f"{name} budget as a fraction of --length")
    needle_values(p)
    return p


# ---- argparse types -------------------------------------------------------------------------------------------
def parse_kernels(text: str) -> tuple:
    """``--kernels``: odd kernels separated by commas, a ``t`` suffix for kvkit's trailing window ("31t"); checked
    when the command line is parsed, before the model loads (a typo costs no minutes)."""
    kernels = []
    for item in (k.strip() for k in text.split(",")):
        if not item:
            continue
        trailing = item.endswith("t")
        try:
            k = int(item[:-1] if trailing else item)
        except ValueError:
            raise ArgumentTypeError(f"expected odd integers (a 't' suffix: trailing window) separated by "
                                    f"commas, got {text!r}") from None
        if k <= 0 or k % 2 == 0:
            raise ArgumentTypeError(f"every kernel must be a positive odd integer, got {text!r}")
        kernels.append((k, "trailing") if trailing else k)
    return tuple(kernels)


def parse_layers(text: str) -> tuple:
    """--select-layers "2,6,10" -> (2, 6, 10): strictly increasing layer indices >= 0 (checked before the model loads)."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ArgumentTypeError(f"expected layer indices separated by commas, e.g. 2,6,10; got {text!r}") from None
    if not layers or any(x < 0 for x in layers) or any(b <= a for a, b in zip(layers, layers[1:])):
        raise ArgumentTypeError(f"expected strictly increasing layer indices >= 0, e.g. 2,6,10; got {text!r}")
    return layers


# ---- one parser per built-in calibrator -----------------------------------------------------------------------
def cake_command(sub):
    """Add ``kvkit calibrate cake``'s parser to ``sub`` and return it."""
    c = sweep_command(
        sub, "cake", "CAKE layer-preference temperatures tau1/tau2, then its pooling kernel",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text; CAKE at --budget-fraction of the context with "
        "each candidate (tau1, tau2) decodes them from one shared prefill per sample; the pair answering most "
        "needles is kept (ties: the paper's). Then, at those taus and with the question in the prefill, the "
        "indicator's pooling kernel (--kernels).")
    c.add_argument("--kernels", type=parse_kernels, default=None,
                   help="pooling kernels (odd; a 't' suffix: kvkit's trailing window, the token and the kernel - 1 "
                        "before it) for the second, question-aware stage at the chosen taus; '' skips it (default: "
                        "kvkit.calibrate.cake.CAKE_KERNELS, the paper's 5 and wider, centered and trailing)")
    return c


def chelsea_command(sub):
    """Add ``kvkit calibrate chelsea``'s parser to ``sub`` and return it."""
    return sweep_command(
        sub, "chelsea", "Chelsea chunk size and protection score from a question-aware needle sweep",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text, the question in the prefill, "
        "half of them with the value a dozen words after its key; Chelsea at ratio --budget-fraction with protect = "
        "0.8 x ratio (kvkit: the highest-attention tokens of each chunk kept exact) and each candidate chunk size and "
        "protection pooling (kernel, max/avg, centered/trailing) decodes them; the one answering most needles is kept "
        "(ties: the answers' teacher-forced log-probability, then kvkit's fallback, 64-token chunks with kernel 7 max "
        "centered, first).")


def shadowkv_command(sub):
    """Add ``kvkit calibrate shadowkv``'s parser to ``sub`` and return it."""
    s = sub.add_parser("shadowkv", help="ShadowKV SVD rank from the spectral energy of the pre-RoPE keys",
                       description="Smallest SVD rank whose rebuilt pre-RoPE keys stay within --max-error "
                       "(relative Frobenius error) in every layer, on essay text; records the error per rank.")
    common_options(s, 2048, 3)
    s.add_argument("--max-error", type=float, default=0.10, help="relative key error bound (0.10 = 99%% energy)")
    return s


def snapkv_command(sub):
    """Add ``kvkit calibrate snapkv``'s parser to ``sub`` and return it."""
    return sweep_command(
        sub, "snapkv", "SnapKV pooling kernel (and avg/max) from a question-aware needle sweep",
        "Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text, the question in the prefill (SnapKV's "
        "setting), half of them with the value a dozen words after its key; SnapKV at --budget-fraction of the "
        "context with each candidate pooling (kernel 5 avg = the paper's, wider avg, max, and kvkit's trailing window) decodes them; the one "
        "answering most needles is kept (ties: the answers' teacher-forced log-probability, then the paper's first).")


def tidal_command(sub):
    """Add ``kvkit calibrate tidal``'s parser to ``sub`` and return it."""
    t = sub.add_parser("tidal", help="TidalDecode selection layers from a needle sweep",
                       description="Needles (kvkit's own words; 7-digit numbers and UUID-shaped codes) in essay text; every "
                       "candidate layout of selection layers decodes them from one shared prefill per sample, each "
                       "at the budget that puts its decode reads at --read-fraction of full attention's; the layout "
                       "answering most needles is kept (ties: the answers' teacher-forced log-probability, then "
                       "fewer selection layers).")
    common_options(t, 4096, 12)
    t.add_argument("--read-fraction", type=float, default=None,
                   help="decode reads as a fraction of full attention's; each layout gets the budget that matches "
                        "(default 0.5)")
    t.add_argument("--budget-fraction", type=float, default=None,
                   help="instead: one tidal budget for every layout, as a fraction of --length")
    t.add_argument("--selection", default="shared", choices=["shared", "kv_head", "q_head"],
                   help="tidal's selection while calibrating (default shared, tidal's default; q_head needs "
                        "--no-shares)")
    t.add_argument("--select-layers", type=parse_layers, default=None,
                   help="skip the layout sweep: these selection layers (comma-separated, e.g. 2,6,10), only their "
                        "layer shares are calibrated (an earlier calibration's evidence for the same layers is kept)")
    t.add_argument("--no-shares", action="store_true",
                   help="uniform budgets over the reuse layers (the paper): no layer_shares")
    needle_values(t)
    return t


def zipcache_command(sub):
    """Add ``kvkit calibrate zipcache``'s parser to ``sub`` and return it."""
    z = sub.add_parser("zipcache", help="ZipCache bit widths: the cheapest that keeps calibration needles",
                       description="Candidate (high_ratio, high_bits, low_bits, key_bits) settings in order of "
                       "bytes; the first that answers every needle the full cache answers is kept.")
    common_options(z, 2048, 8)
    needle_values(z)
    return z


#: policy -> its built-in calibrator's parser function, in the policy registry's order (the calibrators of
#: :func:`kvkit.calibrate.registry.calibrators`; tests/calibrate/test_calibrate.py checks both agree)
COMMANDS = {
    "cake": cake_command,
    "chelsea": chelsea_command,
    "shadowkv": shadowkv_command,
    "snapkv": snapkv_command,
    "tidal": tidal_command,
    "zipcache": zipcache_command,
}
