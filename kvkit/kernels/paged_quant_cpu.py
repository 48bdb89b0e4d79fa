"""Packed 4-bit / 8-bit K/V in a paged cache (vLLM's block layout): writes, reads, a C decode kernel, a torch reference.

Page format (one page = one block of ``bs`` tokens of one KV head, ``bs * C`` bytes, ``C = state_bytes(D, bits)``):

    [ K codes  DB x bs ][ V codes  bs x DB ][ K scale fp16 x bs ][ K min fp16 x bs ][ V scale fp16 x bs ][ V min fp16 x bs ]

with ``DB = D * bits / 8`` bytes of codes per token and head. Both keys and values are quantised **per token**
(asymmetric: ``x ~= code * scale + min`` over the ``D`` channels of one head of one token, codes in
``[0, 2**bits - 1]``), so a slot is written once, when its token is computed, and never re-quantised: no
residual buffer, no per-block statistics that change while a block fills (what a paged cache filled one decode
token at a time would need for per-channel key statistics). Codes use :mod:`kvkit.kernels.quant`'s packing: with
``P = 8 / bits`` values per byte, byte ``b`` holds channels ``b, b + DB, ...`` at bit offsets ``0, bits, ...``.
Bytes per token and head: ``2 * DB + 8`` (4-bit, D=64: 72 bytes against 256 for bf16 K+V, 3.56x; D=128: 136 vs
512, 3.76x; 8-bit: D=64 136 bytes, 1.88x).

* :func:`write` quantises the new tokens' K/V ``[T, H, D]`` into their slots (vectorised torch, one
  ``index_put`` per field).
* :func:`gather` dequantises listed slots back to float K/V (prefill reads the context of the rows it
  prefills this way; tests and the reference too).
* :func:`decode` attends single-token queries ``[n, H * G, D]`` over their rows' pages, straight from the
  block table: a C kernel (one OpenMP task per (row, KV head); per block: scores ``scale_t * (q . code_t) +
  min_t * sum(q)`` for the G query heads of the KV head, an online softmax with a vectorised exp, values
  accumulated as ``sum_t (p_t scale_t) code_t + sum_t p_t min_t``; codes unpacked in registers, never
  written back as floats). :func:`decode_ref` is the plain-torch reference (dequantise, softmax, matmul).

The C source is compiled on first use by :func:`kvkit.kernels.cbuild.build`; without a compiler
:func:`available` is False and :func:`decode` runs the reference. ``KVKIT_PAGED_QUANT_CPU=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import VEC_C, Kernel

BITS = (4, 8)

_SRC = VEC_C + r"""
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
#define MAXG 16

AI v16 ldv(const float *p) { return *(const v16 *)p; }
AI void stv(float *p, v16 v) { *(v16 *)p = v; }
AI u8x16 ldb(const uint8_t *p) { return *(const u8x16 *)p; }
typedef _Float16 h16 __attribute__((vector_size(32), aligned(2)));
AI v16 ldh(const _Float16 *p) { return __builtin_convertvector(*(const h16 *)p, v16); }
AI v16 vmax(v16 a, v16 b) { vi16 k = a > b; return (v16)(((vi16)a & k) | ((vi16)b & ~k)); }
AI float hmax(v16 x) {
  float r = x[0];
  for (int e = 1; e < 16; e++) r = x[e] > r ? x[e] : r;
  return r;
}
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
/* u8 -> i32 (zero-extend: vpmovzxbd) -> f32 (vcvtdq2ps): two steps, or GCC scalarises the conversion */
#if defined(__AVX512F__)
#include <immintrin.h>
AI v16 cvt(u8x16 b) { return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b)); }
#else
AI v16 cvt(u8x16 b) { return __builtin_convertvector(__builtin_convertvector(b, vi16), v16); }
#endif

/* codes of one token (DB bytes) -> D floats (generic path) */
AI void unpack_scalar(const uint8_t *row, int DB, int BITS, float *code) {
  if (BITS == 8) { for (int b = 0; b < DB; b++) code[b] = (float)row[b]; return; }
  for (int b = 0; b < DB; b++) { code[b] = (float)(row[b] & 15); code[b + DB] = (float)(row[b] >> 4); }
}

/* one (row, KV head): G query rows q [G, D] (fp32) over the nb blocks listed in bt, seq tokens; out [G, D].
   VEC: DB % 16 == 0 (16 bytes of codes per vector step); otherwise plain loops. */
