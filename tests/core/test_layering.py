"""The package's layers import downwards only (kernels <- stores <- policies <- cache <- patch <- workloads <- evals,
calibrate, vllm <- cli), no import circle among kvkit's modules, and every kvkit import made inside a function is named
with its reason in :data:`DEFERRED_IMPORTS`."""

import ast
import pathlib
import subprocess
import sys

import kvkit

ROOT = pathlib.Path(kvkit.__file__).parent

#: package -> kvkit packages/modules it must never import (at any depth of its own files)
FORBIDDEN = {
    "kernels": ("kvkit.stores", "kvkit.policies", "kvkit.cache", "kvkit.model_info", "kvkit.patch", "kvkit.registry"),
    "stores": ("kvkit.policies", "kvkit.cache", "kvkit.patch", "kvkit.registry", "kvkit.speculative", "kvkit.evals"),
    "policies": ("kvkit.cache", "kvkit.patch", "kvkit.speculative", "kvkit.evals"),
    "workloads": ("kvkit.evals", "kvkit.calibrate", "kvkit.vllm", "kvkit.cli"),
    # evaluations and calibrations share what they share through kvkit.workloads, below both
    "calibrate": ("kvkit.evals",),
    "evals": ("kvkit.calibrate",),
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative import inside kvkit
                base = path.relative_to(ROOT.parent).with_suffix("").parts[: -node.level]
                out.add(".".join(base + (node.module,)))
            else:
                out.add(node.module)
    return out


def test_lower_layers_never_import_upper_layers():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for mod in _imports(f):
                if any(mod == x or mod.startswith(x + ".") for x in forbidden):
                    bad.append(f"{f.relative_to(ROOT.parent)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_import_circle_from_any_entry_point():
    # each module imported first in a fresh interpreter: a circle shows up as an ImportError on partial init
    for mod in ("kvkit.stores", "kvkit.model_info", "kvkit.state", "kvkit.cache", "kvkit.policies.snapkv",
                "kvkit.speculative.hierarchy", "kvkit.speculative.rows", "kvkit.speculative.cli", "kvkit.registry",
                "kvkit.kernels.decode_op", "kvkit.workloads.generation", "kvkit.calibrate.registry", "kvkit.evals.runner"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True)
        assert r.returncode == 0, f"import {mod} failed:\n{r.stderr}"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> dict[str, pathlib.Path]:
    return {_module_name(f): f for f in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, files) -> str:
    """The kvkit module an imported name loads: itself when it is a module, else the module that defines it
    (``from kvkit.kernels import decode``: ``kvkit.kernels``)."""
    while name not in files and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports_by_place(path: pathlib.Path, mod: str):
    """``(imported module, line, inside a function)`` for every kvkit import ``path`` runs (``if TYPE_CHECKING:``
    blocks excluded): see :func:`_runtime_imports`."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(fn)}
    lines_nested = {n.lineno for n in ast.walk(tree) if id(n) in nested and isinstance(n, (ast.Import, ast.ImportFrom))}
    for name, line in _runtime_imports(path, mod, members=True):
        yield name, line, line in lines_nested


#: ``(importing module or package, imported module or package, reason)``: the only kvkit imports allowed inside a
#: function. Everything else is imported at module top.
CLI = "a command's imports load when it runs: `kvkit --help` and the other commands start without them"
TRITON = "imports triton at module top: loaded only when a Triton kernel is about to run"
VLLM = "imports vllm at module top: loaded only when a vLLM engine uses the plugin"
DEFERRED_IMPORTS = [
    ("kvkit.cli", "kvkit", CLI),
    ("kvkit.catalog", "kvkit", CLI),
    ("kvkit.evals.commands", "kvkit", CLI),
    ("kvkit.doctor", "kvkit", CLI),
    ("kvkit.demo", "kvkit", CLI),
    ("kvkit.calibrate.cli", "kvkit", CLI),
    ("kvkit.calibrate.duo_cli", "kvkit", CLI),
    ("kvkit.kernels", "kvkit.kernels.fused_decode", TRITON),
    ("kvkit.kernels", "kvkit.kernels.sparse", TRITON),
    ("kvkit.kernels", "kvkit.kernels.weighted", TRITON),
    ("kvkit.kernels", "kvkit.kernels.quant_attn", TRITON),
    ("kvkit.kernels", "kvkit.kernels.lowrank", TRITON),
    ("kvkit.vllm", "kvkit.vllm.spec", VLLM),
    ("kvkit.vllm", "kvkit.vllm.quant", VLLM),
]


def _within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def test_kvkit_imports_inside_functions_are_the_listed_ones():
    """Every kvkit import made inside a function matches an entry of DEFERRED_IMPORTS (and each entry is used);
    the heavy-dependency reasons hold: the imported module imports that dependency at its top."""
    files = _files()
    unlisted, used = [], set()
    for mod, f in files.items():
        for name, line, nested in _imports_by_place(f, mod):
            if not nested:
                continue
            target = _resolve(name, files)
            hits = [i for i, (a, b, _) in enumerate(DEFERRED_IMPORTS) if _within(mod, a) and _within(target, b)]
            used.update(hits)
            if not hits:
                unlisted.append(f"{f.relative_to(ROOT.parent)}:{line} imports {target} inside a function")
    assert not unlisted, "\n".join(unlisted)
    assert used == set(range(len(DEFERRED_IMPORTS))), [DEFERRED_IMPORTS[i] for i in set(range(len(DEFERRED_IMPORTS))) - used]
    graph = _top_graph(files)
    for _, target, reason in DEFERRED_IMPORTS:
        dep = {TRITON: "triton", VLLM: "vllm"}.get(reason)
        if dep is not None:  # the target, or a kvkit module it loads at its top, imports ``dep`` at module top
            seen, todo = set(), [target]
            while todo:
                m = todo.pop()
                if m not in seen:
                    seen.add(m)
                    todo.extend(graph[m])
            assert any(dep in _top_level_deps(files[m]) for m in seen), f"{target} does not load {dep} at its top"


def _top_level_deps(path: pathlib.Path) -> set[str]:
    """The top-level packages ``path`` imports at module top (absolute imports)."""
    top = ast.parse(path.read_text()).body
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom) and not n.level]
    return {m.split(".")[0] for m in names}


def _top_graph(files) -> dict[str, set[str]]:
    """kvkit module -> the kvkit modules its module-top imports load."""
    graph = {mod: set() for mod in files}
    for mod, f in files.items():
        for name, _, nested in _imports_by_place(f, mod):
            target = _resolve(name, files)
            if not nested and target in files and target != mod:
                graph[mod].add(target)
    return graph


def test_no_import_circle_among_kvkit_modules():
    """The graph of kvkit's module-top imports (module -> the kvkit module each import loads) has no circle."""
    graph = _top_graph(_files())
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_patch_state_is_read_through_its_accessors():
    """The model attribute that holds the patch state is named in kvkit/state.py only (kvkit.state.patch_state,
    is_patched, set_patch_state), and kvkit.state imports no kvkit module at run time (it sits below the cache)."""
    import re

    holders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if re.search(r"\b_kvkit_state\b", p.read_text())]
    assert holders == ["state.py"]
    top = ast.parse((ROOT / "state.py").read_text()).body  # module-level statements: TYPE_CHECKING's block is an If
    runtime = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    runtime += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in runtime if m.split(".")[0] == "kvkit"], runtime


