/*
 * arena.c: policy arenas, the jemalloc arenas behind them (their settings,
 * big halves, purge on growth, stats, hugepage accounting) and explicit
 * thread caches.
 *
 * Each jemalloc arena we create gets extent hooks (extent.c) that hand out
 * memory from address-space regions reserved for that arena alone (a bump
 * pointer over PROT_NONE reservations, committed on demand). Three things
 * follow:
 *   - placement: NUMA policy (mbind) and hugepage advice (madvise) are applied to
 *     whole extents as they are created, so they never split a mapping per array;
 *   - ownership: every 1 GiB segment of address space maps to one arena in
 *     dm__mem_seg_owner, so free() learns the owning arena with one load and can use
 *     that arena's explicit thread cache (jemalloc's thread caches ignore arenas:
 *     a shared cache would hand one arena's memory out as another's);
 *   - zeroing: with non-default hooks jemalloc zeroes reused memory for calloc
 *     with memset instead of a purge and refault (18-45x faster np.zeros+use,
 *     docs/performance.md).
 * Extents are never unmapped (the dalloc hook opts out, jemalloc retains them);
 * dirty pages go back to the kernel through the purge hooks as decay says.
 *
 * Arenas live for the process: arrays outlive every policy that named them.
 *
 * Thread safety: arena creation and settings changes run under
 * dm__mem_mu; the hooks read the settings with relaxed atomics.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/arena.h"
#include "runtime/bigblock.h"
#include "runtime/os.h"
#include "runtime/spill.h"

static dm__arena_t *arenas[DM_RT_ARENAS_MAX];
static int narenas;
static int nje;

/* ---- jemalloc arenas ---------------------------------------------------- */

static int mallctl_arena_ssize(unsigned idx, const char *leaf, ssize_t v) {
    char name[96];
    snprintf(name, sizeof(name), "arena.%u.%s", idx, leaf);
    return dmje_mallctl(name, NULL, NULL, &v, sizeof(v));
}

static int je_settings(dm__arena_je_t *ja, const dm_arena_spec_t *spec) {
    char name[96];
    /* Eager purge re-faults every page of 8-64 MiB temporaries (2.4-3.1x slower
     * than NumPy's default, docs/performance.md): never treat a size as
     * "oversize" in our arenas. */
    size_t never = (size_t)1 << 62;
    snprintf(name, sizeof(name), "arena.%u.oversize_threshold", ja->index);
    int rc = dmje_mallctl(name, NULL, NULL, &never, sizeof(never));
    /* A pinned arena never gives pages back (extent.c, lock and pinned): no
     * decay that would only try, and be declined, again and again. */
    bool keep = spec->pinned != DM_PIN_NONE;
    if (rc == 0)
        rc = mallctl_arena_ssize(ja->index, "dirty_decay_ms",
                                 keep ? -1 : (ssize_t)spec->dirty_decay_ms);
    if (rc == 0)
        rc = mallctl_arena_ssize(ja->index, "muzzy_decay_ms",
                                 keep ? -1 : (ssize_t)spec->muzzy_decay_ms);
    return rc == 0 ? 0 : DM_EARENA;
}

static dm__arena_je_t *je_create(dm__arena_t *owner, int node, const dm_arena_spec_t *spec,
                                 dm__spill_t *spill) {
    if (nje >= DM_JE_MAX)
        return NULL;
    dm__arena_je_t *ja =
        dmje_mallocx(sizeof(*ja), MALLOCX_ZERO | MALLOCX_TCACHE_NONE | MALLOCX_ARENA(0));
    if (!ja)
        return NULL;
    ja->hooks = dm__extent_hooks;
    ja->spill = spill;
    ja->node = node;
    ja->owner = owner;
    ja->place = &owner->place;
    ja->slot = (uint16_t)nje;
    ja->tracked = atomic_load_explicit(&owner->tracked, memory_order_relaxed);
    pthread_mutex_init(&ja->region.mu, NULL);
    pthread_mutex_init(&ja->reuse.mu, NULL);
    /* Publish before jemalloc can call the hooks (arenas.create may allocate). */
    dm__mem_by_slot[nje] = ja;
    extent_hooks_t *hp = &ja->hooks;
    size_t sz = sizeof(ja->index);
    ja->region.creating = true; /* under dm__mem_mu: no other arena is being created */
    int rc = dmje_mallctl("arenas.create", &ja->index, &sz, &hp, sizeof(hp));
    ja->region.creating = false;
    if (rc != 0) {
        uint64_t lim = dm__os_as_limit();
        if (lim)
            dm__log("datamem: arena '%s': jemalloc cannot create an arena (%s); the "
                    "address-space limit RLIMIT_AS is %llu MiB", owner->name, strerror(rc),
                    (unsigned long long)(lim >> 20));
        else
            dm__log("datamem: arena '%s': jemalloc cannot create an arena (%s)", owner->name,
                    strerror(rc));
        dm__mem_by_slot[nje] = NULL;
        dmje_dallocx(ja, MALLOCX_TCACHE_NONE);
        return NULL;
    }
    nje++;
    char name[64];
    size_t miblen = 3;
    snprintf(name, sizeof(name), "arena.%u.purge", ja->index);
    if (dmje_mallctlnametomib(name, ja->purge_mib, &miblen) != 0)
        ja->purge_mib[0] = 0; /* no purge on growth */
    if (je_settings(ja, spec) != 0)
        dm__log("datamem: arena '%s': cannot apply decay settings", owner->name);
    /* jemalloc grows an arena's retained memory geometrically (the next extent
     * it asks the hooks for doubles, up to the whole address space): committed,
     * hence accounted and counted in RLIMIT_AS, long before it is used. With
     * 100 MiB arrays under `prlimit --as=8GiB` that stopped a job at 3.7 GiB
     * where NumPy's default reached 8 GiB. Growing by at most 128 MiB beyond the
     * request keeps commitment close to use. */
    size_t grow = (size_t)128 << 20;
    snprintf(name, sizeof(name), "arena.%u.retain_grow_limit", ja->index);
    if (dmje_mallctl(name, NULL, NULL, &grow, sizeof(grow)) != 0)
        dm__log("datamem: arena '%s': cannot limit retained growth", owner->name);
    return ja;
}

