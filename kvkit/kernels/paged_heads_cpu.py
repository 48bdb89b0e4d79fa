"""Decode attention over vLLM's bf16 paged KV cache where every (row, KV head) reads its own list of blocks.

vLLM's CPU op (``cpu_attention_with_kv_cache``) takes one block table per row, shared by all heads. DuoAttention
(``duo`` in the vLLM plugin) needs more: a *retrieval* head reads every block of its row, a *streaming* head only
the sink blocks and the most recent ones. :func:`decode` attends single-token queries ``q [n, H * G, D]`` over
per-(row, KV head) block lists ``blocks [n, H, W]`` (block ids) with ``ntok [n, H]`` tokens: every listed block
is full except the last, which holds ``ntok - (nblk - 1) * bs`` tokens (``nblk = ceil(ntok / bs)``). The G query
heads of a KV head (GQA, vLLM's order: query head ``j`` uses KV head ``j // G``) share its reads. Keys are cached
after RoPE, so attention over a subset of a row's blocks is exact softmax attention over the tokens listed.

Page layout: a layer's cache is vLLM's ``[num_blocks, kv_heads, block_size, 2 * head_size]`` tensor, viewed as
``[num_blocks, kv_heads, 2 * block_size, head_size]`` and split in two: the key page of (block, head) is the first
``bs * D`` elements of its slab, the value page the next ``bs * D``. The order *inside* a page depends on the ISA
vLLM's ``cpu_attn_reshape_and_cache`` writes for (read back from it, ``tests/test_vllm_duo.py``):

* ``"amx"`` (bf16 on AMX machines, ``D % 32 == 0``): keys in 16-token tiles ``[bs/16][D/2][16][2]`` (channel pairs
  of 16 tokens: one 64-byte line = 16 tokens x 2 channels), values in 16-channel groups ``[D/16][bs/2][16][2]``
  (token pairs: one line = 2 tokens x 16 channels);
* ``"vec"`` (the ``vec`` / ``vec16`` ISAs): keys channel-major ``[D][bs]``, values token-major ``[bs][D]``.

Either way a 64-byte load feeds 16 fp32 lanes, bf16 -> fp32 by a 16-bit shift (``x << 16`` / ``x & 0xffff0000``
on the pair words), no shuffles. One OpenMP task per (row, KV head) (dynamic schedule: a retrieval head's task is
longer than a streaming head's); per listed block the G query rows' scores are computed 16 tokens at a time, an
online softmax (vectorised exp) rescales the G x D accumulators held in vector registers, and the block's values
are accumulated. :func:`decode_ref` is the plain-torch reference (gather the listed tokens, softmax, matmul) and
the fallback without a C compiler; ``KVKIT_PAGED_HEADS_CPU=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import VEC_C, Kernel

LAYOUTS = ("amx", "vec")

_SRC = VEC_C + r"""
#define MAXG 16
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16x16 __attribute__((vector_size(32), aligned(2)));

AI v16 ldv(const float *p) { return *(const v16 *)p; }
AI void stv(float *p, v16 v) { *(v16 *)p = v; }
AI vu16 ldu(const uint32_t *p) { return *(const vu16 *)p; }
AI v16 lo16(vu16 x) { return (v16)(x << 16); }                    /* bf16 in the low half of each word */
AI v16 hi16(vu16 x) { return (v16)(x & 0xffff0000u); }            /* bf16 in the high half */
AI v16 ldbf(const uint16_t *p) { return (v16)(__builtin_convertvector(*(const h16x16 *)p, vu16) << 16); }
AI v16 vmax(v16 a, v16 b) { vi16 k = a > b; return (v16)(((vi16)a & k) | ((vi16)b & ~k)); }
AI float hmax(v16 x) {
  float r = x[0];
  for (int e = 1; e < 16; e++) r = x[e] > r ? x[e] : r;
  return r;
}