def test_c_sources_live_in_csrc_not_in_python_strings():
    """The CPU kernels' C is in kvkit/kernels/csrc/*.c (shipped as package data, read by cbuild.c_source)."""
    from pathlib import Path

    import kvkit
    from kvkit.kernels.cbuild import c_source

    root = Path(kvkit.__file__).parent
    holders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "#include <" in p.read_text(encoding="utf-8")]
    assert holders == []
    sources = sorted(p.name for p in (root / "kernels" / "csrc").glob("*.c"))
    assert sources == ["decode_cpu.c", "paged_heads_cpu.c", "paged_quant_cpu.c", "quant_cpu.c", "vec.c"]
    assert all("{" in c_source(s) for s in sources)  # readable through the package (what cbuild compiles)


def test_kvkit_switches_are_read_in_one_place():
    """Every KVKIT_* environment switch is listed in kvkit.env.SWITCHES and read only by kvkit/env.py."""
    import re
    from pathlib import Path

    import kvkit
    from kvkit import env

    root = Path(kvkit.__file__).parent
    named, readers = set(), []
    for p in root.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        named |= set(re.findall(r"KVKIT_[A-Z0-9_]+[A-Z0-9]", text))
        if p.name != "env.py" and re.search(r"(environ\.get|getenv|environ\[)\(?\s*[\"']KVKIT_", text):
            readers.append(str(p.relative_to(root)))
    assert readers == []
    assert named <= set(env.SWITCHES), sorted(named - set(env.SWITCHES))
    assert "| `KVKIT_KERNELS` |" in env.table()


