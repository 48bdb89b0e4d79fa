"""``kvkit doctor``: environment report and the architecture x policy support matrix.

The matrix is generated, never typed by hand: every cell patches a tiny random model of that
architecture with that policy, decodes a left-padded batch of two prompts and compares each row with
the same prompt decoded alone. ``tests/core/test_support_matrix.py`` runs the same cells.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import textwrap

#: options that make each policy compress on the tiny test contexts (tens of tokens)
PROMPT_LENGTHS = (40, 27)
NEW_TOKENS = 8


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    """Versions, accelerator and which kernel path runs."""
    import torch

    import kvkit

    info = {
        "kvkit": kvkit.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "flash-attn": _version("flash-attn") if torch.cuda.is_available() else "n/a (no CUDA)",
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "gpu_count": torch.cuda.device_count(),
        "policies": ", ".join(kvkit.available_policies()),
    }
    try:
        kernels = importlib.import_module("kvkit.kernels")
        backend = getattr(kernels, "backend", None)
        if callable(backend):
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            info["kernels"] = backend(dev)
    except ImportError:
        info["kernels"] = "torch reference only"
    return info


def small_options(policy: str) -> dict:
    from kvkit.testing import tiny_options

    return tiny_options(policy)


def check_cell(arch: str, policy: str) -> tuple[str, str]:
    """Run one (architecture, policy) cell: returns (status, detail), status in ok/refused/FAIL."""
    import torch

    with torch.no_grad():
        return _check_cell(arch, policy)


def _check_cell(arch: str, policy: str) -> tuple[str, str]:
    import torch

    import kvkit
    from kvkit.compat import cache_kw
    from kvkit.testing import greedy, left_padded_batch, tiny_model

    model = tiny_model(arch)
    try:
        kvkit.patch(model, policy, **small_options(policy))
    except ValueError as e:
        return "refused", str(e).split(";")[0]
    try:
        ids, mask, prompts = left_padded_batch(PROMPT_LENGTHS)
        toks, _, cache = greedy(model, ids, NEW_TOKENS, attention_mask=mask)
        for i, p in enumerate(prompts):
            single, _, _ = greedy(model, p[None], NEW_TOKENS)
            if not torch.equal(single[0], toks[i]):
                return "FAIL", f"batch row {i} differs from the same prompt alone"
        full = kvkit.KVCache(model, "full")
        model(torch.cat([ids, toks[:, :-1]], 1), attention_mask=torch.cat([mask, torch.ones_like(toks[:, :-1])], 1),
              **cache_kw(full), use_cache=True)
        ratio = full.nbytes() / max(1, cache.nbytes())
        return "ok", f"{ratio:.1f}x"
    except Exception as e:  # the matrix reports failures instead of hiding them
        return "FAIL", f"{type(e).__name__}: {e}"[:120]
    finally:
        kvkit.unpatch(model)


def support_matrix(archs=None, policies=None) -> list[tuple[str, str, str, str]]:
    import kvkit
    from kvkit.testing import MATRIX_ARCHS

    rows = []
    for arch in archs or MATRIX_ARCHS:
        for pol in policies or kvkit.available_policies():
            status, detail = check_cell(arch, pol)
            rows.append((arch, pol, status, detail))
    return rows


def matrix_markdown(rows) -> str:
    policies = list(dict.fromkeys(r[1] for r in rows))
    archs = list(dict.fromkeys(r[0] for r in rows))
    cell = {(a, p): (s, d) for a, p, s, d in rows}
    lines = ["| architecture | " + " | ".join(f"`{p}`" for p in policies) + " |", "|---" * (len(policies) + 1) + "|"]
    notes = []
    for a in archs:
        out = []
        for p in policies:
            s, d = cell[(a, p)]
            if s == "ok":
                out.append(f"ok {d}" if p != "full" else "ok")
            elif s == "refused":
                if d not in notes:
                    notes.append(d)
                out.append(f"refused [{notes.index(d) + 1}]")
            else:
                out.append(f"FAIL: {d}")
        lines.append(f"| {a} | " + " | ".join(out) + " |")
    for i, n in enumerate(notes):
        lines.append("\n" + textwrap.fill(f"[{i + 1}] {n}", width=116))
    return "\n".join(lines)


def add_commands(sub) -> None:
    p = sub.add_parser("doctor", help="versions, GPU, kernel paths; --matrix runs the support matrix",
                       description="versions, GPU, kernel paths; --matrix runs the support matrix")
    p.add_argument("--matrix", action="store_true", help="run the architecture x policy support matrix")
    p.add_argument("--write-readme", action="store_true", help="replace the matrix in README.md")
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args) -> int:
    for k, v in environment().items():
        print(f"{k:<13} {v}")
    if args.matrix or args.write_readme:
        md_table = matrix_markdown(support_matrix())
        print()
        print(md_table)
        if args.write_readme:
            write_readme_matrix(md_table)
    return 0


BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"


def write_readme_matrix(table: str, path: str = "README.md") -> None:
    text = open(path, encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    cmd = ("Generated by `kvkit doctor --write-readme`. Each cell: a tiny random config, a left-padded batch of 2 equal\n"
           "to each prompt alone; `ok 2.3x` = 2.3x fewer KV bytes than `full`.")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{cmd}\n\n{table}\n{END}{tail}")