AI void attend(const float *q, const uint8_t *cache, int64_t bstride, int64_t hstride, int h, const int32_t *bt,
               int64_t seq, int G, int D, int bs, int BITS, float scaling, int VEC, float *out) {
  const int DB = D * BITS / 8, NC = DB / 16, bsp = (bs + 15) & ~15;
  float s[G * bsp], acc[G * D], code[D], qc[G * D];
  float sumq[MAXG], m[MAXG], l[MAXG], accz[MAXG];
  for (int g = 0; g < G; g++) {
    m[g] = -INFINITY; l[g] = 0.f; accz[g] = 0.f;
    for (int d = 0; d < D; d++) acc[g * D + d] = 0.f;
  }
  int64_t nb = (seq + bs - 1) / bs;
  for (int64_t j = 0; j < nb; j++) {
    const uint8_t *base = cache + (int64_t)bt[j] * bstride + (int64_t)h * hstride;
    int n = seq - j * bs < bs ? (int)(seq - j * bs) : bs;
    const uint8_t *kc = base, *vc = base + (int64_t)bs * DB;
    const _Float16 *ks = (const _Float16 *)(base + 2 * (int64_t)bs * DB), *kz = ks + bs, *vs = kz + bs, *vz = vs + bs;
    const _Float16 *kcs = vz + bs;  /* the block's key channel scale [D] */
    if (j + 1 < nb) __builtin_prefetch(cache + (int64_t)bt[j + 1] * bstride + (int64_t)h * hstride);
    for (int g = 0; g < G; g++) {  /* q . k = scale_t (q c) . code_t + min_t sum(q c) */
      float z = 0.f;
      for (int d = 0; d < D; d++) { float x = q[g * D + d] * (float)kcs[d]; qc[g * D + d] = x; z += x; }
      sumq[g] = z;
    }
    /* scores */
    for (int t = 0; t < n; t++) {
      uint8_t row[256];  /* this token's key bytes: a column of the block's [DB, bs] key codes */
      for (int b = 0; b < DB; b++) row[b] = kc[(int64_t)b * bs + t];
      float sc = (float)ks[t], zc = (float)kz[t];
      if (VEC) {
        v16 dv[MAXG];
        for (int g = 0; g < G; g++) dv[g] = (v16){0};
        for (int c = 0; c < NC; c++) {
          u8x16 b = ldb(row + 16 * c);
          if (BITS == 8) {
            v16 cv = cvt(b);
            for (int g = 0; g < G; g++) dv[g] += ldv(qc + g * D + 16 * c) * cv;
          } else {
            v16 lo = cvt(b & 15), hi = cvt(b >> 4);
            for (int g = 0; g < G; g++) dv[g] += ldv(qc + g * D + 16 * c) * lo + ldv(qc + g * D + DB + 16 * c) * hi;
          }
        }
        for (int g = 0; g < G; g++) s[g * bsp + t] = (sc * hsum(dv[g]) + zc * sumq[g]) * scaling;
      } else {
        unpack_scalar(row, DB, BITS, code);
        for (int g = 0; g < G; g++) {
          float a = 0.f;
          for (int d = 0; d < D; d++) a += qc[g * D + d] * code[d];
          s[g * bsp + t] = (sc * a + zc * sumq[g]) * scaling;
        }
      }
    }
    /* online softmax: new max, rescale, exponentiate (padding lanes -inf -> 0) */
    for (int g = 0; g < G; g++) {
      float *sg = s + g * bsp;
      float mx = m[g];
      for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
      for (int t = n; t < bsp; t++) sg[t] = -INFINITY;
      float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
      m[g] = mx;
      l[g] *= alpha; accz[g] *= alpha;
      for (int d = 0; d < D; d++) acc[g * D + d] *= alpha;
      v16 tot = (v16){0};
      for (int t = 0; t < bsp; t += 16) {
        v16 e = vexp(ldv(sg + t) - mx);
        stv(sg + t, e);
        tot += e;
      }
      l[g] += hsum(tot);
      float z = 0.f;
      for (int t = 0; t < n; t++) { z += sg[t] * (float)vz[t]; sg[t] *= (float)vs[t]; }
      accz[g] += z;
    }
    /* values: acc_g += sum_t (p_t scale_t) code_t */
    for (int t = 0; t < n; t++) {
      const uint8_t *row = vc + (int64_t)t * DB;
      if (VEC) {
        for (int c = 0; c < NC; c++) {
          u8x16 b = ldb(row + 16 * c);
          if (BITS == 8) {
            v16 cv = cvt(b);
            for (int g = 0; g < G; g++) {
              float *a = acc + g * D + 16 * c;
              stv(a, ldv(a) + cv * s[g * bsp + t]);
            }
          } else {
            v16 lo = cvt(b & 15), hi = cvt(b >> 4);
            for (int g = 0; g < G; g++) {
              float w = s[g * bsp + t], *a = acc + g * D + 16 * c, *a2 = a + DB;
              stv(a, ldv(a) + lo * w);
              stv(a2, ldv(a2) + hi * w);
            }
          }
        }
      } else {
        unpack_scalar(row, DB, BITS, code);
        for (int g = 0; g < G; g++) {
          float w = s[g * bsp + t];
          for (int d = 0; d < D; d++) acc[g * D + d] += w * code[d];
        }
      }
    }
  }
  for (int g = 0; g < G; g++) {
    float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int d = 0; d < D; d++) out[g * D + d] = (acc[g * D + d] + accz[g]) * inv;
  }
}


