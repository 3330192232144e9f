/*
 * tally.h: live and peak bytes per context tag, tag limits and the worker
 * limit (tally.c). Internal to the runtime.
 */
#ifndef DM_RUNTIME_TALLY_H
#define DM_RUNTIME_TALLY_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runtime/beside.h"
#include "runtime/budget.h"
#include "runtime/context.h"
#include "runtime/mem.h"

/* Hidden, as the engine's other headers': the fast path reaches these without a GOT load. */
#pragma GCC visibility push(hidden)

/* FNV-1a over `n` strings, each with its NUL: a tag row's key, a context's
 * (context.c). */
uint64_t dm__tally_hash(const char *const *s, int n);

#define DM_TALLY_TAGS_MAX 4096 /* tag rows; rows no context refers to are reused
                                  (unlimited first), and past that names count under
                                  "(other)" until one is free (tally.c) */
#define DM_TALLY_GRAIN_SHIFT 4 /* shadow entry per 16 bytes: counted blocks are >= 16
                                  bytes and 16-aligned */

/* A count: a tag row's, or the worker total's. The allocation paths touch
 * live, peak and limit, first in the row; the rest changes on refusals and,
 * under dm__mem_mu, when rows are made and reused (tally.c). */
typedef struct dm__tally_row {
    _Atomic uint64_t live, peak;
    _Atomic uint64_t limit;    /* UINT64_MAX = none */
    _Atomic uint64_t refused;
    _Atomic uint64_t spilled;  /* refusals a spill arena then served (the worker total's) */
    /* the last refusal (dm_runtime_refusals): written after `refused` grows */
    _Atomic uint64_t last_request, last_limit, last_live;
    /* under dm__mem_mu */
    uint64_t hash;
    int refs;                  /* contexts counting under it */
    uint16_t hnext;            /* hash chain: next row + 1, 0 = end */
    int8_t idle;               /* the idle list it is on, or -1 */
    int16_t prev, next;        /* on that list; -1 = end */
    char name[DM_NAME_MAX];
} dm__tally_row_t;

extern dm__tally_row_t dm__tally_rows[DM_TALLY_TAGS_MAX];
extern dm__tally_row_t dm__tally_total; /* every counted block: the worker limit's count */

#define DM_TALLY_ID_FIRST 2 /* the first id a made context gets (0: root, 1: "(other)") */

/* The shadow of each 1 GiB segment that ever held a counted block: a 16-bit
 * entry per 16 bytes, the block's context id + 1 (0: not counted). */
#define DM_TALLY_NSEGS (1u << (DM_VA_BITS - DM_SEG_SHIFT))
extern uint16_t *_Atomic dm__tally_shadow[DM_TALLY_NSEGS];

/* The shadow of p's segment, NULL if it has none yet (or p is past the
 * address space the shadows cover). */
static inline uint16_t *dm__tally_shadow_peek(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    return DM_LIKELY(seg < DM_TALLY_NSEGS)
               ? atomic_load_explicit(&dm__tally_shadow[seg], memory_order_acquire)
               : NULL;
}

/* Under dm__mem_mu, once: the root context's id and row ("(untagged)"). */
void dm__tally_root_init(struct dm_ctx *root);
/* Under dm__mem_mu, when a context is made: gives it an id and its tags'
 * rows, or, when every id or row is taken by contexts that are held, the row
 * "(other)". False when out of memory (the context is then not made). */
bool dm__tally_ctx_init(struct dm_ctx *c);
/* Under dm__mem_mu, when a context is freed (nothing holds it, so no live
 * block carries its id): its id and its rows' references go back. */
void dm__tally_ctx_fini(struct dm_ctx *c);
/* Under dm__mem_mu: no id or no tag row is free (a sweep may free some). */
bool dm__tally_crowded(void);
/* Under dm__mem_mu: `c` counts some of its tags under "(other)" and a
 * context made now for its tags would count more of them under their own
 * rows (an id is free, and a row for one of them: free, idle or made since). */
