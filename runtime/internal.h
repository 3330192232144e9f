/*
 * internal.h: what the runtime's .c files share and nobody else sees.
 *
 * Objects and lifetimes:
 *   dm_arena_t  a policy arena, found by name; lives for the process (arrays
 *               outlive policies). Behind it one jemalloc arena, or one per NUMA
 *               node with per_node.
 *   je_arena_t  one jemalloc arena with our extent hooks; `slot` is its small
 *               integer id, also stored in the segment map so that free() finds
 *               the owner from the address with one load.
 *   rt_table_t  a published dispatch table (compiled policy + slots), reference
 *               counted: the global pointer holds one reference, each thread
 *               bound to it holds one. Freed when the last goes.
 *   dm_tls_t    per-thread state: the bound table, view cache, the block
 *               cache (bins per size class, memo per size class), explicit
 *               jemalloc thread caches (one per je arena) and counters. Reached
 *               through datamem_tls_anchor (tls_anchor.c) on the fast path.
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
#include "runtime/sizeclass.h"

#define DM_LIKELY(x) __builtin_expect(!!(x), 1)
#define DM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define DM_CACHELINE 64

#define DM_RT_ARENAS_MAX DM_STATS_ARENAS_MAX /* policy arenas ever seen */
#define DM_JE_MAX 1024                       /* jemalloc arenas we create */
#define DM_SEG_SHIFT 30                      /* 1 GiB address-space segments */
#define DM_SEG_SIZE ((size_t)1 << DM_SEG_SHIFT)
#define DM_VA_BITS 47
#define DM_CTX_MAX 4096
#define DM_JE_OLD_MAX 8                      /* earlier regions kept per je arena */
#define DM_REUSE_MAX 8                       /* freed big blocks kept per je arena */

/* Counters one thread writes and any thread reads: relaxed atomics compile to
 * plain adds on x86-64 (no lock prefix), and keep TSan honest. */
typedef _Atomic uint64_t dm_ctr_t;
#define DM_CTR_ADD(c, n)                                                       \
    atomic_store_explicit(&(c), atomic_load_explicit(&(c), memory_order_relaxed) + (n), \
                          memory_order_relaxed)
#define DM_CTR_GET(c) atomic_load_explicit(&(c), memory_order_relaxed)

typedef struct dm_arena_ctrs {
    dm_ctr_t nalloc, nfree, nrealloc, nfail, nfallback, ndtype_known, bytes, nlimit;
} dm_arena_ctrs_t;

typedef struct je_arena {
    extent_hooks_t hooks;    /* first: jemalloc hands &hooks back to us */
    unsigned index;          /* jemalloc's arena index */
    uint16_t slot;           /* our id; segment map holds slot + 1 */
    int node;                /* per_node arenas: their node; else -1 */
    struct dm_arena *owner;
    /* The big half (arena.c, "Big halves"): the jemalloc arena serving this
     * one's blocks of DM_BIG_THP_MIN bytes and more; NULL when there is none
     * (then this one serves them). Set once, under dm__mu. */
    struct je_arena *_Atomic big;
    bool is_big;             /* this is some arena's big half */
    pthread_mutex_t mu;      /* guards the bump region below */
    char *cur, *end;         /* committed-on-demand bump region */
    size_t reserved;         /* bytes of address space reserved */
    /* Committed parts of the regions, for hugepage accounting (stats scan only
     * these, not the PROT_NONE reservations: ~14 us per GiB otherwise). */
    char *base;              /* start of the current region */
    int nold;                /* earlier regions; beyond DM_JE_OLD_MAX not kept */
    char *old[DM_JE_OLD_MAX][2];
    /* Bytes of memory the arena has started to use (fresh extents, retained
     * ranges committed again) since dm__arena_after_growth last looked. */
    _Atomic uint64_t grown;
    /* Kept big blocks handed out again (bigblock.c), which jemalloc does not
     * count; and, under dm__mu, the allocations counted at the last growth
     * check (dm__arena_after_growth: an arena with none since is idle). */
    _Atomic uint64_t reused;
    uint64_t ops_seen;
    size_t purge_mib[3];         /* "arena.<index>.purge" */
    bool creating;               /* inside arenas.create (under dm__mu) */
    /* Some extent was mlock'ed / registered with the GPU runtime: purges
     * unlock first / are declined (arena.c). Only ever set to true. */
    _Atomic bool ever_locked, ever_pinned;
    /* Its owner counts live bytes (a copy of dm_arena_t.tracked, so that a
     * free, which has `ja` in hand, tests it with one load). */
    _Atomic bool tracked;
    /* Freed blocks of 4 MiB or more kept for the next allocation of their
     * size class (bigblock.c, "Reuse"), oldest first. Under reuse_mu, which
     * is never held across a jemalloc call. */
    pthread_mutex_t reuse_mu;
    int nreuse;
    struct {
        void *p;
        size_t usable;
        size_t touched;      /* its last user's request: the pages past it are not resident */
        int64_t at_ms;
    } reuse[DM_REUSE_MAX];
    _Atomic size_t reuse_bytes;
} je_arena_t;

