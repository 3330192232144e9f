/*
 * extent.c: the extent hooks of every jemalloc arena we create (arena.c makes
 * the arenas; extent.h, dm__extent_hooks). They hand out memory from
 * address-space regions reserved for that arena alone (a bump pointer over
 * PROT_NONE reservations, committed on demand), mark each region's 1 GiB
 * segments in dm__mem_seg_owner (so free() finds the owner from the
 * address), apply the arena's placement (NUMA policy, hugepage advice) to
 * whole extents as they are created, page-lock or register them (`lock`,
 * `pinned`), and purge, decommit and count growth (dm__arena_after_growth) as
 * jemalloc asks. Extents are never unmapped (the dalloc hook opts out,
 * jemalloc retains them); dirty pages go back to the kernel through the purge
 * hooks as decay says. A file-backed arena's extents are its file's pages
 * instead (spill.c: mapped, reserved, punched there). Also the tests' fault
 * injection for these events.
 *
 * Thread safety: hooks run on any thread, inside jemalloc; they take only
 * their arena's bump mutex (a leaf lock) and read settings with relaxed
 * atomics.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "runtime/extent.h"
#include "runtime/mem.h"
#include "runtime/os.h"
#include "runtime/spill.h"

/* Fault injection for tests: the next n events fail (-1: all, 0: none). */
static _Atomic int64_t fault_extent_allocs, fault_placements;

void dm_fault_extent_alloc(int64_t n) {
    atomic_store_explicit(&fault_extent_allocs, n, memory_order_relaxed);
}

void dm_fault_placement(int64_t n) {
    atomic_store_explicit(&fault_placements, n, memory_order_relaxed);
}

static bool fault_fire(_Atomic int64_t *budget) {
    int64_t n = atomic_load_explicit(budget, memory_order_relaxed);
    while (n != 0) {
        int64_t next = n < 0 ? n : n - 1;
        if (atomic_compare_exchange_weak(budget, &n, next))
            return true;
    }
    return false;
}

/* ---- extent hooks ------------------------------------------------------ */

static size_t align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* Once per process: why address space ran out, naming RLIMIT_AS when set. */
static void log_reserve_failure(const dm__place_t *a, size_t len) {
    static _Atomic bool said;
    if (atomic_exchange_explicit(&said, true, memory_order_relaxed))
        return;
    uint64_t lim = dm__os_as_limit();
    if (lim)
        dm__log("datamem: arena '%s': cannot reserve %zu MiB of address space: the address-space "
                "limit RLIMIT_AS (ulimit -v, prlimit --as) is %llu MiB and is reached; datamem "
                "reserves address space in 1 GiB segments per arena in use. Allocations that "
                "do not fit fail with MemoryError.", a->name, len >> 20,
                (unsigned long long)(lim >> 20));
    else
        dm__log("datamem: arena '%s': cannot reserve %zu MiB of address space: %s", a->name,
                len >> 20, strerror(errno));
}

/* Reserves a fresh region of at least `need` bytes and marks its segments. The
 * old region's unused whole segments go back to the kernel (their owner entries
 * cleared first): under an RLIMIT_AS they are address space the job needs. */
static bool region_grow(dm__arena_je_t *ja, size_t need) {
    size_t len = align_up(need > DM_SEG_SIZE ? need : DM_SEG_SIZE, DM_SEG_SIZE);
    char *base = dm__os_reserve(len, DM_SEG_SIZE);
    if (!base) {
        log_reserve_failure(ja->place, len);
        return false;
    }
    if (ja->spill && !dm__spill_region_add(ja->spill, base, len)) { /* its stretch of file */
        dm__os_release(base, len);
        return false;
    }
    uintptr_t first = (uintptr_t)base >> DM_SEG_SHIFT;
    uintptr_t last = ((uintptr_t)base + len - 1) >> DM_SEG_SHIFT;
    if (last >= (1u << (DM_VA_BITS - DM_SEG_SHIFT)))
        return false; /* outside the map: leave it reserved but unused */
    for (uintptr_t s = first; s <= last; s++)
        atomic_store_explicit(&dm__mem_seg_owner[s], (uint16_t)(ja->slot + 1),
                              memory_order_release);
    if (ja->region.cur) { /* remember the old region's committed part (stats) */
        if (ja->region.nold < DM_JE_OLD_MAX) {
            ja->region.old[ja->region.nold][0] = ja->region.base;
            ja->region.old[ja->region.nold][1] = ja->region.cur;
        }
        ja->region.nold++;
        char *unused = (char *)align_up((size_t)ja->region.cur, DM_SEG_SIZE);
        if (unused < ja->region.end) {
            for (uintptr_t s = (uintptr_t)unused >> DM_SEG_SHIFT;
                 s <= ((uintptr_t)ja->region.end - 1) >> DM_SEG_SHIFT; s++)
                atomic_store_explicit(&dm__mem_seg_owner[s], 0, memory_order_release);
            dm__os_release(unused, (size_t)(ja->region.end - unused));
            ja->region.reserved -= (size_t)(ja->region.end - unused);
        }
    }
    ja->region.base = base;
    ja->region.cur = base;
    ja->region.end = base + len;
    ja->region.reserved += len;
    return true;
}

