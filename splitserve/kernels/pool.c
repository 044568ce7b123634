/* One helper thread that lends the engine a CPU it does not own, only while nothing else
 * wants that CPU.
 *
 * An engine's CPUs are its own (splitserve/placement.py); its front-end's CPU sleeps
 * through most of a step, waking to stream tokens or parse a request. The helper runs on
 * such a CPU under SCHED_IDLE: the scheduler hands the CPU to the front-end (or anything
 * else) the moment it wakes, and back to the helper only when it sleeps again.
 *
 * Work is shared by claiming, not by division. run() hands out ranges of a job from one
 * atomic counter to the calling thread and the helper until none are left. A helper without
 * its CPU claims nothing and the caller does the work alone. The range a helper holds when
 * it loses its CPU would stall the caller until the CPU comes back, which on a CPU some
 * other process keeps busy can be hundreds of milliseconds. So the caller never waits for
 * it: past a short deadline it takes the range back and runs it itself. That is safe because
 * the helper never writes the caller's memory and reads of it only what lives as long as the
 * process (weights, the KV cache): it reads inputs the kernel copied into this file's staging
 * buffers and writes outputs there, and the caller copies out only ranges the helper marked
 * done. Before that memory is freed, pool_quiesce() waits for the helper to leave the range
 * it may still be running. Staging buffers are never freed (a larger one replaces a smaller
 * one and the old one stays mapped), so a helper that wakes long after its job ended
 * computes into memory nobody reads, fails to mark its range done, and moves on. What it
 * reads then may be a later job's; pool.h says why that stays inside mapped memory.
 *
 * Each range has a state word, (job id << 2) | FREE, HELPER, DONE or CALLER, changed only
 * by compare-and-swap, so a range is the helper's or the caller's, never both. The job's
 * description is published under a sequence lock and copied by the helper before use.
 * Between jobs the helper spins for SPIN_NS (the gaps inside a step are short), then sleeps
 * on a futex until the next job.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define HELPER_NAME "kernel-helper"   /* in /proc/<pid>/task/<tid>/comm */
#define SPIN_NS 2000000               /* 2 ms: covers the gaps between a step's kernels */
#define GRACE_NS 20000                /* the helper's last range may take this beyond twice
                                       * the caller's mean range before it is taken back */

enum { FREE, HELPER, DONE, CALLER };
#define STATE(id, s) ((id) << 2 | (s))

struct job {
    uint64_t id;
    pool_task fn;
    int64_t n, grain, ranges;
    _Alignas(64) unsigned char ctx[POOL_CTX_MAX];
};

static struct job desc;                 /* written by the caller between seq odd and even */
static _Atomic uint64_t seq;
static _Atomic uint64_t live;           /* the id of the job being run; 0 between jobs */
static _Atomic uint64_t inside;         /* the job whose ranges the helper may be running */
static _Atomic int64_t next;            /* the next range to hand out */
typedef _Atomic uint64_t state_word;
static state_word *_Atomic states;      /* per range; replaced by a larger one as needed */
static int64_t states_cap;
static void *stage_in, *stage_out, *stage_index;
static size_t stage_in_cap, stage_out_cap, stage_index_cap;
static uint64_t last_id;