static void store_settings(dm__arena_t *a, const dm_arena_spec_t *spec) {
    atomic_store_explicit(&a->place.thp, spec->hugepages, memory_order_relaxed);
    atomic_store_explicit(&a->place.numa, spec->numa, memory_order_relaxed);
    uint64_t nodes = spec->numa_all ? dm__os_numa_nodes() : spec->numa_nodes;
    atomic_store_explicit(&a->place.numa_nodes, nodes, memory_order_relaxed);
    atomic_store_explicit(&a->alignment, spec->alignment, memory_order_relaxed);
    atomic_store_explicit(&a->per_node, spec->per_node, memory_order_relaxed);
    atomic_store_explicit(&a->dirty_budget, spec->dirty_budget, memory_order_relaxed);
    atomic_store_explicit(&a->place.reuse_ms, spec->pinned != DM_PIN_NONE ? -1 : spec->dirty_decay_ms,
                          memory_order_relaxed);
    atomic_store_explicit(&a->limit, spec->limit, memory_order_relaxed);
    atomic_store_explicit(&a->place.lock, spec->lock, memory_order_relaxed);
    atomic_store_explicit(&a->place.pinned, (int)spec->pinned, memory_order_relaxed);
    atomic_store_explicit(&a->in_policy, true, memory_order_relaxed);
    dm__arena_je_t *ja = atomic_load_explicit(&a->single, memory_order_acquire);
    if (ja && ja->spill) { /* backing.max and resident_max: reloadable */
        atomic_store_explicit(&ja->spill->max, spec->backing.max, memory_order_relaxed);
        atomic_store_explicit(&ja->spill->resident_max, spec->backing.resident_max,
                              memory_order_relaxed);
        if (spec->backing.resident_max != SIZE_MAX)
            dm__spill_pager_ensure();
    }
}

static dm__arena_je_t *je_get(dm__arena_je_t *_Atomic *p) {
    return atomic_load_explicit(p, memory_order_acquire);
}

/* ---- big halves -----------------------------------------------------------
 *
 * An arena at `hugepages: system` serves blocks of DM_BIG_THP_MIN (4 MiB) and
 * more from a second jemalloc arena, its big half, as NumPy's default serves
 * them apart from its small blocks (glibc maps them, or reuses heap memory it
 * advised for them). In one jemalloc arena the two sizes share extents: a
 * freed big block, advised MADV_HUGEPAGE (bigblock.c), is split for small
 * ones, and a purge of the small ones' pages splits its hugepages (107
 * split PMDs per run on bench/run.py's mixed sizes, NumPy's default 3-4), while
 * every 2 MiB frame a small block touches first is zeroed whole: 1,227
 * hugepage faults against the default's 1,118-1,240, and 1.06x the default's time
 * at --quick (median of 21 runs). With the halves apart: 1,053 hugepage
 * faults, 0.94x, the same peak RSS (0.92x the default's). docs/performance.md
 * has the numbers.
 *
 * The cost is address space: each half reserves its own 1 GiB segments. Under
 * an address-space limit (RLIMIT_AS, what HPC schedulers set) that is what
 * runs out first, so there no big half is made and one jemalloc arena serves
 * every size. */
static void ensure_big_half(dm__arena_t *a, dm__arena_je_t *ja, const dm_arena_spec_t *spec) {
    if (je_get(&ja->big) || spec->hugepages != DM_THP_SYSTEM || dm__os_as_limit() || ja->spill)
        return;
    dm__arena_je_t *big = je_create(a, ja->node, spec, NULL);
    if (!big)
        return; /* logged; ja serves its big blocks too */
    big->is_big = true;
    atomic_store_explicit(&ja->big, big, memory_order_release);
}

/* Called with dm__mem_mu held: creates the jemalloc arenas `spec` needs. Nothing
 * visible changes for the policy in force: the new arenas serve no slot yet. */
