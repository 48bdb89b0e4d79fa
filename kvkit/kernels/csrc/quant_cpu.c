
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#define AI static inline __attribute__((always_inline))
#define RB 4

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
int kvkit_has_avx512(void) { return 1; }

/* float value of the low 4 bits of a lane: the code itself (4-bit) or its low 2 bits (2-bit) */
static const float LUT4[16] __attribute__((aligned(64))) = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const float LUT2[16] __attribute__((aligned(64))) = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};

/* CW (4, 8 or 16) bytes of codes -> P = 8/BITS vectors of CW channels (lanes >= CW are zero). 2/4-bit codes go
   from integer lanes to floats through one permute of a 16-entry table (it reads only the low 4 bits of each
   lane, so no mask and no int-to-float conversion is needed) */
AI void unpack(const uint8_t *p, int CW, int BITS, __m512 *c) {
  __m128i b = CW == 16 ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8((__mmask16)((1u << CW) - 1), p);
  __m512i x = _mm512_cvtepu8_epi32(b);
  if (BITS == 8) { c[0] = _mm512_cvtepi32_ps(x); return; }
  const __m512 tab = _mm512_load_ps(BITS == 4 ? LUT4 : LUT2);
  c[0] = _mm512_permutexvar_ps(x, tab);
  for (int j = 1; j < 8 / BITS; j++) c[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, j * BITS), tab);
}

AI __m512 ld(const float *p, int CW) {
  return CW == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << CW) - 1), p);
}

/* exp(x) for x <= 0 (softmax numerators); 0 below -87 and for -inf. Cephes-style: 2^n * poly(r). */
AI __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __mmask16 ok = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ);
  x = _mm512_max_ps(x, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(ok, _mm512_scalef_ps(y, n));
}

/* lane t of the result = sum of the 16 lanes of v[t]: four levels of (permute, permute, add), each halving the
   number of vectors and the partial sums per token (level i: 16/2^(i+1) vectors of 2^(i+1) tokens x 8/2^i sums) */
static const int HS_X[4][16] __attribute__((aligned(64))) = {
  {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
  {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
  {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
  {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
static const int HS_Y[4][16] __attribute__((aligned(64))) = {
  {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
  {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
  {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
  {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};

AI __m512 hsum16(__m512 *v) {
  int n = 16;
  for (int lvl = 0; lvl < 4; lvl++) {
    __m512i X = _mm512_load_si512(HS_X[lvl]), Y = _mm512_load_si512(HS_Y[lvl]);
    for (int i = 0; i < n / 2; i++)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], X, v[2 * i + 1]), _mm512_permutex2var_ps(v[2 * i], Y, v[2 * i + 1]));
    n /= 2;
  }
  return v[0];
}

/* scores of R query rows (already multiplied by the key scale: qs [R, D]; bias qz [R]) over n tokens */
AI void qk_rows(const float *qs, const float *qz, const uint8_t *kd, const uint8_t *msk, int64_t n, int R, int D,
                int KB, float scaling, float *s, int64_t lds) {
  const int P = 8 / KB, DB = D / P, CW = DB < 16 ? DB : 16, NC = DB / CW;
  __m512 qv[RB][16];
  for (int r = 0; r < R; r++) for (int j = 0; j < P; j++) for (int c = 0; c < NC; c++)
    qv[r][j * NC + c] = ld(qs + r * D + j * DB + c * CW, CW);
  int64_t t0 = 0;
  for (; t0 + 16 <= n; t0 += 16) {  /* 16 tokens: per-token partial vectors, then one transposed reduction */
    __m512 acc[RB][16];
    for (int tt = 0; tt < 16; tt++) {
      const uint8_t *row = kd + (t0 + tt) * DB;
      for (int r = 0; r < R; r++) acc[r][tt] = _mm512_setzero_ps();
      for (int c = 0; c < NC; c++) {
        __m512 cv[4];
        unpack(row + c * CW, CW, KB, cv);
        for (int j = 0; j < P; j++) for (int r = 0; r < R; r++) acc[r][tt] = _mm512_fmadd_ps(qv[r][j * NC + c], cv[j], acc[r][tt]);
      }
    }
    for (int r = 0; r < R; r++) {
      __m512 sc = _mm512_mul_ps(_mm512_add_ps(hsum16(acc[r]), _mm512_set1_ps(qz[r])), _mm512_set1_ps(scaling));
      if (msk) {
        __mmask16 keep = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(msk + t0))), _mm512_setzero_si512());
        sc = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), sc);
      }
      _mm512_storeu_ps(s + r * lds + t0, sc);
    }
  }
  for (int64_t t = t0; t < n; t++) {
    const uint8_t *row = kd + t * DB;
    __m512 acc[RB];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < NC; c++) {
      __m512 cv[4];
      unpack(row + c * CW, CW, KB, cv);
      for (int j = 0; j < P; j++) for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(qv[r][j * NC + c], cv[j], acc[r]);
    }
    int keep = !msk || msk[t];
    for (int r = 0; r < R; r++) s[r * lds + t] = keep ? (_mm512_reduce_add_ps(acc[r]) + qz[r]) * scaling : -INFINITY;
  }
}

