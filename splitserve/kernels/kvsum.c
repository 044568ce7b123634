/* The checksum of a KV block (kv/checksums.py), alone or while copying the block:
 *   kv_sum       the block's sum                                (CTX: a lease's blocks)
 *   kv_copy_sum  copies src into dst and returns src's sum       (GEN: a received frame)
 *
 * The sum is a Fletcher sum in sixteen lanes. The block, zero-padded to a multiple of 64
 * bytes, is read as steps of sixteen little-endian 32-bit words; word l of each step goes
 * to lane l, whose two 64-bit accumulators take A += word, B += A (mod 2^64). At the end
 * the block's length and the 32 accumulators are folded into 64 bits, one after the other,
 * through MurmurHash3's 64-bit finalizer (a bijection): h = fmix(h ^ acc).
 *
 * Per 64 bytes that is a mask, a shift and four vector additions, no multiplication, and
 * the same code is AVX-512, AVX2 or SSE2 code by -march: every target gives the same sums.
 * kv_copy_sum copies CHUNK bytes with libc's memcpy, then sums them out of L1 from the
 * copy, so the block crosses memory once and the sum hides in the copy's memory time.
 * What the sum detects is in docs/tuning.md ("KV block checksums").
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define STEP 64          /* bytes: sixteen words, one per lane */
#if defined(__AVX512F__)
#define VB 64
#elif defined(__AVX2__)
#define VB 32
#else
#define VB 16
#endif
#define NV (STEP / VB)   /* vectors of a step */
#define CHUNK 8192       /* bytes copied before they are summed, from L1 */

typedef uint64_t vq __attribute__((vector_size(VB)));

static inline uint64_t fmix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

/* The accumulators: 64-bit word j of a step holds lane 2j (its low half) and lane 2j + 1
 * (its high half); lo[v][e] is lane 2j's for j = v * VB / 8 + e, hi[v][e] lane 2j + 1's. */
typedef struct {
    vq alo[NV], ahi[NV], blo[NV], bhi[NV];
} acc;

/* One step: the 64 bytes at src into the accumulators. */
static inline void step(const uint8_t *src, acc *s) {
    for (int v = 0; v < NV; v++) {
        vq w;
        memcpy(&w, src + v * VB, VB);
        s->alo[v] += w & 0xffffffffu;
        s->ahi[v] += w >> 32;
        s->blo[v] += s->alo[v];
        s->bhi[v] += s->ahi[v];
    }
}

static uint64_t sum(uint8_t *restrict dst, const uint8_t *restrict src, size_t n) {
    acc s = {0};
    size_t whole = n / STEP * STEP;
    if (dst) {   /* libc's copy a chunk at a time, then the chunk's sum out of L1 */
        for (size_t c = 0; c < whole; c += CHUNK) {
            size_t end = c + CHUNK < whole ? c + CHUNK : whole;
            memcpy(dst + c, src + c, end - c);
            for (size_t i = c; i < end; i += STEP) step(dst + i, &s);
        }
    } else {
        for (size_t i = 0; i < whole; i += STEP) step(src + i, &s);
    }
    if (whole < n) {   /* the last, partial step: zero-padded */
        uint8_t last[STEP] = {0};
        memcpy(last, src + whole, n - whole);
        if (dst) memcpy(dst + whole, last, n - whole);
        step(last, &s);
    }
    uint64_t h = fmix(n);
    for (int j = 0; j < STEP / 8; j++)   /* lanes 0..15: the A accumulators, then the B */
        h = fmix(fmix(h ^ s.alo[j / (VB / 8)][j % (VB / 8)]) ^ s.ahi[j / (VB / 8)][j % (VB / 8)]);
    for (int j = 0; j < STEP / 8; j++)
        h = fmix(fmix(h ^ s.blo[j / (VB / 8)][j % (VB / 8)]) ^ s.bhi[j / (VB / 8)][j % (VB / 8)]);
    return h;
}

uint64_t kv_sum(const uint8_t *src, size_t n) { return sum(NULL, src, n); }

uint64_t kv_copy_sum(uint8_t *restrict dst, const uint8_t *restrict src, size_t n) {
    return sum(dst, src, n);
}
