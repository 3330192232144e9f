/*
 * alloc.c: the allocation paths: the fast path, the block cache's pops and
 * pushes, the general (routed) path, limits and per-tag tallies, big blocks,
 * call-site rules, free and realloc (refusals: refusal.c). Everything the fast path (dm_alloc,
 * dm_free_hint: alloc_impl, free_impl) inlines lives in this one file, so the
 * compiler sees it whole; the block cache's state and slow operations are in
 * bcache.c (bcache.h), binding in thread.c.
 *
 * Fast path (sizes up to 256 KiB whose class the thread's view sends wholly to
 * one arena): an acquire-load of the table in force (dispatch.c), pointer
 * compares, a memo read, a pop from the thread's block cache (or one jemalloc
 * call), a tag store and relaxed per-thread counter adds. General path: the
 * same checks, a view lookup (binary search over size bounds), a slot read and
 * one jemalloc call with the thread's cache for that arena. Only when the
 * table or the context changed does a thread bind (thread.c), under
 * dm__mem_mu. Neither path takes a lock, logs, allocates outside jemalloc
 * or touches Python; refusals by a limit log at most one line a second.
 *
 * Free never consults the policy: a block's tag (cached path) or its address's
 * segment (otherwise) names its arena.
 *
 * Thread safety: every path runs on any thread, with or without the GIL; a
 * thread writes only its own state and relaxed counters, and reads the table
 * it holds a reference to.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/alloc.h"
#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/context.h"
#include "runtime/dispatch.h"
#include "runtime/libcheap.h"
#include "runtime/mem.h"
#include "runtime/os.h"
#include "runtime/refusal.h"
#include "runtime/spill.h"
#include "runtime/tally.h"
#include "runtime/thread.h"

#if defined(__SANITIZE_THREAD__)
char dm__alloc_tsan_sync; /* alloc.h, DM_TSAN_ACQUIRE */
#endif

static _Atomic uint64_t foreign_frees; /* frees of blocks that are not ours */

uint64_t dm__alloc_foreign_frees(void) {
    return atomic_load_explicit(&foreign_frees, memory_order_relaxed);
}

/* ---- the calling thread ----------------------------------------------------- */

/* The calling thread's state. We are dlopen'ed, so dm__thread_self is
 * global-dynamic and every &dm__thread_self is a call (a TLS descriptor here,
 * -mtls-dialect=gnu2; otherwise __tls_get_addr); GCC rematerializes it after
 * each call rather than keep it in a register (with __tls_get_addr: 5 calls per
 * malloc+free, 55 instructions; bench/callgrind.sh). The empty asm hides where
 * the pointer came from, so it is computed once per entry point and passed
 * down. */
static inline dm__thread_t *tls_self(void) {
    dm__thread_t *t = &dm__thread_self;
    __asm__("" : "+r"(t));
    return t;
}

/* The same, through the initial-exec anchor (tls_anchor.c): one load. */
extern __thread void *datamem_tls_anchor __attribute__((tls_model("initial-exec")));

static __attribute__((noinline)) dm__thread_t *tls_anchor_set(void) {
    dm__thread_t *t = tls_self();
    datamem_tls_anchor = t;
    return t;
}

static inline dm__thread_t *tls_fast(void) {
    dm__thread_t *t = datamem_tls_anchor;
    return DM_LIKELY(t != NULL) ? t : tls_anchor_set();
}

/* ---- explicit jemalloc caches --------------------------------------------- */

/* The flags that select the calling thread's explicit cache for `ja`. */
static __attribute__((noinline)) unsigned tcache_slow(dm__thread_t *t, dm__arena_je_t *ja) {
    if (ja->is_big) /* its blocks are all past jemalloc's cache sizes: none */
        return t->tcache[ja->slot] = (unsigned)MALLOCX_TCACHE_NONE;
    if (t->exiting)
        return (unsigned)MALLOCX_TCACHE_NONE;
    pthread_mutex_lock(&dm__mem_mu);
    dm__thread_register(t);
    pthread_mutex_unlock(&dm__mem_mu);
    unsigned tc = dm__arena_tcache_create();
    /* Out of explicit caches (jemalloc has 4096): correct but uncached. */
    t->tcache[ja->slot] = tc ? (unsigned)MALLOCX_TCACHE(tc - 1)
                             : (unsigned)MALLOCX_TCACHE_NONE;
    return t->tcache[ja->slot];
}

static inline unsigned tcache_flags(dm__thread_t *t, dm__arena_je_t *ja) {
    unsigned f = t->tcache[ja->slot];
    return DM_LIKELY(f != 0) ? f : tcache_slow(t, ja);
}


/* ---- serving a slot -------------------------------------------------------- */