int dm__arena_ensure(dm__arena_t *a, const dm_arena_spec_t *spec) {
    if (!spec->per_node) {
        dm__arena_je_t *ja = je_get(&a->single);
        if (ja && !ja->spill != !spec->backing.dir[0]) /* install.c checked: said why */
            return DM_EINVALID;
        if (!ja) {
            dm__spill_t *spill = NULL;
            char why[320];
            if (spec->backing.dir[0] &&
                !(spill = dm__spill_open(spec->backing.dir, spec->backing.max, why, sizeof(why)))) {
                dm__log("datamem: arena '%s': %s", a->name, why);
                return DM_EIO;
            }
            if (!(ja = je_create(a, -1, spec, spill)))
                return DM_EARENA; /* a spill file made stays unused: nameless, it goes at exit */
            if (spill)
                dm__spill_attach(spill, ja, dm__bigblock_expire);
            atomic_store_explicit(&a->single, ja, memory_order_release);
        }
        ensure_big_half(a, ja, spec);
        return 0;
    }
    uint64_t nodes = dm__os_numa_nodes();
    for (int n = 0; n < DM_NODES_MAX; n++) {
        if (!(nodes & (UINT64_C(1) << n)))
            continue;
        dm__arena_je_t *ja = je_get(&a->by_node[n]);
        if (!ja) {
            if (!(ja = je_create(a, n, spec, NULL)))
                return DM_EARENA;
            atomic_store_explicit(&a->by_node[n], ja, memory_order_release);
        }
        ensure_big_half(a, ja, spec);
    }
    return 0;
}

static uint64_t stat_zu(unsigned idx, const char *leaf);

/* Called with dm__mem_mu held, before a table with a limit on `a` is published:
 * from now on the arena counts its live bytes. Blocks made before are counted
 * from jemalloc's "allocated" (which also counts blocks sitting in threads'
 * caches, so the count may err high by what those hold: at most 2.3 MiB of
 * block cache and 26 MiB of jemalloc cache per thread; docs/operations.md). */
static void track_start(dm__arena_t *a) {
    if (atomic_load_explicit(&a->tracked, memory_order_relaxed))
        return;
    uint64_t epoch = 1, sum = 0;
    size_t esz = sizeof(epoch);
    dmje_mallctl("epoch", &epoch, &esz, &epoch, esz);
    for (int j = 0; j < nje; j++)
        if (dm__mem_by_slot[j]->owner == a)
            sum += stat_zu(dm__mem_by_slot[j]->index, "small.allocated") +
                   stat_zu(dm__mem_by_slot[j]->index, "large.allocated");
    atomic_store_explicit(&a->live, sum, memory_order_relaxed);
    atomic_store_explicit(&a->tracked, true, memory_order_release);
    for (int j = 0; j < nje; j++)
        if (dm__mem_by_slot[j]->owner == a)
            atomic_store_explicit(&dm__mem_by_slot[j]->tracked, true, memory_order_release);
}

/* Called with dm__mem_mu held: new settings for new extents and decay. */
void dm__arena_apply(dm__arena_t *a, const dm_arena_spec_t *spec) {
    store_settings(a, spec);
    if (spec->limit != SIZE_MAX)
        track_start(a);
    for (int j = 0; j < nje; j++)
        if (dm__mem_by_slot[j]->owner == a && je_settings(dm__mem_by_slot[j], spec) != 0)
            dm__log("datamem: arena '%s': cannot apply decay settings", a->name);
}

/* Called with dm__mem_mu held: the arena called `name`, or NULL. */
dm__arena_t *dm__arena_find(const char *name) {
    for (int i = 0; i < narenas; i++)
        if (strcmp(arenas[i]->name, name) == 0)
            return arenas[i];
    return NULL;
}

/* Called with dm__mem_mu held: finds the arena by name, creating it if new. */
dm__arena_t *dm__arena_get(const char *name, const dm_arena_spec_t *spec) {
    dm__arena_t *found = dm__arena_find(name);
    if (found)
        return found;
    if (narenas >= DM_RT_ARENAS_MAX)
        return NULL;
    dm__arena_t *a =
        dmje_mallocx(sizeof(*a), MALLOCX_ZERO | MALLOCX_TCACHE_NONE | MALLOCX_ARENA(0));
    if (!a)
        return NULL;
    snprintf(a->name, sizeof(a->name), "%s", name);
    a->place.name = a->name;
    a->id = narenas;
    store_settings(a, spec); /* hooks of arenas created next read these */
    atomic_store_explicit(&a->in_policy, false, memory_order_relaxed);
    arenas[narenas++] = a;
    return a;
}

void dm__arena_mark_all_unused(void) {
    for (int i = 0; i < narenas; i++)
        atomic_store_explicit(&arenas[i]->in_policy, false, memory_order_relaxed);
}

dm__arena_je_t *dm__arena_je_for_node(dm__arena_t *a, int node) {
    dm__arena_je_t *ja;
    if (node >= 0 && node < DM_NODES_MAX && (ja = je_get(&a->by_node[node])))
        return ja;
    if ((ja = je_get(&a->single)))
        return ja;
    for (int n = 0; n < DM_NODES_MAX; n++)
        if ((ja = je_get(&a->by_node[n])))
            return ja;
    return NULL;
}

