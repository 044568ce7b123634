/* Causal prefill attention over the paged KV cache, float32, one thread.
 *
 * One call attends one prefill chunk of one sequence: L query tokens at positions
 * start .. start+L-1, against every key 0 .. start+L-1 (or the last `window` of them),
 * read in place from the paged cache through the block table: nothing is gathered first.
 *
 * Work is split into units of (KV head g, VW consecutive query positions, up to RVMAX of
 * the query heads that share g). In a unit every vector register holds one query head's
 * VW positions (lane = position), so
 *   - S = Q K^T is a broadcast of one key element times RV query vectors: K is read in its
 *     cache layout, never transposed, and each key element serves every head of the group;
 *   - the online softmax (running max, sum, rescale) is lane-wise, with no horizontal
 *     reductions, and the causal mask is one compare of the lanes' positions per key;
 *   - O += P V is a broadcast of one value element times RV probability vectors.
 * Key tiles past a unit's last position are never touched; only tiles crossing the
 * diagonal (or the window's edge) are masked.
 *
 * vec.h has the vectors (16 floats with AVX-512, else 8) and exp.
 */
#include "pool.h"
#include "vec.h"

#define RVMAX 3          /* query heads per unit: RVMAX * KB accumulators + RVMAX loads fit AVX2's 16 registers */
#define KB 4             /* keys per register block */
#define KT SOFTMAX_TILE   /* keys per tile (vec.h; a multiple of KB) */

/* rows[j] = the key row of position min(k0 + j, last), head g, for j < nk: tiles are padded
 * to whole register blocks with repeats of the last key, which exist and are masked. One
 * division per tile; the block walk does the rest. */
static inline void key_rows(const Paged *kv, int64_t k0, int64_t last, int g, int D, int nk,
                            const float *rows[KT]) {
    int64_t blk = k0 / kv->bs, off = k0 % kv->bs;
    const float *base = kv->cache + kv->table[blk] * kv->block_stride + (int64_t)g * D;
    for (int j = 0; j < nk; j++) {
        if (k0 + j <= last) {
            rows[j] = base + off * kv->tok_stride;
            if (++off == kv->bs && k0 + j < last) {
                off = 0;
                base = kv->cache + kv->table[++blk] * kv->block_stride + (int64_t)g * D;
            }
        } else {
            rows[j] = rows[j - 1];
        }
    }
}

/* s[j][v] = sum_d K[k0+j][d] * qt[v][d] for j < nk (nk a multiple of KB). */
static inline __attribute__((always_inline)) void qk_tile(
        const float *const rows[KT], int D, int nk, int rv,
        const vf qt[RVMAX][DMAX], vf s[KT][RVMAX]) {
    for (int j = 0; j < nk; j += KB) {
        const float *const *k = rows + j;
        vf acc[KB][RVMAX] = {{{0}}};
        for (int d = 0; d < D; d++) {
            vf qd[RVMAX];          /* loaded once, used KB times: keeps the loads off the FMAs */
#pragma GCC unroll 3
            for (int v = 0; v < rv; v++) {
                qd[v] = qt[v][d];
                IN_REGISTER(qd[v]);
            }
#pragma GCC unroll 4
            for (int b = 0; b < KB; b++) {
                vf kb = splat(k[b][d]);
#pragma GCC unroll 3
                for (int v = 0; v < rv; v++) acc[b][v] = vfma(kb, qd[v], acc[b][v]);
            }
        }
        for (int b = 0; b < KB; b++)
            for (int v = 0; v < rv; v++) s[j + b][v] = acc[b][v];
    }
}

/* ot[v][d] += sum_j p[j][v] * V[k0+j][d] */
static inline __attribute__((always_inline)) void pv_tile(
        const float *const rows[KT], int64_t v_offset, int D, int nk, int rv,
        const vf p[KT][RVMAX], vf ot[RVMAX][DMAX]) {
    const float *vrow[KT];
    for (int j = 0; j < nk; j++) vrow[j] = rows[j] + v_offset;
    for (int d = 0; d < D; d += 4) {
        vf acc[4][RVMAX];
        for (int e = 0; e < 4; e++)
            for (int v = 0; v < rv; v++) acc[e][v] = ot[v][d + e];
        for (int j = 0; j < nk; j++) {
            vf pj[RVMAX];
#pragma GCC unroll 3
            for (int v = 0; v < rv; v++) {
                pj[v] = p[j][v];
                IN_REGISTER(pj[v]);
            }
#pragma GCC unroll 4
            for (int e = 0; e < 4; e++) {
                vf ve = splat(vrow[j][d + e]);
#pragma GCC unroll 3
                for (int v = 0; v < rv; v++) acc[e][v] = vfma(ve, pj[v], acc[e][v]);
            }
        }
        for (int e = 0; e < 4; e++)
            for (int v = 0; v < rv; v++) ot[v][d + e] = acc[e][v];
    }
}