static inline dm__arena_je_t *slot_je(const dm__dispatch_slot_t *s) {
    return DM_LIKELY(s->je != NULL) ? s->je
                                    : dm__arena_je_for_node(s->arena, dm__os_current_node());
}

static void *slot_alloc_tracked(dm__thread_t *t, const dm__dispatch_slot_t *s, size_t size,
                                int zero);

/* Where a block of n >= DM_BIG_THP_MIN bytes goes: ja's big half if it has one
 * (arena.c, "Big halves"). */
static inline dm__arena_je_t *big_half(dm__arena_je_t *ja) {
    dm__arena_je_t *big = atomic_load_explicit(&ja->big, memory_order_acquire);
    return big ? big : ja;
}

static inline void *je_alloc_flags(dm__thread_t *t, int flags, dm__arena_je_t *ja, size_t n,
                                   int zero) {
    DM_TSAN_ACQUIRE();
    if (ja == t->auto_je && flags == 0) /* the thread's bound arena */
        return zero ? dmje_mallocx(n, MALLOCX_ZERO) : dmje_malloc(n);
    return dmje_mallocx(n, (int)((unsigned)flags | (unsigned)zero |
                                 (unsigned)MALLOCX_ARENA(ja->index) | tcache_flags(t, ja)));
}

/* A block below DM_BIG_THP_MIN from `ja`; past jemalloc's small classes the
 * arena's growth check follows (arena.c). */
static inline __attribute__((always_inline)) void *
small_block(dm__thread_t *t, const dm__dispatch_slot_t *s, dm__arena_je_t *ja, size_t n,
            int zero) {
    void *p = je_alloc_flags(t, s->flags, ja, n, zero);
    if (n > DM_SC_MAX)
        dm__arena_check_growth(ja);
    return p;
}

/* A big block of n bytes fresh from jemalloc, handed out at colour c (n + c
 * asked for, with big-block flags): the kept blocks' frames lent to it, its
 * pages past n trimmed (bigblock.c, "Lending", "Trimming"), the growth
 * check, and a spill arena's resident bound kept before anyone writes. */
static void *big_fresh(dm__thread_t *t, dm__arena_je_t *ja, int flags, size_t n, size_t c,
                       int zero, dm__donors_t *d) {
    char *p = je_alloc_flags(t, flags, ja, n + c, zero);
    bool lends = d && d->n;
    if (lends)
        dm__bigblock_lend(ja, p, n + c, d);
    if (!p && lends) /* the donors went back to jemalloc, which may use them */
        p = je_alloc_flags(t, flags, ja, n + c, zero);
    if (!p)
        return NULL;
    dm__bigblock_fresh(ja, p, n + c);
    dm__arena_check_growth(ja);
    if (DM_UNLIKELY(ja->spill != NULL))
        dm__spill_catch_up(ja->spill, n);
    return p + c;
}

/* n >= 4 MiB, untracked: a kept block of its size at the colour it had
 * (bigblock.c, "Reuse"), else a fresh one at a new colour ("Lending"). */
static __attribute__((noinline)) void *slot_alloc_big(dm__thread_t *t, const dm__dispatch_slot_t *s,
                                                      dm__arena_je_t *ja, size_t n, int zero) {
    int flags = dm__bigblock_flags(ja, s->flags);
    size_t c;
    dm__donors_t donors, *d = zero ? NULL : &donors; /* a calloc's pages must read zero */
    char *p = dm__bigblock_take(ja, n, flags, s->flags, &c, d);
    if (!p)
        return big_fresh(t, ja, flags, n, dm__bigblock_colour(ja, n, s->flags, flags), zero, d);
    if (DM_UNLIKELY(ja->spill != NULL)) /* resident_max, before anyone writes */
        dm__spill_catch_up(ja->spill, n);
    if (zero)
        memset(p + c, 0, n);
    return p + c;
}

static inline __attribute__((always_inline)) void *
slot_alloc(dm__thread_t *t, const dm__dispatch_slot_t *s, size_t size, int zero) {
    if (DM_UNLIKELY(s->tracked))
        return slot_alloc_tracked(t, s, size, zero);
    size_t n = dm__slot_size(s, size);
    if (DM_UNLIKELY(n == 0))
        return NULL;
    dm__arena_je_t *ja = slot_je(s);
    if (DM_UNLIKELY(!ja))
        return NULL;
    if (DM_UNLIKELY(n >= DM_BIG_THP_MIN))
        return slot_alloc_big(t, s, big_half(ja), n, zero);
    return small_block(t, s, ja, n, zero);
}

/* Adds `usable` bytes to a tracked arena's live count unless that would pass
 * its limit; then the refusal is recorded for the thread (dm_runtime_last_failure;
 * the caller's caller names the rule) and nothing changes. */