int dm__arena_count(void) { return narenas; }
dm__arena_t *dm__arena_at(int id) { return id < narenas ? arenas[id] : NULL; }

/* ---- explicit thread caches -------------------------------------------- */

unsigned dm__arena_tcache_create(void) {
    unsigned tc;
    size_t sz = sizeof(tc);
    if (dmje_mallctl("tcache.create", &tc, &sz, NULL, 0) != 0)
        return 0;
    return tc + 1;
}

void dm__arena_tcache_destroy(unsigned tc) {
    unsigned idx = tc - 1;
    dmje_mallctl("tcache.destroy", NULL, NULL, &idx, sizeof(idx));
}

/* A thread inside an extent hook holds its arena's bump lock and none of
 * ours; fork must not copy it held. */
void dm__arena_fork(int phase) {
    for (int i = 0; i < DM_JE_MAX && dm__mem_by_slot[i]; i++) {
        if (phase == 0)
            pthread_mutex_lock(&dm__mem_by_slot[i]->region.mu);
        else
            pthread_mutex_unlock(&dm__mem_by_slot[i]->region.mu);
    }
}

/* ---- jemalloc's stats --------------------------------------------------- */

/* "stats.arenas.<i>.<leaf>" by cached MIB: the name is translated once
 * (mallctlnametomib, ~170 ns like any by-name call), then each read is a
 * mallctlbymib with mib[2] = the arena index (~20 ns; notes/jemalloc.md). With
 * 16 arenas that is 208 reads per snapshot. Guarded by dm__mem_mu, which every
 * caller (dm_stats_snapshot, dm__arena_after_growth) holds. */
#define STAT_MIBS_MAX 16
#define STAT_MIB_LEN 8
static struct stat_mib {
    const char *leaf;
    size_t mib[STAT_MIB_LEN];
    size_t len; /* 0: the name did not translate */
} stat_mibs[STAT_MIBS_MAX];
static int nstat_mibs;

static const struct stat_mib *stat_mib(const char *leaf) {
    for (int i = 0; i < nstat_mibs; i++)
        if (strcmp(stat_mibs[i].leaf, leaf) == 0)
            return &stat_mibs[i];
    if (nstat_mibs == STAT_MIBS_MAX)
        return NULL;
    struct stat_mib *m = &stat_mibs[nstat_mibs++];
    char name[128];
    snprintf(name, sizeof(name), "stats.arenas.0.%s", leaf);
    m->leaf = leaf;
    m->len = STAT_MIB_LEN;
    if (dmje_mallctlnametomib(name, m->mib, &m->len) != 0 || m->len < 3)
        m->len = 0;
    return m;
}

static int stat_read(unsigned idx, const char *leaf, void *v, size_t sz) {
    const struct stat_mib *m = stat_mib(leaf);
    if (!m || !m->len)
        return -1;
    size_t mib[STAT_MIB_LEN];
    memcpy(mib, m->mib, sizeof(mib));
    mib[2] = idx;
    return dmje_mallctlbymib(mib, m->len, v, &sz, NULL, 0);
}

static uint64_t stat_zu(unsigned idx, const char *leaf) {
    size_t v = 0;
    if (stat_read(idx, leaf, &v, sizeof(v)) != 0)
        return 0;
    return v;
}

/* jemalloc's pactive/pdirty/pmuzzy count its own pages (LG_PAGE: 64 KiB in the
 * aarch64 wheels, for kernels with 4, 16 or 64 KiB pages; third_party/jemalloc),
 * not the kernel's. */
static uint64_t je_page_size(void) {
    static _Atomic size_t page;
    size_t p = atomic_load_explicit(&page, memory_order_relaxed), n = sizeof(p);
    if (!p) {
        if (dmje_mallctl("arenas.page", &p, &n, NULL, 0) != 0 || !p)
            p = dm__os_page_size();
        atomic_store_explicit(&page, p, memory_order_relaxed);
    }
    return p;
}

static uint64_t stat_u64(unsigned idx, const char *leaf) {
    uint64_t v = 0;
    if (stat_read(idx, leaf, &v, sizeof(v)) != 0)
        return 0;
    return v;
}

