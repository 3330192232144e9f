/*
 * realloc.c: dm_realloc. The block follows the rules for its new size (a
 * growing array can move to the arena its new size selects). Same arena:
 * rallocx, which may resize in place. Another arena: allocate there, copy,
 * free here; never rallocx across arenas, which would free the old block into
 * the new arena's thread cache. NumPy calls this with or without the GIL. The
 * slot paths it shares with allocation are alloc.c's (dm__alloc_*).
 *
 * A big half's block keeps its colour (bigblock.c): it is resized as its
 * colour plus the new size from its start, which stays on a 2 MiB frame, and
 * its data stays at the same offset from that start.
 *
 * Thread safety: as alloc.c's paths: the calling thread's state, relaxed
 * counters, and the table it holds a reference to.
 */
#include <stdio.h>
#include <string.h>

#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/internal.h"

/* How far p is from the start of its block: its colour in a big half. */
static size_t colour_of(const void *p) {
    return (size_t)((const char *)p - (const char *)dm__block_of(dm__arena_owner_of(p), p));
}

/* realloc while bytes are counted per tag: a new block in the caller's
 * context, the bytes copied, the old block freed (its tags give its bytes
 * back). Never in place: the block may change tags. */
static __attribute__((noinline)) void *realloc_tallied(const dm_ctx_t *c, void *p, size_t size) {
    void *q = dm_alloc(c, size, DM_DT_UNKNOWN);
    if (!q)
        return NULL; /* the old block stays valid */
    size_t have = dm__block_usable(p) - colour_of(p);
    memcpy(q, p, have < size ? have : size);
    dm_free(p);
    return q;
}

/* A refusal by a limit during realloc: the rule is named, counted, logged. */
static void realloc_refused(dm__thread_t *t, const dm__dispatch_slot_t *s, int r) {
    t->limit_refused = false;
    snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s",
             r < t->table->policy->nrules ? t->table->policy->rules[r].name : "default");
    DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
    DM_CTR_ADD(t->rule_ctrs[r].nlimit, 1);
    dm__failure_log(&t->last_failure);
}

/* The block stays in its arena `ja`: rallocx, which may resize in place. A
 * tracked arena reserves what the block grows by first, and settles after. */
static void *realloc_same(dm__thread_t *t, const dm__dispatch_slot_t *s, int r,
                          dm__arena_je_t *ja, void *p, size_t size) {
    size_t n = size ? size : 1;
    n = (n + s->round) & ~s->round;
    bool fits = n >= size; /* the rounding did not wrap */
    int flags = s->flags;
    char *b = dm__block_of(ja, p);
    size_t c = (size_t)((char *)p - b);
    if (ja->is_big) { /* the block stays on a frame, its data at its colour */
        flags = dm__bigblock_flags(ja, flags);
        fits = fits && n + c >= n;
        n += c;
    }
    flags = (int)((unsigned)flags | (unsigned)MALLOCX_ARENA(ja->index));
    dm__arena_t *a = ja->owner;
    bool tracked = atomic_load_explicit(&a->tracked, memory_order_relaxed);
    size_t had = 0, grow = 0;
    char *q = NULL;
    if (!fits)
        n = 0;
    if (DM_UNLIKELY(tracked) && n != 0) {
        had = dmje_sallocx(b, 0);
        size_t want = dmje_nallocx(n, flags);
        grow = want > had ? want - had : 0;
        if (grow && !dm__alloc_live_reserve(t, a, grow, size)) {
            n = 0; /* refused: fails below, the old block stays */
            realloc_refused(t, s, r);
        }
    }
    if (n != 0)
        q = dmje_rallocx(b, n, (int)((unsigned)flags | dm__alloc_tcache_flags(t, ja)));
    if (DM_UNLIKELY(tracked) && n != 0) {
        if (!q) /* the old block stays as it was */
            atomic_fetch_sub_explicit(&a->live, grow, memory_order_relaxed);
        else /* settle: the count now holds had + grow; make it the new size */
            atomic_fetch_add_explicit(&a->live, (uint64_t)dmje_sallocx(q, 0) - had - grow,
                                      memory_order_relaxed);
    }
    return q ? q + c : NULL;
}

/* The block moves from `old` to the slot's arena: allocate there, copy, free
 * here. */
static void *realloc_move(dm__thread_t *t, const dm__dispatch_slot_t *s, int r,
                          dm__arena_je_t *old, void *p, size_t size) {
    void *q = dm__alloc_slot(t, s, size);
    if (q) {
        char *b = dm__block_of(old, p);
        size_t have = dmje_sallocx(b, 0) - (size_t)((char *)p - b);
        memcpy(q, p, have < size ? have : size);
        DM_CTR_ADD(t->ctrs[old->owner->id].nfree, 1);
        DM_CTR_ADD(t->ctrs[s->arena_id].nalloc, 1);
        dm__alloc_untrack(old, b);
        dmje_dallocx(b, (int)dm__alloc_tcache_flags(t, old));
    } else if (t->limit_refused) {
        realloc_refused(t, s, r);
    }
    return q;
}

void *dm_realloc(const dm_ctx_t *c, void *p, size_t size) {
    if (!p)
        return dm_alloc(c, size, DM_DT_UNKNOWN);
    dm__arena_je_t *old = dm__arena_owner_of(p);
    if (DM_UNLIKELY(!old))
        return NULL;
    dm__bcache_tag_drop(p); /* the block leaves the cached path: resized, moved or freed */
    dm__thread_t *t = dm__alloc_thread();
    int r;
    const dm__dispatch_slot_t *s = dm__alloc_route(t, c, size, DM_DT_UNKNOWN, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_UNLIKELY(t->table->tally)) /* the bound table: route() holds a reference */
        return realloc_tallied(c, p, size);
    dm__arena_je_t *ja = dm__alloc_slot_je(s);
    dm__arena_je_t *big = ja ? atomic_load_explicit(&ja->big, memory_order_acquire) : NULL;
    if (big && old == big)
        ja = old; /* a big block stays in the big half, resized in place if it can */
    /* A block growing to 4 MiB or more moves from the small half to the big
     * one, where the arena's other big blocks are and where its free can be
     * reused. pandas' hash tables grow their vectors by realloc (1 -> 4 -> 16
     * -> 64 MiB); left in the small half, such blocks are served by nothing
     * once freed, while the big half grows for the next big arrays (1.10x
     * NumPy's default peak RSS on pandas3_etl, bench/results/issue28.md). */
    size_t rounded = ((size ? size : 1) + s->round) & ~s->round;
    bool up = big && ja == old && rounded >= DM_BIG_THP_MIN;
    DM_TSAN_RELEASE();
    DM_TSAN_ACQUIRE();
    void *q = ja == old && !up ? realloc_same(t, s, r, ja, p, size)
                               : realloc_move(t, s, r, old, p, size);
    if (DM_UNLIKELY(!q)) {
        DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
        DM_CTR_ADD(t->rule_ctrs[r].nfail, 1);
        return NULL; /* the old block stays valid, as realloc promises */
    }
    DM_CTR_ADD(t->ctrs[s->arena_id].nrealloc, 1);
    DM_CTR_ADD(t->ctrs[s->arena_id].bytes, size);
    DM_CTR_ADD(t->rule_ctrs[r].nrealloc, 1);
    DM_CTR_ADD(t->rule_ctrs[r].bytes, size);
    return q;
}