/* the vector path, with G, D and BITS compile-time constants (D % 16 == 0 and 16 | D*BITS/8): the G query rows
   (times the block's key channel scale) and the G x D accumulators live in vector registers */
AI void attend_vec(const float *q, const uint8_t *cache, int64_t bstride, int64_t hstride, int h, const int32_t *bt,
                   int64_t seq, int bs, float scaling, float *out, const int G, const int D, const int BITS) {
  const int DB = D * BITS / 8, NC = DB / 16, NV = D / 16, bsp = (bs + 15) & ~15;
  float s[G * bsp];
  float sumq[G], m[G], l[G], accz[G];
  v16 qv[G][NV], acc[G][NV];
  for (int g = 0; g < G; g++) {
    m[g] = -INFINITY; l[g] = 0.f; accz[g] = 0.f;
    for (int c = 0; c < NV; c++) acc[g][c] = (v16){0};
  }
  int64_t nb = (seq + bs - 1) / bs;
  for (int64_t j = 0; j < nb; j++) {
    const uint8_t *base = cache + (int64_t)bt[j] * bstride + (int64_t)h * hstride;
    int n = seq - j * bs < bs ? (int)(seq - j * bs) : bs;
    const uint8_t *kc = base, *vc = base + (int64_t)bs * DB;
    const _Float16 *ks = (const _Float16 *)(base + 2 * (int64_t)bs * DB), *kz = ks + bs, *vs = kz + bs, *vz = vs + bs;
    const _Float16 *kcs = vz + bs;
    if (j + 1 < nb) __builtin_prefetch(cache + (int64_t)bt[j + 1] * bstride + (int64_t)h * hstride);
    for (int c = 0; c < NV; c++) {
      v16 cs;
      for (int e = 0; e < 16; e++) cs[e] = (float)kcs[16 * c + e];
      for (int g = 0; g < G; g++) qv[g][c] = ldv(q + g * D + 16 * c) * cs;
    }
    for (int g = 0; g < G; g++) {
      v16 z = (v16){0};
      for (int c = 0; c < NV; c++) z += qv[g][c];
      sumq[g] = hsum(z);
    }
    float qf[G][D];  /* q * c as scalars, broadcast per channel below */
    for (int g = 0; g < G; g++) for (int c = 0; c < NV; c++) stv(&qf[g][16 * c], qv[g][c]);
    for (int t = 0; t < bsp; t += 16) {  /* keys are [DB, bs] per block: 16 tokens' byte b in one load */
      v16 dv[G], dw[G];  /* two independent accumulators per query row (FMA latency) */
      for (int g = 0; g < G; g++) { dv[g] = (v16){0}; dw[g] = (v16){0}; }
      for (int b = 0; b < DB; b += 2) {
        u8x16 x = ldb(kc + (int64_t)b * bs + t), y = ldb(kc + (int64_t)(b + 1) * bs + t);
        if (BITS == 8) {
          v16 cx = cvt(x), cy = cvt(y);
          for (int g = 0; g < G; g++) { dv[g] += qf[g][b] * cx; dw[g] += qf[g][b + 1] * cy; }
        } else {
          v16 lx = cvt(x & 15), hx = cvt(x >> 4), ly = cvt(y & 15), hy = cvt(y >> 4);
          for (int g = 0; g < G; g++) {
            dv[g] += qf[g][b] * lx;
            dw[g] += qf[g][DB + b] * hx;
            dv[g] += qf[g][b + 1] * ly;
            dw[g] += qf[g][DB + b + 1] * hy;
          }
        }
      }
      v16 sc = ldh(ks + t), zc = ldh(kz + t);
      for (int g = 0; g < G; g++) stv(s + g * bsp + t, (sc * (dv[g] + dw[g]) + zc * sumq[g]) * scaling);
    }
    for (int g = 0; g < G; g++) {  /* online softmax, 16 tokens per step (lanes >= n: -inf -> p = 0) */
      float *sg = s + g * bsp;
      for (int t = n; t < bsp; t++) sg[t] = -INFINITY;
      v16 mv = (v16){0} + m[g];
      for (int t = 0; t < bsp; t += 16) mv = vmax(mv, ldv(sg + t));
      float mx = hmax(mv);
      float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
      m[g] = mx;
      l[g] *= alpha; accz[g] *= alpha;
      for (int c = 0; c < NV; c++) acc[g][c] *= alpha;
      v16 tot = (v16){0}, zt = (v16){0};
      for (int t = 0; t < bsp; t += 16) {
        v16 e = vexp(ldv(sg + t) - mx);
        vi16 live = ((vi16){0} + t + (vi16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}) < n;
        v16 sv = (v16)((vi16)ldh(vs + t) & live), zv = (v16)((vi16)ldh(vz + t) & live);
        tot += e;
        zt += e * zv;
        stv(sg + t, e * sv);
      }
      l[g] += hsum(tot);
      accz[g] += hsum(zt);
    }
    for (int t = 0; t < n; t++) {
      const uint8_t *row = vc + (int64_t)t * DB;
      for (int c = 0; c < NC; c++) {
        u8x16 b = ldb(row + 16 * c);
        if (BITS == 8) {
          v16 cv = cvt(b);
          for (int g = 0; g < G; g++) acc[g][c] += cv * s[g * bsp + t];
        } else {
          v16 lo = cvt(b & 15), hi = cvt(b >> 4);
          for (int g = 0; g < G; g++) {
            float w = s[g * bsp + t];
            acc[g][c] += lo * w;
            acc[g][NC + c] += hi * w;
          }
        }
      }
    }
  }
  for (int g = 0; g < G; g++) {
    float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int c = 0; c < NV; c++) stv(out + g * D + 16 * c, (acc[g][c] + accz[g]) * inv);
  }
}

