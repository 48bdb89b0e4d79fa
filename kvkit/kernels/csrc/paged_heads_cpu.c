
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