typedef struct dm_arena {
    char name[DM_NAME_MAX];
    int id;
    /* Placement for new extents; hooks read these, reload rewrites them. */
    _Atomic int thp, numa;
    _Atomic uint64_t numa_nodes;
    _Atomic size_t alignment;
    _Atomic bool per_node, in_policy;
    _Atomic size_t dirty_budget;  /* decay.budget; SIZE_MAX = never */
    _Atomic int64_t reuse_ms;     /* decay.dirty: how long a kept big block waits; -1 = no limit */
    /* Written under dm__mu, read by the per_node fast path without it. */
    je_arena_t *_Atomic single;              /* the arena when not per_node */
    je_arena_t *_Atomic by_node[DM_NODES_MAX];
    dm_ctr_t placement_errors;
    dm_ctr_t growth_purges;          /* purges by decay.budget */
    /* `limit` (reloadable; SIZE_MAX = none). An arena counts its live bytes
     * (usable sizes, one atomic add per allocation and free) from the first
     * install that gives it a limit, for the rest of the process; untracked
     * arenas pay nothing. */
    _Atomic size_t limit;
    _Atomic bool tracked;
    _Atomic uint64_t live;
    /* lock / pinned: settings for new extents, and bytes currently locked or
     * registered (extent hooks). */
    _Atomic bool lock;
    _Atomic int pinned;              /* dm_pin_t */
    _Atomic uint64_t locked_bytes, pinned_bytes;
    dm_arena_ctrs_t dead;            /* counters of threads that exited */
} dm_arena_t;

/* One per rule, plus one for the default, in a published table. */
typedef struct rt_slot {
    int flags;          /* MALLOCX_ARENA | MALLOCX_ALIGN (when > 64) */
    size_t round;       /* size rounding mask for alignment <= 64 */
    dm_arena_t *arena;
    je_arena_t *je;     /* NULL when per_node: chosen per call */
    uint16_t arena_id;
    bool tracked;       /* the arena counts live bytes (a limit): never cached */
} rt_slot_t;

typedef struct rt_view_entry {
    struct rt_view_entry *next;
    dm_view_t *view;
    uint64_t key[];     /* dm_table_ctx_key_words words */
} rt_view_entry_t;

typedef struct rt_table {
    dm_table_t *table;
    dm_policy_t *policy;
    rt_slot_t *slots;            /* nrules + 1 */
    int nslots;
    bool uses_dtype;
    uint64_t seq;                /* its install number (site masks name it) */
    int fallback;                /* slot index of the fallback arena, or -1 */
    rt_slot_t fallback_slot;
    _Atomic int refs;
    rt_view_entry_t *views;      /* guarded by the runtime mutex */
    dm_arena_ctrs_t *rule_ctrs;  /* per slot, folded from threads that moved on
                                    (nfree unused); guarded by dm__mu */
    bool tally;                  /* bytes are counted per tag (tally.c): every
                                    allocation takes alloc_tallied */
} rt_table_t;

#define DM_FC_SLOTS 8                      /* most blocks per class and thread */
#define DM_FC_CLASS_BYTES ((size_t)64 << 10) /* fewer for big classes (at least 1):
                                                2.3 MiB per thread at most */

typedef struct dm_fc_bin {
    _Atomic uint32_t n;          /* written by its thread, read by stats */
    uint32_t tag;                /* the je arena (slot + 1) of every block here */
    dm_ctr_t *nfree;             /* that arena's free counter in this thread */
    void *items[DM_FC_SLOTS];
} dm_fc_bin_t;

/* What the bound view does with one raw size class, learnt on first use
 * (runtime.c, memo_fill) and forgotten at every bind. */