bool dm__tally_could_count(const struct dm_ctx *c);

/* Under dm__mem_mu, at install: tag limits from `p`, the worker limit
 * from `w` (dm__budget_worker_limit's for `p`). Returns whether counting is on
 * (sticky: once on, on for the process). */
bool dm__tally_configure(const dm_policy_t *p, const dm__budget_worker_t *w);

/* Reserves `n` bytes for a block about to be allocated in context `c`: against
 * the worker limit, then each of the context's tags' limits (compare-and-swap:
 * a count never passes its limit). False on refusal, with `f` filled (kind,
 * tag, limit, live, request) and nothing reserved. */
bool dm__tally_reserve(const struct dm_ctx *c, uint64_t n, uint64_t request, dm_failure_t *f);
/* Takes back a reservation whose allocation failed. */
void dm__tally_unreserve(const struct dm_ctx *c, uint64_t n);
/* The block `p` was allocated for reservation `n`: settles the counts to its
 * usable size (asks jemalloc unless `exact`: n is that size) and records its
 * context in the shadow; the block holds a reference on the context until
 * its free. The caller is bound to `c` (so holds it). */
void dm__tally_record(const struct dm_ctx *c, void *p, uint64_t n, bool exact);

/* Whether any block may be counted: set (for good) when counting turns on,
 * before the table that counts is published. */
extern _Atomic bool dm__tally_counting;

/* A block is released: if it was counted, its usable size leaves its tags.
 * Call before the block goes back to jemalloc (the block cache's blocks, whose
 * class is their size: dm__tally_release_held). */
void dm__tally_release_slow(const void *p);
static inline void dm__tally_release(const void *p) {
    if (DM_UNLIKELY(dm__tally_shadow_peek(p) != NULL))
        dm__tally_release_slow(p);
}

/* ---- inlined into the block cache's counted path (alloc.c) ---------------- */

static inline _Atomic uint16_t *dm__tally_entry(uint16_t *sh, const void *p) {
    return (_Atomic uint16_t *)&sh[((uintptr_t)p & (DM_SEG_SIZE - 1)) >> DM_TALLY_GRAIN_SHIFT];
}

/* Block p (shadow sh) is counted for context c: the block holds its context
 * (the caller holds it too; one counted under "(other)" is found by no id, so
 * not held), and its shadow entry names it. */
static inline void dm__tally_mark(const struct dm_ctx *c, uint16_t *sh, const void *p) {
    if (c->id >= DM_TALLY_ID_FIRST)
        dm__context_hold_made(c);
    atomic_store_explicit(dm__tally_entry(sh, p), (uint16_t)(c->id + 1), memory_order_relaxed);
}

/* The rest of dm__tally_charge, out of line: from count k (-1: the worker
 * total, i >= 0: the context's i-th tag), `now` the value count k reached if
 * it was just added and its peak must rise (0: count k is not added yet). The
 * block's shadow segment is made here if it has none. */
bool dm__tally_charge_from(const struct dm_ctx *c, void *p, uint64_t n, uint64_t request,
                           dm_failure_t *f, int k, uint64_t now);

#define DM_TALLY_CHARGED (-3) /* dm__tally_charge_fast: counted */

/* Adds n to a count without a limit whose peak it does not raise; false when
 * it has a limit (nothing added, *now 0) or the peak must rise (added, *now
 * the count now). */
static inline __attribute__((always_inline)) bool dm__tally_add_fast(dm__tally_row_t *t,
                                                                     uint64_t n,
                                                                     uint64_t *now) {
    if (DM_UNLIKELY(atomic_load_explicit(&t->limit, memory_order_relaxed) != UINT64_MAX))
        return false;
    uint64_t v = atomic_fetch_add_explicit(&t->live, n, memory_order_relaxed) + n;
    if (DM_UNLIKELY(v > atomic_load_explicit(&t->peak, memory_order_relaxed))) {
        *now = v;
        return false;
    }
    return true;
}

