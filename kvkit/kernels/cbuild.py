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
import threading

# The C prelude of kvkit's vectorised CPU kernels: 16-lane float / int vectors in GCC/Clang vector extensions
# (AVX-512 registers under -march=native where the machine has them, split by the compiler elsewhere), a horizontal
# sum and a vectorised exp for softmax numerators. Kernels start their source with it.
VEC_C = r"""#include <stdint.h>
#include <math.h>
#include <string.h>
#define AI static inline __attribute__((always_inline))

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

AI float hsum(v16 x) {  /* tree reduction: 16 -> 8 -> 4 lanes, then scalar */
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (softmax numerators), 16 lanes; 0 below -87 and for -inf. Cephes-style 2^n * poly(r), as
   quant_cpu's AVX-512 exp, in portable vector extensions (libm's scalar expf costs more than the rest here) */
AI v16 vexp(v16 x) {
  const v16 lo = (v16){0} - 87.0f;
  vi16 ok = x > lo;
  x = (v16)(((vi16)x & ok) | ((vi16)lo & ~ok));
  v16 fx = x * 1.44269504088896341f;
  vi16 n = __builtin_convertvector(fx, vi16);  /* toward zero; fx <= 0, so round to nearest: */
  v16 nf = __builtin_convertvector(n, v16);
  vi16 down = (fx - nf) < -0.5f;
  n = n + down;  /* down is -1 where true */
  nf = __builtin_convertvector(n, v16);
  v16 r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  v16 y = (v16){0} + 1.9875691500E-4f;
  y = y * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * (r * r) + (r + 1.0f);
  vi16 e = (n + 127) << 23;
  y = y * (v16)e;
  return (v16)((vi16)y & ok);
}

"""


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


class Kernel:
    """A C library built on first use, once per process (thread-safe). ``load()`` returns the ``ctypes.CDLL`` with
    ``signatures`` (function name -> (argtypes, restype)) applied, or None without a working compiler;
    ``available()`` is False also when the environment variable ``env`` switches the kernel off."""

    def __init__(self, name: str, src: str, signatures: dict, env: str):
        self.name, self.src, self.signatures, self.env = name, src, signatures, env
        self._lock = threading.Lock()
        self._lib, self._tried = None, False

    def load(self):
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        lib = build(self.name, self.src)
                    except OSError:
                        lib = None
                    for fn, (argtypes, restype) in self.signatures.items() if lib is not None else ():
                        getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
                    self._lib, self._tried = lib, True
        return self._lib

    def available(self) -> bool:
        return not disabled(self.env) and self.load() is not None
