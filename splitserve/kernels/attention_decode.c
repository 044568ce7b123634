/* Decode attention over the paged KV cache, float32, one thread.
 *
 * One call attends n sequences' single new queries (one position each) against all their
 * keys, read in place from the paged cache through each sequence's block table. PyTorch's
 * way, a gather of every sequence's blocks into one padded tensor and then SDPA, moves the
 * KV three times (read, write, read again); at long contexts decode is bound by exactly
 * those bytes, so here they are read once.
 *
 * Work goes by sequence and tile of VW keys, and inside a tile by KV head g: a tile's
 * tokens are read from memory once for all heads (a sequence's KV at long contexts is more
 * than the caches hold, so a pass per KV head would read it KVH times), and the G query
 * heads of g share each key and value row. A row is VW-wide vectors along head_dim: QK is
 * D / VW FMAs per head and key, the tile's VW dot products are summed across lanes all at
 * once (hsums), and PV is D / VW FMAs per head and value. Scores of a tile sit in one
 * vector (lane = key) for the online softmax.
 */
#include "pool.h"
#include "vec.h"

#define GMAX 16          /* query heads per KV head handled; more returns -1 */
#define HMAX 256         /* query heads handled (they live on the stack); more returns -1 */

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

/* One step of a transposing reduction: lanes in blocks of w; the result's even blocks
 * hold x's pairs of blocks summed, its odd blocks y's. */
static inline vf fold(vf x, vf y, int w) {
    vi a, b;
    for (int l = 0; l < VW; l++) {
        a[l] = (l / w) % 2 == 0 ? l : VW + l - w;
        b[l] = (l / w) % 2 == 0 ? l + w : VW + l;
    }
    return __builtin_shuffle(x, y, a) + __builtin_shuffle(x, y, b);
}

/* r[j] = sum of acc[j]'s lanes, for VW vectors at once: log2(VW) rounds of folds, then one
 * permutation (the folds leave vector j in lane bit-reverse(j)). */
static inline vf hsums(vf acc[VW]) {
#pragma GCC unroll 16
    for (int n = VW, w = VW / 2; n > 1; n /= 2, w /= 2)
#pragma GCC unroll 16
        for (int k = 0; k < n / 2; k++) acc[k] = fold(acc[2 * k], acc[2 * k + 1], w);
    vi rev;
    for (int l = 0; l < VW; l++) {
        int r = 0;
        for (int b = 1; b < VW; b *= 2) r = r * 2 + ((l / b) & 1);
        rev[l] = r;
    }
    return __builtin_shuffle(acc[0], rev);
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
    return m;
}

typedef struct {
    vf *q, *o;                   /* (G, nd) each: the group's queries, pre-scaled, and outputs */
    float *m, *l;                /* (G,) running max and sum */
} Group;

/* s[h] lanes j = q_h . K[k0 + j] for the tile's keys (rows[j]; `valid` of them), -inf past
 * them. */
static inline __attribute__((always_inline)) void scores(
        const Group *gr, int G, int nd, const float *const rows[VW], int valid, vf s[GMAX]) {
    vf acc[GMAX][VW];
    for (int j = 0; j < VW; j++) {
        if (j >= valid) {
            for (int h = 0; h < G; h++) acc[h][j] = splat(0.0f);
            continue;
        }
        vf k[DMAX / VW];
        for (int c = 0; c < nd; c++) k[c] = load(rows[j] + c * VW);
        for (int h = 0; h < G; h++) {
            vf a = gr->q[h * nd] * k[0];
            for (int c = 1; c < nd; c++) a += gr->q[h * nd + c] * k[c];
            acc[h][j] = a;
        }
    }
    float lane[VW];
    for (int j = 0; j < VW; j++) lane[j] = (float)j;
    vi past = load(lane) >= splat((float)valid);
    for (int h = 0; h < G; h++) s[h] = sel(past, splat(-INFINITY), hsums(acc[h]));
}

/* Folds keys k0 .. k0 + valid - 1 (rows[j]) into the group's running softmax and outputs.
 * Inlined with constant G and nd where the dispatch below knows them, so the outputs stay
 * in registers across the tile's values instead of being loaded and stored per value. */