/* ---- purge on growth ------------------------------------------------------
 *
 * Decay keeps freed pages for a while so that the next array of a similar size
 * reuses them without page faults (the temporaries of `a*b + c` loops). But when
 * the arena has to take new pages (a fresh extent, or a retained range
 * committed again), the dirty pages it holds did not fit that request; with
 * sizes that vary they pile up and the resident set grows far past the live
 * data (1.42x-1.71x NumPy's default peak RSS on bench/'s mixed run). So after
 * such an allocation, if the arena holds more dirty pages than its budget
 * (decay.budget) plus 1/64 of its active pages, it purges them at once. (A
 * slack of 1/16 lets sklearn_pipeline peak 28 MB, 1.05x, over NumPy's default;
 * 1/64 holds it at 1.007x with the same faults on every real job.) In a
 * steady loop nothing grows and nothing is purged. Nor below the peak: a
 * purge only lowers the peak RSS when datamem's footprint (active + dirty
 * bytes over all its arenas) passes the highest it has been, so growth below
 * that leaves the dirty pages to decay (bench/run.py's mixed run: 0.28x the
 * default's time instead of 0.91x, the same peak RSS; real jobs: the same
 * peak RSS to the megabyte, sklearn_pipeline 7.6k faults instead of 11k).
 * Nor well below the process's own peak: the figure a user (and a memory
 * limit) reads is the process's peak RSS, and when the new pages, added to
 * what the process holds now (VmRSS), leave it a sixteenth or more under the
 * peak it already had (VmHWM), neither the purge nor the trim runs: pandas or
 * Arrow freed their own buffers meanwhile, and what a purge or a trim gave
 * back there the next arrays and buffers faulted in again (pandas_etl -3.8%
 * pages at scale 0.3, pandas3_arrow -2.5%, pandas3_etl -2.0%; every peak RSS
 * within 0.7 MB). The mark rises there as past the peak, so that what such a
 * growth kept is not given back in one piece at the next check near the
 * peak: whether that check came turned on a transient rise outside datamem
 * that differs from run to run, and pandas3_etl took 1.086x the default's
 * pages or 1.041x by it (bench/results/mark-rises.md).
 * The sixteenth is for the rises no check sees (glibc's buffers, blocks
 * refilling frames they lent, hugepage frames): gating at the peak itself, a
 * process that churns there ratchets its peak up by them (bench/run.py's
 * mixed run: 1.12x-1.21x peak RSS per live byte against 1.09x); with the
 * sixteenth it reads 1.092 and 133.3 pages per operation, as before
 * (bench/results/process-peak.md).
 * The check runs after allocations above the block cache's sizes, outside
 * jemalloc, and reads jemalloc's stats (under dm__mem_mu like every stats reader)
 * and /proc/self/status (before taking it) only when the arena did grow.
 * docs/performance.md has the numbers.
 *
 * A big half's kept blocks (bigblock.c) wait as dirty pages do, and count so
 * here (their bytes lent to other blocks not at all: those are in the blocks
 * that took them). Past the peak, jemalloc's dirty pages all go, and kept
 * blocks only for what the footprint passed the peak by, blocks that lent
 * first: shedding them all, or none, cost pandas_etl 8.6k faults, or
 * sklearn_pipeline 13 MB of peak RSS (bench/results/lend-*.md).
 *
 * Past the peak, glibc's malloc is also asked to give back its free pages
 * (malloc_trim), at most once per 1/16 the footprint grows. Under NumPy's
 * default, arrays and the rest (pandas' hash tables, Python's objects) share
 * glibc's heap, and memory one frees serves the other; with the arrays in
 * datamem's arenas, glibc keeps what the rest freed (its trim threshold rises
 * to 32-64 MiB with the blocks it has mapped, and holes inside the heap are
 * never trimmed) while the arenas take new pages. At pandas_etl's peak glibc
 * held 17 MiB free: 1.020x NumPy's default peak RSS, 1.002x with the trim;
 * pandas3_etl 1.018x, 1.010x. 4 to 23 calls per job, 4.4 ms in
 * all at most (bench/results/jobs-size-class-trim.md). The footprint it
 * compares leaves out what blocks that lent their frames left behind in
 * jemalloc (bigblock.h, `unbacked`: dirty to jemalloc, no page behind):
 * counted, they read as growth each time a block lends, and each trim gave
 * back glibc's free pages that pandas' next buffers faulted in again
 * (pandas3_arrow, hugepages off: 190.9k pages, 183.1k without them, the
 * default 176.2k; every job's peak RSS within 0.9 MB; bench/results/unbacked.md).
 * The purge still counts them as jemalloc does: left out there too, the kept
 * blocks shed in their place cost fft_image 7k pages at the same peak. */
static uint64_t peak_footprint; /* under dm__mem_mu */
static uint64_t trimmed_at;     /* the footprint at the last malloc_trim, under dm__mem_mu */
static _Atomic uint64_t trims;  /* malloc_trim calls at growth (tests) */

uint64_t dm__arena_growth_trims(void) { return atomic_load_explicit(&trims, memory_order_relaxed); }

static void trim_libc(void) {
    atomic_fetch_add_explicit(&trims, 1, memory_order_relaxed);
    dm__os_trim_libc();
}

/* Of x's dirty bytes d, those kept blocks lent away and then gave back to
 * jemalloc: no page is behind them (bigblock.h, `unbacked`). */
static uint64_t unbacked(const dm__arena_je_t *x, uint64_t d) {
    uint64_t u = atomic_load_explicit(&x->reuse.unbacked, memory_order_relaxed);
    return u < d ? u : d;
}

/* The next `arena.<i>.purge` on this thread leaves the `pages` most recently
 * freed dirty pages (0: none, jemalloc's own meaning). Added to jemalloc's
 * source by third_party/jemalloc/jemalloc.bzl; its private namespace names it. */
void dmje_private_je_dm_purge_keep(size_t pages);
#define dm_purge_keep dmje_private_je_dm_purge_keep