#define AV(G_, D_, B_) attend_vec(qr, cache, bstride, hstride, h, bt + i * btw, seq[i], bs, scaling, orow, G_, D_, B_)
#define BY_B(G_, D_) do { if (bits == 4) AV(G_, D_, 4); else AV(G_, D_, 8); } while (0)
#define BY_D(G_) do { if (D == 64) BY_B(G_, 64); else BY_B(G_, 128); } while (0)
/* 1 if (G, D, bits) has a compiled vector path (called with it), else 0 */
AI int dispatch_vec(const float *qr, const uint8_t *cache, int64_t bstride, int64_t hstride, int h, const int32_t *bt,
                    int64_t i, int64_t btw, const int32_t *seq, int G, int D, int bs, int bits, float scaling, float *orow) {
  if (D != 64 && D != 128) return 0;
  switch (G) {
    case 1: BY_D(1); return 1;
    case 2: BY_D(2); return 1;
    case 3: BY_D(3); return 1;
    case 4: BY_D(4); return 1;
    case 5: BY_D(5); return 1;
    case 6: BY_D(6); return 1;
    case 7: BY_D(7); return 1;
    case 8: BY_D(8); return 1;
    default: return 0;
  }
}


AI float ld16(const uint16_t *p, int is_bf16) {
  if (is_bf16) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }
  _Float16 h; memcpy(&h, p, 2); return (float)h;
}

/* per-token asymmetric quantisation of x [D] (already divided by the channel scale) into codes (stride cst
   between packed bytes), scale / min as fp16 (the same arithmetic as the torch path) */
