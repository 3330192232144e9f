/*
 * beside.c: the memory beside the arenas, which counts against the worker
 * limit (beside.h; tally.c compares its total with the limit less it).
 *
 * worker_limit bounds what the process holds, not only its counted arrays: a
 * pandas job keeps a third of its memory in malloc (hash tables), Arrow's pool
 * and Python objects, and a cgroup charges all of it (counting arrays alone, a
 * pandas ETL under spill.yaml was OOM-killed with its arrays at 80% of the
 * limit). So the
 * worker total is compared with its limit less `beside`: the most the
 * process's memory beside its counted arrays has been over the last
 * DM_TALLY_BESIDE_WINDOW_MS (two half-window buckets: between one half and one
 * whole window). A reading is the process's resident anonymous bytes (os.c,
 * dm__os_anon_resident) less the counted live bytes, and, when that would be
 * a new high, less the pages the arenas keep idle (arena.c: jemalloc's stats
 * refreshed), which the next arrays reuse. Why the most and not the last:
 * pandas and Arrow grow their own memory between two arrays, by 100 MiB and
 * more in a merge, where no allocation of ours can say no; the arrays leave
 * room for the highs they have seen (bench/spill_pandas.py: pandas3_arrow in a
 * cgroup of 0.6x its peak was OOM-killed under spill.yaml with the last
 * reading, finished with the most).
 *
 * A reserve against the worker limit reads again when the last reading is
 * DM_TALLY_BESIDE_STALE_MS old (a coarse clock read; one thread wins a
 * compare-and-swap and reads /proc/self/statm, ~10 us, at most 100 times a
 * second): a process that makes no arrays pays nothing. Spilled blocks are file
 * pages, not anonymous: not beside. Counted blocks not yet written (np.empty)
 * are counted whole in `live` and are not resident, which reads as less
 * beside (never below 0): the sum is then what the process holds.
 *
 * One budget for a cgroup's processes: where the limit is a share of a
 * cgroup's limit (`worker_limit: 70%` in a container), a reading is that
 * cgroup's charge instead (cgroup.c, dm__cgroup_charge: anonymous pages and
 * shmem of every process in it), so the arrays of this process count against
 * what the others hold too: four Pool workers in one group share its 70%, and
 * the one whose array would pass it spills or refuses, not the kernel's OOM
 * killer. Another process's growth is seen at this process's next reading
 * (DM_TALLY_BESIDE_STALE_MS; an array counts once written, as the kernel
 * charges it), and its frees after the window (bench/spill_pool.py). A
 * DATAMEM_MEMORY_LIMIT or a size in the policy stays this process's own.
 *
 * Thread safety: relaxed atomics (design.md's concurrency table); the
 * group's directory under dm__mem_mu, which a reader only tries.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "runtime/arena.h"
#include "runtime/beside.h"
#include "runtime/mem.h"
#include "runtime/os.h"

#define DM_TALLY_BESIDE_STALE_NS ((uint64_t)DM_TALLY_BESIDE_STALE_MS * 1000000)
static _Atomic uint64_t beside;    /* bytes counted against the worker limit: the window's most */
static _Atomic uint64_t beside_at; /* CLOCK_MONOTONIC_COARSE ns of the last reading, 0: never */
static _Atomic uint64_t window_at; /* when the current bucket began */
static _Atomic uint64_t most_now, most_before; /* the current and the previous bucket's most */
static char group[4096];   /* the budget's cgroup directory, "" none (dm__mem_mu) */
static int group_version;  /* its hierarchy: 1 or 2 (dm__mem_mu) */
static _Atomic bool grouped; /* group[0] != 0: a reader without one takes no lock */
static const _Atomic uint64_t none_counted;
/* The counted live bytes, which are not beside (tally.c's worker total; set at install) */
static const _Atomic uint64_t *_Atomic counted = &none_counted;

static uint64_t counted_live(void) {
    return atomic_load_explicit(atomic_load_explicit(&counted, memory_order_relaxed),
                                memory_order_relaxed);
}
uint64_t dm__beside_window_ms = DM_TALLY_BESIDE_WINDOW_MS;

