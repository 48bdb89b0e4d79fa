
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
