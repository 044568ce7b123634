/* y (M, N) = x (M, K) @ W^T (+ bias) in float32, for the few rows of a decode step.
 *
 * W (N, K) is stored once, at load time, in tiles of NR output rows interleaved along K:
 * tile t holds W[t*NR .. t*NR+NR) as (K, NR), so row k of a tile is NR consecutive floats.
 * The inner loop then multiplies one broadcast x[m][k] into NR contiguous weights held in
 * two vector registers and adds into NR accumulators per row of x: no horizontal sums, and
 * the whole of W is read once, front to back, which is what bounds decode (M small, every
 * weight used M times). Rows of W past N in the last tile are zero (padding).
 *
 * Rows of x are taken MR_MAX at a time; a tile's weights (K * NR floats, 72-192 KB for
 * SmolLM2) stay in L2 between those passes, so only the first pass reads memory. (Taking
 * 9-16 rows in one pass over each half of a tile, one register of weights each, was
 * 1.4x slower on Zen 5: 17 loads per 16 FMAs instead of 10.) 512 rows of prefill run as
 * fast as oneDNN's packed weights this way, so prefill needs no second layout.
 *
 * Vector width follows the compile target: AVX-512 (NR = 32), AVX2 + FMA (NR = 16), or
 * a portable 4-wide fallback. gemv_pack() lays W out for the width this build was made for,
 * so a packed weight only ever meets the kernel that packed it.
 */
