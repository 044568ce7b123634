/* Decode attention over the paged KV cache, float32, one thread.
 *
 * One call attends n sequences' single new queries (one position each) against all their
 * keys, read in place from the paged cache through each sequence's block table. PyTorch's
 * way, a gather of every sequence's blocks into one padded tensor and then SDPA, moves the
 * KV three times (read, write, read again); at long contexts decode is bound by exactly
 * those bytes, so here they are read once.
 *
 * A query's arithmetic is attention.c's for a query at the same position, operation for
 * operation, so a token's attention output, and the logits and the KV that follow from it,
 * are the same bits whether the token was decoded or came inside a prefill chunk (a prompt's
 * last token recomputed after a prefix-cache hit, a chunk of one token, a stream prefilled
 * again after a migration), and a seeded draw does not depend on which:
 *   - a score is one chain of FMAs over head_dim in order, from 0;
 *   - keys go in tiles of SOFTMAX_TILE from the same first key (vec.h); per tile: the
 *     running max, exponentials by vexp, their sum in key order, l = l * corr + sum, the
 *     output scaled by corr and then += p * value for the keys in order;
 *   - the result is the output times 1 / l.
 * The score chain runs along head_dim, so here lanes hold keys: VW keys' rows are
 * transposed in registers, VW dimensions at a time, and the block serves every query head
 * of its KV head. A tile's tokens are read from memory once for all KV heads (a sequence's
 * KV at long contexts is more than the caches hold, so a pass per KV head would read it KVH
 * times).
 */
#include "pool.h"
#include "vec.h"

#define GMAX 16          /* query heads per KV head handled; more returns -1 */
#define HMAX 256         /* query heads handled (they live on the stack); more returns -1 */
#define KT SOFTMAX_TILE
#define SROW (KT + VW)   /* a head's scores in a tile, and room for a last vector's padding */