typedef struct {
    vf m[RVMAX], l[RVMAX];       /* running max and sum, per lane */
    vf pos;                      /* the lanes' positions (padding lanes repeat the last) */
} Softmax;

/* Turns s (scores) into p = exp(s - max) in place, masking keys a lane may not see, and
 * rescales ot and the running sums to the new max. Keys k0 .. k0+nk-1, of which the first
 * `valid` exist. */
static inline __attribute__((always_inline)) void softmax_tile(
        Softmax *sm, int64_t k0, int nk, int valid, int window, int masked, int rv, int D,
        vf s[KT][RVMAX], vf ot[RVMAX][DMAX]) {
    if (masked) {
        for (int j = 0; j < nk; j++) {
            vf key = splat((float)(k0 + j));
            vi hide = key > sm->pos;
            if (window > 0) hide |= key <= sm->pos - (float)window;
            if (j >= valid) hide = hide | -1;
            for (int v = 0; v < rv; v++) s[j][v] = sel(hide, splat(-INFINITY), s[j][v]);
        }
    }
    for (int v = 0; v < rv; v++) {
        vf mx = sm->m[v];
        for (int j = 0; j < nk; j++) mx = vmax(mx, s[j][v]);
        vf safe = sel(mx == splat(-INFINITY), splat(0.0f), mx);    /* every key hidden so far */
        vf corr = vexp(sm->m[v] - safe);
        corr = sel(sm->m[v] == splat(-INFINITY), splat(0.0f), corr);
        vf sum = splat(0.0f);
        for (int j = 0; j < nk; j++) {
            vf e = vexp(s[j][v] - safe);
            if (masked) e = sel(s[j][v] == splat(-INFINITY), splat(0.0f), e);
            s[j][v] = e;
            sum += e;
        }
        sm->l[v] = vfma(sm->l[v], corr, sum);
        sm->m[v] = mx;
        for (int d = 0; d < D; d++) ot[v][d] *= corr;
    }
}

static inline __attribute__((always_inline)) void unit(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                 const Paged *kv, int g, int h0, int rv, int i0, int n, int64_t start,
                 int D, int window, float scale) {
    vf qt[RVMAX][DMAX], ot[RVMAX][DMAX], s[KT][RVMAX];
    Softmax sm;
    float lanes[VW];
    for (int i = 0; i < VW; i++) lanes[i] = (float)(start + i0 + (i < n ? i : n - 1));
    sm.pos = load(lanes);
    for (int v = 0; v < rv; v++) {
        sm.m[v] = splat(-INFINITY);
        sm.l[v] = splat(0.0f);
        for (int d = 0; d < D; d++) {
            float col[VW] = {0};
            for (int i = 0; i < n; i++) col[i] = q[(int64_t)(i0 + i) * q_stride + (h0 + v) * D + d] * scale;
            qt[v][d] = load(col);
            ot[v][d] = splat(0.0f);
        }
    }
    int64_t first = start + i0, last = start + i0 + n - 1;          /* positions in the unit */
    int64_t kbeg = first_tile(window > 0 && first - window + 1 > 0 ? first - window + 1 : 0);
    for (int64_t k0 = kbeg; k0 <= last; k0 += KT) {
        int valid = last + 1 - k0 < KT ? (int)(last + 1 - k0) : KT;
        int nk = (valid + KB - 1) / KB * KB;
        int masked = k0 + nk - 1 > first || (window > 0 && k0 <= last - window);
        const float *rows[KT];
        key_rows(kv, k0, last, g, D, nk, rows);
        qk_tile(rows, D, nk, rv, (const vf(*)[DMAX])qt, s);
        softmax_tile(&sm, k0, nk, valid, window, masked, rv, D, s, ot);
        pv_tile(rows, kv->v_offset, D, nk, rv, (const vf(*)[RVMAX])s, ot);
    }
    for (int v = 0; v < rv; v++) {
        vf inv = 1.0f / sm.l[v];
        for (int d = 0; d < D; d++) {
            float col[VW];
            vf o = ot[v][d] * inv;
            memcpy(col, &o, sizeof col);
            for (int i = 0; i < n; i++) out[(int64_t)(i0 + i) * out_stride + (h0 + v) * D + d] = col[i];
        }
    }
}

#define UNIT(RV) static void unit##RV(const float *q, int64_t qs, float *out, int64_t os, \
        const Paged *kv, int g, int h0, int i0, int n, int64_t start, int D, int window, \
        float scale) { unit(q, qs, out, os, kv, g, h0, RV, i0, n, start, D, window, scale); }