static _Atomic uint32_t generation;     /* futex word: bumped on every job */
static _Atomic int sleeping;
static _Atomic int started;
static pthread_t helper;                /* detached; it runs as long as the process */
static _Atomic int ready;               /* the helper's start: 0 pending, 1 running, -errno */
static _Atomic int64_t helped, taken_back, waited_ns;
static _Atomic int64_t stall_ns;        /* pool_stall_next: a lost CPU, for tests */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Memory that is never unmapped: a helper may still read or write it after its job. */
static void *lasting(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static int grow(void **buf, size_t *cap, size_t bytes)
{
    if (bytes <= *cap)
        return 0;
    size_t want = bytes > 2 * *cap ? bytes : 2 * *cap;
    void *p = lasting(want);
    if (!p)
        return -1;
    *buf = p;     /* the old buffer stays mapped: see the top of the file */
    *cap = want;
    return 0;
}

static int grow_states(int64_t ranges)
{
    void *p = (void *)atomic_load(&states);
    size_t cap = (size_t)states_cap * sizeof(uint64_t);
    if (grow(&p, &cap, (size_t)ranges * sizeof(uint64_t)))
        return -1;
    atomic_store(&states, p);
    states_cap = (int64_t)(cap / sizeof(uint64_t));
    return 0;
}

static int stage(size_t in_bytes, size_t out_bytes, size_t index_bytes, void **in, void **out,
                 void **index)
{
    /* A new buffer is all zeros (mmap): 0 is an index every job accepts (pool.h). */
    if (grow(&stage_in, &stage_in_cap, in_bytes ? in_bytes : 1) ||
        grow(&stage_out, &stage_out_cap, out_bytes ? out_bytes : 1) ||
        grow(&stage_index, &stage_index_cap, index_bytes ? index_bytes : 1))
        return -1;
    *in = stage_in;
    *out = stage_out;
    *index = stage_index;
    return 0;
}

static void range_of(const struct job *j, int64_t r, int64_t *begin, int64_t *end)
{
    *begin = r * j->grain;
    *end = *begin + j->grain < j->n ? *begin + j->grain : j->n;
}

/* The helper's part of job `id`, from its own copy of the description. */
static void help(uint64_t id)
{
    struct job j;
    for (;;) {
        uint64_t s1 = atomic_load(&seq);
        if (s1 & 1)
            continue;
        memcpy(&j, &desc, sizeof j);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&seq) == s1)
            break;
    }
    if (j.id != id)
        return;              /* a newer job replaced it meanwhile: take that one next */
    /* Set before any range is claimed, cleared after the last: pool_quiesce() reads it. A
     * range is claimed only while it is FREE, which no range of a finished job is. */
    atomic_store(&inside, id);
    while (atomic_load(&live) == id) {
        int64_t r = atomic_fetch_add(&next, 1);
        if (r >= j.ranges)
            break;
        state_word *st = atomic_load(&states);
        uint64_t expect = STATE(id, FREE);
        if (!atomic_compare_exchange_strong(&st[r], &expect, STATE(id, HELPER)))
            continue;
        int64_t b, e;
        range_of(&j, r, &b, &e);
        int64_t stall = atomic_exchange(&stall_ns, 0);
        if (stall) {
            struct timespec ts = {stall / 1000000000, stall % 1000000000};
            nanosleep(&ts, NULL);
        }
        j.fn(j.ctx, b, e);
        expect = STATE(id, HELPER);
        if (atomic_compare_exchange_strong(&st[r], &expect, STATE(id, DONE)))
            atomic_fetch_add(&helped, 1);
    }
    atomic_store(&inside, 0);
}

static void *helper_main(void *arg)
{
    (void)arg;
    /* SCHED_IDLE is set by the thread itself (pthread attributes take only the real-time
     * policies and SCHED_OTHER); a helper that cannot have it does not run at all. */
    struct sched_param param = {0};
    if (sched_setscheduler(0, SCHED_IDLE, &param)) {
        atomic_store(&ready, -errno);
        return NULL;
    }
    atomic_store(&ready, 1);
    uint64_t done = 0;
    int64_t idle_since = now_ns();
    for (;;) {
        uint32_t gen = atomic_load(&generation);
        uint64_t id = atomic_load(&live);
        if (id && id != done) {
            help(id);
            done = id;
            idle_since = now_ns();
            continue;
        }
        if (now_ns() - idle_since < SPIN_NS) {
            for (int k = 0; k < 16; k++)
                PAUSE();
            continue;
        }
        atomic_store(&sleeping, 1);
        id = atomic_load(&live);
        if (!id || id == done)   /* a job published after `gen` was read changed it */
            syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
        atomic_store(&sleeping, 0);
        idle_since = now_ns();
    }
    return NULL;
}

/* Runs range r of the current job on the caller's thread if it can take it from `from`;
 * whether it did. */
static int take(const struct job *j, const void *ctx, int64_t r, uint64_t from)
{
    state_word *st = atomic_load(&states);
    if (!atomic_compare_exchange_strong(&st[r], &from, STATE(j->id, CALLER)))
        return 0;
    int64_t b, e;
    range_of(j, r, &b, &e);
    j->fn(ctx, b, e);
    return 1;
}