/* acc_out[R, D] += vp * (sum_t p_t vs_t code_t + sum_t p_t vz_t) over n tokens */
AI void pv_rows(float *p, int64_t ldp, const uint8_t *vd, const float *vs, const float *vz, const float *vp,
                int64_t n, int R, int D, int VB, float *acc_out) {
  const int P = 8 / VB, DB = D / P, CW = DB < 16 ? DB : 16, NC = DB / CW;
  __m512 acc[RB][16];
  float zs[RB];
  for (int r = 0; r < R; r++) {  /* zs = sum_t p_t vz_t, then p_t <- p_t vs_t (p is this part's scratch) */
    float *pr = p + r * ldp;
    __m512 z = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      __m512 pv = _mm512_loadu_ps(pr + t);
      z = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vz + t), z);
      _mm512_storeu_ps(pr + t, _mm512_mul_ps(pv, _mm512_loadu_ps(vs + t)));
    }
    zs[r] = _mm512_reduce_add_ps(z);
    for (; t < n; t++) { zs[r] += pr[t] * vz[t]; pr[t] *= vs[t]; }
    for (int i = 0; i < P * NC; i++) acc[r][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < n; t++) {
    __m512 w[RB];
    for (int r = 0; r < R; r++) w[r] = _mm512_set1_ps(p[r * ldp + t]);
    const uint8_t *row = vd + t * DB;
    for (int c = 0; c < NC; c++) {
      __m512 cv[4];
      unpack(row + c * CW, CW, VB, cv);
      for (int j = 0; j < P; j++) for (int r = 0; r < R; r++) acc[r][j * NC + c] = _mm512_fmadd_ps(w[r], cv[j], acc[r][j * NC + c]);
    }
  }
  const __mmask16 lm = (__mmask16)(CW == 16 ? 0xffff : (1u << CW) - 1);
  for (int r = 0; r < R; r++) for (int j = 0; j < P; j++) for (int c = 0; c < NC; c++) {
    int off = j * DB + c * CW;
    __m512 o = _mm512_add_ps(acc[r][j * NC + c], _mm512_set1_ps(zs[r]));
    if (vp) o = _mm512_mul_ps(o, ld(vp + off, CW));
    _mm512_mask_storeu_ps(acc_out + r * D + off, lm, _mm512_add_ps(o, ld(acc_out + r * D + off, CW)));
  }
}

AI float row_max(const float *s, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float mx = _mm512_reduce_max_ps(m);
  for (; t < n; t++) mx = s[t] > mx ? s[t] : mx;
  return mx;
}

