/*
 * dispatch.h: the published dispatch tables (dispatch.c): a compiled policy
 * with one slot per rule (the arena, flags and rounding it allocates with),
 * reference counted: the global pointer holds one reference, each thread
 * bound to it holds one; freed when the last goes. Each table keeps its views
 * (one per context key) until no thread is bound to them.
 *
 * Thread safety: a table is immutable once published, but for `refs`
 * (atomic) and its views (dm__mem_mu).
 */
#ifndef DM_RUNTIME_DISPATCH_H
#define DM_RUNTIME_DISPATCH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/policy.h"
#include "runtime/arena.h"
#include "runtime/datamem.h"
#include "runtime/mem.h"

#define DM_VIEWS_MAX 256 /* views cached per table before unused ones are freed */

/* One per rule, plus one for the default, in a published table. */
typedef struct dm__dispatch_slot {
    int flags;          /* MALLOCX_ARENA | MALLOCX_ALIGN (when > 64) */
    size_t round;       /* size rounding mask for alignment <= 64 */
    dm__arena_t *arena;
    dm__arena_je_t *je; /* NULL when per_node: chosen per call */
    uint16_t arena_id;
    bool tracked;       /* the arena counts live bytes (a limit): never cached */
} dm__dispatch_slot_t;

/* What slot `s` asks jemalloc for to serve `size` bytes: at least 1 (mallocx(0)
 * is undefined), rounded up to the slot's alignment; 0 when that wraps. */
static inline size_t dm__slot_size(const dm__dispatch_slot_t *s, size_t size) {
    return ((size ? size : 1) + s->round) & ~s->round;
}

typedef struct dm__dispatch_view {
    struct dm__dispatch_view *next;
    dm_view_t *view;
    bool in_use;        /* a thread is bound to it (views_sweep's mark) */
    uint64_t key[];     /* dm_table_ctx_key_words words */
} dm__dispatch_view_t;

typedef struct dm__dispatch {
    dm_table_t *table;
    dm_policy_t *policy;
    dm__dispatch_slot_t *slots;  /* nrules + 1 */
    int nslots;
    bool uses_dtype;
    uint64_t seq;                /* its install number (site masks name it) */
    int fallback;                /* slot index of the fallback arena, or -1 */
    dm__dispatch_slot_t fallback_slot;
    _Atomic int refs;
    dm__dispatch_view_t *views;  /* guarded by the runtime mutex */
    int nviews, views_sweep_at;  /* how many; when unused ones are freed */
    dm__ctrs_t *rule_ctrs;       /* per slot, folded from threads that moved on
                                    (nfree unused); guarded by dm__mem_mu */
    bool tally;                  /* bytes are counted per tag (tally.c): the
                                    block cache's counted path or alloc_tallied */
    /* By policy arena index: the slots that serve what a tag's or the worker's
     * limit refuses (tag_limits[].spill, worker_spill; spill.c). */
    dm__dispatch_slot_t spill_slots[DM_ARENAS_MAX];
} dm__dispatch_t;

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

/* dispatch.c: the table in force (release-store, acquire-load). */
extern _Atomic(dm__dispatch_t *) dm__dispatch_current;
/* A compiled table with its slots for `nslots` rules, one reference, counted
 * in dm__dispatch_live; NULL when out of memory (tt and p are the caller's). */
dm__dispatch_t *dm__dispatch_new(dm_table_t *tt, dm_policy_t *p, int nslots);
void dm__dispatch_destroy(dm__dispatch_t *t);
void dm__dispatch_release(dm__dispatch_t *t);
void dm__dispatch_slot_init(dm__dispatch_slot_t *s, dm__arena_t *a, const dm_arena_spec_t *spec);
/* Under dm__mem_mu: publishes `tab` (its site masks too); returns the
 * table it replaces, whose reference passes to the caller. */
dm__dispatch_t *dm__dispatch_publish(dm__dispatch_t *tab);
/* Under dm__mem_mu: the view of `tab` for a context and thread name. */
const dm_view_t *dm__dispatch_view(dm__dispatch_t *tab, const dm_ctx_t *c, const char *thread);
/* Under dm__mem_mu: view `v` is bound to a thread (dm__dispatch_view_mark);
 * then the views not marked are freed (dm__dispatch_views_sweep), once
 * `nviews` reaches `views_sweep_at`. */
void dm__dispatch_view_mark(dm__dispatch_t *tab, const dm_view_t *v);
void dm__dispatch_views_sweep(dm__dispatch_t *tab);
int dm__dispatch_live(void); /* tables published or still referenced */

#pragma GCC visibility pop

#endif /* DM_RUNTIME_DISPATCH_H */