AI void quant_token(const float *x, int D, int bits, uint8_t *codes, int64_t cst, _Float16 *sc, _Float16 *mn) {
  const int qmax = (1 << bits) - 1, DB = D * bits / 8;
  float lo = INFINITY, hi = -INFINITY;
  for (int d = 0; d < D; d++) { lo = x[d] < lo ? x[d] : lo; hi = x[d] > hi ? x[d] : hi; }
  _Float16 z = (_Float16)lo;
  _Float16 s = (_Float16)((hi - (float)z) / (float)qmax);
  if (!((float)s > 0.f)) s = (_Float16)1.0f;
  float zf = (float)z, sf = (float)s;
  uint8_t q[512];
  for (int d = 0; d < D; d++) {
    float c = nearbyintf((x[d] - zf) / sf);
    c = c < 0.f ? 0.f : (c > (float)qmax ? (float)qmax : c);
    q[d] = (uint8_t)c;
  }
  if (bits == 8) for (int b = 0; b < DB; b++) codes[b * cst] = q[b];
  else for (int b = 0; b < DB; b++) codes[b * cst] = (uint8_t)(q[b] | (q[b + DB] << 4));
  *sc = s; *mn = z;
}

/* k, v [T, H, D] 16-bit (token / head strides in elements); slots [T] (< 0: skipped). Pages as in decode.
   1) blocks whose first slot is written here get c = sqrt(max |k|) over this call's tokens of the block;
   2) every token: keys k / c and values quantised per token into their slot. */
int kvkit_paged_quant_write(const uint16_t *k, const uint16_t *v, int64_t kts, int64_t khs, int64_t vts, int64_t vhs,
                            int is_bf16, const int64_t *slots, int64_t T, uint8_t *cache, int64_t bstride,
                            int64_t hstride, int H, int D, int bs, int bits, int nthreads) {
  if (D > 512 || (bits != 4 && bits != 8) || (bits == 4 && D % 2)) return -1;
  const int DB = D * bits / 8;
  #pragma omp parallel num_threads(nthreads)
  {
    float x[512];
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < T; i++) {  /* fresh blocks: channel scales (one task per block's first token) */
      int64_t sl = slots[i];
      if (sl < 0 || sl % bs) continue;
      int64_t blk = sl / bs;
      for (int h = 0; h < H; h++) {
        for (int d = 0; d < D; d++) x[d] = 0.f;
        for (int64_t j = 0; j < T; j++) {
          if (slots[j] < 0 || slots[j] / bs != blk) continue;
          const uint16_t *kr = k + j * kts + h * khs;
          for (int d = 0; d < D; d++) { float a = fabsf(ld16(kr + d, is_bf16)); x[d] = a > x[d] ? a : x[d]; }
        }
        _Float16 *cs = (_Float16 *)(cache + blk * bstride + h * hstride + 2 * (int64_t)bs * DB + 8 * (int64_t)bs);
        float fl = 0.f;  /* floor: the mean over channels (a block begun by one decode token has near-zero channels) */
        for (int d = 0; d < D; d++) fl += x[d];
        fl = fl / (float)D;
        fl = fl > 1e-4f ? fl : 1e-4f;
        for (int d = 0; d < D; d++) cs[d] = (_Float16)sqrtf(x[d] > fl ? x[d] : fl);
      }
    }
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < T; i++) {
      int64_t sl = slots[i];
      if (sl < 0) continue;
      int64_t blk = sl / bs, off = sl % bs;
      for (int h = 0; h < H; h++) {
        uint8_t *base = cache + blk * bstride + h * hstride;
        _Float16 *st = (_Float16 *)(base + 2 * (int64_t)bs * DB), *cs = st + 4 * bs;
        const uint16_t *kr = k + i * kts + h * khs, *vr = v + i * vts + h * vhs;
        for (int d = 0; d < D; d++) {
          float a = ld16(kr + d, is_bf16) / (float)cs[d];
          x[d] = a < -6.0e4f ? -6.0e4f : (a > 6.0e4f ? 6.0e4f : a);
        }
        quant_token(x, D, bits, base + off, bs, st + off, st + bs + off);
        for (int d = 0; d < D; d++) {
          float a = ld16(vr + d, is_bf16);
          x[d] = a < -6.0e4f ? -6.0e4f : (a > 6.0e4f ? 6.0e4f : a);
        }
        quant_token(x, D, bits, base + (int64_t)bs * DB + off * DB, 1, st + 2 * bs + off, st + 3 * bs + off);
      }
    }
  }
  return 0;
}