AI float row_exp_sum(float *s, int64_t n, float mx) {
  __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(mx);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {
    __mmask16 k = (__mmask16)((1u << (n - t)) - 1);
    __m512 e = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}
#else
int kvkit_has_avx512(void) { return 0; }

AI void qk_rows(const float *qs, const float *qz, const uint8_t *kd, const uint8_t *msk, int64_t n, int R, int D,
                int KB, float scaling, float *s, int64_t lds) {
  const int P = 8 / KB, DB = D / P, km = (1 << KB) - 1;
  float code[256];
  for (int64_t t = 0; t < n; t++) {
    const uint8_t *row = kd + t * DB;
    for (int j = 0; j < P; j++) for (int b = 0; b < DB; b++) code[j * DB + b] = (float)((row[b] >> (j * KB)) & km);
    int keep = !msk || msk[t];
    for (int r = 0; r < R; r++) {
      float a = 0.f;
      for (int d = 0; d < D; d++) a += qs[r * D + d] * code[d];
      s[r * lds + t] = keep ? (a + qz[r]) * scaling : -INFINITY;
    }
  }
}

AI void pv_rows(float *p, int64_t ldp, const uint8_t *vd, const float *vs, const float *vz, const float *vp,
                int64_t n, int R, int D, int VB, float *acc_out) {
  const int P = 8 / VB, DB = D / P, vm = (1 << VB) - 1;
  float acc[RB][256], code[256], zs[RB];
  for (int r = 0; r < R; r++) { zs[r] = 0.f; for (int d = 0; d < D; d++) acc[r][d] = 0.f; }
  for (int64_t t = 0; t < n; t++) {
    const uint8_t *row = vd + t * DB;
    for (int j = 0; j < P; j++) for (int b = 0; b < DB; b++) code[j * DB + b] = (float)((row[b] >> (j * VB)) & vm);
    for (int r = 0; r < R; r++) {
      float pr = p[r * ldp + t], w = pr * vs[t];
      zs[r] += pr * vz[t];
      for (int d = 0; d < D; d++) acc[r][d] += w * code[d];
    }
  }
  for (int r = 0; r < R; r++) for (int d = 0; d < D; d++)
    acc_out[r * D + d] += (acc[r][d] + zs[r]) * (vp ? vp[d] : 1.f);
}

AI float row_max(const float *s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
  return mx;
}

AI float row_exp_sum(float *s, int64_t n, float mx) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; t++) { float e = s[t] == -INFINITY ? 0.f : expf(s[t] - mx); s[t] = e; sum += e; }
  return sum;
}
#endif

/* compile-time constants for the common shapes, a generic call otherwise */
#define BY_BITS(F, R_, D_, BITS, ...) \
  do { if (BITS == 4) F(__VA_ARGS__, R_, D_, 4); else if (BITS == 2) F(__VA_ARGS__, R_, D_, 2); else F(__VA_ARGS__, R_, D_, 8); } while (0)
#define BY_R(F, R, D_, BITS, ...) \
  do { if (R == 4) BY_BITS(F, 4, D_, BITS, __VA_ARGS__); else if (R == 3) BY_BITS(F, 3, D_, BITS, __VA_ARGS__); \
       else if (R == 2) BY_BITS(F, 2, D_, BITS, __VA_ARGS__); else BY_BITS(F, 1, D_, BITS, __VA_ARGS__); } while (0)
#define DISPATCH(F, R, D, BITS, ...) \
  do { if (D == 64) BY_R(F, R, 64, BITS, __VA_ARGS__); else if (D == 128) BY_R(F, R, 128, BITS, __VA_ARGS__); \
       else BY_R(F, R, D, BITS, __VA_ARGS__); } while (0)
#define QK(qs, qz, kd, msk, n, scaling, s, lds, R_, D_, B_) qk_rows(qs, qz, kd, msk, n, R_, D_, B_, scaling, s, lds)
#define PV(p, ldp, vd, vs, vz, vp, n, o, R_, D_, B_) pv_rows(p, ldp, vd, vs, vz, vp, n, R_, D_, B_, o)

/* q [B*H, M, D]; part i: kd [B*H, n_i, D*kb_i/8], ks/kz [B*H, ng_i, D] (ng_i = ceil(n_i / kg_i): one statistic
   per channel per group of kg_i tokens), vd [B*H, n_i, D*vb_i/8], vs/vz [B*H, n_i],
   vp [B*H, D] or NULL, mask [B, n_i] or NULL (uint8, 0 = not visible); scratch [B*H, M, sum n_i];
   prior_out [B*H, M, D] / prior_lse [B*H, M] or NULL: a partial attention over other keys, merged in;
   out [B*H, M, D]; lse [B*H, M] */
