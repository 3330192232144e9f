/*
 * mem.h: the engine's memory floor (//runtime:mem): what every file of the
 * engine shares below the policy arenas: the engine lock, the rate-limited
 * log, one jemalloc arena's state (assembled from the parts its modules own)
 * and the segment map that finds it from an address.
 *
 * The floor is mem.c (the lock, the log, the segment map), extent.c (the
 * extent hooks, extent.h), spill.c (file-backed arenas, spill.h) and
 * bigblock.c (big blocks, bigblock.h), over os.c and cgroup.c (//runtime:os).
 * It is a Bazel library of its own, so the build refuses it an include of the
 * floors above (arena.h, thread.h and the headers next to them): what it needs of a
 * policy arena is dm__place_t, which the arena above embeds.
 *
 * Lock order, for every path and for fork (runtime.c, "init, fork", takes them
 * in this order before fork()):
 *   1. dm__mem_mu, the engine lock (arenas, tables, the thread registry,
 *      stats); never taken on the fast path;
 *   2. jemalloc's own locks (it calls the extent hooks under an arena's grow
 *      lock);
 *   3. an arena's region lock (extent.h, region.mu) and its reuse lock
 *      (bigblock.h, reuse.mu), leaves; a spill arena's reserve_mu and
 *      pass_mu (spill.h) under or beside them.
 * The notify and observer locks (runtime.c) are taken with none of these held.
 */
#ifndef DM_RUNTIME_MEM_H
#define DM_RUNTIME_MEM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "jemalloc/jemalloc.h"
#include "runtime/bigblock.h"
#include "runtime/datamem.h"
#include "runtime/extent.h"

#define DM_LIKELY(x) __builtin_expect(!!(x), 1)
#define DM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define DM_CACHELINE 64

#define DM_JE_MAX 1024                       /* jemalloc arenas we create */
#define DM_SEG_SHIFT 30                      /* 1 GiB address-space segments */
#define DM_SEG_SIZE ((size_t)1 << DM_SEG_SHIFT)
#define DM_VA_BITS 47

/* Counters one thread writes and any thread reads: relaxed atomics compile to
 * plain adds on x86-64 (no lock prefix), and keep TSan honest. */
typedef _Atomic uint64_t dm__ctr_t;
#define DM_CTR_ADD(c, n)                                                       \
    atomic_store_explicit(&(c), atomic_load_explicit(&(c), memory_order_relaxed) + (n), \
                          memory_order_relaxed)
#define DM_CTR_GET(c) atomic_load_explicit(&(c), memory_order_relaxed)

/* What this floor reads of a policy arena (the floor above, arena.c, writes it
 * on install and reload): placement for new extents, and what the extent hooks
 * count back. */
typedef struct dm__place {
    const char *name;            /* the policy arena's name, for messages */
    _Atomic int thp, numa;       /* dm_thp_t, dm_numa_t */
    _Atomic uint64_t numa_nodes;
    _Atomic int64_t reuse_ms;    /* decay.dirty: how long a kept big block waits; -1 = no limit */
    /* lock / pinned: settings for new extents, and bytes currently locked or
     * registered (extent hooks). */
    _Atomic bool lock;
    _Atomic int pinned;          /* dm_pin_t */
    _Atomic uint64_t locked_bytes, pinned_bytes;
    dm__ctr_t placement_errors;
} dm__place_t;

struct dm__arena;
struct dm__spill;

/* One jemalloc arena with our extent hooks, and every part of it a module
 * owns. `slot` is its small integer id, also stored in the segment map so that
 * free() finds the owner from the address with one load. */
typedef struct dm__arena_je {
    extent_hooks_t hooks;    /* first: jemalloc hands &hooks back to us */
    unsigned index;          /* jemalloc's arena index */
    uint16_t slot;           /* our id; segment map holds slot + 1 */
    int node;                /* per_node arenas: their node; else -1 */
    dm__place_t *place;      /* its policy arena's settings, and counts back */
    /* The policy arena above (arena.c); this floor never looks inside it. */
    struct dm__arena *owner;
    /* The big half (arena.c, "Big halves"): the jemalloc arena serving this
     * one's blocks of DM_BIG_THP_MIN bytes and more; NULL when there is none
     * (then this one serves them). Set once, under dm__mem_mu. */
    struct dm__arena_je *_Atomic big;
    bool is_big;             /* this is some arena's big half */
    /* A file-backed arena's file and regions (spill.h); NULL for RAM. Set
     * before the arena is created, never changed. */
    struct dm__spill *spill;
    dm__region_t region;     /* extent.h: its address space */
    dm__reuse_t reuse;       /* bigblock.h: its kept big blocks */
    /* Some extent was mlock'ed / registered with the GPU runtime: purges
     * unlock first / are declined (arena.c). Only ever set to true. */
    _Atomic bool ever_locked, ever_pinned;
    /* Its owner counts live bytes (a copy of the policy arena's `tracked`, so
     * that a free, which has `ja` in hand, tests it with one load). */
    _Atomic bool tracked;
    /* arena.c's part, under dm__mem_mu: the allocations counted at the last
     * growth check (an arena with none since is idle), "arena.<index>.purge". */
    uint64_t ops_seen;
    size_t purge_mib[3];
} dm__arena_je_t;

#pragma GCC visibility push(hidden)

/* mem.c: the engine lock (see the lock order above). */
extern pthread_mutex_t dm__mem_mu;
/* At most one line a second per `last_s`: whether this one may go out. */
bool dm__mem_log_due(_Atomic int64_t *last_s);

/* mem.c: the segment map. Every 1 GiB segment of address space a region
 * reserves holds its arena's slot + 1 (extent.c writes it), so free() learns
 * the owning arena with one load; dm__mem_by_slot is written under
 * dm__mem_mu before jemalloc can call the arena's hooks (arena.c). */
extern dm__arena_je_t *dm__mem_by_slot[DM_JE_MAX];
extern _Atomic uint16_t dm__mem_seg_owner[1u << (DM_VA_BITS - DM_SEG_SHIFT)];

#pragma GCC visibility pop

static inline dm__arena_je_t *dm__mem_owner_of(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    if (DM_UNLIKELY(seg >= (1u << (DM_VA_BITS - DM_SEG_SHIFT))))
        return NULL;
    uint16_t s = atomic_load_explicit(&dm__mem_seg_owner[seg], memory_order_relaxed);
    return s ? dm__mem_by_slot[s - 1] : NULL;
}

/* A big half's blocks each start on a 2 MiB frame and are handed out at a
 * colour below DM_BIG_FRAME (bigblock.c, "Colour"): the jemalloc block under
 * the user pointer p of arena ja (its owner), p itself elsewhere. */
#define DM_BIG_FRAME ((uintptr_t)2 << 20)
static inline void *dm__block_of(const dm__arena_je_t *ja, const void *p) {
    return (void *)(ja && ja->is_big ? (uintptr_t)p & ~(DM_BIG_FRAME - 1) : (uintptr_t)p);
}

/* How far user pointer p is from the start of its block: its colour in a big half. */
static inline size_t dm__colour_of(const void *p) {
    return (size_t)((const char *)p - (const char *)dm__block_of(dm__mem_owner_of(p), p));
}

/* jemalloc's usable size of the block under user pointer p, counted from the
 * block's start (a colour included). */
static inline size_t dm__block_usable(const void *p) {
    return dmje_sallocx(dm__block_of(dm__mem_owner_of(p), p), 0);
}

/* The engine logs through the same function it offers the services (mem.c). */
#define dm__log dm_log

#endif /* DM_RUNTIME_MEM_H */