/* Memory jemalloc asks for while it creates an arena (its metadata): mapped
 * on its own, outside every segment, so an arena costs no address space until
 * it serves an array (with a 1 GiB segment per arena at creation, demo.yaml
 * would not start under `prlimit --as=5GiB`). No array is ever there. */
static void *meta_alloc(size_t size, size_t alignment) {
    char *p = dm__os_reserve(align_up(size, dm__os_page_size()), alignment);
    if (p && dm__os_commit(p, size) != 0)
        p = NULL; /* the reservation stays: a few MiB, once */
    return p;
}

static void place(dm__arena_je_t *ja, void *p, size_t size) {
    dm__place_t *a = ja->place;
    int thp = atomic_load_explicit(&a->thp, memory_order_relaxed);
    int numa = atomic_load_explicit(&a->numa, memory_order_relaxed);
    uint64_t nodes = atomic_load_explicit(&a->numa_nodes, memory_order_relaxed);
    if (ja->node >= 0) { /* per_node: this arena serves one node */
        numa = DM_NUMA_BIND;
        nodes = UINT64_C(1) << ja->node;
    }
    int errs = (dm__os_thp(p, size, thp) != 0) + (dm__os_numa(p, size, numa, nodes) != 0);
    if (DM_UNLIKELY(fault_fire(&fault_placements))) {
        errno = EIO; /* injected */
        errs++;
    }
    if (DM_LIKELY(errs == 0))
        return;
    /* The memory is still served, only not placed as asked: count it (stats,
     * metrics) and warn once per arena. Hooks run on any thread: atomic add. */
    if (atomic_fetch_add_explicit(&a->placement_errors, (uint64_t)errs, memory_order_relaxed) == 0)
        dm__log("datamem: arena '%s': cannot apply its NUMA/hugepage placement to new memory "
                "(%s); serving it unplaced, counting in placement_errors",
                a->name, strerror(errno));
}

/* ---- lock and pinned ------------------------------------------------------
 * `lock`: an extent is mlock'ed as it starts to serve (a fresh extent, or a
 * decommitted range committed again) and munlock'ed just before its pages go
 * back to the kernel (purge, decommit: madvise refuses locked pages anyway).
 * `pinned: cuda`: a fresh extent is registered with cudaHostRegister. The CUDA
 * runtime unregisters only whole registrations, while jemalloc purges parts of
 * extents, so a pinned arena never gives pages back (its purge and decommit
 * hooks decline): registered memory stays registered and resident for the
 * process, as in the CUDA caching host allocators. A failure (RLIMIT_MEMLOCK,
 * the CUDA runtime's error) is counted in placement_errors, logged once per
 * arena, and the memory served as ordinary pageable memory. */

static _Atomic int64_t fault_locks; /* tests: the next n locks fail (ENOMEM) */

void dm_fault_lock(int64_t n) { atomic_store_explicit(&fault_locks, n, memory_order_relaxed); }