/* A jemalloc arena at a growth check (dm__arena_after_growth). */
struct candidate {
    dm__arena_je_t *x;
    uint64_t dirty, kept, active;
    bool due;
};

/* A purge to make: leave `keep` bytes of x's dirty pages, shed `shed` bytes of
 * its kept blocks first. */
struct purge {
    dm__arena_je_t *x;
    uint64_t keep, shed;
};

/* Only what the growth passed the peak by (`over`) goes, from each arena due
 * in turn (slot order: a policy arena's small half before its big half, whose
 * dirty ranges are often blocks that lent their pages away, so that purging
 * them frees nothing): jemalloc's dirty pages, the oldest freed first and in
 * whole extents, then kept blocks (those that lent first, then the oldest;
 * bigblock.c, dm__bigblock_release_some). A page given back past that is one
 * the next allocation faults in again (scipy_cg: 15 MB for a 4 KiB
 * overshoot). Fills list, adds what it gives back to *purged, returns how
 * many purges. */
static int plan_purges(const struct candidate *mine, int nmine, uint64_t over, uint64_t budget,
                       struct purge *list, uint64_t *purged) {
    int npurge = 0;
    for (int k = 0; k < nmine && over > 0; k++) {
        uint64_t d = mine[k].dirty + mine[k].kept;
        if (!mine[k].due || d <= budget || d - budget <= mine[k].active / 64 ||
            !mine[k].x->purge_mib[0])
            continue;
        uint64_t take = over < mine[k].dirty ? over : mine[k].dirty;
        uint64_t shed = over - take < mine[k].kept ? over - take : mine[k].kept;
        over -= take + shed;
        *purged += take + shed;
        list[npurge++] = (struct purge){mine[k].x, mine[k].dirty - take, shed};
    }
    return npurge;
}

void dm__arena_after_growth(dm__arena_je_t *ja) {
    uint64_t grown = atomic_exchange_explicit(&ja->region.grown, 0, memory_order_relaxed);
    if (grown == 0)
        return;
    size_t budget = atomic_load_explicit(&ja->owner->dirty_budget, memory_order_relaxed);
    if (budget == SIZE_MAX || !ja->purge_mib[0])
        return;
    uint64_t rss, hwm;
    bool under_peak = dm__os_rss_peak(&rss, &hwm) && rss + grown + (hwm >> 4) <= hwm;
    /* Growth is rare: the stats readers' lock (dm__mem_mu) is affordable here. */
    uint64_t epoch = 1, page = je_page_size();
    pthread_mutex_lock(&dm__mem_mu);
    dmje_mallctl("epoch", NULL, NULL, &epoch, sizeof(epoch)); /* refresh the stats */
    /* Past the peak, the jemalloc arena that grew is purged if it holds dirty
     * pages over its budget plus 1/64 of its active ones; so is, on the same
     * terms, each big half of the policy arena that served no allocation since
     * the last check: in one jemalloc arena its idle pages would have served
     * this growth (sklearn_pipeline: 111 MB of them, or 1.034x the default's
     * peak RSS instead of 1.01x). */
    struct candidate mine[2 * DM_NODES_MAX]; /* one per node, or one, and their big halves */
    int nmine = 0;
    uint64_t footprint = 0, purged = 0, no_pages = 0;
    for (int j = 0; j < nje; j++) { /* one read of each arena's stats */
        dm__arena_je_t *x = dm__mem_by_slot[j];
        uint64_t d = stat_zu(x->index, "pdirty") * page, a = stat_zu(x->index, "pactive") * page;
        no_pages += unbacked(x, d); /* the trim's footprint leaves them out */
        /* its kept blocks' pages wait as dirty ones do (jemalloc counts them active) */
        uint64_t kept = atomic_load_explicit(&x->reuse.bytes, memory_order_relaxed);
        uint64_t gone = kept + atomic_load_explicit(&x->reuse.lent, memory_order_relaxed);
        kept = kept < a ? kept : a;
        a -= gone < a ? gone : a; /* what they lent is in other blocks now, or given back */
        footprint += d + kept + a;
        if (x->owner != ja->owner || nmine == 2 * DM_NODES_MAX)
            continue;
        bool due = x == ja;
        if (x->is_big) {
            uint64_t ops = stat_u64(x->index, "large.nmalloc") +
                           atomic_load_explicit(&x->reuse.reused, memory_order_relaxed);
            due = due || ops == x->ops_seen;
            x->ops_seen = ops;
        }
        mine[nmine++] = (struct candidate){x, d, kept, a, due};
    }
    bool past = footprint > peak_footprint && !under_peak;
    struct purge list[2 * DM_NODES_MAX];
    int npurge = plan_purges(mine, nmine, past ? footprint - peak_footprint : 0, budget, list,
                             &purged);
    /* A purge never lowers the mark, and growth well under the process's
     * peak raises it as any growth does: what that growth kept is not given
     * back in one piece at the next check near the peak. */
    if (footprint - purged > peak_footprint)
        peak_footprint = footprint - purged;
    bool trim = past && footprint - no_pages > trimmed_at + (trimmed_at >> 4);
    if (trim)
        trimmed_at = footprint - no_pages;
    pthread_mutex_unlock(&dm__mem_mu);
    for (int k = 0; k < npurge; k++) {
        if (list[k].shed)
            dm__bigblock_release_some(list[k].x, list[k].shed);
        dm_purge_keep(list[k].keep / page);
        dmje_mallctlbymib(list[k].x->purge_mib, 3, NULL, NULL, NULL, 0);
        dm_purge_keep(0);
    }
    if (trim)
        trim_libc();
    if (npurge)
        atomic_fetch_add_explicit(&ja->owner->growth_purges, 1, memory_order_relaxed);
}