/* One (row, KV head): G query rows q [G, D] (fp32, unscaled) over the blocks bl[0 .. ceil(ntok/bs)) of the pages
   kbase / vbase (bf16 elements; the page of block b at b * bstride, head offset already applied); out [G, D] fp32.
   AMX: the "amx" page layout, else "vec". D % 16 == 0 (AMX: D % 32 == 0), bs % 16 == 0. Inlined with constant
   G, D, AMX by the dispatch below (registers), and once with runtime values (the generic path). */
AI void attend(const float *q, const uint16_t *kbase, const uint16_t *vbase, int64_t bstride, const int32_t *bl,
               int64_t ntok, int bs, float scaling, float *out, const int G, const int D, const int AMX) {
  const int NV = D / 16;
  float s[G][bs];
  float qf[G][D];
  float m[G], l[G];
  v16 acc[G][NV];
  for (int g = 0; g < G; g++) {
    m[g] = -INFINITY; l[g] = 0.f;
    for (int c = 0; c < NV; c++) acc[g][c] = (v16){0};
    for (int d = 0; d < D; d++) qf[g][d] = q[g * D + d] * scaling;
  }
  const int64_t nb = (ntok + bs - 1) / bs;
  for (int64_t j = 0; j < nb; j++) {
    const int64_t blk = bl[j];
    const uint16_t *kp = kbase + blk * bstride, *vp = vbase + blk * bstride;
    const int n = ntok - j * bs < bs ? (int)(ntok - j * bs) : bs;
    const int nt = (n + 15) & ~15;  /* tokens scored: whole 16-token tiles (lanes >= n masked below) */
    /* scores */
    /* no software prefetch of the next block: spreading prefetches of its pages over this block's tiles made a
       4 x 4K layer 0.68 ms against 0.54 ms without (timed A/B, benchmarks in results/vllm/duo/README.md) */
    for (int t = 0; t < nt; t += 16) {
      v16 dv[G], dw[G];  /* two accumulators per query row (FMA latency) */
      for (int g = 0; g < G; g++) { dv[g] = (v16){0}; dw[g] = (v16){0}; }
      if (AMX) {  /* tile t/16: [D/2][16 tokens][2 channels] */
        const uint32_t *kt = (const uint32_t *)(kp + (int64_t)t * D);
        for (int p = 0; p < D / 2; p++) {
          vu16 x = ldu(kt + 16 * p);
          v16 a = lo16(x), b = hi16(x);
          for (int g = 0; g < G; g++) { dv[g] += qf[g][2 * p] * a; dw[g] += qf[g][2 * p + 1] * b; }
        }
      } else {  /* [D][bs]: channel d of 16 tokens is 32 contiguous bytes */
        for (int d = 0; d < D; d += 2) {
          v16 a = ldbf(kp + (int64_t)d * bs + t), b = ldbf(kp + (int64_t)(d + 1) * bs + t);
          for (int g = 0; g < G; g++) { dv[g] += qf[g][d] * a; dw[g] += qf[g][d + 1] * b; }
        }
      }
      vi16 live = ((vi16){0} + t + (vi16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}) < n;
      const v16 ninf = (v16){0} - INFINITY;
      for (int g = 0; g < G; g++) {
        v16 x = dv[g] + dw[g];  /* unwritten slots may hold anything (NaN): select, never arithmetic */
        stv(&s[g][t], (v16)(((vi16)x & live) | ((vi16)ninf & ~live)));
      }
    }
    /* online softmax over this block */
    for (int g = 0; g < G; g++) {
      v16 mv = (v16){0} + m[g];
      for (int t = 0; t < nt; t += 16) mv = vmax(mv, ldv(&s[g][t]));
      const float mx = hmax(mv);
      const float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
      m[g] = mx;
      l[g] *= alpha;
      for (int c = 0; c < NV; c++) acc[g][c] *= alpha;
      v16 tot = (v16){0};
      for (int t = 0; t < nt; t += 16) {
        v16 e = vexp(ldv(&s[g][t]) - mx);
        stv(&s[g][t], e);
        tot += e;
      }
      l[g] += hsum(tot);
    }
    /* values */
    if (AMX) {  /* channel group c: [bs/2][16 channels][2 tokens] */
      int t = 0;
      for (; t + 1 < n; t += 2) {
        for (int c = 0; c < NV; c++) {
          vu16 x = ldu((const uint32_t *)(vp + (int64_t)c * bs * 16 + (int64_t)t * 16));
          v16 a = lo16(x), b = hi16(x);
          for (int g = 0; g < G; g++) acc[g][c] += s[g][t] * a + s[g][t + 1] * b;
        }
      }
      if (t < n) {  /* an odd last token: its pair's other half was never written */
        for (int c = 0; c < NV; c++) {
          v16 a = lo16(ldu((const uint32_t *)(vp + (int64_t)c * bs * 16 + (int64_t)t * 16)));
          for (int g = 0; g < G; g++) acc[g][c] += s[g][t] * a;
        }
      }
    } else {  /* [bs][D] */
      for (int t = 0; t < n; t++) {
        const uint16_t *row = vp + (int64_t)t * D;
        for (int c = 0; c < NV; c++) {
          v16 a = ldbf(row + 16 * c);
          for (int g = 0; g < G; g++) acc[g][c] += s[g][t] * a;
        }
      }
    }
  }
  for (int g = 0; g < G; g++) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int c = 0; c < NV; c++) stv(out + g * D + 16 * c, acc[g][c] * inv);
  }
}