static void pin_failed(dm__place_t *a, const char *what, const char *why) {
    if (atomic_fetch_add_explicit(&a->placement_errors, 1, memory_order_relaxed) != 0)
        return;
    uint64_t lim = dm__os_memlock_limit();
    char limtext[64] = "unlimited";
    if (lim != UINT64_MAX)
        snprintf(limtext, sizeof(limtext), "%llu KiB", (unsigned long long)(lim >> 10));
    dm__log("datamem: arena '%s': cannot %s new memory (%s; RLIMIT_MEMLOCK, ulimit -l, is %s); "
            "serving it as ordinary pageable memory, counting in placement_errors",
            a->name, what, why, limtext);
}

static void pin_range(dm__arena_je_t *ja, void *p, size_t size, bool fresh) {
    dm__place_t *a = ja->place;
    if (atomic_load_explicit(&a->lock, memory_order_relaxed)) {
        int rc = fault_fire(&fault_locks) ? -ENOMEM : dm__os_lock(p, size);
        if (rc == 0) {
            atomic_fetch_add_explicit(&a->locked_bytes, size, memory_order_relaxed);
            ja->ever_locked = true;
        } else {
            pin_failed(a, "page-lock (mlock)", strerror(-rc));
        }
    }
    if (fresh && atomic_load_explicit(&a->pinned, memory_order_relaxed) == DM_PIN_CUDA) {
        char why[160];
        if (dm__os_gpu_register(p, size, why, sizeof(why)) == 0) {
            atomic_fetch_add_explicit(&a->pinned_bytes, size, memory_order_relaxed);
            ja->ever_pinned = true;
        } else {
            pin_failed(a, "register with the CUDA runtime (cudaHostRegister)", why);
        }
    }
}

/* Before [p, p+len) goes back to the kernel. False: the pages must stay. */
static bool unpin_range(dm__arena_je_t *ja, void *p, size_t len) {
    if (ja->ever_pinned)
        return false;
    if (ja->ever_locked && dm__os_unlock(p, len) == 0) {
        dm__place_t *a = ja->place;
        uint64_t cur = atomic_load_explicit(&a->locked_bytes, memory_order_relaxed);
        while (!atomic_compare_exchange_weak_explicit(&a->locked_bytes, &cur,
                                                      cur > len ? cur - len : 0,
                                                      memory_order_relaxed, memory_order_relaxed))
            ;
    }
    return true;
}

static void *hook_alloc(extent_hooks_t *h, void *new_addr, size_t size,
                        size_t alignment, bool *zero, bool *commit,
                        unsigned arena_ind) {
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    if (DM_UNLIKELY(fault_fire(&fault_extent_allocs)))
        return NULL;
    if (alignment < dm__os_page_size())
        alignment = dm__os_page_size();
    /* Hugepage-backed arenas align big extents to 2 MiB so THP can back them. */
    if (atomic_load_explicit(&ja->place->thp, memory_order_relaxed) == DM_THP_ON &&
        size >= ((size_t)2 << 20) && alignment < ((size_t)2 << 20))
        alignment = (size_t)2 << 20;

    if (DM_UNLIKELY(ja->region.creating) && !new_addr) {
        void *m = meta_alloc(size, alignment);
        if (m) {
            *zero = true;
            *commit = true;
        }
        return m;
    }
    pthread_mutex_lock(&ja->region.mu);
    char *p = NULL;
    if (new_addr) { /* in-place growth: only right after our last extent */
        if ((char *)new_addr == ja->region.cur && (size_t)(ja->region.end - ja->region.cur) >= size)
            p = new_addr;
    } else {
        char *at = ja->region.cur ? (char *)align_up((size_t)ja->region.cur, alignment) : NULL;
        if (!at || at > ja->region.end || (size_t)(ja->region.end - at) < size) {
            if (region_grow(ja, size + alignment))
                at = (char *)align_up((size_t)ja->region.cur, alignment);
            else
                at = NULL;
        }
        p = at;
    }
    if (p) {
        if ((ja->spill ? dm__spill_map(ja, p, size, *commit) : dm__os_commit(p, size)) != 0)
            p = NULL;
        else
            ja->region.cur = p + size;
    }
    pthread_mutex_unlock(&ja->region.mu);
    if (!p)
        return NULL;
    if (!ja->spill) /* a file's pages take no placement (spill.c) */
        place(ja, p, size);
    *zero = true; /* never handed out before: fresh anonymous pages */
    dm__place_t *a = ja->place;
    if (!*commit && !atomic_load_explicit(&a->lock, memory_order_relaxed) &&
        atomic_load_explicit(&a->pinned, memory_order_relaxed) == DM_PIN_NONE) {
        /* jemalloc grows by more than it needs and keeps the rest as retained
         * address space. The mapping is committed already, but reporting it
         * uncommitted makes jemalloc call hook_commit for each part it starts
         * to use, which is where growth is counted: counting the whole
         * mapping here hid every later first use of the retained rest from
         * the growth purge (dm__arena_after_growth). */
        return p;
    }
    pin_range(ja, p, size, true);
    atomic_fetch_add_explicit(&ja->region.grown, size, memory_order_relaxed);
    *commit = true;
    return p;
}

