/* The allocator's two bulk operations on a pool's page bitmap, in one pass each.
 *
 * page_bitmap.py loads this through ctypes and keeps a numpy version of both
 * with the same results (the fallback without a C compiler, and the check the
 * tests hold this one to). Each numpy version is some fifteen array calls on a
 * few hundred pages; their dispatch, not the work, was most of an eviction's
 * time on the scheduler's loop.
 *
 * `used` is one pool's bitmap (one byte per page, `npages` of them: every
 * block's row of `ppb` pages); `block_used` counts the used pages of every
 * arena block (shared by the pools: a block belongs to one at a time).
 */
#include <stdint.h>

/* One pool's arrays, set up once (page_bitmap.NativePageRows): a call passes its
 * address and a count, since ctypes spends ~0.07 us on each argument. */
typedef struct {
    uint8_t *used;
    int64_t npages;
    int64_t *block_used;
    int64_t *scratch;
    int64_t ppb;
    int64_t *pages; /* pages in (release) or out (take) */
    int64_t *out;   /* release's triples */
    int64_t *plan;  /* take's (block, count) pairs */
} rm_rows;

enum { RELEASE_OUT_OF_RANGE = -1, RELEASE_NOT_IN_USE = -2, RELEASE_DUPLICATE = -3 };

/* Clears the first `n` of `r->pages` in `r->used` and takes them off their
 * blocks' counts.
 *
 * All or nothing: on an error nothing has changed (a page outside the bitmap,
 * one not in use -- a double free or another pool's -- or one listed twice).
 * `scratch` is one zeroed int64 per block and is left zeroed. `out` gets one
 * triple per block touched, ascending by block: block, pages freed there,
 * pages still used there. Returns how many blocks were touched, or an error
 * (which one, where several apply, is not specified).
 */
int64_t rm_release(const rm_rows *r, int64_t n) {
    uint8_t *used = r->used;
    int64_t *block_used = r->block_used, *scratch = r->scratch, *out = r->out;
    const int64_t *pages = r->pages, npages = r->npages, ppb = r->ppb;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = pages[i];
        if (p < 0 || p >= npages) return RELEASE_OUT_OF_RANGE;
        if (!used[p]) return RELEASE_NOT_IN_USE;
    }
    int64_t touched = 0, b = 0, lo = 0, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = pages[i];
        if (!used[p]) { /* every page was in use a moment ago: listed twice */
            for (int64_t j = 0; j < i; j++) used[pages[j]] = 1;
            for (int64_t t = 0; t < touched; t++) scratch[out[3 * t]] = 0;
            return RELEASE_DUPLICATE;
        }
        used[p] = 0;
        if (p < lo || p >= hi) { /* pages come in runs: divide once per run */
            b = p / ppb;
            lo = b * ppb;
            hi = lo + ppb;
            if (scratch[b] == 0) out[3 * touched++] = b;
        }
        scratch[b]++;
    }
    /* Ascending, as the numpy version gives them (a handful: insertion sort). */
    for (int64_t t = 1; t < touched; t++) {
        int64_t b = out[3 * t], s = t;
        for (; s > 0 && out[3 * (s - 1)] > b; s--) out[3 * s] = out[3 * (s - 1)];
        out[3 * s] = b;
    }
    for (int64_t t = 0; t < touched; t++) {
        int64_t b = out[3 * t];
        block_used[b] -= scratch[b];
        out[3 * t + 1] = scratch[b];
        out[3 * t + 2] = block_used[b];
        scratch[b] = 0;
    }
    return touched;
}

/* Takes the lowest free pages of blocks: `r->plan` holds `nblocks` pairs
 * (block, pages to take there). Writes the page ids, ascending within each
 * block, to `r->pages`, marks them used and adds them to their blocks' counts.
 * Returns how many pages it wrote: fewer than asked only if a block's row had
 * fewer free pages than its count said (the caller treats that as corrupt
 * bookkeeping).
 */
int64_t rm_take(const rm_rows *r, int64_t nblocks) {
    uint8_t *used = r->used;
    int64_t *block_used = r->block_used, *out = r->pages;
    const int64_t *plan = r->plan, ppb = r->ppb;
    int64_t written = 0;
    for (int64_t k = 0; k < nblocks; k++) {
        int64_t b = plan[2 * k], want = plan[2 * k + 1], got = 0;
        uint8_t *row = used + b * ppb;
        for (int64_t i = 0; i < ppb && got < want; i++) {
            if (!row[i]) {
                row[i] = 1;
                out[written++] = b * ppb + i;
                got++;
            }
        }
        block_used[b] += got;
        if (got < want) return written;
    }
    return written;
}