static void __attribute__((noinline)) attend_any(const float *q, const uint16_t *kb, const uint16_t *vb, int64_t bst,
    const int32_t *bl, int64_t ntok, int bs, float sc, float *out, int G, int D, int amx) {
  if (amx) attend(q, kb, vb, bst, bl, ntok, bs, sc, out, G, D, 1);
  else attend(q, kb, vb, bst, bl, ntok, bs, sc, out, G, D, 0);
}

#define AT(G_, D_, A_) attend(qr, kb, vb, bstride, bl, nt, bs, scaling, orow, G_, D_, A_)
#define BY_A(G_, D_) do { if (amx) AT(G_, D_, 1); else AT(G_, D_, 0); } while (0)
#define BY_D(G_) do { if (D == 64) BY_A(G_, 64); else BY_A(G_, 128); } while (0)

/* one (row, KV head): the compiled fast path for (G <= 8, D in {64, 128}), else the generic one */
static void __attribute__((noinline)) attend_task(const float *qr, const uint16_t *kb, const uint16_t *vb,
    int64_t bstride, const int32_t *bl, int64_t nt, int bs, float scaling, float *orow, int G, int D, int amx) {
  if (D == 64 || D == 128) {
    switch (G) {
      case 1: BY_D(1); return;
      case 2: BY_D(2); return;
      case 3: BY_D(3); return;
      case 4: BY_D(4); return;
      case 5: BY_D(5); return;
      case 6: BY_D(6); return;
      case 7: BY_D(7); return;
      case 8: BY_D(8); return;
      default: break;
    }
  }
  attend_any(qr, kb, vb, bstride, bl, nt, bs, scaling, orow, G, D, amx);
}

/* q [n, H*G, D] fp32; kcache / vcache: the key / value page of (block b, KV head h) at b*bstride + h*hstride
   (bf16 elements); blocks [n, H, W] int32 block ids; ntok [n, H] int32 tokens read; out [n, H*G, D] fp32.
   layout: 1 = "amx", 0 = "vec". Returns -1 on unsupported shapes. */
