/*
 * arena.h: policy arenas (arena.c), the engine's middle floor
 * (//runtime:arena): each found by name and living for the process (arrays
 * outlive policies), with one jemalloc arena behind it (mem.h), or one per
 * NUMA node with per_node, and a big half for blocks of 4 MiB and more; their
 * settings, the purge on growth, stats, hugepage accounting and explicit
 * thread caches. It sees the memory floor below and nothing above: the
 * dispatch tables, threads and allocation paths (thread.h, dispatch.h, alloc.c) use it.
 *
 * Thread safety: arenas are made and their settings changed under dm__mem_mu;
 * the fast path and the extent hooks read settings with relaxed atomics.
 */
#ifndef DM_RUNTIME_ARENA_H
#define DM_RUNTIME_ARENA_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/policy.h"
#include "runtime/datamem.h"
#include "runtime/mem.h"

#define DM_RT_ARENAS_MAX DM_STATS_ARENAS_MAX /* policy arenas ever seen */

/* An arena's counters, and a thread's per arena (thread.c). */
typedef struct dm__ctrs {
    dm__ctr_t nalloc, nfree, nrealloc, nfail, nfallback, ndtype_known, bytes, nlimit;
} dm__ctrs_t;

typedef struct dm__arena {
    char name[DM_NAME_MAX];
    int id;
    /* What the memory floor reads (mem.h): placement for new extents, which
     * reload rewrites, and what the extent hooks count back. */
    dm__place_t place;
    _Atomic size_t alignment;
    _Atomic bool per_node, in_policy;
    _Atomic size_t dirty_budget; /* decay.budget; SIZE_MAX = never */
    /* Written under dm__mem_mu, read by the per_node fast path without it. */
    dm__arena_je_t *_Atomic single; /* the arena when not per_node */
    dm__arena_je_t *_Atomic by_node[DM_NODES_MAX];
    dm__ctr_t growth_purges;     /* purges by decay.budget */
    /* `limit` (reloadable; SIZE_MAX = none). An arena counts its live bytes
     * (usable sizes, one atomic add per allocation and free) from the first
     * install that gives it a limit, for the rest of the process; untracked
     * arenas pay nothing. */
    _Atomic size_t limit;
    _Atomic bool tracked;
    _Atomic uint64_t live;
    dm__ctrs_t dead;             /* counters of threads that exited */
} dm__arena_t;

#pragma GCC visibility push(hidden)

dm__arena_t *dm__arena_get(const char *name, const dm_arena_spec_t *spec);
dm__arena_t *dm__arena_find(const char *name);
int dm__arena_ensure(dm__arena_t *a, const dm_arena_spec_t *spec);
void dm__arena_apply(dm__arena_t *a, const dm_arena_spec_t *spec);
void dm__arena_mark_all_unused(void);
dm__arena_je_t *dm__arena_je_for_node(dm__arena_t *a, int node);
int dm__arena_count(void);
dm__arena_t *dm__arena_at(int id);
void dm__arena_je_stats(dm__arena_t *a, dm_arena_stats_t *out);
int dm__arena_hugepages(uint64_t *out, int cap);
unsigned dm__arena_tcache_create(void);
/* After an allocation outside the block cache: if the arena grew meanwhile
 * while holding dirty pages, those did not fit and are given back. */
void dm__arena_after_growth(dm__arena_je_t *ja);
/* Every arena's idle pages (kept big blocks, dirty pages) and glibc's free
 * ones go back to the kernel now; false if the runtime's lock was busy and
 * nothing was done (arena.c; the worker limit's relief, tally.c). */
bool dm__arena_give_back_idle(void);
/* The bytes every arena keeps idle now (dirty and muzzy pages, kept big
 * blocks; jemalloc's stats refreshed), or UINT64_MAX if the runtime's lock was
 * busy (arena.c; the worker limit's figure of memory beside the arrays). */
uint64_t dm__arena_idle_bytes(void);
/* malloc_trim calls the purge on growth has made (tests). */
uint64_t dm__arena_growth_trims(void);
static inline void dm__arena_check_growth(dm__arena_je_t *ja) {
    if (DM_UNLIKELY(atomic_load_explicit(&ja->region.grown, memory_order_relaxed) != 0))
        dm__arena_after_growth(ja);
}
void dm__arena_tcache_destroy(unsigned tc);
/* fork: 0 before it takes every jemalloc arena's bump lock (dm__mem_mu held), 1
 * after it, in parent and child, releases them. */
void dm__arena_fork(int phase);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_ARENA_H */