int kvkit_quant_attn(int nparts, const int64_t *ns, const int64_t *kg, const int *kb, const int *vb, const uint8_t **kd,
                     const float **ks, const float **kz, const uint8_t **vd, const float **vs, const float **vz,
                     const float **vp, const uint8_t **mask, const float *q, int64_t B, int64_t H, int M, int D,
                     float scaling, float *scratch, const float *prior_out, const float *prior_lse, float *out,
                     float *lse, int nthreads) {
  if (D > 256 || M < 1) return -1;
  int64_t ntot = 0;
  for (int i = 0; i < nparts; i++) ntot += ns[i];
  int64_t BH = B * H;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t bh = 0; bh < BH; bh++) {
    int64_t b = bh / H;
    const float *qb = q + bh * M * D;
    float *sb = scratch + bh * M * ntot, *ob = out + bh * M * D;
    memset(ob, 0, sizeof(float) * M * D);
    for (int r0 = 0; r0 < M; r0 += RB) {
      int R = M - r0 < RB ? M - r0 : RB;
      float qs[RB * 256], qz[RB];
      int64_t off = 0;
      for (int i = 0; i < nparts; i++) {
        int64_t G = kg[i] > 0 && kg[i] < ns[i] ? kg[i] : (ns[i] > 0 ? ns[i] : 1);
        int64_t ng = (ns[i] + G - 1) / G;
        for (int64_t g = 0; g < ng; g++) {  /* the query scaled by group g's key statistics, then its tokens */
          const float *sc = ks[i] + (bh * ng + g) * D, *zp = kz[i] + (bh * ng + g) * D;
          for (int r = 0; r < R; r++) {
            float z = 0.f;
            for (int d = 0; d < D; d++) { float x = qb[(r0 + r) * D + d]; qs[r * D + d] = x * sc[d]; z += x * zp[d]; }
            qz[r] = z;
          }
          int64_t t0 = g * G, nn = ns[i] - t0 < G ? ns[i] - t0 : G;
          const uint8_t *kdp = kd[i] + (bh * ns[i] + t0) * (D * kb[i] / 8);
          const uint8_t *mp = mask[i] ? mask[i] + b * ns[i] + t0 : 0;
          DISPATCH(QK, R, D, kb[i], qs, qz, kdp, mp, nn, scaling, sb + r0 * ntot + off + t0, ntot);
        }
        off += ns[i];
      }
      for (int r = 0; r < R; r++) {
        float *row = sb + (r0 + r) * ntot;
        float mx = row_max(row, ntot);
        if (mx == -INFINITY) { memset(row, 0, sizeof(float) * ntot); lse[bh * M + r0 + r] = -INFINITY; continue; }
        float l = row_exp_sum(row, ntot, mx);
        lse[bh * M + r0 + r] = mx + logf(l);
        float inv = 1.f / l;
        for (int64_t t = 0; t < ntot; t++) row[t] *= inv;
      }
      off = 0;
      for (int i = 0; i < nparts; i++) {
        const uint8_t *vdp = vd[i] + bh * ns[i] * (D * vb[i] / 8);
        const float *vpp = vp[i] ? vp[i] + bh * D : 0;
        DISPATCH(PV, R, D, vb[i], sb + r0 * ntot + off, ntot, vdp, vs[i] + bh * ns[i], vz[i] + bh * ns[i], vpp,
                 ns[i], ob + r0 * D);
        off += ns[i];
      }
    }
    if (prior_out) {
      for (int r = 0; r < M; r++) {
        float l1 = lse[bh * M + r], l2 = prior_lse[bh * M + r];
        float mx = l1 > l2 ? l1 : l2;
        if (mx == -INFINITY) continue;  /* neither part sees a key: zeros, -inf */
        float w1 = expf(l1 - mx), w2 = expf(l2 - mx), tot = w1 + w2;
        const float *po = prior_out + (bh * M + r) * D;
        float *o = ob + r * D;
        for (int d = 0; d < D; d++) o[d] = (o[d] * w1 + po[d] * w2) / tot;
        lse[bh * M + r] = mx + logf(tot);
      }
    }
  }
  return 0;
}