static bool live_reserve(dm__thread_t *t, dm__arena_t *a, size_t usable, size_t request) {
    size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
    /* A compare-and-swap, not add-then-undo: the count itself never passes the
     * limit, not even for an instant (stats read it while threads race). */
    uint64_t before = atomic_load_explicit(&a->live, memory_order_relaxed);
    while (before + usable <= limit && before + usable >= before)
        if (atomic_compare_exchange_weak_explicit(&a->live, &before, before + usable,
                                                  memory_order_relaxed, memory_order_relaxed))
            return true;
    dm_failure_t *f = &t->last_failure;
    f->seq++;
    f->kind = DM_REFUSED_ARENA;
    f->tag[0] = 0;
    memcpy(f->arena, a->name, sizeof(f->arena));
    f->rule[0] = 0;
    f->request = request;
    f->limit = limit;
    f->live = before;
    f->fallback_tried = false;
    t->limit_refused = true;
    return false;
}

/* An arena with a limit (`s->tracked`): the block's usable size is added to
 * the arena's live bytes (a compare-and-swap that refuses to pass the limit)
 * *before* it is allocated, then it is allocated as an untracked one is (no
 * kept big blocks: a tracked arena keeps none), and the reservation is taken
 * back if that fails, so concurrent threads can never take the arena past its
 * limit. Frees (free_slow) subtract the same usable size. No block cache: its
 * blocks are never tagged. */
static __attribute__((noinline)) void *slot_alloc_tracked(dm__thread_t *t,
                                                          const dm__dispatch_slot_t *s,
                                                          size_t size, int zero) {
    size_t n = dm__slot_size(s, size);
    dm__arena_je_t *ja = n ? slot_je(s) : NULL;
    if (DM_UNLIKELY(!ja))
        return NULL;
    bool big = n >= DM_BIG_THP_MIN;
    int flags = s->flags;
    size_t c = 0; /* a big block's colour (bigblock.c) */
    if (big) {
        ja = big_half(ja);
        flags = dm__bigblock_flags(ja, flags);
        c = dm__bigblock_colour(ja, n, s->flags, flags);
    }
    size_t usable = dmje_nallocx(n + c, (int)((unsigned)flags | MALLOCX_ARENA(ja->index)));
    if (DM_UNLIKELY(usable == 0) || !live_reserve(t, s->arena, usable, size))
        return NULL;
    void *p = big ? big_fresh(t, ja, flags, n, c, zero, NULL) : small_block(t, s, ja, n, zero);
    if (DM_UNLIKELY(!p))
        atomic_fetch_sub_explicit(&s->arena->live, usable, memory_order_relaxed);
    return p;
}

/* A tracked arena's block goes: its usable size leaves the arena's count. */
static __attribute__((noinline)) void untrack_slow(dm__arena_je_t *ja, const void *p) {
    atomic_fetch_sub_explicit(&ja->owner->live, dmje_sallocx(p, 0), memory_order_relaxed);
}

static inline void untrack(dm__arena_je_t *ja, const void *p) {
    if (DM_UNLIKELY(atomic_load_explicit(&ja->tracked, memory_order_relaxed)))
        untrack_slow(ja, p);
}

/* Returns the slot for (size, dt) in the caller's context, binding if needed. */
static inline const dm__dispatch_slot_t *route(dm__thread_t *t, const dm_ctx_t *c, size_t size,
                                     int dt, int *rule) {
    dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_acquire);
    if (DM_UNLIKELY(t->table != tab || t->ctx != c) && !dm__thread_bind(t, c))
        return NULL;
    int r = dm_view_lookup(t->view, size, dt);
    *rule = r;
    return &t->table->slots[r];
}

/* Slot `s` (rule `r`) failed: refusal.c counts it and names the fallback,
 * which is tried here. */
static __attribute__((noinline, cold)) void *failed(dm__thread_t *t, const dm__dispatch_slot_t *s,
                                                    int r, size_t size, int zero) {
    dm__refusal_t why;
    const dm__dispatch_slot_t *f = dm__refusal_failed(t, s, r, &why);
    return f ? dm__refusal_fallback(t, r, &why, slot_alloc(t, f, size, zero)) : NULL;
}

/* A tag's or the worker limit's refusal: the spill arena it names serves the
 * block, else refusal.c records the refusal (NULL). */
static __attribute__((noinline, cold)) void *refused(dm__thread_t *t, const dm__dispatch_slot_t *s,
                                                     int r, size_t size, int zero) {
    const dm__dispatch_slot_t *sp = dm__refusal_spill_target(t);
    void *p = sp ? dm__refusal_spilled(t, sp, r, slot_alloc(t, sp, size, zero)) : NULL;
    return p ? p : dm__refusal_tallied(t, s, r);
}