/* x (VW rows) -> its transpose. Data movement only: no value changes. */
static inline __attribute__((always_inline)) void transpose(vf x[VW]) {
#if VW == 8 && defined(__AVX__)
    /* 24 single-instruction shuffles; the generic rounds below cost AVX2 three each */
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps((__m256)x[i], (__m256)x[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps((__m256)x[i], (__m256)x[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        x[i] = (vf)_mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        x[i + 4] = (vf)_mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
#else
    /* log2(VW) rounds, each swapping the off-diagonal b x b blocks of every 2b x 2b block */
#pragma GCC unroll 8
    for (int b = VW / 2; b >= 1; b /= 2) {
        vi lo, hi;
        for (int l = 0; l < VW; l++) {
            lo[l] = (l / b) % 2 == 0 ? l : VW + l - b;
            hi[l] = (l / b) % 2 == 0 ? l + b : VW + l;
        }
#pragma GCC unroll 16
        for (int r = 0; r < VW / 2; r++) {        /* the pairs (top, top + b) */
            int top = r / b * 2 * b + r % b;
            vf a = x[top], c = x[top + b];
            x[top] = __builtin_shuffle(a, c, lo);
            x[top + b] = __builtin_shuffle(a, c, hi);
        }
    }
#endif
}

typedef struct {
    const float *q;              /* (G, D): the group's queries, pre-scaled */
    vf *o;                       /* (G, nd): their outputs */
    float *m, *l;                /* (G,) running max and sum */
} Group;

/* s[h][j0 ..] = q_h . K[j] for keys j0 .. j0 + VW - 1 of the tile (rows[], padded by
 * repeats): lane j of a chain of FMAs over d in order (attention.c's qk_tile). */
static inline __attribute__((always_inline)) void scores(
        const Group *gr, int G, int D, const float *const rows[VW], float s[GMAX][SROW], int j0) {
    vf acc[GMAX];
    for (int h = 0; h < G; h++) acc[h] = splat(0.0f);
    for (int c = 0; c < D; c += VW) {
        vf k[VW];
#pragma GCC unroll 16
        for (int j = 0; j < VW; j++) k[j] = load(rows[j] + c);
        transpose(k);                                  /* k[i] lane j = K[j][c + i] */
#pragma GCC unroll 16
        for (int i = 0; i < VW; i++)
            for (int h = 0; h < G; h++) acc[h] = vfma(k[i], splat(gr->q[h * D + c + i]), acc[h]);
    }
    for (int h = 0; h < G; h++) memcpy(&s[h][j0], &acc[h], sizeof acc[h]);
}

/* Folds keys j0 .. valid - 1 of a tile (their rows at tok[j] + goff) into the group's
 * running softmax and outputs, as attention.c's softmax_tile and pv_tile do for a lane.
 * Inlined with constant G and nd where the dispatch below knows them. */
static inline __attribute__((always_inline)) void tile_body(
        Group *gr, int G, int nd, const float *const tok[KT], int64_t goff, int64_t v_offset,
        int j0, int valid) {
    int D = nd * VW;
    float s[GMAX][SROW];
    for (int jb = j0; jb < valid; jb += VW) {
        const float *rows[VW];
        for (int j = 0; j < VW; j++) rows[j] = tok[jb + j < valid ? jb + j : valid - 1] + goff;
        scores(gr, G, D, rows, s, jb);
    }
    vf o[GMAX][DMAX / VW];
    for (int h = 0; h < G; h++) {
        float m0 = gr->m[h], mx = m0;
        for (int j = j0; j < valid; j++) mx = mx > s[h][j] ? mx : s[h][j];   /* vmax's order */
        float safe = mx == -INFINITY ? 0.0f : mx;
        float corr = m0 == -INFINITY ? 0.0f : vexp(splat(m0 - safe))[0];
        for (int jb = j0; jb < valid; jb += VW) {
            vf e = vexp(load(&s[h][jb]) - splat(safe));
            memcpy(&s[h][jb], &e, sizeof e);
        }
        float sum = 0.0f;
        for (int j = j0; j < valid; j++) sum += s[h][j];
        gr->l[h] = sfma(gr->l[h], corr, sum);
        gr->m[h] = mx;
        for (int c = 0; c < nd; c++) o[h][c] = gr->o[h * nd + c] * corr;
    }
    for (int j = j0; j < valid; j++) {
        vf v[DMAX / VW];
        for (int c = 0; c < nd; c++) v[c] = load(tok[j] + goff + v_offset + c * VW);
        for (int h = 0; h < G; h++) {
            vf pj = splat(s[h][j]);
            for (int c = 0; c < nd; c++) o[h][c] = vfma(v[c], pj, o[h][c]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < nd; c++) gr->o[h * nd + c] = o[h][c];
}

#define TILE(G, ND) static void tile_##G##_##ND(Group *gr, const float *const tok[KT], \
        int64_t goff, int64_t v_offset, int j0, int valid) { \
        tile_body(gr, G, ND, tok, goff, v_offset, j0, valid); }
TILE(1, 4)
TILE(2, 4)
TILE(3, 4)
TILE(4, 4)
TILE(1, 8)
TILE(2, 8)
TILE(3, 8)
TILE(4, 8)

static void tile(Group *gr, int G, int nd, const float *const tok[KT], int64_t goff,
                 int64_t v_offset, int j0, int valid) {
    static void (*const fixed[2][4])(Group *, const float *const *, int64_t, int64_t, int, int) = {
        {tile_1_4, tile_2_4, tile_3_4, tile_4_4}, {tile_1_8, tile_2_8, tile_3_8, tile_4_8}};
    if ((nd == 4 || nd == 8) && G <= 4)
        fixed[nd / 8][G - 1](gr, tok, goff, v_offset, j0, valid);
    else
        tile_body(gr, G, nd, tok, goff, v_offset, j0, valid);
}

/* One sequence's query (H, D) at `pos` -> out (H, D). */
static void sequence(const float *q, float *out, const Paged *kv, int64_t pos, int H, int KVH,
                     int D, int window, float scale) {
    int nd = D / VW, G = H / KVH;
    float qs[H * D];
    vf os[H * nd];
    float ms[H], ls[H];
    for (int i = 0; i < H * D; i++) qs[i] = q[i] * scale;      /* as attention.c scales */
    for (int i = 0; i < H * nd; i++) os[i] = splat(0.0f);
    for (int h = 0; h < H; h++) {
        ms[h] = -INFINITY;
        ls[h] = 0.0f;
    }
    int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    for (int64_t k0 = first_tile(first); k0 <= pos; k0 += KT) {
        const float *tok[KT];
        int valid = pos + 1 - k0 < KT ? (int)(pos + 1 - k0) : KT;
        int j0 = first > k0 ? (int)(first - k0) : 0;    /* keys before it: out of the window */
        for (int j = j0; j < valid; j++) {
            int64_t key = k0 + j;
            tok[j] = kv->cache + kv->table[key / kv->bs] * kv->block_stride
                + (key % kv->bs) * kv->tok_stride;
        }
        for (int g = 0; g < KVH; g++) {
            Group gr = {qs + (int64_t)g * G * D, os + g * G * nd, ms + g * G, ls + g * G};
            tile(&gr, G, nd, tok, (int64_t)g * D, kv->v_offset, j0, valid);
        }
    }
    for (int h = 0; h < H; h++) {
        float inv = 1.0f / ls[h];
        for (int c = 0; c < nd; c++) {
            vf o = os[h * nd + c] * inv;
            memcpy(out + h * D + c * VW, &o, sizeof o);
        }
    }
}

struct decode_args {
    const float *q;
    int64_t q_stride;
    float *out;
    int64_t out_stride;
    const float *cache;
    int64_t block_stride, v_offset, tok_stride;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *positions;
    int bs, H, KVH, D, window;
    float scale;
};

/* Sequences [i0, i1). A position is held inside its table's row: a valid one always is,
 * and a helper that read a later job's staging (pool.h) then still reads only block ids. */
static void decode_units(const void *ctx, int64_t i0, int64_t i1)
{
    const struct decode_args *a = ctx;
    int64_t last = a->table_stride * a->bs - 1;
    for (int64_t i = i0; i < i1; i++) {
        Paged kv = {a->cache, a->block_stride, a->v_offset, a->tok_stride,
                    a->tables + i * a->table_stride, a->bs};
        int64_t pos = a->positions[i];
        pos = pos > last ? last : pos < 0 ? 0 : pos;
        sequence(a->q + i * a->q_stride, a->out + i * a->out_stride, &kv, pos, a->H, a->KVH,
                 a->D, a->window, a->scale);
    }
}

/* The helper's sequences, from its staging copy of out into the caller's. */
static void decode_copy(const void *ctx, const void *helper_ctx, int64_t i0, int64_t i1)
{
    const struct decode_args *a = ctx, *h = helper_ctx;
    for (int64_t i = i0; i < i1; i++)
        memcpy(a->out + i * a->out_stride, h->out + i * h->out_stride,
               (size_t)(a->H * a->D) * sizeof(float));
}

/* For i < n: out[i * out_stride ..] (H, D) = attention of q[i * q_stride ..] (H, D) at
 * position positions[i] over keys 0 .. positions[i] (the last `window` of them if window > 0)
 * of the sequence whose block ids are tables[i * table_stride ..]. Cache addressing as in
 * attention.c. Returns 0, or -1 for shapes it does not handle (nothing written then).
 * Its sequences are shared with pool.c's helper thread when pool is not NULL; the helper
 * reads staging copies of the queries, and of the tables and positions among the block ids
 * of pool.h's index buffer. */
int attn_decode_shared(const struct pool_api *pool, const float *q, int64_t q_stride,
                       float *out, int64_t out_stride, const float *cache, int64_t block_stride,
                       int64_t v_offset, int64_t tok_stride, const int64_t *tables,
                       int64_t table_stride, const int64_t *positions, int n, int bs, int H,
                       int KVH, int D, int window, float scale) {
    if (D > DMAX || D % VW || KVH <= 0 || H % KVH || H / KVH > GMAX || H > HMAX || bs <= 0 ||
        table_stride < 1)
        return -1;
    struct decode_args a = {q, q_stride, out, out_stride, cache, block_stride, v_offset,
                            tok_stride, tables, table_stride, positions, bs, H, KVH, D, window,
                            scale};
    int64_t row = (int64_t)H * D, ids = (int64_t)n * table_stride;
    void *in, *staged_out, *index;
    if (!pool || n < 2 ||
        pool->stage((size_t)(n * row) * sizeof(float), (size_t)(n * row) * sizeof(float),
                    (size_t)(ids + n) * sizeof(int64_t), &in, &staged_out, &index)) {
        decode_units(&a, 0, n);
        return 0;
    }
    int64_t *staged = index;
    pool_copy_rows(in, q, n, q_stride, row);
    pool_store_ids(staged, tables, ids);
    pool_store_ids(staged + ids, positions, n);
    struct decode_args h = a;
    h.q = in;
    h.out = staged_out;
    h.q_stride = h.out_stride = row;
    h.tables = staged;
    h.positions = staged + ids;
    pool->run(decode_units, &a, &h, sizeof h, n, 1, decode_copy);
    return 0;
}