static void run(pool_task fn, const void *ctx, const void *helper_ctx, size_t helper_ctx_bytes,
                int64_t n, int64_t grain, pool_copy copy)
{
    grain = grain < 1 ? 1 : grain;
    int64_t ranges = (n + grain - 1) / grain;
    if (!atomic_load(&started) || ranges < 2 || helper_ctx_bytes > POOL_CTX_MAX ||
        grow_states(ranges)) {
        fn(ctx, 0, n);
        return;
    }
    uint64_t id = ++last_id;
    atomic_fetch_add(&seq, 1);                      /* odd: being written */
    desc.id = id;
    desc.fn = fn;
    desc.n = n;
    desc.grain = grain;
    desc.ranges = ranges;
    memcpy(desc.ctx, helper_ctx, helper_ctx_bytes);
    atomic_fetch_add(&seq, 1);                      /* even: whole */
    state_word *st = atomic_load(&states);
    for (int64_t r = 0; r < ranges; r++)
        atomic_store_explicit(&st[r], STATE(id, FREE), memory_order_relaxed);
    atomic_store(&next, 0);
    atomic_store(&live, id);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleeping))
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);

    struct job *j = &desc;     /* only this thread writes it */
    int64_t t0 = now_ns(), mine = 0;
    for (;;) {
        int64_t r = atomic_fetch_add(&next, 1);
        if (r >= ranges)
            break;
        mine += take(j, ctx, r, STATE(id, FREE));
    }
    atomic_store(&live, 0);    /* the helper claims no more */
    int64_t deadline = 0, waited_from = 0;
    for (int64_t r = 0; r < ranges; r++) {
        for (;;) {
            uint64_t s = atomic_load(&st[r]);
            if (s == STATE(id, CALLER))
                break;
            if (s == STATE(id, FREE)) {       /* handed to the helper, not yet claimed */
                if (take(j, ctx, r, s))
                    break;
                continue;
            }
            if (s == STATE(id, DONE)) {
                int64_t b, e;
                range_of(j, r, &b, &e);
                copy(ctx, helper_ctx, b, e);
                break;
            }
            /* HELPER: it is running it; wait a little, then take it back */
            int64_t t = now_ns();
            if (!deadline) {
                waited_from = t;
                deadline = t + 2 * (t - t0) / (mine ? mine : 1) + GRACE_NS;
            }
            if (t < deadline) {
                PAUSE();
                continue;
            }
            if (take(j, ctx, r, s)) {
                atomic_fetch_add(&taken_back, 1);
                break;
            }
        }
    }
    if (waited_from)
        atomic_fetch_add(&waited_ns, now_ns() - waited_from);
}

static const struct pool_api api = {stage, run};

/* The interface kernels take (pool.h). */
const struct pool_api *pool_api(void) { return &api; }

/* Start the helper on `cpu` under SCHED_IDLE (once; later calls return 0 and change
 * nothing). 0 on success, else an errno value: then every job runs on its caller alone. */
int pool_start(int cpu)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&started, &expected, 1))
        return 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int err = pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    atomic_store(&ready, 0);
    if (!err)
        err = pthread_create(&helper, &attr, helper_main, NULL);
    pthread_attr_destroy(&attr);
    if (!err) {
        pthread_setname_np(helper, HELPER_NAME);
        pthread_detach(helper);
        while (!atomic_load(&ready))
            sched_yield();
        if (atomic_load(&ready) < 0)
            err = -atomic_load(&ready);
    }
    if (err)
        atomic_store(&started, 0);
    return err;
}

/* Waits until the helper runs no range of any job, before the memory such ranges read
 * (weights, the KV cache) is freed: a helper that lost its CPU mid-range is still running it
 * after the job's caller has returned. Meanwhile the helper may also run on the caller's
 * CPUs, so a CPU others keep busy cannot hold it back. 0 once it runs none, ETIMEDOUT if it
 * still did after timeout_ns. */
int pool_quiesce(int64_t timeout_ns)
{
    if (!atomic_load(&started) || !atomic_load(&inside))
        return 0;
    cpu_set_t own, wider;
    int widened = !pthread_getaffinity_np(helper, sizeof own, &own) &&
                  !sched_getaffinity(0, sizeof wider, &wider);
    if (widened) {
        CPU_OR(&wider, &wider, &own);
        widened = !pthread_setaffinity_np(helper, sizeof wider, &wider);
    }
    int64_t until = now_ns() + timeout_ns;
    int err = 0;
    while (atomic_load(&inside)) {
        if (now_ns() >= until) {
            err = ETIMEDOUT;
            break;
        }
        struct timespec ts = {0, 50000};   /* sleeping leaves the caller's CPU to the helper */
        nanosleep(&ts, NULL);
    }
    if (widened)
        pthread_setaffinity_np(helper, sizeof own, &own);
    return err;
}

/* The helper sleeps `ns` after claiming its next range, as if it had lost its CPU there:
 * for tests of what the caller then does. */
void pool_stall_next(int64_t ns) { atomic_store(&stall_ns, ns); }

/* What the helper did so far: ranges it ran, ranges the caller took back from it, and the
 * time callers spent waiting at the end of a job for its last range, in stats[0 .. 3). */
void pool_stats(int64_t *stats)
{
    stats[0] = atomic_load(&helped);
    stats[1] = atomic_load(&taken_back);
    stats[2] = atomic_load(&waited_ns);
}