#define _DEFAULT_SOURCE   /* madvise under -std=c11 */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define MR_MAX 8   /* 16 accumulators + 2 weights + 1 broadcast of 32 zmm registers */
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VBCAST(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VZERO() _mm512_setzero_ps()
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define MR_MAX 6   /* 12 accumulators + 2 weights + 1 broadcast of 16 ymm registers */
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VBCAST(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VZERO() _mm256_setzero_ps()
#else
#define VW 4
#define MR_MAX 4
typedef float vec __attribute__((vector_size(16)));
static inline vec vload_(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
#define VLOAD(p) vload_(p)
#define VSTORE(p, v) do { vec v_ = (v); memcpy((p), &v_, sizeof v_); } while (0)
#define VBCAST(s) ((vec){0} + (s))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VZERO() ((vec){0})
#endif

#define NR (2 * VW)
/* Bytes ahead of the weight being read that are requested from memory. With two or more
 * rows of x the FMAs slow the stream enough that the hardware prefetcher falls behind and
 * this wins 1.15-1.4x; with one row the prefetcher alone is faster. Measured on an EPYC
 * (Zen 5) over SmolLM2's 121 decode matrices: 4096 beat 256-2048 and matched 8192-16384. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

int gemv_tile_rows(void) { return NR; }

/* Ask for transparent huge pages over [p, p + bytes) (2 MB-aligned): a 4 KB page ends the
 * hardware prefetcher's stream and costs a TLB walk every 4 KB; streaming the weights
 * through 2 MB pages made SmolLM2's decode matrices 5-15% faster. 0 on success, -1 where
 * the system has no such advice (then the pages stay small and everything still works). */
int gemv_advise_huge(void *p, int64_t bytes)
{
#ifdef MADV_HUGEPAGE
    return madvise(p, (size_t)bytes, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
    return -1;
#endif
}

/* Lay W (n, k) row-major out as tiles (ceil(n / NR), k, NR) into `out`, zero-padded. */
void gemv_pack(const float *w, float *out, int64_t n, int64_t k)
{
    int64_t tiles = (n + NR - 1) / NR;
    for (int64_t t = 0; t < tiles; t++) {
        float *dst = out + t * k * NR;
        for (int64_t r = 0; r < NR; r++) {
            int64_t row = t * NR + r;
            for (int64_t i = 0; i < k; i++)
                dst[i * NR + r] = row < n ? w[row * k + i] : 0.0f;
        }
    }
}

/* acc[m] (NR floats each) += x[m] (k floats, rows ldx apart) @ tile (k, NR), for mr rows.
 * Inlined into one copy per constant mr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void
tile_dot(int mr, const float *x, int64_t ldx, const float *tile, int64_t k,
         vec acc[MR_MAX][2])
{
    for (int m = 0; m < mr; m++)
        acc[m][0] = acc[m][1] = VZERO();
    for (int64_t i = 0; i < k; i++) {
        const float *w = tile + i * NR;
        if (mr > 1) {   /* one prefetch per 64-byte line of the NR * 4 bytes read */
            for (int line = 0; line < NR * 4; line += 64)
                __builtin_prefetch((const char *)w + PREFETCH_BYTES + line);
        }
        vec w0 = VLOAD(w), w1 = VLOAD(w + VW);
        for (int m = 0; m < mr; m++) {
            vec b = VBCAST(x[m * ldx + i]);
            acc[m][0] = VFMA(w0, b, acc[m][0]);
            acc[m][1] = VFMA(w1, b, acc[m][1]);
        }
    }
}

/* y[m][0 .. cols) = acc[m] (+ bias) for mr rows, rows of y ldy apart; cols <= NR. */
static void store_rows(int mr, vec acc[MR_MAX][2], const float *bias, float *y, int64_t ldy,
                       int64_t cols)
{
    for (int m = 0; m < mr; m++) {
        float row[NR];
        VSTORE(row, acc[m][0]);
        VSTORE(row + VW, acc[m][1]);
        float *dst = y + m * ldy;
        for (int64_t c = 0; c < cols; c++)
            dst[c] = bias ? row[c] + bias[c] : row[c];
    }
}

#define TILE_CASE(R) case R: tile_dot(R, x, k, tile, k, acc); break

/* One tile of NR output columns for mr (<= MR_MAX) rows of x. */
static void tile_rows(int mr, const float *x, const float *tile, const float *bias, float *y,
                      int64_t n, int64_t k, int64_t cols)
{
    vec acc[MR_MAX][2];
    switch (mr) {
    TILE_CASE(1); TILE_CASE(2); TILE_CASE(3); TILE_CASE(4);
#if MR_MAX >= 6
    TILE_CASE(5); TILE_CASE(6);
#endif
#if MR_MAX >= 8
    TILE_CASE(7); TILE_CASE(8);
#endif
    default: return;
    }
    store_rows(mr, acc, bias, y, n, cols);
}

struct gemv_args {
    const float *x, *wp, *bias;
    float *y;
    int64_t m, n, k;
};

/* Tiles [t0, t1) of W: columns [t0 * NR, t1 * NR) of y, for every row of x. */
static void gemv_tiles(const void *ctx, int64_t t0, int64_t t1)
{
    const struct gemv_args *a = ctx;
    int64_t m = a->m, n = a->n, k = a->k;
    for (int64_t t = t0; t < t1; t++) {
        const float *tile = a->wp + t * k * NR;
        int64_t col = t * NR, cols = n - col < NR ? n - col : NR;
        const float *b = a->bias ? a->bias + col : 0;
        for (int64_t r = 0; r < m; r += MR_MAX) {
            int mr = (int)(m - r < MR_MAX ? m - r : MR_MAX);
            tile_rows(mr, a->x + r * k, tile, b, a->y + r * n + col, n, k, cols);
        }
    }
}

/* y (m, n) = x (m, k) @ W^T + bias (n,) or none (NULL); wp is gemv_pack's layout of W.
 * x and y are row-major and contiguous. */
void gemv(const float *x, const float *wp, const float *bias, float *y,
          int64_t m, int64_t n, int64_t k)
{
    struct gemv_args a = {x, wp, bias, y, m, n, k};
    gemv_tiles(&a, 0, (n + NR - 1) / NR);
}

/* The helper's columns [t0 * NR, t1 * NR) of y, from its staging copy into the caller's. */
static void gemv_copy(const void *ctx, const void *helper_ctx, int64_t t0, int64_t t1)
{
    const struct gemv_args *a = ctx, *h = helper_ctx;
    int64_t col = t0 * NR, end = t1 * NR < a->n ? t1 * NR : a->n;
    for (int64_t r = 0; r < a->m; r++)
        memcpy(a->y + r * a->n + col, h->y + r * a->n + col, (size_t)(end - col) * sizeof(float));
}

/* gemv, its tiles shared `grain` at a time with pool.c's helper thread. */
void gemv_shared(const struct pool_api *pool, const float *x, const float *wp,
                 const float *bias, float *y, int64_t m, int64_t n, int64_t k, int64_t grain)
{
    struct gemv_args a = {x, wp, bias, y, m, n, k}, h = a;
    void *in, *out, *unused;
    if (pool->stage((size_t)(m * k) * sizeof(float), (size_t)(m * n) * sizeof(float), 0, &in,
                    &out, &unused)) {
        gemv_tiles(&a, 0, (n + NR - 1) / NR);
        return;
    }
    memcpy(in, x, (size_t)(m * k) * sizeof(float));
    h.x = in;
    h.y = out;
    pool->run(gemv_tiles, &a, &h, sizeof h, (n + NR - 1) / NR, grain, gemv_copy);
}
