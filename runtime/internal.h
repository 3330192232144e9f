/*
 * internal.h: what the runtime's .c files share and nobody else sees: the
 * engine's objects and each file's cross-file functions.
 *
 * Objects and lifetimes:
 *   dm__arena_t     a policy arena: arena.h's, the floor below this header.
 *   dm__arena_je_t  one jemalloc arena with our extent hooks: the memory
 *                   floor's (mem.h), below this header, which it cannot see.
 *   dm__dispatch_t  a published dispatch table (dispatch.c: compiled policy +
 *                   slots), reference counted: the global pointer holds one
 *                   reference, each thread bound to it holds one. Freed when
 *                   the last goes.
 *   dm__thread_t    per-thread state (thread.c): the bound table, view cache,
 *                   the block cache (bcache.h: bins per size class, memo per
 *                   size class), explicit jemalloc thread caches (one per je
 *                   arena) and counters. Reached through datamem_tls_anchor
 *                   (tls_anchor.c) on the fast path.
 *
 * Names: a cross-file internal is dm__<file>_* after the file that defines it
 * (dm__arena_get in arena.c, dm__thread_bind in thread.c); what this header
 * itself defines for every file (counters, limits) is dm__ctr*, DM_*.
 */
#ifndef DM_RUNTIME_INTERNAL_H
#define DM_RUNTIME_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "jemalloc/jemalloc.h"
#include "policy/policy.h"
#include "runtime/datamem.h"
#include "runtime/arena.h"
#include "runtime/mem.h"
#include "runtime/sizeclass.h"

#define DM_CTX_MAX 4096                      /* context ids (tally.c); contexts themselves
                                                are recycled (context.c) */
#define DM_VIEWS_MAX 256                     /* views cached per table before unused ones
                                                are freed (dispatch.c) */

/* jemalloc is not instrumented, so ThreadSanitizer cannot see that a block freed
 * on one thread and handed out again on another was passed through jemalloc's
 * locks. In TSan builds free releases and alloc acquires one sync object
 * (alloc.c), which models that hand-off (coarsely: it orders every free before
 * every later allocation). Compiled out otherwise. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
extern char dm__alloc_tsan_sync;
#define DM_TSAN_ACQUIRE() __tsan_acquire(&dm__alloc_tsan_sync)
#define DM_TSAN_RELEASE() __tsan_release(&dm__alloc_tsan_sync)
#else
#define DM_TSAN_ACQUIRE() ((void)0)
#define DM_TSAN_RELEASE() ((void)0)
#endif

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

#define DM_BCACHE_SLOTS 8                      /* most blocks per class and thread */
#define DM_BCACHE_CLASS_BYTES ((size_t)64 << 10) /* fewer for big classes (at least 1):
                                                2.3 MiB per thread at most */

typedef struct dm__bcache_bin {
    _Atomic uint32_t n;          /* written by its thread, read by stats */
    uint32_t tag;                /* the je arena (slot + 1) of every block here */
    dm__ctr_t *nfree;            /* that arena's free counter in this thread */
    void *items[DM_BCACHE_SLOTS];
} dm__bcache_bin_t;

/* What the bound view does with one raw size class, learnt on first use
 * (bcache.c, dm__bcache_learn) and forgotten at every bind. */
/* CACHED_TALLY: cached, and bytes are counted per tag (alloc.c, bcache_tallied). */
typedef enum {
    DM_MEMO_UNKNOWN = 0,
    DM_MEMO_SLOW,
    DM_MEMO_CACHED,
    DM_MEMO_CACHED_TALLY
} dm__bcache_memo_state_t;
typedef struct dm__bcache_memo {
    dm__bcache_bin_t *bin;       /* the bin of the class its blocks have */
    uint64_t tag_bits;           /* class and arena fields of its blocks' tags */
    dm__ctrs_t *arena_ctrs, *rule_ctrs;
    uint32_t tag;                /* its je arena (slot + 1) */
    uint16_t rule;               /* its slot in the table */
    uint8_t state;               /* dm__bcache_memo_state_t */
    uint8_t cls;                 /* its blocks' class: dm_sc_size(cls) is their usable size */
} dm__bcache_memo_t;

