/* The helper thread's interface for kernels (pool.c says how it works). A kernel that
 * shares its work passes two contexts: the caller's, over the caller's memory, and the
 * helper's, over staging copies that pool.c owns for good. */
#ifndef SPLITSERVE_POOL_H
#define SPLITSERVE_POOL_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Runs ranges [begin, end) of a job's 0 .. n. */
typedef void (*pool_task)(const void *ctx, int64_t begin, int64_t end);
/* Copies what the helper wrote for [begin, end) (through helper_ctx) into the caller's
 * output (through ctx). */
typedef void (*pool_copy)(const void *ctx, const void *helper_ctx, int64_t begin, int64_t end);

#define POOL_CTX_MAX 256   /* bytes of a helper context */

struct pool_api {
    /* Staging buffers for the next run: `in` for the inputs the helper reads (copied there
     * by the kernel), `out` for what it writes, `index` for indices it follows into memory
     * that outlives the job (a block table into the KV cache). A helper that lost its CPU
     * may read them after its job ended, when a later job has overwritten them: garbage
     * floats in `in` only spoil a result nobody copies, but a garbage index would read
     * outside the cache. So `index` holds nothing but indices every job of the process
     * accepts (block ids: the KV cache and the models live as long as the process), and
     * is all zeros at first. 0, or -1 when there is no memory for them (then the kernel
     * runs alone). */
    int (*stage)(size_t in_bytes, size_t out_bytes, size_t index_bytes, void **in, void **out,
                 void **index);
    /* fn over [0, n) in ranges of `grain`: fn(ctx, ...) on this thread, fn(helper_ctx, ...)
     * on the helper, then copy() for each range the helper finished. Returns when all ran.
     * Memory the helper reads other than the staging buffers (weights, the KV cache) must
     * outlive the process's jobs. */
    void (*run)(pool_task fn, const void *ctx, const void *helper_ctx, size_t helper_ctx_bytes,
                int64_t n, int64_t grain, pool_copy copy);
};

/* rows of `width` floats, `stride` apart in src, copied packed into dst (the helper's q). */
static inline void pool_copy_rows(float *dst, const float *src, int64_t rows, int64_t stride,
                                  int64_t width)
{
    for (int64_t i = 0; i < rows; i++)
        memcpy(dst + i * width, src + i * stride, (size_t)width * sizeof(float));
}

/* n block ids (or positions) into the index buffer as it asks: each stored whole, and
 * none below 0 (a table's padding), so a late reader meets only ids it may follow. */
static inline void pool_store_ids(int64_t *dst, const int64_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        __atomic_store_n(&dst[i], src[i] < 0 ? 0 : src[i], __ATOMIC_RELAXED);
}

#endif