#: kvkit's layers, lowest first: a module may import (at module top or inside a function) only modules of its own
#: layer or below. ``kvkit`` itself (the package's ``__init__``: the public names, ``kvkit.patch`` to
#: ``kvkit.prefill``) sits with the prefill, so the layers above may write ``import kvkit; kvkit.patch(...)``.
LAYERS = [
    ("kvkit.env", "kvkit.fileio", "kvkit.compat", "kvkit.hostsync", "kvkit.state", "kvkit.options"),
    ("kvkit.kernels",),
    ("kvkit.model_info",),
    ("kvkit.stores",),
    ("kvkit.registry", "kvkit.calibration"),
    ("kvkit.catalog", "kvkit.policy_spec", "kvkit.cli_grammar"),  # the policy catalog and the commands' grammar: no torch
    ("kvkit.policies",),
    ("kvkit.attention", "kvkit.cache"),
    ("kvkit.patch",),
    ("kvkit.prefill", "kvkit.models", "kvkit.speculative", "kvkit.testing", "kvkit.demo", "kvkit.doctor"),
    ("kvkit.workloads",),
    ("kvkit.evals", "kvkit.calibrate", "kvkit.vllm"),
    ("kvkit.cli", "kvkit.__main__"),
]
#: the layer of ``kvkit`` itself (its ``__init__``)
PACKAGE_LAYER = next(i for i, grp in enumerate(LAYERS) if "kvkit.prefill" in grp)


def _layer(mod: str) -> int | None:
    if mod == "kvkit":
        return PACKAGE_LAYER
    hits = [i for i, grp in enumerate(LAYERS) for g in grp if mod == g or mod.startswith(g + ".")]
    return max(hits) if hits else None


def _runtime_imports(path: pathlib.Path, mod: str, members: bool = False):
    """``(imported module, line)`` for every kvkit import of ``path`` that runs (module top or inside a function;
    ``if TYPE_CHECKING:`` blocks excluded); ``from kvkit import x`` counts as ``kvkit.x``, and with ``members``
    every ``from m import x`` as ``m.x`` (:func:`_resolve` then finds the module it loads)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            here = pkg[: len(pkg) - node.level + 1] if node.level else []  # ``from . import x``: x of this package
            base = ".".join(here + [node.module]) if node.module else ".".join(here)
            bare = node.module is None  # ``from . import x`` loads the module x (or a name of the package)
            names = [f"{base}.{a.name}" for a in node.names] if base == "kvkit" or members or bare else [base]
        else:
            continue
        for name in names:
            if name.startswith("kvkit.") or name == "kvkit":
                yield name, node.lineno


def test_every_import_points_down_the_layers():
    """Every kvkit module sits in a layer of LAYERS, and every kvkit import it runs -- at module top or inside a
    function -- points to its own layer or below; none points up."""
    bad, unplaced = [], []
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        me = _layer(mod)
        if me is None:
            unplaced.append(mod)
            continue
        for name, line in _runtime_imports(f, mod):
            there = _layer(name)
            if there is None:
                unplaced.append(name)
            elif there > me:
                bad.append(f"{f.relative_to(ROOT.parent)}:{line} imports {name} (layer {there} > {me})")
    assert not unplaced, f"modules in no layer of LAYERS: {sorted(set(unplaced))}"
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvkit.cli\n"
                 "def g():\n    from kvkit.patch import patch\n")
    assert list(_runtime_imports(f, "kvkit.stores.x")) == [("kvkit.patch", 5)]


def test_registry_sees_the_builtin_policies_without_importing_them():
    """kvkit.registry imports no policy module (it sits below them); importing it runs ``kvkit/__init__``, which
    imports the built-in policies package, so a lookup right after ``import kvkit.registry`` knows every built-in
    policy and an unknown name is refused with their list."""
    assert not [m for m, _ in _runtime_imports(ROOT / "registry.py", "kvkit.registry")]
    code = ("import kvkit.registry as r\n"
            "try:\n    r.get_policy('nosuch')\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "unknown kvkit policy 'nosuch'; known policies: full, streaming" in r.stdout
    for name in ("duo", "snapkv", "shadowkv", "zipcache"):
        assert name in r.stdout
