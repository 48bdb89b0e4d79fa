
#define TB 4

/* scores of the M query rows q [M, D] against the keys rebuilt at token ids tok [K] (-1: none -> -inf):
   k = U[tok] @ sv (sv = (S*V^T)[head] [r, D]), RoPE at off + tok (or posb[tok]) from the half tables [P, H2].
   Common layout (D = 16 * NV, full rotary): TB tokens at a time, their keys accumulated in TB x NV vector
   registers over the r rows of sv (each row loaded once per TB tokens: a register-blocked GEMM), rotated in
   registers, dotted with the query rows; never stored. s[m * lds + t] */
AI void rebuilt_scores_vec(const float *q, const float *Ub, const float *sv, const int64_t *tok, int64_t K,
                           int64_t off, const int64_t *posb, const float *cosb, const float *sinb, int M, int r,
                           int NV, float scaling, float *s, int64_t lds) {
  const int H2V = NV / 2;
  for (int64_t t0 = 0; t0 < K; t0 += TB) {
    int nb = K - t0 < TB ? (int)(K - t0) : TB;
    const float *u[TB];
    int live[TB];
    for (int i = 0; i < TB; i++) {
      int64_t tk = i < nb ? tok[t0 + i] : -1;
      live[i] = tk >= 0;
      u[i] = Ub + (live[i] ? tk : 0) * r;
    }
    v16 acc[TB][8];
    for (int i = 0; i < TB; i++) for (int c = 0; c < NV; c++) acc[i][c] = (v16){0};
    for (int j = 0; j < r; j++) {
      v16 row[8];
      for (int c = 0; c < NV; c++) row[c] = *(const v16 *)(sv + (int64_t)j * NV * 16 + c * 16);
      for (int i = 0; i < TB; i++) {
        v16 uj = (v16){0} + u[i][j];
        for (int c = 0; c < NV; c++) acc[i][c] += uj * row[c];
      }
    }
    for (int i = 0; i < nb; i++) {
      int64_t t = t0 + i;
      if (!live[i]) { for (int m = 0; m < M; m++) s[m * lds + t] = -INFINITY; continue; }
      int64_t tk = tok[t], p = posb ? posb[tk] : off + tk;
      const float *c = cosb + p * H2V * 16, *sn = sinb + p * H2V * 16;
      for (int h = 0; h < H2V; h++) {
        v16 cv = *(const v16 *)(c + h * 16), sv_ = *(const v16 *)(sn + h * 16);
        v16 a = acc[i][h], b = acc[i][h + H2V];
        acc[i][h] = a * cv - b * sv_;
        acc[i][h + H2V] = b * cv + a * sv_;
      }
      for (int m = 0; m < M; m++) {
        v16 d = (v16){0};
        for (int cc = 0; cc < NV; cc++) d += *(const v16 *)(q + m * NV * 16 + cc * 16) * acc[i][cc];
        s[m * lds + t] = hsum(d) * scaling;
      }
    }
  }
}

/* the same for any D and partial rotary (2 * H2 <= D): one token at a time, plain loops */
AI void rebuilt_scores_generic(const float *q, const float *Ub, const float *sv, const int64_t *tok, int64_t K,
                               int64_t off, const int64_t *posb, const float *cosb, const float *sinb, int H2, int M,
                               int r, int D, float scaling, float *s, int64_t lds) {
  float k[512];
  for (int64_t t = 0; t < K; t++) {
    int64_t tk = tok[t];
    if (tk < 0) { for (int m = 0; m < M; m++) s[m * lds + t] = -INFINITY; continue; }
    const float *u = Ub + tk * r;
    for (int d = 0; d < D; d++) k[d] = 0.f;
    for (int j = 0; j < r; j++) {
      const float uj = u[j], *row = sv + (int64_t)j * D;
      for (int d = 0; d < D; d++) k[d] += uj * row[d];
    }
    int64_t p = posb ? posb[tk] : off + tk;
    const float *c = cosb + p * H2, *sn = sinb + p * H2;
    for (int i = 0; i < H2; i++) {
      float a = k[i], b = k[i + H2];
      k[i] = a * c[i] - b * sn[i];
      k[i + H2] = b * c[i] + a * sn[i];
    }
    for (int m = 0; m < M; m++) {
      float acc = 0.f;
      for (int d = 0; d < D; d++) acc += q[m * D + d] * k[d];
      s[m * lds + t] = acc * scaling;
    }
  }
}

/* scores against n exact keys (rows of D floats, consecutive); a slot with pos < 0 is not read (-inf) */
AI void exact_scores(const float *q, const float *kb, const int32_t *pb, int64_t n, int M, int D, float scaling,
                     float *s, int64_t lds) {
  for (int64_t e = 0; e < n; e++) {
    if (pb[e] < 0) { for (int m = 0; m < M; m++) s[m * lds + e] = -INFINITY; continue; }
    const float *kr = kb + e * D;
    for (int m = 0; m < M; m++) {
      float acc = 0.f;
      for (int d = 0; d < D; d++) acc += q[m * D + d] * kr[d];
      s[m * lds + e] = acc * scaling;
    }
  }
}

