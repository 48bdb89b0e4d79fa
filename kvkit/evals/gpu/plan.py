"""Which rows a shaped-model bench runs, in which order, with which options.

Rows: the transformers baselines :data:`HF_ROWS` (``hf-dynamic``: unpatched, eager, ``DynamicCache``;
``hf-static``: ``StaticCache``, its decode forward compiled), kvkit's ``full`` (the reference of every ratio) and any
kvkit policy with options, given as ``--policies ROW[:KEY=VALUE,...] ...`` (:func:`parse_rows`: ``full`` first,
duplicates dropped); :data:`DEFAULT_ROWS` when none are given.

Run order (:func:`plan_rows`): each row as given, a kvkit policy with a static store (:func:`kvkit.cache.
static_policies`: the policies whose class is ``static_capable``) followed at once by its compiled row
``"<policy> static+compile"`` (same options). The default set thus runs full, full static+compile, hf-dynamic,
hf-static, streaming, streaming static+compile, then the others, so a time limit cuts the least wanted rows. A
policy without a static store gets no compiled row; :func:`static_refusal` says why (``KVCache.compile_refusal``).

Options (:func:`default_options`), before the user's own: on the real shapes :data:`GPU_OPTIONS` (budgets chosen for
the reference workload of :data:`REFERENCE_LENGTH` tokens; streaming keeps a quarter of the length); on ``tiny`` each
policy's tiny-model options (:data:`kvkit.testing.TEST_OPTIONS`). A compiled row adds the policy's ``static_options``. duo always gets a seeded random gate pattern (random weights have no calibrated one).
"""

from __future__ import annotations

import torch

from kvkit.cache import KVCache, static_policies
from kvkit.evals.settings import resolve_policy_options
from kvkit.options import parse_options
from kvkit.registry import available_policies
from kvkit.testing import tiny_options

#: the transformers rows (unpatched model)
HF_ROWS = ("hf-dynamic", "hf-static")
#: the rows run when ``--policies`` is not given, in this order (``full`` always runs first: it is the reference)
DEFAULT_ROWS = ("hf-dynamic", "hf-static", "full", "streaming", "snapkv", "tidal", "duo", "cake", "chelsea",
                "zipcache", "shadowkv", "kvzip")
#: the suffix of a kvkit policy's compiled row (``static=True`` caches, decode steps through
#: ``model.get_compiled_call``): ``"full static+compile"``, ``"streaming static+compile"``, ...
COMPILED_SUFFIX = "static+compile"
#: the length the default budgets below were chosen for (the reference workload: 16 rows x 16,384 tokens)
REFERENCE_LENGTH = 16384
#: GPU-sensible options per policy at long context (streaming: a quarter of the length, see :func:`default_options`)
GPU_OPTIONS: dict[str, dict] = {
    "snapkv": dict(budget=4096), "tidal": dict(budget=4096), "duo": dict(sparsity=0.5), "cake": dict(budget=4096),
    "chelsea": dict(ratio=0.25), "zipcache": {}, "shadowkv": dict(budget=2048), "kvzip": dict(budget=4096),
}


def known_rows() -> list[str]:
    return list(HF_ROWS) + available_policies()


def parse_rows(specs: list[str] | None) -> list[tuple[str, dict]]:
    """``["full", "streaming:budget=512,sink=4", ...]`` -> ``[(name, user options)]``, ``full`` first (added when
    missing), duplicates dropped. Unknown rows / options raise ValueError naming the known ones."""
    items = [s for spec in (specs or DEFAULT_ROWS) for s in ([spec] if ":" in spec else spec.split(",")) if s.strip()]
    out: list[tuple[str, dict]] = []
    known = known_rows()
    for item in items:
        name, _, opts = item.strip().partition(":")
        name = name.strip()
        if name not in known:
            raise ValueError(f"unknown row {name!r} in --policies; known: {', '.join(known)}")
        if name in HF_ROWS:
            if opts.strip():
                raise ValueError(f"--policies {item!r}: the transformers row {name!r} takes no options")
            user = {}
        else:
            user = resolve_policy_options(name, parse_options([opts] if opts else None))
        if (name, user) not in out:
            out.append((name, user))
    if ("full", {}) not in out:
        out.insert(0, ("full", {}))
    else:
        out.remove(("full", {}))
        out.insert(0, ("full", {}))
    return out


def compiled_name(policy: str) -> str:
    """The name of ``policy``'s compiled row: ``"<policy> static+compile"``."""
    return f"{policy} {COMPILED_SUFFIX}"


def plan_rows(rows: list[tuple[str, dict]], compiled: bool = True) -> list[tuple[str, dict, bool]]:
    """The rows in run order, ``[(name, options, compiled)]``: each row of ``rows`` (:func:`parse_rows`: ``full``
    first), and with ``compiled`` each kvkit policy with a static store (:data:`kvkit.cache.STATIC_POLICIES`) followed
    at once by its compiled row (same options). The default rows thus run as full, full static+compile, hf-dynamic,
    hf-static, streaming, streaming static+compile, snapkv, snapkv static+compile, ...: the most wanted rows first
    (a time limit skips the last ones)."""
    out: list[tuple[str, dict, bool]] = []
    for name, user in rows:
        out.append((name, user, False))
        if compiled and name not in HF_ROWS and name in static_policies():
            out.append((name, user, True))
    return out


def static_refusal(model, policy: str, options: dict) -> str:
    """Why ``policy`` gets no compiled row: ``KVCache.compile_refusal`` of its cache on ``model`` (its first layer
    that is not compileable and that store's reason); the error when such a cache cannot even be built."""
    try:
        why = KVCache(model, policy, **options).compile_refusal
    except Exception as e:  # noqa: BLE001 -- a policy that refuses this model says so in its eager row too
        why = f"{type(e).__name__}: {e}"
    return why or "no static variant"


def default_options(policy: str, shape: str, length: int, config, seed: int = 0) -> tuple[dict, dict]:
    """``(options, label options)`` for ``policy`` on this shape and length, before the user's own.

    Real shapes: :data:`GPU_OPTIONS` (streaming keeps ``length // 4``). ``tiny``: the policy's tiny-model options
    (budgets of a few tokens) with streaming at ``length // 4``, chelsea ratio 0.25, duo sparsity 0.5. duo always
    gets a random gate pattern ``[layers, kv_heads]`` (seeded; random weights have no calibrated one), shown as
    ``pattern=random`` in labels."""
    if policy in ("full", *HF_ROWS):
        return {}, {}
    opts = tiny_options(policy) if shape == "tiny" else dict(GPU_OPTIONS.get(policy, {}))
    if policy == "streaming":
        opts["budget"] = max(8, length // 4)
    if shape == "tiny" and policy == "chelsea":
        opts["ratio"] = 0.25
    label = dict(opts)
    if policy == "duo":
        g = torch.Generator().manual_seed(seed)
        alpha = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=g)
        opts.update(pattern=[[round(float(a), 4) for a in r] for r in alpha], sparsity=opts.get("sparsity", 0.5))
        label.update(pattern=f"random(seed {seed})", sparsity=opts["sparsity"])
    return opts, label