/* Serves slot `s` (rule `r`) and counts it; a failure goes to refusal.c. */
static inline __attribute__((always_inline)) void *
alloc_counted(dm__thread_t *t, const dm__dispatch_slot_t *s, int r, size_t size, int dt, int zero) {
    void *p = slot_alloc(t, s, size, zero);
    if (DM_UNLIKELY(!p))
        return failed(t, s, r, size, zero);
    dm__ctrs_t *ac = &t->ctrs[s->arena_id], *rc = &t->rule_ctrs[r];
    DM_CTR_ADD(ac->nalloc, 1);
    DM_CTR_ADD(ac->bytes, size);
    DM_CTR_ADD(ac->ndtype_known, dt != DM_DT_UNKNOWN);
    DM_CTR_ADD(rc->nalloc, 1);
    DM_CTR_ADD(rc->bytes, size);
    DM_CTR_ADD(rc->ndtype_known, dt != DM_DT_UNKNOWN);
    return p;
}

/* Bytes per tag are counted (tally.c): the block's usable size is reserved
 * against the worker limit and its context's tags, then allocated as
 * alloc_counted does, then recorded for its free. A refusal fails the
 * allocation (no fallback: another arena would not change the tag's bytes).
 * Sizes the block cache serves take bcache_tallied instead once learnt. */
static __attribute__((noinline)) void *alloc_tallied(dm__thread_t *t, const dm_ctx_t *c,
                                                     const dm__dispatch_slot_t *s, int r,
                                                     size_t size, int dt, int zero) {
    const dm_ctx_t *cx = c ? c : &dm__context_root;
    size_t n = dm__slot_size(s, size);
    if (DM_UNLIKELY(n == 0))
        return alloc_counted(t, s, r, size, dt, zero); /* fails as it would untallied */
    /* The usable size: jemalloc's class, from our table when no alignment
     * flag changes it (sizeclass.h), else jemalloc's answer. */
    bool small = s->flags == 0 && n <= DM_SC_MAX;
    uint64_t est = small ? dm_sc_size(dm_sc_index(n)) : dmje_nallocx(n, s->flags);
    if (DM_UNLIKELY(est == 0))
        return alloc_counted(t, s, r, size, dt, zero);
    if (DM_UNLIKELY(!dm__tally_reserve(cx, est, size, &t->refusal)))
        return refused(t, s, r, size, zero);
    void *p = alloc_counted(t, s, r, size, dt, zero);
    if (DM_UNLIKELY(!p)) {
        dm__tally_unreserve(cx, est);
        return NULL;
    }
    /* the block's size is the one reserved unless the fallback arena served it */
    dm__arena_je_t *owner = dm__mem_owner_of(p);
    dm__tally_record(cx, p, est, small && owner && owner->owner == s->arena);
    return p;
}