int kvkit_paged_heads_decode(const float *q, const uint16_t *kcache, const uint16_t *vcache, int64_t bstride,
                             int64_t hstride, const int32_t *blocks, int64_t W, const int32_t *ntok, int64_t n,
                             int H, int G, int D, int bs, int amx, float scaling, float *out, int nthreads) {
  if (G < 1 || G > MAXG || D % 16 || D > 512 || (amx && D % 32) || bs % 16 || bs > 4096) return -1;
  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t task = 0; task < n * H; task++) {
    const int h = (int)(task % H);
    const float *qr = q + task * (int64_t)G * D;
    float *orow = out + task * (int64_t)G * D;
    const int64_t nt = ntok[task];
    if (nt <= 0) { memset(orow, 0, sizeof(float) * G * D); continue; }
    const int32_t *bl = blocks + task * W;
    const uint16_t *kb = kcache + (int64_t)h * hstride, *vb = vcache + (int64_t)h * hstride;
    attend_task(qr, kb, vb, bstride, bl, nt, bs, scaling, orow, G, D, amx);
  }
  return 0;
}

AI float bf2f(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
AI uint16_t f2bf(float f) {  /* round to nearest even (finite inputs) */
  uint32_t u; memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The engine's entry: bf16 query rows read in place (row tok[i] of q [T, H*G, D], row stride qst elements, heads
   contiguous) and bf16 output rows written in place (row tok[i] of out, row stride ost): no float copies. */
int kvkit_paged_heads_decode_rows(const uint16_t *q, int64_t qst, const int64_t *tok, const uint16_t *kcache,
                                  const uint16_t *vcache, int64_t bstride, int64_t hstride, const int32_t *blocks,
                                  int64_t W, const int32_t *ntok, int64_t n, int H, int G, int D, int bs, int amx,
                                  float scaling, uint16_t *out, int64_t ost, int nthreads) {
  if (G < 1 || G > MAXG || D % 16 || D > 512 || (amx && D % 32) || bs % 16 || bs > 4096) return -1;
  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t task = 0; task < n * H; task++) {
    const int64_t i = task / H;
    const int h = (int)(task % H);
    float qr[G * D], orow[G * D];
    const uint16_t *qs = q + tok[i] * qst + (int64_t)h * G * D;
    for (int e = 0; e < G * D; e++) qr[e] = bf2f(qs[e]);
    const int64_t nt = ntok[task];
    if (nt <= 0) memset(orow, 0, sizeof(float) * G * D);
    else {
      const int32_t *bl = blocks + task * W;
      const uint16_t *kb = kcache + (int64_t)h * hstride, *vb = vcache + (int64_t)h * hstride;
      attend_task(qr, kb, vb, bstride, bl, nt, bs, scaling, orow, G, D, amx);
    }
    uint16_t *os = out + tok[i] * ost + (int64_t)h * G * D;
    for (int e = 0; e < G * D; e++) os[e] = f2bf(orow[e]);
  }
  return 0;
}
"""


# --- page layout --------------------------------------------------------------------------------------------------
def layout_for_isa(isa: str) -> str:
    """The page layout vLLM's ``cpu_attn_reshape_and_cache`` writes for ``isa``."""
    if isa == "amx":
        return "amx"
    if isa in ("vec", "vec16"):
        return "vec"
    raise NotImplementedError(f"kvkit paged heads: vLLM's {isa!r} CPU page layout is not supported (amx, vec, vec16)")


