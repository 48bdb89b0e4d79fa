"""Build-on-first-use of kvkit's small CPU C kernels (:mod:`.quant_cpu`, :mod:`.decode_cpu`, ...).

A kernel's C source is compiled with the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``; ``-O3
-march=native -fopenmp``, falling back to fewer flags) into ``$KVKIT_CACHE/kernels`` (default
``~/.cache/kvkit/kernels``) and loaded with ``ctypes``. Without a compiler (or when every flag set fails)
:func:`build` returns None and the caller keeps its torch path.

What is loaded is code that runs in the process, so the cache is treated as such:

* the folder is created ``0700``; one not owned by the user, or writable by group / others, is not used (a one-line
  :class:`KernelCacheWarning`) and the kernels are built in a private temporary folder for this process instead;
* a library is loaded only when it is a regular file (not a symlink) owned by the user and not writable by group /
  others; on Linux it is loaded through the descriptor that was checked (``/proc/self/fd/N``), so the file cannot be
  swapped between the check and the load. One that fails the check is rebuilt over;
* its name carries a key over the source, the compiler (path and ``--version``), the flags and the CPU features the
  build targets (the macros ``cc <flags> -E -dM`` defines: ``-march=native`` on an AVX-512 machine is not the same
  build as on an AVX2 one), and the library holds that key (``kvkit_kernel_key``), checked after loading;
* a library is compiled in a temporary folder and renamed into place atomically, so concurrent processes never load
  a half-written one;
* any failure to build or load (a foreign library, a missing symbol, a key that does not match) makes
  :meth:`Kernel.load` return None (the torch path) with a one-line warning instead of raising.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings

from kvkit import env as kvkit_env


def c_source(name: str) -> str:
    """The text of ``kvkit/kernels/csrc/<name>`` (package data): the C source of a CPU kernel."""
    from importlib.resources import files

    return files("kvkit.kernels").joinpath("csrc", name).read_text(encoding="utf-8")


# The C prelude of kvkit's vectorised CPU kernels (csrc/vec.c): 16-lane float / int vectors in GCC/Clang vector
# extensions (AVX-512 registers under -march=native where the machine has them, split by the compiler elsewhere), a
# horizontal sum and a vectorised exp for softmax numerators. Kernels start their source with it.
VEC_C = c_source("vec.c")


class KernelCacheWarning(RuntimeWarning):
    """A C kernel cache folder or library kvkit does not use (not private, not the user's, or not loadable)."""


#: Flag sets tried in order; the first that compiles is used (the key covers all of them).
FLAG_SETS = (("-march=native", "-fopenmp"), ("-march=native",), ())
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno")
KEY_VERSION = 2  # the layout of what the key covers
KEY_SYMBOL = "kvkit_kernel_key"


def _warn(msg: str) -> None:
    warnings.warn(msg, KernelCacheWarning, stacklevel=3)


def cache_dir() -> str:
    """The configured kernel cache folder (``$KVKIT_CACHE/kernels``, default ``~/.cache/kvkit/kernels``)."""
    root = kvkit_env.cache_root()
    return os.path.join(root, "kernels")


def unsafe_reason(st: os.stat_result, kind: str) -> str | None:
    """Why a folder / library with this ``stat`` must not be trusted (None when it is the user's and private)."""
    want = stat.S_ISDIR if kind == "folder" else stat.S_ISREG
    if not want(st.st_mode):
        return f"is not a {'folder' if kind == 'folder' else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by {'group' if st.st_mode & stat.S_IWGRP else 'others'} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_DIR_LOCK = threading.Lock()
_DIRS: dict[str, str] = {}  # configured folder -> the folder used (itself, or a private temporary one)
_TEMP: list[str] = []


def _temp_dir() -> str:
    if not _TEMP:
        d = tempfile.mkdtemp(prefix="kvkit-kernels-")  # 0700, this user's
        atexit.register(shutil.rmtree, d, True)
        _TEMP.append(d)
    return _TEMP[0]


def kernel_dir() -> str:
    """The folder kernels are built into and loaded from: :func:`cache_dir` (created ``0700``) when it is the
    user's and not writable by group / others; otherwise a private temporary folder of this process (warned once)."""
    want = cache_dir()
    with _DIR_LOCK:
        if want in _DIRS:
            return _DIRS[want]
        try:
            os.makedirs(want, mode=0o700, exist_ok=True)
            reason = unsafe_reason(os.stat(want), "folder")
        except OSError as e:
            reason = f"cannot be created ({e.strerror})"
        if reason is None:
            _DIRS[want] = want
        else:
            _DIRS[want] = _temp_dir()
            _warn(f"kvkit: not using the kernel cache {want}: it {reason}; building the C kernels in the private "
                  f"folder {_DIRS[want]} for this process (chmod 700 it, or set KVKIT_CACHE to a folder of yours)")
        return _DIRS[want]


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


@functools.cache
def compiler_version(cc: str) -> str:
    """``cc --version`` (empty when it does not answer)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


@functools.cache
def target_features(cc: str, flags: tuple) -> str:
    """What a build with ``flags`` targets: the macros ``cc flags -E -dM`` defines (``__AVX512F__``, ``__ARM_NEON``,
    ...: ``-march=native`` resolved on this machine); the CPU's own flags (``/proc/cpuinfo``) when the compiler
    cannot tell."""
    try:
        r = subprocess.run([cc, *flags, "-E", "-dM", "-x", "c", os.devnull], capture_output=True, text=True,
                           timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            return "\n".join(sorted(r.stdout.splitlines()))
    except (OSError, subprocess.SubprocessError):
        pass
    return f"cpu {platform.machine()}: {_cpu_flags()}"


def build_key(src: str, cc: str, flag_sets=FLAG_SETS) -> str:
    """The cache key of ``src`` built by ``cc``: the source, the compiler and its version, the flags tried and the
    CPU features each flag set targets."""
    parts = [KEY_VERSION, src, cc, compiler_version(cc), list(BASE_FLAGS),
             [[list(f), target_features(cc, tuple(f))] for f in flag_sets]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


_BUILD_SECONDS = [0.0]


def build_seconds() -> float:
    """Seconds this process has spent compiling kernels (a benchmark subtracts the first-use builds it timed)."""
    return _BUILD_SECONDS[0]


_FDS: list[int] = []  # descriptors of the libraries loaded through /proc/self/fd (kept open: glibc knows them so)


class KernelLoadError(OSError):
    """A cached library that cannot be used: it does not load, or is not the library kvkit built for this key."""


class UnsafeLibrary(KernelLoadError):
    """A cached library that is not the user's private regular file (never loaded; :func:`build` builds over it)."""


def _load(so: str, tag: str):
    """The ``ctypes.CDLL`` of ``so`` after the checks: FileNotFoundError when it is absent, :class:`UnsafeLibrary`
    (not loaded) when it is not the user's private regular file, :class:`KernelLoadError` when it does not load or
    was not built with ``tag``."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(so, flags)  # a symlink is refused (ELOOP), a FIFO does not block
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeLibrary(f"{so} is a symbolic link") from None
        raise
    try:
        reason = unsafe_reason(os.fstat(fd), "file")
    except OSError:
        os.close(fd)
        raise
    if reason is not None:
        os.close(fd)
        raise UnsafeLibrary(f"{so} {reason}")
    proc = f"/proc/self/fd/{fd}"
    try:
        if os.path.exists(proc):  # load the file that was checked, whatever the path names by now
            lib = ctypes.CDLL(proc)
            _FDS.append(fd)
        else:
            os.close(fd)
            lib = ctypes.CDLL(so)
    except OSError as e:
        if fd not in _FDS:
            try:
                os.close(fd)
            except OSError:
                pass
        raise KernelLoadError(f"{so} does not load ({str(e).splitlines()[0] if str(e) else e!r})") from None
    try:
        key = (ctypes.c_char * (len(tag) + 1)).in_dll(lib, KEY_SYMBOL).value.decode("ascii", "replace")
    except ValueError:
        key = None
    if key != tag:
        raise KernelLoadError(f"{so} is not the library kvkit built for this source, compiler and CPU "
                              f"({KEY_SYMBOL} {'missing' if key is None else repr(key)}); delete it")
    return lib


def _compile(name: str, src: str, cc: str, so: str) -> bool:
    """Compile ``src`` into ``so`` (written to a temporary file next to it, made private, renamed into place)."""
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kvkit-build-") as tmp:
            path = os.path.join(tmp, f"{name}.c")
            with open(path, "w") as f:
                f.write(src)
            tmp_so = os.path.join(tmp, f"{name}.so")
            for extra in FLAG_SETS:
                cmd = [cc, *extra, *BASE_FLAGS, path, "-o", tmp_so, "-lm"]
                if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
                    break
            else:
                return False
            fd, part = tempfile.mkstemp(dir=os.path.dirname(so), prefix=f".{name}_", suffix=".so.part")
            try:
                with os.fdopen(fd, "wb") as dst, open(tmp_so, "rb") as s:
                    shutil.copyfileobj(s, dst)
                    os.fchmod(dst.fileno(), 0o700)
                os.replace(part, so)  # atomic: a reader sees the old file or the whole new one
            except BaseException:
                if os.path.exists(part):
                    os.unlink(part)
                raise
        return True
    finally:
        _BUILD_SECONDS[0] += time.perf_counter() - t0


def build(name: str, src: str):
    """The ``ctypes.CDLL`` of ``src`` (compiled now if not cached), or None without a working compiler. Raises
    :class:`KernelLoadError` (an ``OSError``) when the cached library is not kvkit's (:class:`Kernel` falls back)."""
    cc = compiler()
    if cc is None:
        return None
    tag = build_key(src, cc)
    so = os.path.join(kernel_dir(), f"{name}_{tag}.so")
    try:
        return _load(so, tag)
    except FileNotFoundError:
        pass
    except UnsafeLibrary as e:
        _warn(f"kvkit: not loading {e}; building it again")
    marked = f'{src}\n__attribute__((visibility("default"), used)) const char {KEY_SYMBOL}[] = "{tag}";\n'
    if not _compile(name, marked, cc, so):
        return None
    return _load(so, tag)


def disabled(env: str) -> bool:
    """True when the environment variable ``env`` switches a kernel off (0 / false / no / off)."""
    return kvkit_env.switched_off(env)


class Kernel:
    """A C library built on first use, once per process (thread-safe). ``load()`` returns the ``ctypes.CDLL`` with
    ``signatures`` (function name -> (argtypes, restype)) applied, or None without a working compiler, or when the
    library cannot be built or loaded (a one-line :class:`KernelCacheWarning`; the callers keep their torch path);
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
                        for fn, (argtypes, restype) in self.signatures.items() if lib is not None else ():
                            f = getattr(lib, fn)
                            f.argtypes, f.restype = argtypes, restype
                    except Exception as e:  # noqa: BLE001 - any failure: the torch path, said once
                        msg = (str(e).splitlines() or [""])[0]
                        _warn(f"kvkit: the C kernel {self.name} is not used ({type(e).__name__}: {msg}); "
                              "falling back to the torch path")
                        lib = None
                    self._lib, self._tried = lib, True
        return self._lib

    def available(self) -> bool:
        return not disabled(self.env) and self.load() is not None