static __attribute__((noinline)) void *alloc_slow(dm__thread_t *t, const dm_ctx_t *c, size_t size,
                                                  int dt, int zero) {
    int r;
    const dm__dispatch_slot_t *s = route(t, c, size, dt, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (size - 1 < DM_SC_MAX) { /* the cached path, next time */
        unsigned k = dm_sc_index(size);
        if (t->memo[k].state == DM_MEMO_UNKNOWN)
            dm__bcache_learn(t, k);
    }
    if (DM_UNLIKELY(t->table->tally))
        return alloc_tallied(t, c, s, r, size, dt, zero);
    return alloc_counted(t, s, r, size, dt, zero);
}

/* A call site whose module/function matches some site rule (mask != 0): the
 * view's answer, then the first earlier site rule that matches size and dtype
 * (dm_table_site_pick). Never the block cache's memo, which knows sizes only.
 * The mask was computed against the table of install number `gen`; after a
 * reload its bits mean other rules, so it is dropped (the allocation is routed
 * as if its site were unknown, once, until the caller's cache catches up). */
static __attribute__((noinline)) void *alloc_site(dm__thread_t *t, const dm_ctx_t *c, size_t size,
                                                  int dt, uint64_t mask, uint64_t gen, int zero) {
    int r;
    const dm__dispatch_slot_t *s = route(t, c, size, dt, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_LIKELY(t->table->seq == gen)) {
        r = dm_table_site_pick(t->table->table, t->view, mask, size, dt, r);
        s = &t->table->slots[r];
    }
    if (DM_UNLIKELY(t->table->tally))
        return alloc_tallied(t, c, s, r, size, dt, zero);
    return alloc_counted(t, s, r, size, dt, zero);
}


/* A block leaves through the cached path: tag it with its class and arena,
 * and count it. */
static inline __attribute__((always_inline)) void
bcache_hand_out(const dm__bcache_memo_t *m, void *p, size_t size) {
    atomic_store_explicit(dm__bcache_tag_word((uintptr_t)p), (uintptr_t)p | m->tag_bits,
                          memory_order_relaxed);
    dm__ctrs_t *a = m->arena_ctrs, *r = m->rule_ctrs; /* read once: the adds may alias m */
    DM_CTR_ADD(a->nalloc, 1);
    DM_CTR_ADD(a->bytes, size);
    DM_CTR_ADD(r->nalloc, 1);
    DM_CTR_ADD(r->bytes, size);
}

/* What bcache_hand_out did, undone (a refused block). Another thread may
 * have taken the tag's slot meanwhile: then it is left to that block. */
static void bcache_hand_back(const dm__bcache_memo_t *m, void *p, size_t size) {
    _Atomic uint64_t *w = dm__bcache_tag_word((uintptr_t)p);
    uint64_t mine = (uintptr_t)p | m->tag_bits;
    atomic_compare_exchange_strong_explicit(w, &mine, 0, memory_order_relaxed,
                                            memory_order_relaxed);
    dm__ctrs_t *a = m->arena_ctrs, *r = m->rule_ctrs;
    DM_CTR_ADD(a->nalloc, -1);
    DM_CTR_ADD(a->bytes, -size);
    DM_CTR_ADD(r->nalloc, -1);
    DM_CTR_ADD(r->bytes, -size);
}

/* The usable size of the memo's blocks: their class. While bytes are counted
 * per tag (DM_MEMO_CACHED_TALLY, bcache_tallied) it is what a block reserves
 * against its context's tags and the worker limit, and the free gives back
 * the same from the block's tag word (free_impl): neither asks jemalloc. */
static inline uint64_t bcache_usable(const dm__bcache_memo_t *m) {
    return dm_sc_size(m->cls);
}

/* A refusal: the block goes back to where it came from (the bin, which held
 * n blocks, or jemalloc), and it is reported as alloc_tallied reports it. */
static __attribute__((noinline)) void *bcache_refused(dm__thread_t *t, const dm__bcache_memo_t *m,
                                                      void *p, uint32_t n, size_t size,
                                                      int zero) {
    if (n)
        dm__bcache_set_count(m->bin, n);
    else
        dmje_dallocx(p, MALLOCX_TCACHE_NONE);
    return refused(t, &t->table->slots[m->rule], m->rule, size, zero);
}

/* The cached path's general case, out of line so that a cache hit makes no
 * call and needs no stack frame: a block from the bin if it has one (zeroed
 * here when asked), else from the rule's arena through jemalloc (its malloc
 * fast path for the thread's bound arena); counted, while bytes are, with the
 * whole dm__tally_charge. Takes the counted path's misses and its zeroed
 * allocations, and the uncounted path's misses. */
static __attribute__((noinline)) void *bcache_miss(dm__thread_t *t, const dm_ctx_t *c, size_t size,
                                               const dm__bcache_memo_t *m, int zero) {
    dm__bcache_bin_t *b = m->bin;
    uint32_t n = dm__bcache_count(b);
    void *p;
    if (n && b->tag == m->tag) {
        p = b->items[n - 1];
        dm__bcache_set_count(b, n - 1);
    } else {
        n = 0;
        p = slot_alloc(t, &t->table->slots[m->rule], size, zero);
        if (DM_UNLIKELY(!p))
            return alloc_slow(t, c, size, DM_DT_UNKNOWN, zero); /* failure, fallback */
    }
    if (m->state == DM_MEMO_CACHED_TALLY &&
        DM_UNLIKELY(!dm__tally_charge(c ? c : &dm__context_root, p, bcache_usable(m), size,
                                      &t->refusal)))
        return bcache_refused(t, m, p, n, size, zero);
    bcache_hand_out(m, p, size);
    return n && zero ? memset(p, 0, size) : p;
}

/* The counted hit path once dm__tally_charge_fast stopped at count k (a
 * limit, a rising peak, a new shadow segment) of context c (never NULL): the
 * rest of the counts; refused, the block's hand-out is undone and it goes
 * back on top of its bin. */
static __attribute__((noinline)) void *bcache_tallied_rest(const dm_ctx_t *c, size_t size,
                                                           void *p, int k, uint64_t now) {
    dm__thread_t *t = tls_fast();
    const dm__bcache_memo_t *m = &t->memo[dm_sc_index(size)];
    if (DM_UNLIKELY(!dm__tally_charge_from(c, p, bcache_usable(m), size, &t->refusal, k, now))) {
        bcache_hand_back(m, p, size);
        return bcache_refused(t, m, p, dm__bcache_count(m->bin) + 1, size, 0);
    }
    return p;
}

/* The cached path while bytes are counted, once the block is popped and
 * handed out and the thread's held frees could not count it (alloc_impl): the
 * count. Out of line, so that the fast path keeps no stack frame; it makes
 * tail calls only, so that it keeps none either. */
static __attribute__((noinline)) void *bcache_tallied(const dm_ctx_t *c, size_t size,
                                                      const dm__bcache_memo_t *m, void *p) {
    const dm_ctx_t *cc = c ? c : &dm__context_root;
    uint64_t now;
    int k = dm__tally_charge_fast(cc, p, bcache_usable(m), &now);
    if (DM_UNLIKELY(k != DM_TALLY_CHARGED))
        return bcache_tallied_rest(cc, size, p, k, now);
    return p;
}

/* The fast path: a size class the bound view sends wholly to one arena. Pops a
 * cached block of that arena (or asks jemalloc), tags it, counts; while bytes
 * are counted per tag, the thread's held frees count it if they can (tally.h),
 * else bcache_tallied. Zeroed allocations and empty bins take bcache_miss. Anything else
 * (first call, reload, another context, a class split by a rule, dtype known,
 * alignment > 64, per-node arenas, arrays > 256 KiB, failure) goes to
 * alloc_slow. */
static inline __attribute__((always_inline)) void *alloc_impl(const dm_ctx_t *c, size_t size,
                                                              int dt, int zero) {
    dm__thread_t *t = tls_fast();
    if (DM_LIKELY(t->fast) && size - 1 < DM_SC_MAX && dt == DM_DT_UNKNOWN) {
        dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_acquire);
        const dm__bcache_memo_t *m = &t->memo[dm_sc_index(size)];
        if (DM_LIKELY(t->table == tab && t->ctx == c)) {
            if (DM_LIKELY(m->state == DM_MEMO_CACHED)) {
                dm__bcache_bin_t *b = m->bin;
                uint32_t n = dm__bcache_count(b);
                if (DM_UNLIKELY(n == 0 || b->tag != m->tag))
                    return bcache_miss(t, c, size, m, zero);
                void *p = b->items[n - 1];
                dm__bcache_set_count(b, n - 1);
                bcache_hand_out(m, p, size);
                return zero ? memset(p, 0, size) : p;
            }
            if (m->state == DM_MEMO_CACHED_TALLY) { /* the same, counted */
                dm__bcache_bin_t *b = m->bin;
                uint32_t n = dm__bcache_count(b);
                if (DM_UNLIKELY(zero || n == 0 || b->tag != m->tag))
                    return bcache_miss(t, c, size, m, zero);
                void *p = b->items[n - 1];
                dm__bcache_set_count(b, n - 1);
                bcache_hand_out(m, p, size); /* before counting: undone on a refusal */
                if (DM_LIKELY(dm__tally_take_held(&t->tally_held, c ? c : &dm__context_root, p,
                                                  bcache_usable(m))))
                    return p;
                return bcache_tallied(c, size, m, p);
            }
        }
    }
    return alloc_slow(t, c, size, dt, zero);
}

