/* The decoder layer's elementwise steps, float32, one call each where PyTorch takes two or
 * three kernels (and as many dispatches, each several microseconds at decode sizes):
 *   add_rms_norm  x += delta, then out = x / rms(x) * w      (the residual and the next norm)
 *   rope          x = x * cos + rotate_half(x) * sin, in place, for every head of a token
 *   silu_mul      out = silu(gate) * up, from the fused gate|up projection
 * vec.h has the vectors and exp.
 */
#include "vec.h"

/* x (T, N) row stride N, delta (T, N) or NULL, w (N,) -> out (T, N). x is updated in place. */
void add_rms_norm(float *x, const float *delta, const float *w, float *out, int T, int N,
                  float eps) {
    for (int t = 0; t < T; t++) {
        float *xr = x + (int64_t)t * N, *orow = out + (int64_t)t * N;
        vf acc = splat(0.0f);
        int n = 0;
        if (delta) {
            const float *dr = delta + (int64_t)t * N;
            for (; n + VW <= N; n += VW) {
                vf v = load(xr + n) + load(dr + n);
                memcpy(xr + n, &v, sizeof v);
                acc += v * v;
            }
            for (int i = n; i < N; i++) xr[i] += dr[i];
        } else {
            for (; n + VW <= N; n += VW) {
                vf v = load(xr + n);
                acc += v * v;
            }
        }
        float ss = 0.0f;
        for (int i = 0; i < VW; i++) ss += acc[i];
        for (int i = n; i < N; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)N + eps);
        for (n = 0; n + VW <= N; n += VW) {
            vf v = load(xr + n) * inv * load(w + n);
            memcpy(orow + n, &v, sizeof v);
        }
        for (int i = n; i < N; i++) orow[i] = xr[i] * inv * w[i];
    }
}

/* x: T tokens of H heads of D (token stride `stride`, heads contiguous); cos, sin (T, D),
 * sin with its first half negated, so x * cos + [x2, x1] * sin is the rotate-half RoPE. */
void rope(float *x, int64_t stride, int T, int H, int D, const float *cos, const float *sin) {
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int h = 0; h < H; h++) {
            float *r = x + t * stride + (int64_t)h * D;
            int i = 0;
            for (; i + VW <= half; i += VW) {
                vf a = load(r + i), b = load(r + half + i);
                vf lo = a * load(c + i) + b * load(s + i);
                vf hi = b * load(c + half + i) + a * load(s + half + i);
                memcpy(r + i, &lo, sizeof lo);
                memcpy(r + half + i, &hi, sizeof hi);
            }
            for (; i < half; i++) {
                float a = r[i], b = r[half + i];
                r[i] = a * c[i] + b * s[i];
                r[half + i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* silu(g) = g / (1 + e^-g), through e = exp(-|g|) <= 1 so nothing overflows */
static inline vf vsilu(vf g) {
    vi neg = g < splat(0.0f);
    vf e = vexp(sel(neg, g, -g));
    return sel(neg, g * e, g) / (1.0f + e);
}

/* gu (T, 2I): gate | up -> out (T, I) = silu(gate) * up */
void silu_mul(const float *gu, float *out, int T, int I) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        int i = 0;
        for (; i + VW <= I; i += VW) {
            vf v = vsilu(load(g + i)) * load(u + i);
            memcpy(o + i, &v, sizeof v);
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