UNIT(1)
UNIT(2)
UNIT(3)

struct prefill_args {
    const float *q;
    int64_t q_stride;
    float *out;
    int64_t out_stride;
    Paged kv;
    int L, H, KVH, D, window, blocks;
    int64_t start;
    float scale;
};

/* Units [u0, u1) of a chunk: unit u is KV head u % KVH of the block of VW queries
 * blocks - 1 - u / KVH, so the blocks with the most keys (the last) are handed out first
 * and the cheap ones even out the end. */
static void prefill_units(const void *ctx, int64_t u0, int64_t u1)
{
    const struct prefill_args *a = ctx;
    int G = a->H / a->KVH;
    for (int64_t u = u0; u < u1; u++) {
        int i0 = (a->blocks - 1 - (int)(u / a->KVH)) * VW, g = (int)(u % a->KVH);
        int n = a->L - i0 < VW ? a->L - i0 : VW;
        for (int h0 = g * G; h0 < (g + 1) * G; h0 += RVMAX) {
            int rv = (g + 1) * G - h0 < RVMAX ? (g + 1) * G - h0 : RVMAX;
            if (rv == 3) unit3(a->q, a->q_stride, a->out, a->out_stride, &a->kv, g, h0, i0, n, a->start, a->D, a->window, a->scale);
            else if (rv == 2) unit2(a->q, a->q_stride, a->out, a->out_stride, &a->kv, g, h0, i0, n, a->start, a->D, a->window, a->scale);
            else unit1(a->q, a->q_stride, a->out, a->out_stride, &a->kv, g, h0, i0, n, a->start, a->D, a->window, a->scale);
        }
    }
}

/* The helper's units, from its staging copy of out into the caller's. */
static void prefill_copy(const void *ctx, const void *helper_ctx, int64_t u0, int64_t u1)
{
    const struct prefill_args *a = ctx, *h = helper_ctx;
    int G = a->H / a->KVH;
    for (int64_t u = u0; u < u1; u++) {
        int i0 = (a->blocks - 1 - (int)(u / a->KVH)) * VW, g = (int)(u % a->KVH);
        int n = a->L - i0 < VW ? a->L - i0 : VW;
        for (int i = i0; i < i0 + n; i++)
            memcpy(a->out + i * a->out_stride + g * G * a->D,
                   h->out + i * h->out_stride + g * G * a->D, (size_t)(G * a->D) * sizeof(float));
    }
}

/* out[t][h][:] = attention of query q[t][h][:] (t < L, at position start + t) over keys and
 * values 0 .. start + t of KV head h / (H / KVH). The key of position p, KV head g, is at
 * cache + table[p / bs] * block_stride + (p % bs) * tok_stride + g * D, its value v_offset
 * floats further. Strides are in floats. window > 0 limits each query to the last `window`
 * keys. Returns 0, or -1 for shapes it does not handle (then nothing was written).
 * Its units are shared with pool.c's helper thread when pool is not NULL; the helper reads a
 * staging copy of q and of the table and writes a staging out. */
int attn_prefill_shared(const struct pool_api *pool, const float *q, int64_t q_stride,
                        float *out, int64_t out_stride, const float *cache,
                        int64_t block_stride, int64_t v_offset, int64_t tok_stride,
                        const int64_t *table, int bs, int L, int64_t start, int H, int KVH,
                        int D, int window, float scale) {
    if (D > DMAX || D % 4 || KVH <= 0 || H % KVH || L <= 0 || bs <= 0) return -1;
    struct prefill_args a = {q, q_stride, out, out_stride,
                             {cache, block_stride, v_offset, tok_stride, table, bs},
                             L, H, KVH, D, window, (L + VW - 1) / VW, start, scale};
    int64_t units = (int64_t)a.blocks * KVH, row = (int64_t)H * D;
    int64_t blocks_used = (start + L + bs - 1) / bs;
    void *in, *staged_out, *index;
    if (!pool || pool->stage((size_t)(L * row) * sizeof(float), (size_t)(L * row) * sizeof(float),
                             (size_t)blocks_used * sizeof(int64_t), &in, &staged_out, &index)) {
        prefill_units(&a, 0, units);
        return 0;
    }
    pool_copy_rows(in, q, L, q_stride, row);
    pool_store_ids(index, table, blocks_used);
    struct prefill_args h = a;
    h.q = in;
    h.out = staged_out;
    h.q_stride = h.out_stride = row;
    h.kv.table = index;
    pool->run(prefill_units, &a, &h, sizeof h, units, 1, prefill_copy);
    return 0;
}