def page_offsets(block_size: int, D: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(koff, voff)`` ``[bs, D]`` int64: the element offset of token ``t``, channel ``d`` inside a key / value page."""
    t = torch.arange(block_size).unsqueeze(1)
    d = torch.arange(D).unsqueeze(0)
    if layout == "amx":
        if D % 32 or block_size % 16:
            raise ValueError(f"kvkit paged heads: the amx layout needs D % 32 == 0 and bs % 16 == 0, got D={D} "
                             f"bs={block_size}")
        koff = (t // 16) * (16 * D) + (d // 2) * 32 + (t % 16) * 2 + d % 2
        voff = (d // 16) * (block_size * 16) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    elif layout == "vec":
        koff = d * block_size + t
        voff = t * D + d
    else:
        raise ValueError(f"kvkit paged heads: unknown layout {layout!r} (one of {LAYOUTS})")
    return koff, voff


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU layer cache ``[blocks, H, bs, 2 * D]`` -> (key pages, value pages) ``[blocks, H, bs, D]`` views."""
    nb, H, bs, D2 = kv_cache.shape
    return kv_cache.view(nb, H, 2 * bs, D2 // 2).chunk(2, dim=2)


def _flat_pages(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, H, bs, D]`` key or value pages (each page contiguous) -> ``[blocks, H, bs * D]`` view."""
    nb, H, bs, D = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != D:
        raise ValueError("kvkit paged heads: each page must be contiguous (stride (.., .., D, 1))")
    return torch.as_strided(cache, (nb, H, bs * D), (cache.stride(0), cache.stride(1), 1), cache.storage_offset())


def write(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          slots: torch.Tensor, layout: str) -> None:
    """Write ``key, value [T, H, D]`` into ``slots [T]`` (block * bs + offset) in ``layout`` (torch; what vLLM's
    ``cpu_attn_reshape_and_cache`` does, for tests without vLLM)."""
    nb, H, bs, D = key_cache.shape
    koff, voff = page_offsets(bs, D, layout)
    slots = slots.long()
    blk, t = slots // bs, slots % bs
    kp, vp = _flat_pages(key_cache), _flat_pages(value_cache)
    for h in range(H):
        kp[blk.unsqueeze(1), h, koff[t]] = key[:, h].to(kp.dtype)
        vp[blk.unsqueeze(1), h, voff[t]] = value[:, h].to(vp.dtype)


def gather(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, head: int,
           layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[n, D]`` of one KV head at ``slots [n]`` (fp32)."""
    nb, H, bs, D = key_cache.shape
    koff, voff = page_offsets(bs, D, layout)
    slots = slots.long()
    blk, t = slots // bs, slots % bs
    kp, vp = _flat_pages(key_cache), _flat_pages(value_cache)
    return kp[blk.unsqueeze(1), head, koff[t]].float(), vp[blk.unsqueeze(1), head, voff[t]].float()


def list_slots(blocks: torch.Tensor, ntok: int, block_size: int) -> torch.Tensor:
    """The slots of the ``ntok`` tokens a block list ``blocks [W]`` reads (every block full but the last)."""
    pos = torch.arange(int(ntok))
    return blocks.long()[pos // block_size] * block_size + pos % block_size


# --- reference ----------------------------------------------------------------------------------------------------
def decode_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
               ntok: torch.Tensor, scale: float, layout: str) -> torch.Tensor:
    """Plain torch: each (row, KV head)'s query heads over the tokens its block list reads; fp32 ``[n, H*G, D]``."""
    n, Hq, D = q.shape
    H, bs = key_cache.shape[1], key_cache.shape[2]
    G = Hq // H
    out = torch.zeros(n, Hq, D, dtype=torch.float32)
    for i in range(n):
        for h in range(H):
            L = int(ntok[i, h])
            if L <= 0:
                continue
            k, v = gather(key_cache, value_cache, list_slots(blocks[i, h], L, bs), h, layout)
            qi = q[i, h * G: (h + 1) * G].float()
            p = torch.softmax(qi @ k.T * scale, dim=-1)
            out[i, h * G: (h + 1) * G] = p @ v
    return out


# --- C kernel -----------------------------------------------------------------------------------------------------
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("paged_heads_cpu", _SRC, {
    "kvkit_paged_heads_decode": ([_P, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F, _P, _I], _I),
    "kvkit_paged_heads_decode_rows": ([_P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F,
                                       _P, _I64, _I], _I),
}, "KVKIT_PAGED_HEADS_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_PAGED_HEADS_CPU=0``."""
    return _KERNEL.available()


def decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
           ntok: torch.Tensor, scale: float, layout: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of single-token queries ``q [n, H*G, D]`` over per-(row, KV head) block lists.

    key_cache, value_cache : ``[num_blocks, H, bs, D]`` bf16 pages (:func:`split_cache` of vLLM's layer cache),
        in ``layout`` (:func:`layout_for_isa`).
    blocks : ``[n, H, W]`` block ids per (row, KV head); ntok : ``[n, H]`` tokens read (every listed block full
        but the last; ``ntok <= 0``: zero output).
    Returns fp32 ``[n, H*G, D]`` (into ``out`` if given, fp32 contiguous). The C kernel when available, else
    :func:`decode_ref`."""
    n, Hq, D = q.shape
    nb, H, bs, Dc = key_cache.shape
    if Dc != D or value_cache.shape != key_cache.shape:
        raise ValueError(f"kvkit paged heads: pages {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not "
                         f"match head size {D}")
    if Hq % H:
        raise ValueError(f"kvkit paged heads: {Hq} query heads do not group over {H} KV heads")
    if tuple(blocks.shape[:2]) != (n, H) or tuple(ntok.shape) != (n, H):
        raise ValueError(f"kvkit paged heads: blocks {tuple(blocks.shape)} / ntok {tuple(ntok.shape)} do not match "
                         f"{n} rows x {H} KV heads")
    if layout not in LAYOUTS or bs % 16 or D % 16 or (layout == "amx" and D % 32):
        page_offsets(bs, D, layout)  # raises, naming the problem
    ok = (available() and key_cache.dtype == torch.bfloat16 and value_cache.dtype == torch.bfloat16
          and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1 and key_cache.stride(2) == D)
    if not ok:
        r = decode_ref(q, key_cache, value_cache, blocks, ntok, scale, layout)
        if out is not None:
            out.copy_(r)
            return out
        return r
    qf = q.to(torch.float32).contiguous()
    bl = blocks.to(torch.int32).contiguous()
    nt = ntok.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous()
    if n == 0:
        return out
    with torch.profiler.record_function("kvkit::paged_heads_decode_cpu"):
        rc = _load().kvkit_paged_heads_decode(
            qf.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
            bl.data_ptr(), bl.shape[2], nt.data_ptr(), n, H, Hq // H, D, bs, int(layout == "amx"), float(scale),
            out.data_ptr(), max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_heads_cpu kernel refused shapes H={H} G={Hq // H} D={D} bs={bs} "
                           f"layout={layout}")
    return out


def decode_rows(query: torch.Tensor, tok: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                blocks: torch.Tensor, ntok: torch.Tensor, scale: float, layout: str, output: torch.Tensor) -> None:
    """The engine's call: rows ``tok [n]`` (int64) of ``query [T, H*G, D]`` attend as in :func:`decode` and their
    results land in the same rows of ``output [T, H*G, D]``. bf16 query / output with contiguous heads go straight
    through the C kernel (read and written in place); otherwise :func:`decode` and a copy."""
    T, Hq, D = query.shape
    H = key_cache.shape[1]
    fast = (available() and query.dtype == torch.bfloat16 and output.dtype == torch.bfloat16
            and key_cache.dtype == torch.bfloat16 and value_cache.dtype == torch.bfloat16
            and query.stride(2) == 1 and query.stride(1) == D and output.stride(2) == 1 and output.stride(1) == D
            and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1 and key_cache.stride(2) == D
            and tok.dtype == torch.int64 and tok.is_contiguous() and blocks.dtype == torch.int32
            and blocks.is_contiguous() and ntok.dtype == torch.int32 and ntok.is_contiguous()
            and tuple(blocks.shape[:2]) == (tok.numel(), H) and Hq % H == 0 and layout in LAYOUTS)
    if not fast:
        output[tok] = decode(query[tok], key_cache, value_cache, blocks, ntok, scale, layout).to(output.dtype)
        return
    n = tok.numel()
    if n == 0:
        return
    rc = _load().kvkit_paged_heads_decode_rows(
        query.data_ptr(), query.stride(0), tok.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.stride(0), key_cache.stride(1), blocks.data_ptr(), blocks.shape[2], ntok.data_ptr(), n, H, Hq // H,
        D, key_cache.shape[2], int(layout == "amx"), float(scale), output.data_ptr(), output.stride(0),
        max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_heads_cpu kernel refused shapes H={H} G={Hq // H} D={D} "
                           f"bs={key_cache.shape[2]} layout={layout}")