typedef enum { DM_MEMO_UNKNOWN = 0, DM_MEMO_SLOW, DM_MEMO_CACHED } dm_memo_state_t;
typedef struct dm_memo {
    dm_fc_bin_t *bin;            /* the bin of the class its blocks have */
    uint64_t tag_bits;           /* class and arena fields of its blocks' tags */
    dm_arena_ctrs_t *arena_ctrs, *rule_ctrs;
    uint32_t tag;                /* its je arena (slot + 1) */
    uint16_t rule;               /* its slot in the table */
    uint8_t state;               /* dm_memo_state_t */
} dm_memo_t;

typedef struct dm_tls {
    /* hot: the bound (table, context) and its view */
    rt_table_t *table;
    const dm_ctx_t *ctx;
    const dm_view_t *view;
    /* The jemalloc arena this thread is bound to ("thread.arena"), whose small
     * blocks go through jemalloc's own malloc/free fast paths and the thread's
     * automatic cache; NULL = none. Only blocks of this arena ever enter that
     * cache, so it cannot mix arenas. */
    je_arena_t *auto_je;
    bool fast;                   /* bound: the fast paths may run */
    bool auto_stale;             /* recompute auto_je at the next bind */
    /* The block cache (runtime.c): per size class, freed blocks of one arena,
     * and per raw size class what the bound view does with it (DM_MEMO_*). */
    dm_memo_t memo[DM_SC_COUNT];
    dm_fc_bin_t bins[DM_SC_COUNT];
    dm_arena_ctrs_t *rule_ctrs;  /* per slot of `table` (nfree unused) */
    /* explicit jemalloc thread caches, per je arena slot: index + 1, 0 = none */
    unsigned tcache[DM_JE_MAX];
    dm_arena_ctrs_t ctrs[DM_RT_ARENAS_MAX];
    char thread_name[DM_NAME_MAX];
    dm_failure_t last_failure;   /* the thread's last allocation refused by a limit */
    bool limit_refused;          /* set by the tracked path, read by alloc_failed */
    bool registered, exiting;
    struct dm_tls *next, *prev;  /* registry, under the runtime mutex */
} dm_tls_t;

struct dm_ctx {
    struct dm_ctx *next;
    int ntags;
    char **tags;                 /* sorted, unique */
    uint16_t id;                 /* tally.c: its index, in the shadow as id + 1 */
    int ntally;
    uint16_t *tally;             /* its tags' tally registry ids (root: "(untagged)") */
};

/* arena.c */
dm_arena_t *dm__arena_get(const char *name, const dm_arena_spec_t *spec);
int dm__arena_ensure(dm_arena_t *a, const dm_arena_spec_t *spec);
void dm__arena_apply(dm_arena_t *a, const dm_arena_spec_t *spec);
void dm__arena_mark_all_unused(void);
je_arena_t *dm__arena_je_for_node(dm_arena_t *a, int node);
int dm__arena_count(void);
dm_arena_t *dm__arena_at(int id);
void dm__arena_je_stats(dm_arena_t *a, dm_arena_stats_t *out);
int dm__arena_hugepages(uint64_t *out, int cap);
unsigned dm__tcache_create(void);
/* After an allocation outside the block cache: if the arena grew meanwhile
 * while holding dirty pages, those did not fit and are given back. */
void dm__arena_after_growth(je_arena_t *ja);
static inline void dm__arena_check_growth(je_arena_t *ja) {
    if (DM_UNLIKELY(atomic_load_explicit(&ja->grown, memory_order_relaxed) != 0))
        dm__arena_after_growth(ja);
}
void dm__tcache_destroy(unsigned tc);
/* fork: 0 before it takes every jemalloc arena's bump lock (dm__mu held), 1
 * after it, in parent and child, releases them. */
void dm__arena_fork(int phase);

extern je_arena_t *dm__je[DM_JE_MAX];
extern _Atomic uint16_t dm__seg_owner[1u << (DM_VA_BITS - DM_SEG_SHIFT)];

static inline je_arena_t *dm__owner_of(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    if (DM_UNLIKELY(seg >= (1u << (DM_VA_BITS - DM_SEG_SHIFT))))
        return NULL;
    uint16_t s = atomic_load_explicit(&dm__seg_owner[seg], memory_order_relaxed);
    return s ? dm__je[s - 1] : NULL;
}

/* runtime.c */
extern pthread_mutex_t dm__mu;
/* The size class a block's tag records, or -1 when it has none (tests). */
int dm__tag_class(const void *p);

/* The engine logs through the same function it offers the services. */
#define dm__log dm_log

#endif /* DM_RUNTIME_INTERNAL_H */
