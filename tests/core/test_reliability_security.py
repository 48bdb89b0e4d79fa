"""Nothing kvkit reads runs code.

1. The duo calibration checkpoint is safetensors + JSON metadata (never a pickle): a planted pickle at the
   checkpoint path is refused by name without running; no module of kvkit unpickles.
2. Compiled CPU kernels live in a per-user 0700 cache, are loaded only when they are the user's private regular
   files, are keyed by source / compiler / flags / target CPU features, and any load failure falls back to torch
   with a one-line warning.
"""

from __future__ import annotations

import ast
import ctypes
import os
import pickle
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvkit.calibrate import duo
from kvkit.kernels import cbuild
from kvkit.testing import tiny_model

PACKAGE = Path(duo.__file__).resolve().parents[1]


# ------------------------------------------------------------------ 1. duo calibration checkpoint


class _Planted:
    """A pickle whose loading creates ``marker`` (what a planted checkpoint could do with os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Tok:
    """Toy tokenizer for the tiny models (vocab 128): one id per word."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [2 + sum(map(ord, w)) % 126 for w in text.split()] or [2]


KW = dict(progress=False, length=200, min_length=180, sink=4, recent=16, num_passkeys=2, passkey_words=4)


def test_planted_pickle_checkpoint_is_refused_without_running(tmp_path):
    out = tmp_path / "p.json"
    marker = tmp_path / "pwned"
    ck = duo.checkpoint_path(out)
    with open(tmp_path / "raw.pkl", "wb") as f:
        pickle.dump({"format": "kvkit-duo-calibration-checkpoint", "x": _Planted(marker)}, f)
    torch.save({"format": "kvkit-duo-calibration-checkpoint", "x": _Planted(marker)}, tmp_path / "zip.pt")
    for planted in (tmp_path / "raw.pkl", tmp_path / "zip.pt"):  # a raw pickle and torch's zip format
        shutil.copyfile(planted, ck)
        with pytest.raises(ValueError, match=rf"{ck.name} is not a kvkit duo calibration checkpoint.*delete it"):
            duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)
        assert not marker.exists(), "loading the checkpoint ran code from the file"


def test_checkpoint_is_safetensors_and_resumes_exactly(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "p.json"
    r1 = duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, time_limit=1e-9, resume=True, **KW)
    ck = duo.checkpoint_path(out)
    assert r1["steps_run"] == 1 and ck.is_file()
    with safe_open(str(ck), framework="pt") as f:  # a safetensors file: tensors + JSON header, no pickle
        assert "kvkit" in f.metadata() and len(list(f.keys())) >= 3  # gates + the optimiser's moments
    state = duo._read_checkpoint(ck)
    assert state["step"] == 1 and state["gates"].shape == (3, 2)
    # the optimiser state comes back as torch wrote it: int parameter ids, tuple betas, tensor moments
    assert list(state["optimizer"]["state"]) == [0] and isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)
    assert isinstance(state["optimizer"]["state"][0]["exp_avg"], torch.Tensor)
    one = duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=tmp_path / "one.json", **KW)
    r2 = duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)
    assert r2["history"] == one["history"] and not ck.exists()
    torch.testing.assert_close(r2["alpha"], one["alpha"], rtol=0, atol=0)


def test_checkpoint_fields_are_checked_by_name(tmp_path):
    out = tmp_path / "p.json"
    duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, time_limit=1e-9, resume=True, **KW)
    ck = duo.checkpoint_path(out)
    good = duo._read_checkpoint(ck)
    state = {k: v for k, v in good.items() if k not in ("format", "version")}
    for field, value in (("gates", torch.ones(5, 2)), ("step", 7), ("history", []), ("wall_s", -1.0),
                         ("optimizer", [1, 2])):
        duo.save_checkpoint(ck, {**state, field: value})
        with pytest.raises(ValueError, match=rf"{ck.name} is malformed: '{field}' must be"):
            duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)
    duo.save_checkpoint(ck, {**state, "optimizer": {"state": {}, "param_groups": []}})
    with pytest.raises(ValueError, match=rf"{ck.name} does not fit this run's optimiser"):
        duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)
    from safetensors.torch import save_file

    save_file({"gates": torch.ones(3, 2)}, str(ck), metadata={"other": "tool"})
    with pytest.raises(ValueError, match=rf"{ck.name} is not a kvkit duo calibration checkpoint \(a safetensors file "
                                         "without kvkit's metadata"):
        duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)
    ck.unlink()
    os.mkfifo(ck)  # not a regular file: refused without opening it (a FIFO would block)
    with pytest.raises(ValueError, match="not a regular file"):
        duo.calibrate(tiny_model("llama"), _Tok(), steps=3, out=out, resume=True, **KW)