/* Blocks of 4 MiB and more: NumPy's hugepage advice, and from 32 MiB zeroing by
 * giving pages back (bigblock.c). Out of line: one compare on the fast path. */
static __attribute__((noinline)) void *alloc_big(const dm_ctx_t *c, size_t size, int dt,
                                                 bool zero) {
    bool purge = zero && size >= DM_BIG_ZERO_PURGE_MIN;
    void *p = alloc_impl(c, size, dt, zero && !purge ? MALLOCX_ZERO : 0);
    if (DM_UNLIKELY(!p))
        return NULL;
    dm__bigblock_advise(p, size);
    return purge ? dm__bigblock_zero(p, size) : p;
}

void *dm_alloc(const dm_ctx_t *c, size_t size, int dt) {
    if (DM_UNLIKELY(size >= DM_BIG_THP_MIN))
        return alloc_big(c, size, dt, false);
    return alloc_impl(c, size, dt, 0);
}

void *dm_calloc(const dm_ctx_t *c, size_t size, int dt) {
    if (DM_UNLIKELY(size >= DM_BIG_THP_MIN))
        return alloc_big(c, size, dt, true);
    return alloc_impl(c, size, dt, MALLOCX_ZERO);
}

/* With a call site's mask (see datamem.h); mask == 0: dm_alloc / dm_calloc. */
void *dm_alloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen) {
    if (!mask)
        return dm_alloc(c, size, dt);
    void *p = alloc_site(tls_fast(), c, size, dt, mask, gen, 0);
    if (p && size >= DM_BIG_THP_MIN) /* big blocks: as dm_alloc does */
        dm__bigblock_advise(p, size);
    return p;
}

void *dm_calloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen) {
    if (!mask)
        return dm_calloc(c, size, dt);
    bool big = size >= DM_BIG_THP_MIN, purge = size >= DM_BIG_ZERO_PURGE_MIN;
    void *p = alloc_site(tls_fast(), c, size, dt, mask, gen, purge ? 0 : MALLOCX_ZERO);
    if (!p || !big)
        return p;
    dm__bigblock_advise(p, size);
    return purge ? dm__bigblock_zero(p, size) : p;
}