/* The worker limit counts the process's resident memory (tally.c), in which
 * the pages datamem keeps idle (kept big blocks, dirty pages waiting out
 * decay) read as memory beside the arrays: before it refuses or spills, every
 * arena gives them back, and glibc its free pages. Returns false (nothing
 * done) when the runtime's lock is busy: an allocation never waits for an
 * install or a stats reader. */
bool dm__arena_give_back_idle(void) {
    if (pthread_mutex_trylock(&dm__mem_mu) != 0)
        return false;
    dm__arena_je_t *all[DM_JE_MAX];
    int n = nje;
    for (int j = 0; j < n; j++)
        all[j] = dm__mem_by_slot[j];
    pthread_mutex_unlock(&dm__mem_mu); /* arenas are never freed: the list stays good */
    for (int j = 0; j < n; j++) {
        dm__bigblock_release(all[j]);
        if (all[j]->purge_mib[0])
            dmje_mallctlbymib(all[j]->purge_mib, 3, NULL, NULL, NULL, 0);
    }
    dm__os_trim_libc();
    return true;
}

uint64_t dm__arena_idle_bytes(void) {
    if (pthread_mutex_trylock(&dm__mem_mu) != 0)
        return UINT64_MAX;
    uint64_t epoch = 1, page = je_page_size(), idle = 0;
    dmje_mallctl("epoch", NULL, NULL, &epoch, sizeof(epoch)); /* refresh the stats */
    for (int j = 0; j < nje; j++) {
        dm__arena_je_t *x = dm__mem_by_slot[j];
        if (x->spill)
            continue; /* a file's pages: not anonymous memory */
        idle += (stat_zu(x->index, "pdirty") + stat_zu(x->index, "pmuzzy")) * page +
                atomic_load_explicit(&x->reuse.bytes, memory_order_relaxed);
    }
    pthread_mutex_unlock(&dm__mem_mu);
    return idle;
}

static void je_stats_add(dm__arena_je_t *ja, dm_arena_stats_t *o) {
    unsigned i = ja->index;
    uint64_t page = je_page_size();
    o->allocated += stat_zu(i, "small.allocated") + stat_zu(i, "large.allocated");
    o->active += stat_zu(i, "pactive") * page;
    o->dirty += stat_zu(i, "pdirty") * page;
    o->muzzy += stat_zu(i, "pmuzzy") * page;
    const dm__spill_t *sp = ja->spill;
    /* jemalloc's `resident` is the pages it has touched: a bound, and for a file's
     * pages a wrong one (the pager and the kernel drop them behind its back). A
     * spill arena's is what mincore finds in memory of its reserved pages. */
    uint64_t spill_resident = sp ? dm__spill_resident_bytes(ja->spill) : 0;
    o->resident += sp ? spill_resident : stat_zu(i, "resident");
    o->mapped += stat_zu(i, "mapped");
    o->retained += stat_zu(i, "retained");
    o->reuse_bytes += atomic_load_explicit(&ja->reuse.bytes, memory_order_relaxed);
    o->lent_bytes += atomic_load_explicit(&ja->reuse.lent_total, memory_order_relaxed);
    o->je_nmalloc += stat_u64(i, "small.nmalloc") + stat_u64(i, "large.nmalloc");
    o->je_ndalloc += stat_u64(i, "small.ndalloc") + stat_u64(i, "large.ndalloc");
    pthread_mutex_lock(&ja->region.mu);
    o->reserved += ja->region.reserved;
    pthread_mutex_unlock(&ja->region.mu);
    o->njemalloc++;
    if (sp) {
        o->backed = true;
        o->backing_max = atomic_load_explicit(&sp->max, memory_order_relaxed);
        o->backing_reserved_bytes += atomic_load_explicit(&sp->committed, memory_order_relaxed);
        o->backing_disk_bytes += dm__spill_disk_bytes(sp);
        o->backing_full += atomic_load_explicit(&sp->nfull, memory_order_relaxed);
        o->backing_resident_max = atomic_load_explicit(&sp->resident_max, memory_order_relaxed);
        o->backing_resident_bytes += spill_resident;
        o->backing_paged_out_bytes += atomic_load_explicit(&sp->paged_out, memory_order_relaxed);
        o->backing_fork_copies += atomic_load_explicit(&sp->fork_copies, memory_order_relaxed);
        o->backing_fork_failures += atomic_load_explicit(&sp->fork_failures, memory_order_relaxed);
    }
}

