/*
 * runtime.c: the engine's lifecycle, its top floor: initialisation, fork
 * handling, jemalloc's options, and the observers through which the services
 * hear of installs and forks.
 *
 * The engine's files, one concern each with its own header, in floors that are
 * Bazel libraries, each seeing only the headers of those below it
 * (docs/design.md, the picture):
 *   the top (//runtime:runtime): this file; install.c (compiling and
 *       publishing a policy); stats.c (dm_stats_snapshot)
 *   the allocation floor (//runtime:engine): alloc.c (the allocation paths:
 *       the fast path, tallied, big, realloc, free); refusal.c (a failed or
 *       refused allocation: fallback, spill, the record, the log); bcache.c
 *       (the block cache); thread.c (per-thread state, the registry, binding);
 *       context.c (interned tag sets); dispatch.c (the published tables and
 *       their views); tally.c (bytes per tag, the worker limit) and beside.c
 *       (what counts beside the arrays)
 *   the arena floor (//runtime:arena): arena.c, policy arenas and the
 *       jemalloc arenas behind them
 *   the memory floor (//runtime:mem): mem.c (the engine lock and the lock
 *       order, the log, the segment map); extent.c (the extent hooks);
 *       bigblock.c (blocks of 4 MiB and more); spill.c (file-backed arenas)
 *   the kernel (//runtime:os): os.c, and cgroup.c its cgroup files
 *
 * Thread safety: dm__mem_mu guards the engine's shared state (arenas,
 * publication, the thread registry, stats); it is never taken on the fast
 * path. Init runs once (pthread_once); observers are registered at start-up.
 */
#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/context.h"
#include "runtime/install.h"
#include "runtime/os.h"
#include "runtime/spill.h"
#include "runtime/thread.h"

/* jemalloc options, read once at its initialisation (docs/performance.md).
 * tcache_max: cache sizes up to 1 MiB per thread and arena (the default 32 KiB
 * sends 256 KiB create/destroy down jemalloc's locked large path, +190 ns;
 * performance-baseline).
 * tcache_nslots_large: jemalloc never garbage-collects explicit caches (its GC
 * visits only the thread's own cache) and decay cannot see what they hold; with
 * the default 20 slots per size class, one (thread, arena) kept 130 MiB of freed
 * 16 KiB-1 MiB arrays for good. 4 slots: 26 MiB at most.
 * tcache_gc_incr_bytes: that GC is then pure overhead, run every 64 KiB
 * allocated, i.e. on every big array (190 of 700 instructions per 256 KiB
 * malloc+free, bench/callgrind.sh); push it out of the way.
 * oversize_threshold:0: no hidden "huge" arena. A thread's bound arena (see
 * thread.c, auto_bind) is served by plain malloc(), which would otherwise send requests
 * of 8 MiB and more to jemalloc's own huge arena instead of ours. */
DM_API const char *dmje_malloc_conf =
    "tcache_max:1048576,tcache_nslots_large:4,tcache_gc_incr_bytes:1073741824,"
    "oversize_threshold:0";

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* ---- observers: the services' seam (datamem.h) -----------------------------
 * Registered once at start-up (a constructor in service/), never removed: a
 * slot is filled, then published by the release-increment of the count. */

static struct {
    dm_install_hook_t on_install;
    dm_fork_hook_t on_fork_child;
    void *arg;
} observers[DM_OBSERVERS_MAX];
static _Atomic int nobservers;
static pthread_mutex_t observers_mu = PTHREAD_MUTEX_INITIALIZER;

int dm_runtime_observe(dm_install_hook_t on_install, dm_fork_hook_t on_fork_child, void *arg) {
    pthread_mutex_lock(&observers_mu);
    int n = atomic_load_explicit(&nobservers, memory_order_relaxed);
    if (n >= DM_OBSERVERS_MAX) {
        pthread_mutex_unlock(&observers_mu);
        return DM_ERANGE;
    }
    observers[n].on_install = on_install;
    observers[n].on_fork_child = on_fork_child;
    observers[n].arg = arg;
    atomic_store_explicit(&nobservers, n + 1, memory_order_release);
    pthread_mutex_unlock(&observers_mu);
    return 0;
}


/* Installs notify after they publish, outside dm__mem_mu, so two racing
 * installs can reach here out of order: notify_mu delivers them one at a time
 * and drops one older than the last delivered, so an observer never follows a
 * policy that a later install has replaced. Observers must not install. */