static __attribute__((noinline)) void free_slow(dm__thread_t *t, void *p, _Atomic uint64_t *w,
                                                 uint64_t v, size_t hint) {
    if (!p)
        return;
    if ((v & DM_BCACHE_TAG_PMASK) == (uintptr_t)p) /* tagged, but not for this thread's cache */
        atomic_store_explicit(w, 0, memory_order_relaxed);
    dm__arena_je_t *ja = dm__mem_owner_of(p);
    if (DM_UNLIKELY(!ja)) { /* not ours: never hand it to jemalloc */
        atomic_fetch_add_explicit(&foreign_frees, 1, memory_order_relaxed);
        return;
    }
    DM_CTR_ADD(t->ctrs[ja->owner->id].nfree, 1);
    char *b = dm__block_of(ja, p); /* under its colour, in a big half */
    untrack(ja, b);
    dm__tally_release(p);
    dm__libcheap_note_free(hint); /* as NumPy's free would have, to glibc */
    if (DM_UNLIKELY(ja->spill != NULL)) /* a fork child's decay needs the spill thread too */
        dm__spill_pager_ensure();
    /* NumPy's size says big: maybe kept, with what its user could touch from b */
    if (hint >= DM_BIG_THP_MIN && dm__bigblock_keep(ja, b, hint, (size_t)((char *)p - b)))
        return;
    DM_TSAN_RELEASE();
    if (ja == t->auto_je)
        dmje_free(b); /* jemalloc's fast path; the block is the bound arena's */
    else
        dmje_dallocx(b, (int)tcache_flags(t, ja));
}

/* A counted block of class k whose bin is full: its class's bytes leave its
 * tags (the slow path then finds nothing left to release), then the slow
 * path frees it. Out of line, so that free_impl makes tail calls only. */
static __attribute__((noinline)) void free_counted_slow(dm__thread_t *t, void *p,
                                                        _Atomic uint64_t *w, size_t hint,
                                                        unsigned k) {
    dm__tally_release_held(&t->tally_held, p, dm_sc_size(k));
    free_slow(t, p, w, 0, hint);
}

/* The fast path: a tagged block goes into its class's bin, if the bin is
 * empty or holds the same arena's blocks and has room; otherwise down the
 * slow path, untagged. While bytes are counted, its class's bytes leave its
 * tags first. The tag says the class; NumPy's size (hint) is only a
 * filter for the slow path: a block it calls big may be kept for reuse after
 * jemalloc tells its real size. */
static void free_first(void *p, size_t hint);

static inline __attribute__((always_inline)) void free_impl(void *p, size_t hint) {
    dm__thread_t *t = datamem_tls_anchor;
    if (DM_UNLIKELY(!t)) /* a tail call: this path keeps no stack frame */
        return free_first(p, hint);
    _Atomic uint64_t *w = dm__bcache_tag_word((uintptr_t)p);
    uint64_t v = atomic_load_explicit(w, memory_order_relaxed);
    if (DM_LIKELY(t->fast) && DM_LIKELY(p != NULL) && (v & DM_BCACHE_TAG_PMASK) == (uintptr_t)p) {
        atomic_store_explicit(w, 0, memory_order_relaxed);
        unsigned k = (unsigned)(v >> DM_BCACHE_TAG_CLASS_SHIFT) & 63u;
        uint32_t tag = (uint32_t)(v >> DM_BCACHE_TAG_ARENA_SHIFT);
        /* Counted (bcache_tallied): its class is its usable size, released
         * last, in tail position, so that this path keeps no stack frame (the
         * bin is this thread's: nothing reuses the block before that). */
        dm__bcache_bin_t *b = &t->bins[k];
        uint32_t n = dm__bcache_count(b);
        if (DM_LIKELY(n < dm__bcache_cap[k]) && (DM_LIKELY(b->tag == tag) || n == 0)) {
            if (DM_UNLIKELY(b->tag != tag)) { /* an empty bin changes arena */
                b->tag = tag;
                b->nfree = &t->ctrs[dm__mem_by_slot[tag - 1]->owner->id].nfree;
            }
            DM_CTR_ADD(*b->nfree, 1);
            b->items[n] = p;
            dm__bcache_set_count(b, n + 1);
            if (DM_UNLIKELY(atomic_load_explicit(&dm__tally_counting, memory_order_relaxed)))
                dm__tally_release_held(&t->tally_held, p, dm_sc_size(k));
            return;
        }
        if (DM_UNLIKELY(atomic_load_explicit(&dm__tally_counting, memory_order_relaxed)))
            return free_counted_slow(t, p, w, hint, k);
        v = 0; /* the tag is gone */
    }
    free_slow(t, p, w, v, hint);
}