/* The block cache's counted path, its common case inlined: reserves `n` bytes
 * (the block's usable size) for block `p` in context `c` and records its
 * context, returning DM_TALLY_CHARGED. A limit, a rising peak or a new shadow
 * segment stops it where it is: it returns the k (and *now) to hand to
 * dm__tally_charge_from, which finishes or refuses. It makes no call, so a
 * caller's hit path needs no stack frame. */
static inline __attribute__((always_inline)) int
dm__tally_charge_fast(const struct dm_ctx *c, void *p, uint64_t n, uint64_t *now) {
    uint16_t *sh = dm__tally_shadow_peek(p);
    *now = 0;
    if (DM_UNLIKELY(!sh) || !dm__tally_add_fast(&dm__tally_total, n, now))
        return -1;
    for (int k = 0; k < c->ntally; k++) {
        dm__tally_row_t *t = &dm__tally_rows[c->tally[k]];
        __asm__("" : "+r"(t)); /* one register for the row: GCC would keep a base per field */
        if (!dm__tally_add_fast(t, n, now))
            return k;
    }
    dm__tally_mark(c, sh, p);
    return DM_TALLY_CHARGED;
}

/* ---- a thread's held frees --------------------------------------------------
 * Counting a block costs locked instructions: a counted pair of small blocks
 * took seven (the worker total, the tag's row and the context's reference,
 * each way, and the shadow's exchange), a quarter of an np.empty pair's time.
 * So a thread holds back the bytes of the small counted blocks it frees (the
 * block cache's, whose class is their size), of one context at a time, up to
 * DM_TALLY_HELD_MAX, while no count they are in has a limit: they stay in the
 * counts, and the thread's next small block of that context takes them up
 * instead of counting anew (the block takes over a held block's reference
 * on the context). A loop of allocations and frees then counts once.
 *
 * Only the thread writes its own (plain stores); a stats reader
 * (dm__tally_snapshot, under dm__mem_mu) takes every thread's held bytes out of
 * the live bytes it reports, so live bytes read as they are. A peak may read
 * up to DM_TALLY_HELD_MAX per thread high (the counts rose while a thread held
 * freed bytes in them); a limit is never passed (held bytes only make a count
 * read higher), and no bytes are held while one applies. Held bytes go back
 * when a free of another context or past the bound needs the room, when the
 * context's counts have a limit, at the thread's exit, and in a fork child
 * for the threads that did not survive (tally.c, thread.c). */
#define DM_TALLY_HELD_MAX (256u << 10)
#define DM_TALLY_HELD_BLOCK (1ull << 48) /* `held`: blocks above this bit, bytes below */

typedef struct dm__tally_held {
    /* whose blocks: changes only while none are held, `seq` odd meanwhile (a
     * stats reader retries); read without it only while some are held */
    const struct dm_ctx *_Atomic ctx;
    /* blocks * DM_TALLY_HELD_BLOCK + bytes, one word so that a fork child
     * never reads one without the other; bytes held means a block is (each
     * holds a reference on ctx) */
    _Atomic uint64_t held;
    _Atomic uint32_t seq;
} dm__tally_held_t;

/* The thread's block p of class size n, context c, about to be handed out:
 * counted by taking up n of the held bytes, if h holds that many of c's
 * (false: count it the usual way). */
static inline __attribute__((always_inline)) bool
dm__tally_take_held(dm__tally_held_t *h, const struct dm_ctx *c, void *p, uint64_t n) {
    uint64_t v = atomic_load_explicit(&h->held, memory_order_relaxed);
    uint64_t bytes = v & (DM_TALLY_HELD_BLOCK - 1);
    uint16_t *sh;
    if (bytes >= n && DM_LIKELY(atomic_load_explicit(&h->ctx, memory_order_relaxed) == c) &&
        (bytes == n || v >= 2 * DM_TALLY_HELD_BLOCK) && (sh = dm__tally_shadow_peek(p))) {
        /* first: a fork between the two stores leaves the block counted in
         * the child and never counted out, not counted out twice */
        atomic_store_explicit(&h->held, v - DM_TALLY_HELD_BLOCK - n, memory_order_relaxed);
        atomic_store_explicit(dm__tally_entry(sh, p), (uint16_t)(c->id + 1), memory_order_relaxed);
        return true;
    }
    return false;
}