/* Opt out: jemalloc keeps the extent as retained address space and reuses it. */
static bool hook_dalloc(extent_hooks_t *h, void *addr, size_t size,
                        bool committed, unsigned arena_ind) {
    return true;
}

static void hook_destroy(extent_hooks_t *h, void *addr, size_t size,
                         bool committed, unsigned arena_ind) {
    /* Arenas are never destroyed; if jemalloc asks, keep the address space. */
}

/* Decommit drops the pages (MADV_DONTNEED; the mapping stays), so commit
 * has nothing to do but note that the arena grows again: jemalloc commits a
 * decommitted (retained) range only to reuse it, and its pages will be faulted
 * in anew. The pages read as zeros, as commit promises. */
static bool hook_commit(extent_hooks_t *h, void *addr, size_t size,
                        size_t offset, size_t length, unsigned arena_ind) {
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    if (ja->spill && dm__spill_commit(ja, (char *)addr + offset, length) != 0)
        return true; /* no disk blocks: the allocation that needed them fails */
    atomic_fetch_add_explicit(&ja->region.grown, length, memory_order_relaxed);
    pin_range(ja, (char *)addr + offset, length, false);
    return false;
}

static bool hook_decommit(extent_hooks_t *h, void *addr, size_t size,
                          size_t offset, size_t length, unsigned arena_ind) {
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    if (ja->spill) /* a hole in the file: its blocks go back to the disk */
        return dm__spill_decommit(ja, (char *)addr + offset, length) != 0;
    if (!unpin_range(ja, (char *)addr + offset, length))
        return true; /* declined: the pages stay committed */
    dm__bigblock_dirty_gone(ja, length);
    return dm__os_purge((char *)addr + offset, length, true) != 0;
}

static bool hook_purge_lazy(extent_hooks_t *h, void *addr, size_t size,
                            size_t offset, size_t length, unsigned arena_ind) {
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    /* A file's pages: madvise keeps their blocks; decommit punches them (spill.c). */
    if (ja->spill || !unpin_range(ja, (char *)addr + offset, length))
        return true;
    dm__bigblock_dirty_gone(ja, length);
    return dm__os_purge((char *)addr + offset, length, false) != 0;
}

static bool hook_purge_forced(extent_hooks_t *h, void *addr, size_t size,
                              size_t offset, size_t length, unsigned arena_ind) {
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    if (ja->spill || !unpin_range(ja, (char *)addr + offset, length))
        return true;
    dm__bigblock_dirty_gone(ja, length);
    return dm__os_purge((char *)addr + offset, length, true) != 0;
}

static bool hook_split(extent_hooks_t *h, void *addr, size_t size,
                       size_t size_a, size_t size_b, bool committed,
                       unsigned arena_ind) {
    return false; /* one mapping: any split is fine */
}

static bool hook_merge(extent_hooks_t *h, void *addr_a, size_t size_a,
                       void *addr_b, size_t size_b, bool committed,
                       unsigned arena_ind) {
    /* Only extents of one arena can meet, all inside our reservations; a
     * file-backed arena's two regions are two stretches of its file. */
    dm__arena_je_t *ja = (dm__arena_je_t *)h;
    return ja->spill && !dm__spill_same_region(ja->spill, addr_a, addr_b);
}

const extent_hooks_t dm__extent_hooks = {
    hook_alloc, hook_dalloc, hook_destroy, hook_commit, hook_decommit,
    hook_purge_lazy, hook_purge_forced, hook_split, hook_merge,
};