/* softmax of each row of s [M, n] (stride lds) in place; lse [M]; a row with nothing visible: zeros, -inf */
AI void softmax_rows(float *s, int64_t n, int64_t lds, int M, float *lse) {
  for (int m = 0; m < M; m++) {
    float *row = s + m * lds, mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) mx = row[t] > mx ? row[t] : mx;
    if (mx == -INFINITY) { lse[m] = -INFINITY; for (int64_t t = 0; t < n; t++) row[t] = 0.f; continue; }
    int64_t t = 0;
    v16 vs = (v16){0};
    for (; t + 16 <= n; t += 16) {
      v16 e = vexp(*(v16 *)(row + t) - mx);
      *(v16 *)(row + t) = e;
      vs += e;
    }
    sum = hsum(vs);
    for (; t < n; t++) { float e = row[t] == -INFINITY ? 0.f : expf(row[t] - mx); row[t] = e; sum += e; }
    lse[m] = mx + logf(sum);
    float inv = 1.f / sum;
    for (t = 0; t < n; t++) row[t] *= inv;
  }
}

/* out [M, D] += sum_t p[m, t] * row_t over value rows vb + idx[t] * D (idx NULL: rows 0..n-1), each row read
   once for the M query rows; scattered rows are prefetched a few tokens ahead */
AI void pv_rows(const float *p, int64_t lds, const float *vb, const int64_t *idx, int64_t n, int M, int D, float *out) {
  for (int64_t t = 0; t < n; t++) {
    if (idx && t + 4 < n && idx[t + 4] >= 0) {
      const char *nx = (const char *)(vb + idx[t + 4] * D);
      for (int d = 0; d < D * 4; d += 64) __builtin_prefetch(nx + d);
    }
    int64_t row = idx ? idx[t] : t;
    if (row < 0) continue;
    const float *vr = vb + row * D;
    for (int m = 0; m < M; m++) {
      const float w = p[m * lds + t];
      if (w == 0.f) continue;
      float *o = out + m * D;
      for (int d = 0; d < D; d++) o[d] += w * vr[d];
    }
  }
}

AI void one_head(const float *qb, const float *Ub, const float *sv, const float *Vb, const int64_t *tb, int64_t K,
                 int64_t o, const int64_t *pb, const float *cosb, const float *sinb, int H2, int M, int r, int D,
                 float scaling, int nex, const float **ekb, const float **evb, const int32_t **epb, const int64_t *en,
                 float *sb, int64_t lds, float *ob, float *lb) {
  if (D == 64 && H2 == 32) rebuilt_scores_vec(qb, Ub, sv, tb, K, o, pb, cosb, sinb, M, r, 4, scaling, sb, lds);
  else if (D == 128 && H2 == 64) rebuilt_scores_vec(qb, Ub, sv, tb, K, o, pb, cosb, sinb, M, r, 8, scaling, sb, lds);
  else rebuilt_scores_generic(qb, Ub, sv, tb, K, o, pb, cosb, sinb, H2, M, r, D, scaling, sb, lds);
  int64_t at = K;
  for (int i = 0; i < nex; i++) { exact_scores(qb, ekb[i], epb[i], en[i], M, D, scaling, sb + at, lds); at += en[i]; }
  softmax_rows(sb, at, lds, M, lb);
  for (int64_t x = 0; x < (int64_t)M * D; x++) ob[x] = 0.f;
  pv_rows(sb, lds, Vb, tb, K, M, D, ob);
  at = K;
  for (int i = 0; i < nex; i++) { pv_rows(sb + at, lds, evb[i], 0, en[i], M, D, ob); at += en[i]; }
}

/* q [B*H, M, D]; U [B, N, r]; SV [B*H, r, D]; V [B*H, N, D]; tok [B*H, K] (-1 = none); off [B] or NULL (then
   pos [B, N]); cos/sin [P, H2]. nex exact parts: part i's key/value row e of (b, h) at ek[i]/ev[i] + b * sb[i] +
   h * sh[i] + e * D, its slot position at ep[i] + b * psb[i] + h * psh[i] + e (< 0: not read), en[i] slots.
   scratch [B*H, M, K + sum en]; out [B*H, M, D]; lse [B*H, M] */
