"""Build-on-first-use of kvkit's small CPU C kernels (:mod:`.quant_cpu`, :mod:`.decode_cpu`).

A kernel's C source is compiled with the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``; ``-O3
-march=native -fopenmp``, falling back to fewer flags) into ``$KVKIT_CACHE/kernels`` (default
``~/.cache/kvkit/kernels``), named by a hash of the source, the compiler and the machine, and loaded with
``ctypes``. The library file appears atomically, so concurrent processes never load a half-written one.
Without a compiler (or when every flag set fails) :func:`build` returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile


def cache_dir() -> str:
    root = os.environ.get("KVKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvkit")
    return os.path.join(root, "kernels")


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def build(name: str, src: str):
    """The ``ctypes.CDLL`` of ``src`` (compiled now if not cached), or None without a working compiler."""
    cc = compiler()
    if cc is None:
        return None
    tag = hashlib.sha256((src + cc + os.uname().machine).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    so = os.path.join(out_dir, f"{name}_{tag}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{name}.c")
            with open(path, "w") as f:
                f.write(src)
            tmp_so = os.path.join(tmp, f"{name}.so")
            base = [cc, "-O3", "-shared", "-fPIC", "-fno-math-errno", path, "-o", tmp_so, "-lm"]
            for extra in (["-march=native", "-fopenmp"], ["-march=native"], []):
                r = subprocess.run(base[:1] + extra + base[1:], capture_output=True, text=True)
                if r.returncode == 0:
                    break
            else:
                return None
            os.replace(tmp_so, so)
    return ctypes.CDLL(so)


def disabled(env: str) -> bool:
    """True when the environment variable ``env`` switches a kernel off (0 / false / no / off)."""
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "no", "off")