static pthread_mutex_t notify_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t notified_seq; /* under notify_mu */

void dm__runtime_notify_install(const dm_policy_t *p, uint64_t seq) {
    pthread_mutex_lock(&notify_mu);
    if (seq > notified_seq) {
        notified_seq = seq;
        int nobs = atomic_load_explicit(&nobservers, memory_order_acquire);
        for (int i = 0; i < nobs; i++)
            if (observers[i].on_install)
                observers[i].on_install(p, seq, observers[i].arg);
    }
    pthread_mutex_unlock(&notify_mu);
}

void dm_runtime_after_fork_child(void) {
    int nobs = atomic_load_explicit(&nobservers, memory_order_acquire);
    for (int i = 0; i < nobs; i++)
        if (observers[i].on_fork_child)
            observers[i].on_fork_child(observers[i].arg);
}

/* ---- init, fork ------------------------------------------------------------
 * fork() copies only the calling thread, so before it the forking thread takes
 * every lock another thread could hold, in the engine's lock order (mem.h),
 * which every other path keeps too:
 *   1. dm__mem_mu: its holders call into jemalloc (stats, arenas, caches);
 *   2. jemalloc's own locks, by its prefork handler;
 *   3. each arena's bump lock and reuse lock: jemalloc calls the extent hook,
 *      which takes the bump lock, while it holds the arena's grow lock.
 * Taking 3 before 2 deadlocks: a thread in the hook, holding the grow lock,
 * waits for the bump lock the forking thread holds, which waits for the grow
 * lock (runtime_test: test_fork_while_arenas_grow).
 *
 * pthread_atfork runs prepare handlers in the reverse order of registration and
 * the parent and child handlers in order, so ours are registered on either
 * side of jemalloc's: the inner pair (3) by a constructor that runs before
 * jemalloc's constructor registers its handlers (a constructor with a priority
 * is placed ahead of those without), the outer pair (1) at init, after
 * jemalloc's. In the child, the inner handler unlocks 3 and maps the spill
 * arenas' copies before anything else; jemalloc's makes it usable; the outer
 * retires the threads that did not survive (thread.c, dm__thread_fork_unlink)
 * and frees what they held. */

/* Spill arenas' files are snapshotted for the child with every bump lock
 * held (spill.c, "Fork"), and the child maps its copy before anything else. */
static void inner_prepare(void) {
    dm__arena_fork(0);
    dm__bigblock_fork(0);
    dm__spill_fork(0);
}

static void inner_parent(void) {
    dm__spill_fork(1);
    dm__bigblock_fork(1);
    dm__arena_fork(1);
}

static void inner_child(void) {
    dm__spill_fork(2);
    dm__bigblock_fork(2);
    dm__arena_fork(1);
}

__attribute__((constructor(101))) static void register_inner_fork_handlers(void) {
    pthread_atfork(inner_prepare, inner_parent, inner_child);
}

static void outer_prepare(void) { pthread_mutex_lock(&dm__mem_mu); }

static void outer_parent(void) { pthread_mutex_unlock(&dm__mem_mu); }

static void outer_child(void) {
    pthread_mutex_init(&notify_mu, NULL); /* a notifying thread did not survive */
    dm__thread_t *gone = dm__thread_fork_unlink();
    pthread_mutex_unlock(&dm__mem_mu);
    dm__thread_fork_release(gone);
}

static void init_once_fn(void) {
    dm__bcache_init();
    dm__thread_init();
    /* jemalloc registers its fork handlers as it initialises (its constructor
     * has done so already): make sure, so the outer pair comes after them. */
    unsigned narenas;
    size_t sz = sizeof(narenas);
    dmje_mallctl("arenas.narenas", &narenas, &sz, NULL, 0);
    pthread_atfork(outer_prepare, outer_parent, outer_child);
    pthread_mutex_lock(&dm__mem_mu);
    dm__context_root_tally_init();
    pthread_mutex_unlock(&dm__mem_mu);
}

int dm_runtime_init(void) {
    pthread_once(&init_once, init_once_fn);
    return 0;
}

void dm_runtime_topology(dm_topology_t *out) { out->nodes = dm__os_numa_nodes(); }

int dm_runtime_hugepages(uint64_t *out, int cap) { return dm__arena_hugepages(out, cap); }