/* CLOCK_MONOTONIC_COARSE in ns: a vDSO read, no system call. */
static inline uint64_t coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* What the budget's memory holds now: its cgroup's charge when the limit is a
 * share of a cgroup's (every process in the group counts), else this
 * process's resident anonymous bytes; UINT64_MAX while dm__mem_mu is busy
 * (the group's directory is set under it). */
static uint64_t held_now(void) {
    if (!atomic_load_explicit(&grouped, memory_order_relaxed))
        return dm__os_anon_resident();
    if (pthread_mutex_trylock(&dm__mem_mu) != 0)
        return UINT64_MAX;
    uint64_t held = group[0] ? dm__cgroup_charge(group, group_version) : UINT64_MAX;
    pthread_mutex_unlock(&dm__mem_mu);
    return held != UINT64_MAX ? held : dm__os_anon_resident();
}

static __attribute__((noinline)) void beside_read(uint64_t now, uint64_t at) {
    if (!atomic_compare_exchange_strong_explicit(&beside_at, &at, now ? now : 1,
                                                 memory_order_relaxed, memory_order_relaxed))
        return; /* another thread reads it */
    uint64_t anon = held_now();
    if (anon == UINT64_MAX)
        return; /* the policy is being installed: the next look reads */
    uint64_t half = dm__beside_window_ms * 1000000 / 2;
    uint64_t since = now - atomic_load_explicit(&window_at, memory_order_relaxed);
    uint64_t cur = atomic_load_explicit(&most_now, memory_order_relaxed),
             before = atomic_load_explicit(&most_before, memory_order_relaxed);
    if (since >= half) { /* a new bucket; the one before is forgotten past a whole window */
        before = since >= 2 * half ? 0 : cur;
        cur = 0;
        atomic_store_explicit(&window_at, now, memory_order_relaxed);
    }
    uint64_t live = counted_live();
    uint64_t b = anon > live ? anon - live : 0;
    if (b > cur && b > before) { /* a new high, unless it is the arenas' idle pages */
        uint64_t kept = dm__arena_idle_bytes();
        b = kept == UINT64_MAX ? b : b > kept ? b - kept : 0;
    }
    cur = b > cur ? b : cur;
    atomic_store_explicit(&most_now, cur, memory_order_relaxed);
    atomic_store_explicit(&most_before, before, memory_order_relaxed);
    atomic_store_explicit(&beside, cur > before ? cur : before, memory_order_relaxed);
}

/* Gives the arenas' idle pages back (arena.c) and reads `beside` again:
 * whether it was done. At most once per staleness bound, and only once the
 * counted bytes fell below what they were at the last relief (frees may have
 * left idle pages) or ten bounds have passed: a job spilling array after array
 * does not purge and trim for each. Not done while the runtime's lock is busy. */
bool dm__beside_relieved(void) {
    static _Atomic uint64_t relieved_at, live_then;
    uint64_t now = coarse_ns() + 1; /* 0 is "never" */
    uint64_t at = atomic_load_explicit(&relieved_at, memory_order_relaxed);
    uint64_t live = counted_live();
    bool freed = live < atomic_load_explicit(&live_then, memory_order_relaxed);
    if (at && now - at < (freed ? 1 : 10) * DM_TALLY_BESIDE_STALE_NS)
        return false;
    if (!atomic_compare_exchange_strong_explicit(&relieved_at, &at, now, memory_order_relaxed,
                                                 memory_order_relaxed))
        return false; /* another thread relieves */
    atomic_store_explicit(&live_then, live, memory_order_relaxed);
    if (!dm__arena_give_back_idle())
        return false;
    atomic_store_explicit(&beside_at, 0, memory_order_relaxed); /* read at the next look */
    return true;
}

uint64_t dm__beside_now(void) {
    uint64_t now = coarse_ns();
    uint64_t at = atomic_load_explicit(&beside_at, memory_order_relaxed);
    if (DM_UNLIKELY(!at || now - at >= DM_TALLY_BESIDE_STALE_NS))
        beside_read(now, at);
    return atomic_load_explicit(&beside, memory_order_relaxed);
}

uint64_t dm__beside_last(void) { return atomic_load_explicit(&beside, memory_order_relaxed); }

void dm__beside_configure(const char *dir, int version, const _Atomic uint64_t *live) {
    atomic_store_explicit(&counted, live, memory_order_relaxed);
    snprintf(group, sizeof(group), "%s", dir);
    group_version = version;
    atomic_store_explicit(&grouped, group[0] != 0, memory_order_relaxed);
    /* the policy's limit starts afresh: read at the next reserve, a new window */
    atomic_store_explicit(&most_now, 0, memory_order_relaxed);
    atomic_store_explicit(&most_before, 0, memory_order_relaxed);
    atomic_store_explicit(&window_at, 0, memory_order_relaxed);
    atomic_store_explicit(&beside, 0, memory_order_relaxed);
    atomic_store_explicit(&beside_at, 0, memory_order_relaxed);
}
