#include <stdint.h>
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