def _unpickling_calls(tree) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if name.endswith(("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load", "dill.loads",
                          "joblib.load", "cloudpickle.load", "cloudpickle.loads")):
            found.append(name)
        elif name == "torch.load":
            w = kw.get("weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                found.append("torch.load without weights_only=True")
        elif name.endswith(("np.load", "numpy.load")):
            a = kw.get("allow_pickle")
            if a is not None and not (isinstance(a, ast.Constant) and a.value is False):
                found.append("numpy.load with allow_pickle")
    return found


def test_nothing_in_kvkit_unpickles():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        found = _unpickling_calls(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"kvkit modules that can unpickle a file: {offenders}"
    # the scan itself catches the old call
    assert _unpickling_calls(ast.parse("torch.load(p, map_location='cpu', weights_only=False)"))


# ------------------------------------------------------------------ 2. compiled CPU kernels

CC = cbuild.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")

SRC = "int kvkit_test_add(int a, int b) { return a + b; }\n"
SIGS = {"kvkit_test_add": ([ctypes.c_int, ctypes.c_int], ctypes.c_int)}


@pytest.fixture
def kcache(tmp_path, monkeypatch):
    """A fresh KVKIT_CACHE (the folder decision of an earlier test forgotten); returns it."""
    monkeypatch.setenv("KVKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_DIRS", {}, raising=False)
    return tmp_path / "cache"


def _kernel(name="reltest", src=SRC):
    return cbuild.Kernel(name, src, SIGS, env="KVKIT_RELTEST_KERNEL")


def _expected_so(folder: Path, name="reltest", src=SRC) -> Path:
    return folder / f"{name}_{cbuild.build_key(src, CC)}.so"


def _planted_so(tmp_path, marker, *, key: str | None = None, add=True) -> Path:
    """A library whose constructor creates ``marker`` (and, optionally, the kernel's function / key symbol)."""
    c = tmp_path / "planted.c"
    body = (f'#include <stdio.h>\n__attribute__((constructor)) static void boom(void) '
            f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    if add:
        body += "int kvkit_test_add(int a, int b) { return 666; }\n"
    if key is not None:
        body += f'const char {cbuild.KEY_SYMBOL}[] = "{key}";\n'
    c.write_text(body)
    so = tmp_path / f"planted_{marker.name}.so"
    subprocess.run([CC, "-shared", "-fPIC", str(c), "-o", str(so)], check=True, capture_output=True)
    return so


@needs_cc
def test_cache_is_private_and_a_built_kernel_loads(kcache):
    lib = _kernel().load()
    assert lib is not None and lib.kvkit_test_add(2, 3) == 5
    folder = kcache / "kernels"
    assert (folder.stat().st_mode & 0o777) == 0o700
    [so] = folder.iterdir()  # only the library: the build's temporary file was renamed into place
    assert so == _expected_so(folder) and cbuild.unsafe_reason(so.stat(), "file") is None
    before = cbuild.build_seconds()
    assert _kernel().load().kvkit_test_add(4, 5) == 9  # a second process-level load: from the cache, no build
    assert cbuild.build_seconds() == before


@needs_cc
@pytest.mark.parametrize("mode", [0o775, 0o777])
def test_planted_library_in_a_group_writable_cache_is_not_loaded(kcache, tmp_path, mode):
    folder = kcache / "kernels"
    folder.mkdir(parents=True)
    marker = tmp_path / "ran"
    so = _expected_so(folder)
    shutil.copyfile(_planted_so(tmp_path, marker, key=so.stem.rsplit("_", 1)[1]), so)
    os.chmod(so, 0o755)
    os.chmod(folder, mode)
    with pytest.warns(cbuild.KernelCacheWarning, match=rf"not using the kernel cache {folder}: it is writable by"):
        lib = _kernel().load()
    assert not marker.exists(), "a library planted in a shared cache folder ran its constructor"
    assert lib.kvkit_test_add(2, 3) == 5  # built in a private folder of this process instead
    assert not os.path.dirname(cbuild.kernel_dir()).startswith(str(kcache))


@needs_cc
@pytest.mark.parametrize("case", ["mode 0o666", "mode 0o620", "symlink", "another user"])
def test_library_that_is_not_the_users_private_file_is_not_loaded(kcache, tmp_path, case):
    if case == "another user" and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    folder = kcache / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    marker = tmp_path / "ran"
    so = _expected_so(folder)
    planted = _planted_so(tmp_path, marker, key=so.stem.rsplit("_", 1)[1])
    if case == "symlink":
        so.symlink_to(planted)
    else:
        shutil.copyfile(planted, so)
        os.chmod(so, {"mode 0o666": 0o666, "mode 0o620": 0o620}.get(case, 0o755))
        if case == "another user":
            os.chown(so, 65534, -1)
    why = {"symlink": "is a symbolic link", "another user": "is owned by uid 65534",
           "mode 0o666": "is writable by group", "mode 0o620": "is writable by group"}[case]
    with pytest.warns(cbuild.KernelCacheWarning, match=rf"not loading {so} {why}.*building it again"):
        lib = _kernel().load()
    assert not marker.exists(), f"a library ({case}) was loaded"
    assert lib.kvkit_test_add(2, 3) == 5  # rebuilt over it
    assert not so.is_symlink() and cbuild.unsafe_reason(so.stat(), "file") is None


@needs_cc
@pytest.mark.parametrize("case", ["libc", "no key", "missing symbol", "not ELF"])
def test_foreign_library_falls_back_to_torch_with_a_warning(kcache, tmp_path, case):
    folder = kcache / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    so = _expected_so(folder)
    marker = tmp_path / "ran"
    if case == "libc":
        shutil.copyfile(_libc_path(), so)
    elif case == "not ELF":
        so.write_bytes(b"\x7fELF but not really" * 10)
    else:  # "no key": the function but not kvkit's key; "missing symbol": the key but not the function
        src = _planted_so(tmp_path, marker, key=None if case == "no key" else so.stem.rsplit("_", 1)[1],
                          add=case == "no key")
        shutil.copyfile(src, so)
    os.chmod(so, 0o700)
    why = {"libc": "KernelLoadError", "no key": "KernelLoadError", "missing symbol": "AttributeError",
           "not ELF": "KernelLoadError"}[case]
    with pytest.warns(cbuild.KernelCacheWarning, match=rf"C kernel reltest is not used \({why}: .*falling back"):
        k = _kernel()
        assert k.load() is None
    assert not k.available()


def _libc_path() -> str:
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "/libc." in path or "/libc-" in path:
            return path
    pytest.skip("no libc mapping found")


@needs_cc
def test_real_kernel_with_a_foreign_library_runs_the_torch_path(kcache, monkeypatch):
    import kvkit
    from kvkit.kernels import decode_cpu
    from kvkit.testing import greedy, random_ids

    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(40, seed=3)
    monkeypatch.setenv("KVKIT_DECODE_CPU", "0")  # the torch path, for the reference
    kvkit.patch(model, "tidal", budget=16)
    try:
        ref, _, _ = greedy(model, ids, 6)
        monkeypatch.delenv("KVKIT_DECODE_CPU")
        old = decode_cpu._KERNEL
        folder = kcache / "kernels"
        folder.mkdir(parents=True, mode=0o700)
        shutil.copyfile(_libc_path(), folder / f"decode_cpu_{cbuild.build_key(old.src, CC)}.so")
        fresh = cbuild.Kernel(old.name, old.src, old.signatures, old.env)
        monkeypatch.setattr(decode_cpu, "_KERNEL", fresh)
        monkeypatch.setattr(decode_cpu, "_load", fresh.load)
        with pytest.warns(cbuild.KernelCacheWarning, match="C kernel decode_cpu is not used"):
            out, _, _ = greedy(model, ids, 6)
    finally:
        kvkit.unpatch(model)
    assert not decode_cpu.available()
    assert torch.equal(out, ref)


@needs_cc
def test_key_covers_the_target_cpu_compiler_and_flags(monkeypatch):
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        a, b, feature = "-march=x86-64", "-march=x86-64-v4", "__AVX512F__"
    elif machine in ("aarch64", "arm64"):
        a, b, feature = "-march=armv8-a", "-march=armv8.2-a+sve", "__ARM_FEATURE_SVE"
    else:
        pytest.skip(f"no two -march targets known for {machine}")
    fa, fb = cbuild.target_features(CC, (a,)), cbuild.target_features(CC, (b,))
    assert feature in fb and feature not in fa
    assert cbuild.build_key(SRC, CC, ((a,),)) != cbuild.build_key(SRC, CC, ((b,),))
    # the default key (what build() uses) follows what -march=native resolves to on this machine
    base = cbuild.build_key(SRC, CC)
    assert cbuild.build_key(SRC + " ", CC) != base
    real = cbuild.target_features
    monkeypatch.setattr(cbuild, "target_features", lambda cc, flags: real(cc, flags) + "\n#define __AVX512F__ 1")
    assert cbuild.build_key(SRC, CC) != base  # an AVX-512 machine and an AVX2 one do not share a library
    monkeypatch.setattr(cbuild, "target_features", real)
    monkeypatch.setattr(cbuild, "compiler_version", lambda cc: "gcc 99.1")
    assert cbuild.build_key(SRC, CC) != base
