/* Vectors and helpers shared by the kernels: the width follows the compiler's target
 * (-march=native), 16 floats with AVX-512, else 8 (AVX2; other targets build through the
 * compiler's generic vectors). */
#ifndef SPLITSERVE_VEC_H
#define SPLITSERVE_VEC_H
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define DMAX 256         /* largest head_dim the kernels take; larger returns -1 (the caller falls back) */
/* Keys per online-softmax tile in both attention kernels: a query's running max, sums and
 * rescales step at the same keys in a prefill chunk (attention.c) and in a decode step
 * (attention_decode.c), which is what keeps the two bitwise equal. */
#define SOFTMAX_TILE 64

/* The first key of the tile holding key `first` (the first one a query sees): tiles start
 * at multiples of SOFTMAX_TILE whatever the window or the other queries of a chunk, so a
 * query's tiles depend on its own position only. */
static inline int64_t first_tile(int64_t first) { return first / SOFTMAX_TILE * SOFTMAX_TILE; }

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));   /* unaligned loads/stores */
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf load(const float *p) { return *(const vfu *)p; }
/* Pins a value to a register: without it the compiler folds a vector reused by several
 * FMAs back into each of them as a memory operand, and the loads, not the FMAs, set the pace. */
#if defined(__x86_64__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

static inline vf splat(float x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){0} + x;
#endif
}
/* lane-wise m ? a : b, m from a vector compare (all ones or zero per lane) */
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return sel(a > b, a, b);
#endif
}

/* a * b + c per lane, rounded once where the target has FMA (twice where it has not). The
 * attention kernels are built with -ffp-contract=off (kernels/build.py) and write every
 * multiply-add they want fused through this, so the compiler cannot fuse a * b + c in one
 * inlined copy of a loop and not in another: a result's bits follow from the source alone. */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}
/* vfma for one float, rounded exactly as a lane of vfma is */
static inline float sfma(float a, float b, float c) { return vfma(splat(a), splat(b), splat(c))[0]; }

/* exp(x) for x <= 0 (softmax only takes exponents of differences from a running max):
 * 2^n * exp(r) with n = round(x / ln 2), |r| <= ln 2 / 2. Below -87, where 2^n leaves the
 * normal floats, it returns exp(-87) ~ 1.6e-38; callers zero the masked lanes themselves. */
static inline vf vexp(vf x) {
    const float magic = 12582912.0f;                  /* 1.5 * 2^23: adding it rounds to an integer */
    x = vmax(x, splat(-87.0f));
    vf t = vfma(x, splat(1.44269504088896341f), splat(magic));
    vf fn = t - magic;
    vf r = vfma(fn, splat(2.12194440e-4f), vfma(fn, splat(-0.693359375f), x));
    vf r2 = r * r;
    vf p = vfma(splat(1.9875691500e-4f), r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3334519073e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    p = vfma(p, r2, r) + 1.0f;
    vi n;                                             /* the low bits of t hold n */
    memcpy(&n, &t, sizeof n);
    vi bits = (n - 0x4B400000 + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef struct {
    const float *cache;          /* this layer's keys; values at cache + v_offset */
    int64_t block_stride, v_offset, tok_stride;   /* in floats */
    const int64_t *table;
    int bs;
} Paged;

#endif
