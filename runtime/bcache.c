/*
 * bcache.c: the block cache's state and its slow operations (bcache.h says
 * what the cache is): the global tag table, each class's bin capacity, a
 * thread's flush, and learning which size classes a bound view sends wholly to
 * one arena. The pops, pushes and tag stores themselves are the fast path's,
 * inlined in alloc.c.
 *
 * Thread safety: the tag words are relaxed atomics any thread reads and
 * writes; the capacities are written once at init (before any allocation);
 * a thread's bins and memo are its own (stats read the bin counts relaxed).
 */
#include "runtime/bcache.h"

#include "runtime/alloc.h"
#include "runtime/thread.h"

_Atomic uint64_t dm__bcache_tags[1u << DM_BCACHE_TAG_BITS];
uint8_t dm__bcache_cap[DM_SC_COUNT];

void dm__bcache_init(void) {
    for (unsigned k = 0; k < DM_SC_COUNT; k++) {
        size_t fit = DM_BCACHE_CLASS_BYTES / dm_sc_size(k);
        dm__bcache_cap[k] =
            (uint8_t)(fit < 1 ? 1 : fit > DM_BCACHE_SLOTS ? DM_BCACHE_SLOTS : fit);
    }
}

int dm__bcache_tag_class(const void *p) {
    uint64_t v = atomic_load_explicit(dm__bcache_tag_word((uintptr_t)p), memory_order_relaxed);
    return p && (v & DM_BCACHE_TAG_PMASK) == (uintptr_t)p
               ? (int)((v >> DM_BCACHE_TAG_CLASS_SHIFT) & 63u)
               : -1;
}

/* Each block leaves the count before it is freed, as a pop does: a fork that
 * copies this thread mid-flush leaves the child a bin whose every counted
 * block is still unfreed, which the child then frees itself
 * (thread.c, dm__thread_fork_release). */
void dm__bcache_flush(dm__thread_t *t) {
    DM_TSAN_RELEASE();
    for (unsigned k = 0; k < DM_SC_COUNT; k++) {
        dm__bcache_bin_t *b = &t->bins[k];
        for (uint32_t n = dm__bcache_count(b); n; n--) {
            void *p = b->items[n - 1];
            dm__bcache_set_count(b, n - 1);
            dmje_dallocx(p, MALLOCX_TCACHE_NONE);
        }
        b->tag = 0;
    }
}

/* When every request size of class k falls in one interval of the view (no
 * rule boundary splits it, and no rule uses dtype) and that interval's arena
 * has one jemalloc arena and alignment <= 64, the class is CACHED (or
 * CACHED_TALLY while bytes are counted per tag), with everything the fast path
 * needs precomputed: the rule, the arena, and the bin of the class its blocks
 * have once rounded to the alignment. Otherwise SLOW. */
void dm__bcache_learn(dm__thread_t *t, unsigned k) {
    dm__bcache_memo_t *m = &t->memo[k];
    const dm_view_t *v = t->view;
    size_t lo = k ? dm_sc_size(k - 1) + 1 : 1, hi = dm_sc_size(k);
    m->state = DM_MEMO_SLOW;
    if (v->dt_mask != 0)
        return;
    uint32_t row = dm_view_interval(v, lo);
    if (row != dm_view_interval(v, hi))
        return;
    int r = v->slots[row * v->row_width];
    const dm__dispatch_slot_t *s = &t->table->slots[r];
    unsigned bin = dm_sc_index(dm__slot_size(s, hi));
    if (!s->je || s->flags != 0 || s->tracked || bin != dm_sc_index(dm__slot_size(s, lo)))
        return;
    m->bin = &t->bins[bin];
    m->tag = (uint32_t)s->je->slot + 1;
    m->tag_bits = (uint64_t)bin << DM_BCACHE_TAG_CLASS_SHIFT |
                  (uint64_t)m->tag << DM_BCACHE_TAG_ARENA_SHIFT;
    m->arena_ctrs = &t->ctrs[s->arena_id];
    m->rule_ctrs = &t->rule_ctrs[r];
    m->rule = (uint16_t)r;
    m->cls = (uint8_t)bin;
    m->state = t->table->tally ? DM_MEMO_CACHED_TALLY : DM_MEMO_CACHED;
}
