"""CPU decode attention straight from packed int8 / int4 / int2 K/V (see ``quant.Packed``): a small C kernel.

The torch reference (:func:`kvkit.kernels.reference.quant_decode_ref`) dequantizes every packed token into
a float K and V and attends densely, so each decode step writes and re-reads a float copy of the whole
cache. This kernel reads only the packed bytes and the statistics:

* scores, keys quantised per channel with one statistic per channel per token group (``scale_k, zero_k [D]``):
  ``q . k_n = sum_d (q_d scale_d) code_nd + sum_d q_d zero_d``: the query is multiplied by the key scale
  once per part, and each token's codes are unpacked in registers (16 channels per shift/mask/convert)
  and dotted with it; no float key is ever stored;
* one softmax over the scores of *all* parts (one scratch row of fp32 scores per query row; vectorized
  exp), so several packed parts (precision groups, segments) need no LSE merge among themselves;
* values quantised per token (``scale_n, zero_n``) with an optional channel pre-scale ``c_d``:
  ``sum_n p_n v_nd = c_d (sum_n (p_n scale_n) code_nd + sum_n p_n zero_n)``, accumulated in registers.

Work is split over (batch, KV head) with OpenMP (``torch.get_num_threads()`` threads). The query rows of
a KV head (its G query heads x Tq tokens) are processed in blocks of up to 4, so each byte of codes is
read once per block.

The C source (``kvkit/kernels/csrc/quant_cpu.c``) is compiled on first use by :func:`kvkit.kernels.cbuild.build` (system C compiler,
``-O3 -march=native``, cached in ``$KVKIT_CACHE/kernels``) and loaded with ``ctypes``. AVX-512 (F + BW + VL) machines get the
intrinsics path; others a portable C loop. Without a compiler :func:`available` is False and
``quant_decode`` uses the torch reference. ``KVKIT_QUANT_CPU=0`` disables this kernel.

Supported layouts (:func:`supported`): keys ``axis=-2`` with one statistic per channel per group of
``group_size`` tokens (``group_size >= N``: one over all tokens, the ZipCache paper's layout; the query is scaled
once per group), values ``axis=-1`` with one statistic per token
(``group_size == D``), ``D * bits / 8`` bytes per token in {4, 8} or a multiple of 16, D <= 256.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import Kernel, c_source
from .quant import Packed

_SRC = c_source("quant_cpu.c")

P, I64, Int, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("quant_cpu", _SRC, {
    "kvkit_quant_attn": ([Int, P, P, P, P, P, P, P, P, P, P, P, P, P, I64, I64, Int, Int, F, P, P, P, P, P, Int], Int),
    "kvkit_has_avx512": ([], Int),
}, "KVKIT_QUANT_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_QUANT_CPU=0``."""
    return _KERNEL.available()


def has_avx512() -> bool:
    lib = _load()
    return bool(lib is not None and lib.kvkit_has_avx512())


def supported(kpack: Packed, vpack: Packed, D: int) -> bool:
    """Whether a (keys, values) pair has a layout this kernel reads (see the module docstring)."""
    if kpack.data.device.type != "cpu" or D > 256:
        return False
    N = kpack.shape[-2]
    for p in (kpack, vpack):
        db = D * p.bits // 8
        if not (db in (4, 8) or db % 16 == 0):
            return False
    groups_ok = N == 0 or kpack.scale.shape[-2] == -(-N // max(1, kpack.group_size))
    return (kpack.axis == -2 and groups_ok and kpack.prescale is None
            and vpack.axis == -1 and vpack.group_size == D)


def _view(p: Packed):
    """(pointers of data, scale, zero, prescale as uint8 / fp32 contiguous tensors, the tensors they point into),
    cached on the pack (statistics of 16-bit models are converted to fp32 once)."""
    v = p.cpu_view
    if v is None or v[0][0] != p.data.data_ptr():
        ts = [p.data.contiguous()] + [None if t is None else t.to(torch.float32).contiguous()
                                      for t in (p.scale, p.zero, p.prescale)]
        v = p.cpu_view = (tuple(None if t is None else t.data_ptr() for t in ts), ts)
    return v[0]


def quant_attn(q4: torch.Tensor, parts, scale: float, prior=None):
    """Attention of ``q4 [B, Hq, Tq, D]`` over the union of packed parts ``[(kpack, vpack, mask [B, N] bool | None)]``
    (every query sees every unmasked token), merged with ``prior = (out [B, Hq, Tq, D], lse [B, Hq, Tq])``, a
    partial attention over other keys, when given. Returns (out ``[B, Hq, Tq, D]`` in q's dtype, lse
    ``[B, Hq, Tq]`` fp32); a query row that sees no token gets zeros and ``-inf``."""
    lib = _load()
    B, Hq, Tq, D = q4.shape
    H = parts[0][0].shape[1]
    M = (Hq // H) * Tq
    keep = []  # every tensor whose pointer is handed to C stays referenced until the call returns

    def ptr(t, dtype):
        if t.dtype != dtype or not t.is_contiguous():
            t = t.to(dtype).contiguous()
        keep.append(t)
        return t.data_ptr()

    qf = q4.reshape(B, H, M, D)  # query head h*G + g reads KV head h; row g*Tq + t
    n = len(parts)
    P = ctypes.c_void_p
    kv = [(_view(kp), _view(vpk)) for kp, vpk, _ in parts]
    ns = (ctypes.c_int64 * n)(*(kp.shape[-2] for kp, _, _ in parts))
    kg = (ctypes.c_int64 * n)(*(kp.group_size for kp, _, _ in parts))  # tokens per key statistic
    kb = (ctypes.c_int * n)(*(kp.bits for kp, _, _ in parts))
    vb = (ctypes.c_int * n)(*(vp.bits for _, vp, _ in parts))
    kd, ks, kz = (P * n)(*(k[0] for k, _ in kv)), (P * n)(*(k[1] for k, _ in kv)), (P * n)(*(k[2] for k, _ in kv))
    vd, vs, vz = (P * n)(*(v[0] for _, v in kv)), (P * n)(*(v[1] for _, v in kv)), (P * n)(*(v[2] for _, v in kv))
    vp = (P * n)(*(v[3] for _, v in kv))
    mk = (P * n)(*(None if m is None else ptr(m, torch.uint8) for _, _, m in parts))
    ntot = sum(ns)
    scratch = torch.empty(B * H * M * max(ntot, 1), dtype=torch.float32)
    out = torch.empty(B, H, M, D, dtype=torch.float32)
    lse = torch.empty(B, H, M, dtype=torch.float32)
    po = pl = None
    if prior is not None:
        po = ptr(prior[0].reshape(B, H, M, D), torch.float32)
        pl = ptr(prior[1].reshape(B, H, M), torch.float32)
    with torch.profiler.record_function("kvkit::quant_attn_cpu"):  # names the C call in torch.profiler tables
        rc = lib.kvkit_quant_attn(n, ns, kg, kb, vb, kd, ks, kz, vd, vs, vz, vp, mk, ptr(qf, torch.float32), B, H, M, D,
                                  float(scale), scratch.data_ptr(), po, pl, out.data_ptr(), lse.data_ptr(),
                                  max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit quant_cpu kernel refused shapes B={B} H={H} M={M} D={D}")
    keep.clear()  # the C call has returned: the pointers it read may go
    return out.view(B, Hq, Tq, D).to(q4.dtype), lse.view(B, Hq, Tq)
