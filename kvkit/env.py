"""Every ``KVKIT_*`` environment switch, read here and only here (a leaf module: it imports nothing of kvkit).

:data:`SWITCHES` lists them with what they do (the README's table is :func:`table`:
``python -c "import kvkit.env as e; print(e.table())"``); each has one reader below, which normalises the value
the same way wherever it is read. Values are read at call time, so a switch set inside a process (tests,
benchmarks) takes effect at the next call.
"""

from __future__ import annotations

import contextlib
import os

#: name -> what it does
SWITCHES: dict[str, str] = {
    "KVKIT_KERNELS": "auto (default) | reference | triton: the decode kernels' path (Triton on CUDA tensors in auto)",
    "KVKIT_DEBUG": "1: check kernel index ranges on the host (a device sync per call)",
    "KVKIT_CACHE": "folder of kvkit's caches (built C kernels, converted models); default ~/.cache/kvkit",
    "KVKIT_CALIBRATION_DIR": "extra folders (os.pathsep-separated) searched first for calibration files",
    "KVKIT_QUANT_CPU": "0: the packed-code C kernel off (ZipCache's CPU decode uses the torch reference)",
    "KVKIT_DECODE_CPU": "0: the low-rank / slot-list C kernels off (ShadowKV, TidalDecode CPU decode)",
    "KVKIT_PAGED_HEADS_CPU": "0: the vLLM plugin's per-head paged C kernel off",
    "KVKIT_PAGED_QUANT_CPU": "0: the vLLM plugin's quantized paged C kernel off",
    "KVKIT_VLLM_POLICY": "the vLLM plugin's policy, POLICY[:KEY=VALUE,...] (unset: the plugin stays inactive)",
    "KVKIT_VLLM_DUO_KERNEL": "mixed (default) | split: how the vLLM plugin attends DuoAttention's two head kinds",
    "KVKIT_NO_PROGRESS": "1: no progress bars in the evaluations",
    "KVKIT_GIT_COMMIT": "the commit recorded in benchmark results (default: git rev-parse HEAD)",
}

_OFF = ("0", "false", "no", "off")


def raw(name: str, default: str | None = None) -> str | None:
    """The value of switch ``name`` (one of :data:`SWITCHES`), unnormalised."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a kvkit switch; known: {', '.join(SWITCHES)}")
    return os.environ.get(name, default)


def kernels_mode() -> str:
    """``KVKIT_KERNELS`` lower-cased and stripped: auto | reference | triton (ValueError otherwise)."""
    mode = (raw("KVKIT_KERNELS") or "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"KVKIT_KERNELS must be 'auto', 'reference' or 'triton', got {mode!r}")
    return mode


def debug() -> bool:
    return (raw("KVKIT_DEBUG") or "0").strip() not in ("", "0")


def cache_root() -> str:
    return raw("KVKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvkit")


def calibration_dirs() -> list[str]:
    return [p for p in (raw("KVKIT_CALIBRATION_DIR") or "").split(os.pathsep) if p]


def switched_off(name: str) -> bool:
    """True when a kernel's switch (``KVKIT_*_CPU`` of :data:`SWITCHES`, or the name a ``cbuild.Kernel`` was given)
    is 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() in _OFF


def no_progress() -> bool:
    return raw("KVKIT_NO_PROGRESS") == "1"


def git_commit() -> str | None:
    return raw("KVKIT_GIT_COMMIT") or None


def vllm_policy() -> str | None:
    return raw("KVKIT_VLLM_POLICY")


def vllm_duo_kernel() -> str:
    return (raw("KVKIT_VLLM_DUO_KERNEL") or "mixed").strip().lower()


@contextlib.contextmanager
def override(name: str, value: str):
    """Set switch ``name`` to ``value`` inside the block (the previous value, or its absence, restored after)."""
    old = raw(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def table() -> str:
    """The switches as a markdown table (the README's)."""
    return "| switch | effect |\n|---|---|\n" + "\n".join(f"| `{k}` | {v} |" for k, v in SWITCHES.items())


if __name__ == "__main__":
    print(table())