typedef struct dm__thread {
    /* hot: the bound (table, context) and its view */
    dm__dispatch_t *table;
    const dm_ctx_t *ctx;
    const dm_view_t *view;
    /* The jemalloc arena this thread is bound to ("thread.arena"), whose small
     * blocks go through jemalloc's own malloc/free fast paths and the thread's
     * automatic cache; NULL = none. Only blocks of this arena ever enter that
     * cache, so it cannot mix arenas. */
    dm__arena_je_t *auto_je;
    bool fast;                   /* bound: the fast paths may run */
    bool auto_stale;             /* recompute auto_je at the next bind */
    /* The block cache (bcache.h): per size class, freed blocks of one arena,
     * and per raw size class what the bound view does with it (DM_MEMO_*). */
    dm__bcache_memo_t memo[DM_SC_COUNT];
    dm__bcache_bin_t bins[DM_SC_COUNT];
    dm__ctrs_t *rule_ctrs;       /* per slot of `table` (nfree unused) */
    /* explicit jemalloc thread caches, per je arena slot: index + 1, 0 = none */
    unsigned tcache[DM_JE_MAX];
    dm__ctrs_t ctrs[DM_RT_ARENAS_MAX];
    char thread_name[DM_NAME_MAX];
    dm_failure_t last_failure;   /* the thread's last allocation refused by a limit */
    dm_failure_t refusal;        /* a tag's or the worker's refusal, before it becomes
                                    last_failure (a spill arena may serve it) */
    bool limit_refused;          /* set by the tracked path, read by alloc_failed */
    bool registered, exiting;
    /* The context this thread holds a reference on (context.c): the one it
     * is bound to, kept until it binds another or exits, so that `ctx` is
     * never the address of a context freed and made again. NULL: none. */
    const struct dm_ctx *held;
    struct dm__thread *next, *prev; /* registry, under the runtime mutex */
} dm__thread_t;

struct dm_ctx {
    struct dm_ctx *next;         /* hash chain of interned contexts (dm__mem_mu) */
    uint64_t hash;               /* of its tags (dm__tally_hash) */
    _Atomic uint64_t refs;       /* holders, bound threads and live counted blocks */
    bool interned;               /* false: root, stale and tally's "(other)": static */
    int ntags;
    char **tags;                 /* sorted, unique */
    _Atomic bool retired;        /* lookups no longer find it: a counted one replaces it
                                    (context.c: set under dm__mem_mu, read by
                                    dm_ctx_retired); it lives until its last holder
                                    lets go */
    uint16_t id;                 /* tally.c: its id, in the shadow as id + 1 */
    int ntally;
    uint16_t *tally;             /* tally rows its blocks count under */
    uint64_t uncounted;          /* tally.c: bit i, tags[i] counts under "(other)" (its
                                    own row or an id was not free when it was made) */
    struct dm_ctx *onext, *oprev; /* tally.c: the contexts with `uncounted` bits
                                    (dm__mem_mu) */
};

/* Cross-file internals are hidden (as -fvisibility=hidden makes their
 * definitions): a file reaches another's variables as directly as its own
 * statics, with no GOT load (the fast path reads several). */
#pragma GCC visibility push(hidden)



/* runtime.c: after a successful install, outside dm__mem_mu: the observers
 * see it, in install order (an install older than the last one delivered is
 * dropped). */
void dm__runtime_notify_install(const dm_policy_t *p, uint64_t seq);

/* context.c: the root context (what NULL means) and one never handed out,
 * which forces the next allocation to bind. */
extern struct dm_ctx dm__context_root, dm__context_stale;
/* Under dm__mem_mu: the root context's tally ids (tally.c), once. */
void dm__context_root_tally_init(void);
int dm__context_count(void); /* under dm__mem_mu */
/* A reference on a context its caller already holds one on (or is bound to);
 * giving one back never frees (context.c: freed by a sweep under
 * dm__mem_mu). Static contexts are not counted. */
static inline void dm__context_hold(const struct dm_ctx *c) {
    if (c && c->interned)
        atomic_fetch_add_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_relaxed);
}
static inline void dm__context_drop(const struct dm_ctx *c) {
    if (c && c->interned)
        atomic_fetch_sub_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_release);
}
/* The same for a context known to be made (interned: tally.c's ids from
 * DM_TALLY_ID_FIRST on), without the checks: a counted block's reference. */
static inline void dm__context_hold_made(const struct dm_ctx *c) {
    atomic_fetch_add_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_relaxed);
}
static inline void dm__context_drop_made(const struct dm_ctx *c) {
    atomic_fetch_sub_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_release);
}

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

/* thread.c: the calling thread's state, the registry of live threads (under
 * dm__mem_mu) and binding a thread to the table in force. */
extern __thread dm__thread_t dm__thread_self;
extern dm__thread_t *dm__thread_registry;
extern int dm__thread_n;
void dm__thread_init(void); /* once, at dm_runtime_init */
void dm__thread_register(dm__thread_t *t); /* under dm__mem_mu */
bool dm__thread_bind(dm__thread_t *t, const dm_ctx_t *key);
/* fork, in the child: dm__thread_fork_unlink (under dm__mem_mu) takes every
 * thread but the caller out of the registry; dm__thread_fork_release (no lock
 * held) frees what they held. */
dm__thread_t *dm__thread_fork_unlink(void);
void dm__thread_fork_release(dm__thread_t *gone);

/* alloc.c: frees of blocks that were not ours (stats). */
uint64_t dm__alloc_foreign_frees(void);

/* install.c (under dm__mem_mu): the reload counts, into a snapshot. */
void dm__install_stats(dm_stats_t *out);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_INTERNAL_H */
