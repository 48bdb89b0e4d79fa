"""Operators per compiled decode step: how many operators one static-cache decode step captures, per policy.

Decode on a GPU is launch-bound when a step runs many small kernels: inductor fuses pointwise chains, but every
matmul, reduction, custom operator and copy into a buffer stays a kernel of its own. The count of operators in the
captured graph is a CPU-checkable proxy for the kernels a step launches, and a regression in it shows without a GPU.

:func:`count_step_ops` patches ``model`` with ``policy`` (``static=True``), prefills a prompt eagerly, then runs one
single-token step through ``model.get_compiled_call`` (``fullgraph=True``, ``dynamic=False``) with a backend that
records the graph it receives and runs it as captured:

* ``torch``: the ``call_function`` + ``call_method`` nodes of dynamo's FX graph (torch-level operators);
* ``aten``: the ``call_function`` nodes of the graph AOTAutograd hands its forward compiler (aten operators after
  functionalisation and decomposition: what inductor schedules; ``kvkit::*`` custom operators stay one node);
* ``custom``: the ``kvkit::*`` operator nodes among the aten ones (the fused decode kernels).

:func:`ops_per_layer` compiles the same step on two depths of the model (``layers`` and ``2 * layers``, same
everything else) and splits the aten count into ``per_layer = (n(2L) - n(L)) / L`` and ``fixed = n(L) - L *
per_layer`` (embedding, final norm, head, RoPE tables): exact for a model whose layers are alike.

Kernel path: the count is of the graph as the step's kernel path builds it (``KVKIT_KERNELS``: ``triton`` gives
the GPU's graph, with the fused ``kvkit::view_decode`` operators; ``reference`` the torch reference's). On the CPU
the Triton path runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

import kvkit
from kvkit import env
from kvkit.compat import cache_kw

#: aten operators that only re-describe a tensor (no kernel, no copy): left out of the ``compute`` count
VIEW_OPS = frozenset(f"aten.{n}.{o}" for n in ("view", "_unsafe_view", "t", "unsqueeze", "squeeze", "slice",
                                               "expand", "permute", "transpose", "select", "alias", "as_strided",
                                               "reshape", "detach", "split", "unbind")
                     for o in ("default", "Tensor", "int", "dim", "dims", "Tensor_mode"))


def _targets(gm) -> list[str]:
    return [str(n.target) if n.op == "call_function" else f"method:{n.target}"
            for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


#: the counts :func:`count_step_ops` returns
KINDS = ("torch", "aten", "compute", "custom")


class _Recorder:
    """A dynamo backend that records the torch-level and the aten-level graph and runs the captured graph."""

    def __init__(self):
        self.torch_ops: list[str] = []
        self.aten_ops: list[str] = []
        self.aten_graph = None
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        self.graphs += 1
        self.torch_ops += _targets(gm)

        def fw(g, _inputs):
            self.aten_ops += [t for t in _targets(g) if not t.startswith("method:")]
            self.aten_graph = g
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)


@contextlib.contextmanager
def _kernels(path: str | None):
    if path is None:
        yield
        return
    with env.override("KVKIT_KERNELS", path):
        yield


@torch.no_grad()
def count_step_ops(model, policy: str = "full", options: dict | None = None, prompt: int = 40,
                   kernels: str | None = None, seed: int = 0) -> dict:
    """The operators of one compiled decode step of ``model`` patched with ``policy`` (``static=True``).

    Returns ``{"torch": n, "aten": n, "compute": n, "custom": n, "graphs": g, "top": [(aten op, count), ...],
    "sequence": [aten op, ...]}`` (see the module docstring; ``compute``: the aten operators outside
    :data:`VIEW_OPS`); ``graphs`` must be 1 (``fullgraph=True`` fails loudly otherwise). ``kernels``: the
    ``KVKIT_KERNELS`` path to trace (None: as set). The model is unpatched afterwards."""
    from transformers import CompileConfig

    rec = _Recorder()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g).to(model.device)
    with _kernels(kernels):
        kvkit.patch(model, policy, static=True, **(options or {}))
        try:
            cache = kvkit.KVCache(model, prompt_length=prompt)
            out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            # a plain function: dynamo does not take a callable object as a backend here
            cc = CompileConfig(fullgraph=True, dynamic=False, backend=lambda gm, ex: rec(gm, ex), mode=None)
            cc._compile_all_devices = True
            model.get_compiled_call(cc)(input_ids=nxt, **cache_kw(cache), use_cache=True)
        finally:
            kvkit.unpatch(model)
            for attr in ("_compiled_call", "_last_compile_config"):
                if attr in vars(model):
                    delattr(model, attr)
            torch._dynamo.reset()
    aten = Counter(rec.aten_ops)
    return dict(torch=len(rec.torch_ops), aten=len(rec.aten_ops),
                compute=sum(c for t, c in aten.items() if t not in VIEW_OPS),
                custom=sum(c for t, c in aten.items() if t.startswith("kvkit.")), graphs=rec.graphs,
                top=aten.most_common(12), sequence=list(rec.aten_ops))


def ops_per_layer(make_model, policy: str = "full", options=None, layers: int = 2, kernels: str | None = None,
                  prompt: int = 40) -> dict:
    """Operators per layer and the fixed part of one compiled step: :func:`count_step_ops` on
    ``make_model(num_hidden_layers=layers)`` and on ``make_model(num_hidden_layers=2 * layers)``; ``options``: the
    policy's options, or a function of the depth returning them (a per-layer head pattern differs by depth).

    Returns ``{"per_layer": {"torch", "aten", "custom"}, "fixed": {...}, "at": {L: count dict, 2L: ...}}``."""
    counts = {n: count_step_ops(make_model(num_hidden_layers=n), policy,
                                options(n) if callable(options) else options, prompt=prompt, kernels=kernels)
              for n in (layers, 2 * layers)}
    a, b = counts[layers], counts[2 * layers]
    per = {k: (b[k] - a[k]) / layers for k in KINDS}
    fixed = {k: a[k] - layers * per[k] for k in KINDS}
    return dict(per_layer=per, fixed=fixed, at=counts)


def step_ops(per_layer: dict, fixed: dict, num_hidden_layers: int, kind: str = "aten") -> float:
    """Operators of one step of a model with ``num_hidden_layers`` alike layers: ``fixed + layers * per_layer``."""
    return fixed[kind] + num_hidden_layers * per_layer[kind]
