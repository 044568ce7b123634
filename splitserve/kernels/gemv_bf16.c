/* y (M, N) = x (M, K) @ W^T (+ bias) in bfloat16, float32 accumulation, for the few rows
 * of a decode step, with AVX512-BF16's pair dot product (vdpbf16ps).
 *
 * vdpbf16ps multiplies 16 lanes of bfloat16 pairs and adds each pair's two products into
 * one float32 lane. So W (N, K) is stored once, at load time, in tiles of NR = 32 output
 * rows, K taken two at a time: tile t holds W[t*NR .. t*NR+NR) as (K/2, NR, 2), so one
 * pair-row of a tile is 32 rows' (w[k], w[k+1]), 128 contiguous bytes, two registers. The
 * inner loop broadcasts x[m]'s pair (x[k], x[k+1]) as one 32-bit lane into all 16 lanes and
 * dot-accumulates it against both registers: NR accumulators per row of x, no horizontal
 * sums, W read once front to back (as gemv.c does in float32, at half the bytes). Rows of
 * W past N are zero, and so is the last pair's second half when K is odd.
 *
 * Built on every CPU: where the compiler's target lacks AVX512-BF16 the library holds only
 * gemv_bf16_available(), which returns 0, and the caller keeps its other path.
 */
#include <stdint.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define NR 32
#define MR_MAX 8   /* 16 accumulators + 2 weights + 1 broadcast of 32 zmm registers */
/* Bytes ahead of the weight being read that are requested from memory, as in gemv.c. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

int gemv_bf16_available(void) { return 1; }
int gemv_bf16_tile_rows(void) { return NR; }

/* Pairs of k per tile: ceil(k / 2). */
static inline int64_t pairs_of(int64_t k) { return (k + 1) / 2; }

/* uint16 elements gemv_bf16_pack writes for W (n, k). */
int64_t gemv_bf16_packed_numel(int64_t n, int64_t k)
{
    return (n + NR - 1) / NR * pairs_of(k) * NR * 2;
}

/* Lay W (n, k) bfloat16 row-major out as tiles (ceil(n / NR), ceil(k / 2), NR, 2) into
 * `out`, zero-padded. */
void gemv_bf16_pack(const uint16_t *w, uint16_t *out, int64_t n, int64_t k)
{
    int64_t tiles = (n + NR - 1) / NR, kp = pairs_of(k);
    for (int64_t t = 0; t < tiles; t++) {
        uint16_t *dst = out + t * kp * NR * 2;
        for (int64_t r = 0; r < NR; r++) {
            int64_t row = t * NR + r;
            for (int64_t i = 0; i < kp * 2; i++)
                dst[(i / 2) * NR * 2 + r * 2 + i % 2] = row < n && i < k ? w[row * k + i] : 0;
        }
    }
}

/* acc[m] += x[m]'s pair (x[2p], x[2p + 1]) times pair-row `w` of a tile, for mr rows;
 * `pair` reads one 32-bit pair of x[m] (rows ldx apart). */
#define PAIR_STEP(mr, w, pair_of_m) do {                                                   \
        __m512bh w0_ = (__m512bh)_mm512_loadu_si512(w);                                  \
        __m512bh w1_ = (__m512bh)_mm512_loadu_si512((w) + 32);                           \
        for (int m = 0; m < (mr); m++) {                                                 \
            __m512bh b_ = (__m512bh)_mm512_set1_epi32((int)(pair_of_m));                  \
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0_, b_);                              \
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1_, b_);                              \
        }                                                                                \
    } while (0)

static inline uint32_t load_pair(const uint16_t *x)
{
    uint32_t pair;
    memcpy(&pair, x, sizeof pair);
    return pair;
}

/* acc[m] (NR floats each) = x[m] (k bfloat16, rows ldx apart) @ tile, for mr rows.
 * Inlined into one copy per constant mr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void
tile_dot(int mr, const uint16_t *x, int64_t ldx, const uint16_t *tile, int64_t k,
         __m512 acc[MR_MAX][2])
{
    int64_t whole = k / 2;
    for (int m = 0; m < mr; m++)
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < whole; p++) {
        const uint16_t *w = tile + p * NR * 2;
        if (mr > 1) {   /* one prefetch per 64-byte line of the 128 bytes read */
            __builtin_prefetch((const char *)w + PREFETCH_BYTES);
            __builtin_prefetch((const char *)w + PREFETCH_BYTES + 64);
        }
        PAIR_STEP(mr, w, load_pair(x + m * ldx + 2 * p));
    }
    if (k % 2)   /* the last pair: x[k - 1] and a zero */
        PAIR_STEP(mr, tile + whole * NR * 2, x[m * ldx + k - 1]);
}

