"""The package's layers import downwards only: kernels <- stores <- policies <- cache <- patch, no import circle."""

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
                "kvkit.speculative.hierarchy", "kvkit.speculative.rows", "kvkit.speculative.cli"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True)
        assert r.returncode == 0, f"import {mod} failed:\n{r.stderr}"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_speculative_modules_import_one_way_at_module_top():
    """No import circle among kvkit/speculative's modules (at any depth of their files), and no kvkit module imported
    inside a function there: the package's shared pieces sit in the module that owns them."""
    files = {_module_name(f): f for f in (ROOT / "speculative").glob("*.py")}
    graph = {name: {m for m in _imports(f) if m in files and m != name} for name, f in files.items()}

    def in_circle(name: str) -> bool:  # does an import chain from ``name`` lead back to it?
        stack, seen = [name], set()
        while stack:
            for m in graph[stack.pop()]:
                if m == name:
                    return True
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        return False

    circles = [name for name in graph if in_circle(name)]
    assert not circles, circles
    nested = []
    for name, f in files.items():
        for fn in ast.walk(ast.parse(f.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    nested += [f"{name}.{fn.name} imports {m}" for m in mods if m.split(".")[0] == "kvkit"]
    assert not nested, nested


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
    ("kvkit.policies",),
    ("kvkit.attention", "kvkit.cache"),
    ("kvkit.patch",),
    ("kvkit.prefill", "kvkit.models", "kvkit.speculative", "kvkit.testing", "kvkit.demo", "kvkit.doctor"),
    ("kvkit.evals", "kvkit.calibrate", "kvkit.vllm"),
    ("kvkit.cli", "kvkit.__main__"),
]
#: the only imports allowed to point up, each with its reason: the registry loads the built-in policies on its first
#: lookup (they register themselves by importing it) and type-checks a policy instance against their base class
UPWARD_ALLOWED = {("kvkit.registry", "kvkit.policies")}


def _layer(mod: str) -> int | None:
    if mod == "kvkit":
        return 8
    hits = [i for i, grp in enumerate(LAYERS) for g in grp if mod == g or mod.startswith(g + ".")]
    return max(hits) if hits else None


def _runtime_imports(path: pathlib.Path, mod: str):
    """``(imported module, line)`` for every kvkit import of ``path`` that runs (module top or inside a function;
    ``if TYPE_CHECKING:`` blocks excluded); ``from kvkit import x`` counts as ``kvkit.x``."""
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
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module]) if node.level else node.module
            names = [f"{base}.{a.name}" for a in node.names] if base == "kvkit" else [base]
        else:
            continue
        for name in names:
            if name.startswith("kvkit.") or name == "kvkit":
                yield name, node.lineno


def test_every_import_points_down_the_layers():
    """Every kvkit module sits in a layer of LAYERS, and every kvkit import it runs -- at module top or inside a
    function -- points to its own layer or below (UPWARD_ALLOWED aside)."""
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
            elif there > me and not any(mod.startswith(a) and name.startswith(b) for a, b in UPWARD_ALLOWED):
                bad.append(f"{f.relative_to(ROOT.parent)}:{line} imports {name} (layer {there} > {me})")
    assert not unplaced, f"modules in no layer of LAYERS: {sorted(set(unplaced))}"
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvkit.cli\n"
                 "def g():\n    from kvkit.patch import patch\n")
    assert list(_runtime_imports(f, "kvkit.stores.x")) == [("kvkit.patch", 5)]