int kvkit_lowrank_attn(const float *q, const float *U, const float *SV, const float *V, const int64_t *tok,
                       const int64_t *off, const int64_t *pos, const float *cosb, const float *sinb, int H2,
                       int64_t B, int64_t H, int64_t N, int64_t K, int M, int r, int D, float scaling,
                       int nex, const float **ek, const float **ev, const int32_t **ep, const int64_t *en,
                       const int64_t *sb_, const int64_t *sh_, const int64_t *psb, const int64_t *psh,
                       float *scratch, float *out, float *lse, int nthreads) {
  if (D > 512 || 2 * H2 > D || M < 1 || nex > 4) return -1;
  int64_t lds = K;
  for (int i = 0; i < nex; i++) lds += en[i];
  int64_t BH = B * H;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t bh = 0; bh < BH; bh++) {
    int64_t b = bh / H, h = bh % H;
    const float *ekb[4], *evb[4];
    const int32_t *epb[4];
    for (int i = 0; i < nex; i++) {
      ekb[i] = ek[i] + b * sb_[i] + h * sh_[i];
      evb[i] = ev[i] + b * sb_[i] + h * sh_[i];
      epb[i] = ep[i] + b * psb[i] + h * psh[i];
    }
    const float *qb = q + bh * M * D, *Ub = U + b * N * r, *sv = SV + bh * (int64_t)r * D, *Vb = V + bh * N * D;
    const int64_t *tb = tok + bh * K, *pb = off ? 0 : pos + b * N;
    int64_t o = off ? off[b] : 0;
    float *sbuf = scratch + bh * M * lds, *ob = out + bh * M * D, *lb = lse + bh * M;
    if (D == 64) one_head(qb, Ub, sv, Vb, tb, K, o, pb, cosb, sinb, H2, M, r, 64, scaling, nex, ekb, evb, epb, en, sbuf, lds, ob, lb);
    else one_head(qb, Ub, sv, Vb, tb, K, o, pb, cosb, sinb, H2, M, r, D, scaling, nex, ekb, evb, epb, en, sbuf, lds, ob, lb);
  }
  return 0;
}

/* TidalDecode's reuse layers: each (batch row, list head hs, query token t) reads its own L listed rows.
   q [B*Hs*T, G, D] (the G query heads that share a list); K/V rows: row i of KV head h of batch row b at
   K + ((b * H + h) * kcap + i) * D (V: vcap), h = hs / (Hs / H); idx [B*Hs*T, L] (int64 slots); valid [B*Hs*T, L]
   (uint8, 0 = not read) or NULL; scratch [B*Hs*T, G, L]; out [B*Hs*T, G, D] */
AI void sparse_list(const float *qb, const float *Kb, const float *Vb, const int64_t *ib, const uint8_t *vb, int64_t L,
                    int G, int D, float scaling, float *sb, float *ob) {
  for (int64_t l = 0; l < L; l++) {
    if (l + 4 < L) {
      const char *nx = (const char *)(Kb + ib[l + 4] * D);
      for (int d = 0; d < D * 4; d += 64) __builtin_prefetch(nx + d);
    }
    if (vb && !vb[l]) { for (int g = 0; g < G; g++) sb[g * L + l] = -INFINITY; continue; }
    const float *kr = Kb + ib[l] * D;
    if (D % 16 == 0) {
      for (int g = 0; g < G; g++) {
        v16 acc = (v16){0};
        for (int d = 0; d < D; d += 16) acc += *(const v16 *)(qb + g * D + d) * *(const v16 *)(kr + d);
        sb[g * L + l] = hsum(acc) * scaling;
      }
    } else {
      for (int g = 0; g < G; g++) {
        float acc = 0.f;
        for (int d = 0; d < D; d++) acc += qb[g * D + d] * kr[d];
        sb[g * L + l] = acc * scaling;
      }
    }
  }
  float lse[64];
  softmax_rows(sb, L, L, G, lse);
  for (int64_t x = 0; x < (int64_t)G * D; x++) ob[x] = 0.f;
  pv_rows(sb, L, Vb, ib, L, G, D, ob);
}

int kvkit_sparse_attn(const float *q, const float *K, const float *V, int64_t kcap, int64_t vcap, const int64_t *idx,
                      const uint8_t *valid, int64_t B, int64_t H, int64_t Hs, int64_t T, int64_t L, int G, int D,
                      float scaling, float *scratch, float *out, int nthreads) {
  if (G < 1 || G > 64 || Hs % H) return -1;
  int64_t lists = B * Hs * T, per = Hs / H;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t x = 0; x < lists; x++) {
    int64_t b = x / (Hs * T), hs = (x / T) % Hs, h = hs / per;
    const float *Kb = K + (b * H + h) * kcap * D, *Vb = V + (b * H + h) * vcap * D;
    const uint8_t *vb = valid ? valid + x * L : 0;
    if (D == 64) sparse_list(q + x * G * 64, Kb, Vb, idx + x * L, vb, L, G, 64, scaling, scratch + x * G * L, out + x * G * 64);
    else sparse_list(q + x * G * D, Kb, Vb, idx + x * L, vb, L, G, D, scaling, scratch + x * G * L, out + x * G * D);
  }
  return 0;
}