/* by shadow entry: [id + 1] the context with that id, [0] NULL (tally.c) */
extern struct dm_ctx *_Atomic dm__tally_by_entry[DM_CTX_MAX + 1];
/* Whether freed bytes may be held: no count can have a limit (tally.c). */
extern _Atomic bool dm__tally_holding;

/* dm__tally_release_held's other cases, out of line (tally.c): block of c,
 * n bytes, whose shadow entry is cleared. */
void dm__tally_release_held_slow(dm__tally_held_t *h, const struct dm_ctx *c, uint64_t n);

/* Block p's shadow entry, cleared: what it held (its context's id + 1, the
 * index into dm__tally_by_entry), 0 for a block not counted. A block is freed
 * once, by one thread, after its allocation, so a load and a store clear it,
 * no locked exchange. The caller tests the entry, not the context it names:
 * returning the context and testing that cost 3 instructions a counted pair
 * in the net. */
static inline __attribute__((always_inline)) unsigned dm__tally_entry_clear(const void *p) {
    uint16_t *sh = dm__tally_shadow_peek(p);
    if (!sh)
        return 0;
    _Atomic uint16_t *e = dm__tally_entry(sh, p);
    uint16_t id1 = atomic_load_explicit(e, memory_order_relaxed);
    if (id1)
        atomic_store_explicit(e, 0, memory_order_relaxed);
    return id1;
}

/* The thread's block p of class size n is freed: if it was counted, its bytes
 * are held in h, or leave its counts where they cannot be. The shadow entry
 * is cleared first, then held grows (a fork between the two leaves the block
 * counted, never counted out twice). */
static inline __attribute__((always_inline)) void
dm__tally_release_held(dm__tally_held_t *h, const void *p, uint64_t n) {
    unsigned id1 = dm__tally_entry_clear(p);
    if (!id1)
        return;
    const struct dm_ctx *c = atomic_load_explicit(&dm__tally_by_entry[id1], memory_order_acquire);
    uint64_t v = atomic_load_explicit(&h->held, memory_order_relaxed);
    if (DM_LIKELY(atomic_load_explicit(&h->ctx, memory_order_relaxed) == c) &&
        (v % DM_TALLY_HELD_BLOCK) + n <= DM_TALLY_HELD_MAX &&
        DM_LIKELY(atomic_load_explicit(&dm__tally_holding, memory_order_relaxed)))
        atomic_store_explicit(&h->held, v + DM_TALLY_HELD_BLOCK + n, memory_order_relaxed);
    else
        dm__tally_release_held_slow(h, c, n);
}
/* The held bytes leave their counts, and the held blocks' references go back
 * (a thread's exit; a fork child, for the threads that did not survive). */
void dm__tally_held_return(dm__tally_held_t *h);

/* The same in one call: false on refusal (f filled, nothing reserved). */
static inline __attribute__((always_inline)) bool
dm__tally_charge(const struct dm_ctx *c, void *p, uint64_t n, uint64_t request, dm_failure_t *f) {
    uint64_t now;
    int k = dm__tally_charge_fast(c, p, n, &now);
    return k == DM_TALLY_CHARGED || dm__tally_charge_from(c, p, n, request, f, k, now);
}

/* Stats: fills out's tag fields (caller holds dm__mem_mu), the live bytes
 * less what the `nheld` threads' held frees in `held` hold. */
int dm__tally_snapshot(dm_stats_t *out, dm__tally_held_t *const *held, int nheld);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_TALLY_H */