/* q [n, H*G, D] fp32; cache: page of (block b, KV head h) at cache + b*bstride + h*hstride (bytes);
   bt [n, btw] int32 block ids; seq [n] int32 tokens; out [n, H*G, D] fp32 */
int kvkit_paged_quant_decode(const float *q, const uint8_t *cache, int64_t bstride, int64_t hstride,
                             const int32_t *bt, int64_t btw, const int32_t *seq, int64_t n, int H, int G, int D,
                             int bs, int bits, float scaling, float *out, int nthreads) {
  if (G > MAXG || D > 512 || bs > 4096 || (bits != 4 && bits != 8) || (bits == 4 && D % 2)) return -1;
  const int DB = D * bits / 8, VEC = DB % 16 == 0;
  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t task = 0; task < n * H; task++) {
    int64_t i = task / H;
    int h = (int)(task % H);
    const float *qr = q + (i * H + h) * (int64_t)G * D;
    float *orow = out + (i * H + h) * (int64_t)G * D;
    if (seq[i] <= 0) { memset(orow, 0, sizeof(float) * G * D); continue; }
    if (dispatch_vec(qr, cache, bstride, hstride, h, bt, i, btw, seq, G, D, bs, bits, scaling, orow)) continue;
    if (VEC) {
      if (bits == 4) attend(qr, cache, bstride, hstride, h, bt + i * btw, seq[i], G, D, bs, 4, scaling, 1, orow);
      else attend(qr, cache, bstride, hstride, h, bt + i * btw, seq[i], G, D, bs, 8, scaling, 1, orow);
    } else {
      if (bits == 4) attend(qr, cache, bstride, hstride, h, bt + i * btw, seq[i], G, D, bs, 4, scaling, 0, orow);
      else attend(qr, cache, bstride, hstride, h, bt + i * btw, seq[i], G, D, bs, 8, scaling, 0, orow);
    }
  }
  return 0;
}
"""


# --- page format ------------------------------------------------------------------------------------------------
def code_bytes(D: int, bits: int) -> int:
    """Bytes of codes per token and head (keys or values)."""
    if bits not in BITS:
        raise ValueError(f"kvkit paged quant: bits must be one of {BITS}, got {bits!r}")
    if (D * bits) % 8:
        raise ValueError(f"kvkit paged quant: head size {D} does not pack into bytes at {bits} bits")
    return D * bits // 8


def state_bytes(D: int, bits: int, block_size: int = 128) -> int:
    """Bytes per token and KV head of a page (vLLM's ``state_content_bytes``): K codes + V codes + 4 fp16
    statistics per token, plus the block's key channel scale (``D`` fp16 per page) spread over its tokens."""
    return 2 * code_bytes(D, bits) + 8 + -(-2 * D // block_size)


def as_pages(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[blocks, H, bs, C / elem]`` (any dtype, last dim contiguous) as bytes ``[blocks, H, bs * C]``."""
    u8 = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return u8.view(*u8.shape[:2], -1)  # a view or an error, never a copy (writes must land in the cache)


def page_fields(pages: torch.Tensor, block_size: int, D: int, bits: int):
    """Views of the page fields: K codes ``[blocks, H, DB, bs]`` (channel-major: the decode kernel loads one byte
    column of 16 tokens at a time), V codes ``[blocks, H, bs, DB]`` uint8, token statistics ``[blocks, H, 4, bs]``
    fp16 (K scale, K min, V scale, V min), key channel scale ``[blocks, H, D]`` fp16."""
    DB, bs = code_bytes(D, bits), block_size
    if pages.shape[-1] != bs * state_bytes(D, bits, bs):
        raise ValueError(f"kvkit paged quant: page of {pages.shape[-1]} bytes, expected {bs} x "
                         f"{state_bytes(D, bits, bs)}")
    a = 2 * bs * DB
    kc = pages[:, :, : bs * DB].unflatten(2, (DB, bs))
    vc = pages[:, :, bs * DB: a].unflatten(2, (bs, DB))
    st = pages[:, :, a: a + 8 * bs].view(torch.float16).unflatten(2, (4, bs))
    cs = pages[:, :, a + 8 * bs: a + 8 * bs + 2 * D].view(torch.float16)
    return kc, vc, st, cs


def quantize_tokens(x: torch.Tensor, bits: int):
    """Per-token asymmetric quantisation of ``x [..., D]``: (codes packed ``[..., DB]`` uint8, scale, min fp16 ``[...]``)."""
    D = x.shape[-1]
    code_bytes(D, bits)
    qmax = (1 << bits) - 1
    xf = x.float().clamp(-6.0e4, 6.0e4)
    mn = xf.amin(dim=-1)
    zero = mn.to(torch.float16)
    scale = ((xf.amax(dim=-1) - zero.float()) / qmax).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        q = q.unflatten(-1, (2, D // 2))
        q = q[..., 0, :] | (q[..., 1, :] << 4)
    return q, scale, zero


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes ``[..., DB]`` -> integer codes ``[..., D]`` (uint8)."""
    if bits == 8:
        return codes
    return torch.cat([codes & 15, codes >> 4], dim=-1)


def write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, block_size: int,
          bits: int) -> None:
    """Quantise ``key, value [T, H, D]`` into the slots ``slots [T]`` (block * bs + offset; < 0: skipped).

    A block whose first slot is written in this call gets its key channel scale ``c = sqrt(max(m_d, mean_d m_d))``
    with ``m_d = max |k_d|`` over the tokens of that block written in this call (per KV head; ZipCache's channel
    normalisation, floored at the channel mean so that a block begun by a single decode token does not inflate the
    channels that token happened to have near zero); every key
    is stored as the per-token quantisation of ``k / c`` with its block's ``c``. Blocks are filled in order (vLLM
    appends; prefix-cache hits are whole blocks), so a block's first slot is written before any other."""
    T = min(key.shape[0], slots.shape[0])
    slots = slots[:T].long()
    key, value = key[:T], value[:T]
    if T == 0:
        return
    D = key.shape[-1]
    pages = as_pages(cache)
    if (available() and key.dtype == value.dtype and key.dtype in (torch.bfloat16, torch.float16)
            and key.stride(-1) == 1 and value.stride(-1) == 1):  # the C kernel skips slots < 0 itself
        if pages.shape[-1] != block_size * state_bytes(D, bits, block_size):
            page_fields(pages, block_size, D, bits)  # raises, naming the sizes
        sl = slots.contiguous()
        rc = _load().kvkit_paged_quant_write(
            key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            int(key.dtype == torch.bfloat16), sl.data_ptr(), sl.numel(), pages.data_ptr(), pages.stride(0),
            pages.stride(1), key.shape[1], D, block_size, bits, max(1, torch.get_num_threads()))
        if rc != 0:
            raise RuntimeError(f"kvkit paged_quant_cpu write refused D={D} bits={bits}")
        return
    write_ref(pages, key, value, slots, block_size, bits)


def write_ref(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, block_size: int,
              bits: int) -> None:
    """The torch path of :func:`write`."""
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if slots.numel() == 0:
        return
    D = key.shape[-1]
    kc, vc, st, cs = page_fields(as_pages(cache), block_size, D, bits)
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    kf = key.float()
    fresh = off == 0
    if bool(fresh.any()):
        ub, inv = torch.unique(blk, return_inverse=True)
        amax = torch.zeros(ub.numel(), kf.shape[1], D).scatter_reduce_(
            0, inv.view(-1, 1, 1).expand_as(kf), kf.abs(), "amax", include_self=False)
        is_new = torch.zeros(ub.numel(), dtype=torch.bool)
        is_new[inv[fresh]] = True
        a = amax[is_new]
        floor = a.mean(dim=-1, keepdim=True).clamp_min(1e-4)  # a block begun by one token: no near-zero channels
        c = torch.maximum(a, floor).sqrt().to(torch.float16)
        cs[ub[is_new]] = c
    c = cs[blk].float()  # [T, H, D]: this call's scale for fresh blocks, the stored one for continued blocks
    qk, sk, zk = quantize_tokens(kf / c, bits)
    qv, sv, zv = quantize_tokens(value, bits)
    kc[blk, :, :, off] = qk
    vc[blk, :, off] = qv
    st[blk, :, 0, off] = sk
    st[blk, :, 1, off] = zk
    st[blk, :, 2, off] = sv
    st[blk, :, 3, off] = zv


def gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int, D: int, bits: int,
           dtype: torch.dtype = torch.float32):
    """Dequantised K, V ``[n, H, D]`` of the slots ``slots [n]``."""
    kc, vc, st, cs = page_fields(as_pages(cache), block_size, D, bits)
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    s = st[blk, :, :, off].float()  # [n, H, 4]
    k = (unpack(kc[blk, :, :, off], bits).float() * s[..., 0:1] + s[..., 1:2]) * cs[blk].float()
    v = unpack(vc[blk, :, off], bits).float() * s[..., 2:3] + s[..., 3:4]
    return k.to(dtype), v.to(dtype)


def row_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(row of each token, slot of each token) of the first ``seq_lens[i]`` tokens of each row, row-major."""
    seq = seq_lens.long()
    rows = torch.repeat_interleave(torch.arange(seq.numel()), seq)
    start = torch.cumsum(seq, 0) - seq
    pos = torch.arange(int(seq.sum())) - start[rows]
    slots = block_table.long()[rows, pos // block_size] * block_size + pos % block_size
    return rows, slots


# --- reference --------------------------------------------------------------------------------------------------
def decode_ref(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, bits: int, scale: float) -> torch.Tensor:
    """Plain torch: each row's query ``q [n, H*G, D]`` over its dequantised tokens; fp32 ``[n, H*G, D]``."""
    n, Hq, D = q.shape
    out = torch.zeros(n, Hq, D, dtype=torch.float32)
    for i in range(n):
        L = int(seq_lens[i])
        if L <= 0:
            continue
        pos = torch.arange(L)
        slots = block_table[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = gather(cache, slots, block_size, D, bits)  # [L, H, D]
        H = k.shape[1]
        G = Hq // H
        qi = q[i].float().view(H, G, D)
        s = torch.einsum("hgd,lhd->hgl", qi, k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hgl,lhd->hgd", p, v).reshape(Hq, D)
    return out


# --- C kernel ---------------------------------------------------------------------------------------------------
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("paged_quant_cpu", _SRC, {
    "kvkit_paged_quant_decode": ([_P, _P, _I64, _I64, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _F, _P, _I], _I),
    "kvkit_paged_quant_write": ([_P, _P, _I64, _I64, _I64, _I64, _I, _P, _I64, _P, _I64, _I64, _I, _I, _I, _I, _I],
                                _I),
}, "KVKIT_PAGED_QUANT_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_PAGED_QUANT_CPU=0``."""
    return _KERNEL.available()


def decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           block_size: int, bits: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of single-token queries ``q [n, H*G, D]`` over the packed pages of their rows (block ids
    ``block_table [n, >= max blocks]``, tokens ``seq_lens [n]``); returns fp32 ``[n, H*G, D]`` (into ``out`` if
    given, fp32 contiguous). The C kernel when available, else :func:`decode_ref`."""
    n, Hq, D = q.shape
    pages = as_pages(cache)
    H = pages.shape[1]
    if Hq % H:
        raise ValueError(f"kvkit paged quant: {Hq} query heads do not group over {H} KV heads")
    if pages.shape[-1] != block_size * state_bytes(D, bits, block_size):
        raise ValueError(f"kvkit paged quant: page of {pages.shape[-1]} bytes, expected {block_size} x "
                         f"{state_bytes(D, bits, block_size)}")
    if not available() or pages.stride(2) != 1:
        r = decode_ref(q, cache, block_table, seq_lens, block_size, bits, scale)
        if out is not None:
            out.copy_(r)
            return out
        return r
    qf = q.to(torch.float32).contiguous()
    bt = block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous()
    if n == 0:
        return out
    esz = 1  # pages are uint8: strides in bytes
    with torch.profiler.record_function("kvkit::paged_quant_decode_cpu"):
        rc = _load().kvkit_paged_quant_decode(
            qf.data_ptr(), pages.data_ptr(), pages.stride(0) * esz, pages.stride(1) * esz, bt.data_ptr(), bt.shape[1],
            sl.data_ptr(), n, H, Hq // H, D, block_size, bits, float(scale), out.data_ptr(),
            max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit paged_quant_cpu kernel refused shapes H={H} G={Hq // H} D={D} bs={block_size} "
                           f"bits={bits}")
    return out