/* The thread's first free (its anchor not set yet). */
static __attribute__((noinline)) void free_first(void *p, size_t hint) {
    tls_anchor_set();
    free_impl(p, hint);
}

void dm_free(void *p) { free_impl(p, 0); }

void dm_free_hint(void *p, size_t size_hint) { free_impl(p, size_hint); }

/* ---- realloc ----------------------------------------------------------------
 * The block follows the rules for its new size (a growing array can move to
 * the arena its new size selects). Same arena: rallocx, which may resize in
 * place. Another arena: allocate there, copy, free here; never rallocx across
 * arenas, which would free the old block into the new arena's thread cache.
 * NumPy calls this with or without the GIL. A big half's block keeps its
 * colour (bigblock.c): it is resized as its colour plus the new size from its
 * start, which stays on a 2 MiB frame, and its data stays at the same offset
 * from that start. */

/* realloc while bytes are counted per tag: a new block in the caller's
 * context, the bytes copied, the old block freed (its tags give its bytes
 * back). Never in place: the block may change tags. */
static __attribute__((noinline)) void *realloc_tallied(const dm_ctx_t *c, void *p, size_t size) {
    void *q = dm_alloc(c, size, DM_DT_UNKNOWN);
    if (!q)
        return NULL; /* the old block stays valid */
    size_t have = dm__block_usable(p) - dm__colour_of(p);
    memcpy(q, p, have < size ? have : size);
    dm_free(p);
    return q;
}

/* The block stays in its arena `ja`: rallocx, which may resize in place. A
 * tracked arena reserves what the block grows by first, and settles after. */
static void *realloc_same(dm__thread_t *t, const dm__dispatch_slot_t *s, int r,
                          dm__arena_je_t *ja, void *p, size_t size) {
    size_t n = dm__slot_size(s, size);
    bool fits = n != 0; /* the rounding did not wrap */
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
        if (grow && !live_reserve(t, a, grow, size)) {
            n = 0; /* refused: fails below, the old block stays */
            dm__refusal_realloc(t, s, r);
        }
    }
    if (n != 0)
        q = dmje_rallocx(b, n, (int)((unsigned)flags | tcache_flags(t, ja)));
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
    void *q = slot_alloc(t, s, size, 0);
    if (q) {
        char *b = dm__block_of(old, p);
        size_t have = dmje_sallocx(b, 0) - (size_t)((char *)p - b);
        memcpy(q, p, have < size ? have : size);
        DM_CTR_ADD(t->ctrs[old->owner->id].nfree, 1);
        DM_CTR_ADD(t->ctrs[s->arena_id].nalloc, 1);
        untrack(old, b);
        dmje_dallocx(b, (int)tcache_flags(t, old));
    } else if (t->limit_refused) {
        dm__refusal_realloc(t, s, r);
    }
    return q;
}

void *dm_realloc(const dm_ctx_t *c, void *p, size_t size) {
    if (!p)
        return dm_alloc(c, size, DM_DT_UNKNOWN);
    dm__arena_je_t *old = dm__mem_owner_of(p);
    if (DM_UNLIKELY(!old))
        return NULL;
    dm__bcache_tag_drop(p); /* the block leaves the cached path: resized, moved or freed */
    dm__thread_t *t = tls_self();
    int r;
    const dm__dispatch_slot_t *s = route(t, c, size, DM_DT_UNKNOWN, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_UNLIKELY(t->table->tally)) /* the bound table: route() holds a reference */
        return realloc_tallied(c, p, size);
    dm__arena_je_t *ja = slot_je(s);
    dm__arena_je_t *big = ja ? atomic_load_explicit(&ja->big, memory_order_acquire) : NULL;
    if (big && old == big)
        ja = old; /* a big block stays in the big half, resized in place if it can */
    /* A block growing to 4 MiB or more moves from the small half to the big
     * one, where the arena's other big blocks are and where its free can be
     * reused. pandas' hash tables grow their vectors by realloc (1 -> 4 -> 16
     * -> 64 MiB); left in the small half, such blocks are served by nothing
     * once freed, while the big half grows for the next big arrays (1.10x
     * NumPy's default peak RSS on pandas3_etl, bench/results/jobs-size-class-trim.md). */
    size_t rounded = dm__slot_size(s, size);
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

void dm_runtime_last_failure(dm_failure_t *out) { *out = tls_self()->last_failure; }

const char *dm_owner_arena(const void *p) {
    dm__arena_je_t *ja = p ? dm__mem_owner_of(p) : NULL;
    return ja ? ja->owner->name : NULL;
}

const char *dm_runtime_rule_of(const dm_ctx_t *c, size_t size, int dt) {
    dm__thread_t *t = tls_self();
    int r;
    if (!route(t, c, size, dt, &r))
        return NULL;
    const char *name = dm_table_rule_name(t->table->table, r);
    return name ? name : "default";
}