/* Called with dm__mem_mu held, after an "epoch" refresh. */
void dm__arena_je_stats(dm__arena_t *a, dm_arena_stats_t *out) {
    bool first = true;
    for (int j = 0; j < nje; j++) {
        if (dm__mem_by_slot[j]->owner != a)
            continue;
        je_stats_add(dm__mem_by_slot[j], out);
        if (first) { /* the decay times jemalloc holds (all of an arena's are set alike) */
            ssize_t v[2] = {0, 0};
            const char *leaf[2] = {"dirty_decay_ms", "muzzy_decay_ms"};
            for (int k = 0; k < 2; k++) {
                char name[96];
                size_t sz = sizeof(v[k]);
                snprintf(name, sizeof(name), "arena.%u.%s", dm__mem_by_slot[j]->index, leaf[k]);
                if (dmje_mallctl(name, &v[k], &sz, NULL, 0) != 0)
                    v[k] = 0;
            }
            out->dirty_decay_ms = v[0];
            out->muzzy_decay_ms = v[1];
            first = false;
        }
    }
}

/* ---- hugepage-backed bytes ------------------------------------------------- */

/* smaps fallback: a mapping inside one arena's range (the usual case) counts
 * exactly. Adjacent mappings with the same flags can merge across ranges (two
 * arenas', or ours and NumPy's own madvised arrays); such a mapping's hugepages
 * are split in proportion to the overlap, in whole 2 MiB pages: an estimate. */
static void huge_add(void *arg, uintptr_t start, uintptr_t end, uint64_t huge) {
    uint64_t *out = arg;
    const uintptr_t nseg = (uintptr_t)1 << (DM_VA_BITS - DM_SEG_SHIFT);
    if (end <= start)
        return;
    for (uintptr_t seg = start >> DM_SEG_SHIFT; seg <= (end - 1) >> DM_SEG_SHIFT && seg < nseg;
         seg++) {
        uint16_t s = atomic_load_explicit(&dm__mem_seg_owner[seg], memory_order_acquire);
        dm__arena_je_t *ja = s ? dm__mem_by_slot[s - 1] : NULL;
        if (!ja)
            continue;
        uintptr_t lo = seg << DM_SEG_SHIFT, hi = lo + DM_SEG_SIZE;
        if (lo < start)
            lo = start;
        if (hi > end)
            hi = end;
        if (hi - lo == end - start) {
            out[ja->owner->id] += huge;
        } else { /* in whole hugepages, at most the overlap */
            uint64_t share = (uint64_t)((double)huge * (double)(hi - lo) / (double)(end - start));
            if (share > hi - lo)
                share = hi - lo;
            out[ja->owner->id] += share & ~(((uint64_t)2 << 20) - 1);
        }
    }
}

/* Adds each policy arena's THP-backed bytes to out[arena id] (cap entries):
 * PAGEMAP_SCAN over the committed part of every region (exact; the PROT_NONE
 * rest of a reservation is not walked), else /proc/self/smaps. The ranges are
 * copied under dm__mem_mu (then each arena's bump mutex); the scan runs unlocked. */
int dm__arena_hugepages(uint64_t *out, int cap) {
    if (cap < DM_RT_ARENAS_MAX)
        return DM_ERANGE;
    enum { MAXR = 512 };
    uintptr_t(*r)[2] = malloc(sizeof(*r) * MAXR);
    int *id = malloc(sizeof(*id) * MAXR);
    uint64_t *bytes = calloc(MAXR, sizeof(*bytes));
    int n = 0, rc = 0;
    bool whole = !r || !id || !bytes; /* some ranges unknown: use smaps */
    pthread_mutex_lock(&dm__mem_mu);
    for (int j = 0; j < nje && !whole; j++) {
        dm__arena_je_t *ja = dm__mem_by_slot[j];
        pthread_mutex_lock(&ja->region.mu);
        if (ja->region.nold > DM_JE_OLD_MAX || n + ja->region.nold + 1 > MAXR)
            whole = true;
        for (int k = 0; k < ja->region.nold && !whole; k++, n++) {
            r[n][0] = (uintptr_t)ja->region.old[k][0], r[n][1] = (uintptr_t)ja->region.old[k][1];
            id[n] = ja->owner->id;
        }
        if (ja->region.cur && !whole) {
            r[n][0] = (uintptr_t)ja->region.base, r[n][1] = (uintptr_t)ja->region.cur;
            id[n++] = ja->owner->id;
        }
        pthread_mutex_unlock(&ja->region.mu);
    }
    pthread_mutex_unlock(&dm__mem_mu);
    if (!whole && dm__os_huge_bytes((const uintptr_t(*)[2])r, n, bytes) == 0) {
        for (int i = 0; i < n; i++)
            out[id[i]] += bytes[i];
    } else { /* no PAGEMAP_SCAN here (Linux < 6.7), or too many regions */
        memset(out, 0, sizeof(*out) * (size_t)cap);
        rc = dm__os_smaps_huge(huge_add, out) == 0 ? 0 : DM_ESYS;
    }
    free(r);
    free(id);
    free(bytes);
    return rc;
}