/* float32 -> bfloat16, rounding to nearest even (NaN stays NaN). */
static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(u >> 16 | 0x40);
    return (uint16_t)((u + 0x7fffu + (u >> 16 & 1)) >> 16);
}

static inline float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y[m][0 .. cols) = bf16(acc[m] (+ bias)) for mr rows, rows of y ldy apart; cols <= NR. */
static void store_rows(int mr, __m512 acc[MR_MAX][2], const uint16_t *bias, uint16_t *y,
                       int64_t ldy, int64_t cols)
{
    for (int m = 0; m < mr; m++) {
        float row[NR];
        _mm512_storeu_ps(row, acc[m][0]);
        _mm512_storeu_ps(row + 16, acc[m][1]);
        uint16_t *dst = y + m * ldy;
        for (int64_t c = 0; c < cols; c++)
            dst[c] = to_bf16(bias ? row[c] + from_bf16(bias[c]) : row[c]);
    }
}

#define TILE_CASE(R) case R: tile_dot(R, x, k, tile, k, acc); break

/* One tile of NR output columns for mr (<= MR_MAX) rows of x. */
static void tile_rows(int mr, const uint16_t *x, const uint16_t *tile, const uint16_t *bias,
                      uint16_t *y, int64_t n, int64_t k, int64_t cols)
{
    __m512 acc[MR_MAX][2];
    switch (mr) {
    TILE_CASE(1); TILE_CASE(2); TILE_CASE(3); TILE_CASE(4);
    TILE_CASE(5); TILE_CASE(6); TILE_CASE(7); TILE_CASE(8);
    default: return;
    }
    store_rows(mr, acc, bias, y, n, cols);
}

struct gemv_bf16_args {
    const uint16_t *x, *wp, *bias;
    uint16_t *y;
    int64_t m, n, k;
};

/* Tiles [t0, t1) of W: columns [t0 * NR, t1 * NR) of y, for every row of x. */
static void gemv_bf16_tiles(const void *ctx, int64_t t0, int64_t t1)
{
    const struct gemv_bf16_args *a = ctx;
    int64_t m = a->m, n = a->n, k = a->k, tile_numel = pairs_of(k) * NR * 2;
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *tile = a->wp + t * tile_numel;
        int64_t col = t * NR, cols = n - col < NR ? n - col : NR;
        const uint16_t *b = a->bias ? a->bias + col : 0;
        for (int64_t r = 0; r < m; r += MR_MAX) {
            int mr = (int)(m - r < MR_MAX ? m - r : MR_MAX);
            tile_rows(mr, a->x + r * k, tile, b, a->y + r * n + col, n, k, cols);
        }
    }
}

/* y (m, n) = x (m, k) @ W^T + bias (n,) or none (NULL), all bfloat16; wp is
 * gemv_bf16_pack's layout of W. x and y are row-major and contiguous. */
void gemv_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
               int64_t m, int64_t n, int64_t k)
{
    struct gemv_bf16_args a = {x, wp, bias, y, m, n, k};
    gemv_bf16_tiles(&a, 0, (n + NR - 1) / NR);
}

/* The helper's columns [t0 * NR, t1 * NR) of y, from its staging copy into the caller's. */
static void gemv_bf16_copy(const void *ctx, const void *helper_ctx, int64_t t0, int64_t t1)
{
    const struct gemv_bf16_args *a = ctx, *h = helper_ctx;
    int64_t col = t0 * NR, end = t1 * NR < a->n ? t1 * NR : a->n;
    for (int64_t r = 0; r < a->m; r++)
        memcpy(a->y + r * a->n + col, h->y + r * a->n + col, (size_t)(end - col) * 2);
}

/* gemv_bf16, its tiles shared `grain` at a time with pool.c's helper thread. */
void gemv_bf16_shared(const struct pool_api *pool, const uint16_t *x, const uint16_t *wp,
                      const uint16_t *bias, uint16_t *y, int64_t m, int64_t n, int64_t k,
                      int64_t grain)
{
    struct gemv_bf16_args a = {x, wp, bias, y, m, n, k}, h = a;
    void *in, *out, *unused;
    if (pool->stage((size_t)(m * k) * 2, (size_t)(m * n) * 2, 0, &in, &out, &unused)) {
        gemv_bf16_tiles(&a, 0, (n + NR - 1) / NR);
        return;
    }
    memcpy(in, x, (size_t)(m * k) * 2);
    h.x = in;
    h.y = out;
    pool->run(gemv_bf16_tiles, &a, &h, sizeof h, (n + NR - 1) / NR, grain, gemv_bf16_copy);
}

#else

int gemv_bf16_available(void) { return 0; }

#endif