static inline __attribute__((always_inline)) void tile_body(
        Group *gr, int G, int nd, const float *const rows[VW], int64_t v_offset, int valid) {
    vf s[GMAX];
    scores(gr, G, nd, rows, valid, s);
    float p[GMAX][VW];
    vf o[GMAX][DMAX / VW];
    for (int h = 0; h < G; h++) {
        vf sh = s[h];                                  /* lanes past `valid` are -inf */
        float mx = hmax(sh), m = gr->m[h] > mx ? gr->m[h] : mx;
        vf e = vexp(sh - m);
        e = sel(sh == splat(-INFINITY), splat(0.0f), e);
        float corr = gr->m[h] == -INFINITY ? 0.0f : expf(gr->m[h] - m);
        gr->l[h] = gr->l[h] * corr + hsum(e);
        gr->m[h] = m;
        for (int c = 0; c < nd; c++) o[h][c] = gr->o[h * nd + c] * corr;
        memcpy(p[h], &e, sizeof e);
    }
    for (int j = 0; j < valid; j++) {
        vf v[DMAX / VW];
        for (int c = 0; c < nd; c++) v[c] = load(rows[j] + v_offset + c * VW);
        for (int h = 0; h < G; h++) {
            vf pj = splat(p[h][j]);
            for (int c = 0; c < nd; c++) o[h][c] += pj * v[c];
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < nd; c++) gr->o[h * nd + c] = o[h][c];
}

#define TILE(G, ND) static void tile_##G##_##ND(Group *gr, const float *const rows[VW], \
        int64_t v_offset, int valid) { tile_body(gr, G, ND, rows, v_offset, valid); }
TILE(1, 4)
TILE(2, 4)
TILE(3, 4)
TILE(4, 4)
TILE(1, 8)
TILE(2, 8)
TILE(3, 8)
TILE(4, 8)

static void tile(Group *gr, int G, int nd, const float *const rows[VW], int64_t v_offset,
                 int valid) {
    static void (*const fixed[2][4])(Group *, const float *const *, int64_t, int) = {
        {tile_1_4, tile_2_4, tile_3_4, tile_4_4}, {tile_1_8, tile_2_8, tile_3_8, tile_4_8}};
    if ((nd == 4 || nd == 8) && G <= 4)
        fixed[nd / 8][G - 1](gr, rows, v_offset, valid);
    else
        tile_body(gr, G, nd, rows, v_offset, valid);
}

/* One sequence's query (H, D) at `pos` -> out (H, D). */
static void sequence(const float *q, float *out, const Paged *kv, int64_t pos, int H, int KVH,
                     int D, int window, float scale) {
    int nd = D / VW, G = H / KVH;
    vf qs[H * nd], os[H * nd];
    float ms[H], ls[H];
    for (int i = 0; i < H * nd; i++) {
        qs[i] = load(q + i * VW) * scale;
        os[i] = splat(0.0f);
    }
    for (int h = 0; h < H; h++) {
        ms[h] = -INFINITY;
        ls[h] = 0.0f;
    }
    int64_t kbeg = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    for (int64_t k0 = kbeg; k0 <= pos; k0 += VW) {
        const float *tok[VW], *rows[VW];
        int valid = pos + 1 - k0 < VW ? (int)(pos + 1 - k0) : VW;
        for (int j = 0; j < valid; j++) {
            int64_t key = k0 + j;
            tok[j] = kv->cache + kv->table[key / kv->bs] * kv->block_stride
                + (key % kv->bs) * kv->tok_stride;
        }
        for (int g = 0; g < KVH; g++) {
            Group gr = {qs + g * G * nd, os + g * G * nd, ms + g * G, ls + g * G};
            for (int j = 0; j < valid; j++) rows[j] = tok[j] + (int64_t)g * D;
            tile(&gr, G, nd, rows, kv->v_offset, valid);
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < nd; c++) {
            vf o = os[h * nd + c] / ls[h];
            memcpy(out + h * D + c * VW, &o, sizeof o);
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

