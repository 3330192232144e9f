/*
 * datamem.h: the datamem runtime's C API (no Python here).
 *
 * The runtime owns jemalloc arenas (by name, for the life of the process), the
 * published dispatch table, the allocation fast path and the counters behind
 * stats. The Python extension is a thin layer over this header; C programs can
 * use it directly.
 *
 * Thread safety: every function may be called from any thread, with or without
 * the GIL. dm_alloc/dm_calloc/dm_realloc/dm_free take no lock, never log and
 * never allocate outside jemalloc once the calling thread is bound to the
 * current table; binding (first call on a thread, after a reload, on a new
 * context) takes the runtime mutex once. Blocks of 4 MiB or more (where
 * jemalloc takes its own arena locks anyway) pass through the arena's reuse
 * mutex, held for a search of at most 8 entries and never across a jemalloc
 * call.
 */
#ifndef DATAMEM_H
#define DATAMEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/diag.h"
#include "policy/policy.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DM_API __attribute__((visibility("default")))

#define DM_VERSION_STRING "0.1.0"

/* A context: an interned, immutable set of tags (datamem.tag()). The Python
 * layer stores one per NEP 49 handler, so NumPy's ContextVar carries it across
 * await and into asyncio tasks; dm_ctx_root() has no tags. */
typedef struct dm_ctx dm_ctx_t;

#define DM_CTX_TAGS_MAX 64 /* tags in one context */

DM_API int dm_runtime_init(void);

/* Parses, validates, compiles and publishes a policy file. On error nothing
 * changes (the previous policy stays in force) and `diags` says why. */
DM_API int dm_runtime_load(const char *path, dm_diags_t *diags);

/* Publishes an already parsed policy (the runtime takes ownership of `p`). */
DM_API int dm_runtime_install(dm_policy_t *p, dm_diags_t *diags);

/* A reload of `path`: loads it like dm_runtime_load, but publishes it only while
 * the policy in force was itself loaded from `path` and, unless `over_hash` is 0,
 * is the one whose content hash (dm_policy_t.hash) is `over_hash`. An install
 * that lands while the file is read wins: this returns DM_ESUPERSEDED and changes
 * nothing (not counted as a failed reload). The file watcher reloads through it
 * over the policy whose settings it watches with, so a reload it started never
 * undoes datamem.install() or datamem.reload(), nor acts on a debounce that a
 * newer policy changed. */
DM_API int dm_runtime_reload(const char *path, uint64_t over_hash, dm_diags_t *diags);

/* True once a policy is in force. */
DM_API bool dm_runtime_active(void);

/* A copy of the policy in force (NULL if none); free with dm_policy_free. */
DM_API dm_policy_t *dm_runtime_policy_copy(void);

/* The machine's NUMA topology, as the validator sees it. */
DM_API void dm_runtime_topology(dm_topology_t *out);

/* What NumPy's default allocator does about hugepages (NumPy advises
 * MADV_HUGEPAGE on arrays >= 4 MiB unless NUMPY_MADVISE_HUGEPAGE=0 or
 * np._core.multiarray._set_madvise_hugepage(False)); arenas at `hugepages:
 * system` follow it for blocks >= 4 MiB. On by default; the Python layer sets
 * it from NumPy's own setting at every install. */
DM_API void dm_runtime_set_numpy_hugepages(bool on);

/* From now on, for the process: the mappings that hold arenas' memory (extent
 * commits, spill files) are made with syscall(2), unseen by a profiler that
 * hooks libc's mmap. The extension calls it when it finds its own GOT hooked
 * and shows arrays to the profiler itself (pyext/shadow.c). */
DM_API void dm_runtime_hide_mappings(void);

DM_API const dm_ctx_t *dm_ctx_root(void);
/* The context with `base`'s tags plus `tag` (interned: the same set gives the
 * same context while it lives), with one reference for the caller, who may
 * keep it for the process or give it back with dm_ctx_release; while held it
 * is valid. Any number of distinct sets may be made over a process's life: a
 * context nothing holds (no reference, no bound thread, no live counted
 * block) is freed and its id reused. NULL only for a bad request (`tag` NULL
 * or DM_NAME_MAX bytes or longer, `base` already holding DM_CTX_TAGS_MAX tags)
 * or out of memory; never because a table is full. A context made while
 * every tally id or tag row was held counts its blocks (or some tags') under
 * "(other)", with those tags' limits not applied (stats: tags_unenforced),
 * for as long as it is held; the first lookup of the same set once an id and
 * a row are free returns a new context counted under its own tags (the old one
 * is no longer found and lives until its holders let go), so a holder gets
 * counted again by looking its tags up again. */
DM_API const dm_ctx_t *dm_ctx_with_tag(const dm_ctx_t *base, const char *tag);
/* Gives back a reference dm_ctx_with_tag returned (NULL and the root: nothing). */
DM_API void dm_ctx_release(const dm_ctx_t *c);
/* Whether `c` was retired: a lookup of its tags returns a counted context in
 * its place (see dm_ctx_with_tag). A cache of contexts drops it. */
DM_API bool dm_ctx_retired(const dm_ctx_t *c);
/* How many contexts were retired so far (grows; acquire: the flags of those
 * counted are seen by dm_ctx_retired): a cache scans for retired ones only
 * when it moved. */
DM_API uint64_t dm_ctx_retirements(void);
DM_API int dm_ctx_tags(const dm_ctx_t *c, const char **tags, int cap);

/* The calling thread's name for thread rules (set when a thread starts). */
DM_API void dm_thread_set_name(const char *name);

/* The fast path. `dt` is a dm_dtype_t (DM_DT_UNKNOWN when not known). */
DM_API void *dm_alloc(const dm_ctx_t *c, size_t size, int dt);
DM_API void *dm_calloc(const dm_ctx_t *c, size_t size, int dt);
DM_API void *dm_realloc(const dm_ctx_t *c, void *p, size_t size);
DM_API void dm_free(void *p);
/* dm_free with the caller's idea of the block's size (NumPy's, NEP 49): only a
 * hint, never trusted. A block of 4 MiB or more may then be kept for the next
 * allocation of its size instead of going back to jemalloc (bigblock.c). */
DM_API void dm_free_hint(void *p, size_t size_hint);

/* Call-site rules (match.module / match.function). The caller knows the site
 * (the Python layer: the innermost frame outside NumPy and friends) and gets
 * its mask with dm_runtime_site_mask (slow: takes the runtime mutex; cache it
 * per code object together with `gen`, recomputed when dm_runtime_site_gen()
 * moves on). mask == 0 is exactly dm_alloc / dm_calloc. */
DM_API void *dm_alloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen);
DM_API void *dm_calloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen);
DM_API uint64_t dm_runtime_site_mask(const char *module, const char *function, uint64_t *gen);
DM_API uint64_t dm_runtime_site_gen(void);
/* Nonzero while the table in force has call-site rules: one load, for the
 * handler to skip finding call sites when none is needed. */
DM_API extern _Atomic int dm_runtime_site_rules;

/* Whether the current table has any dtype rule (the Python layer skips dtype
 * discovery when not). One acquire-load. */
DM_API bool dm_runtime_wants_dtype(void);

/* The calling thread's last allocation refused by an arena's `limit` (the
 * fast path returns NULL and NumPy raises MemoryError; this says why).
 * `seq` counts refusals on this thread: 0 = none yet. */
typedef enum {
    DM_REFUSED_ARENA = 0, /* the arena's `limit` */
    DM_REFUSED_TAG,       /* a tag's limit (`tag_limits`) */
    DM_REFUSED_WORKER     /* `worker_limit` */
} dm_refusal_t;
typedef struct dm_failure {
    uint64_t seq;
    int kind;                 /* dm_refusal_t */
    char tag[DM_NAME_MAX];    /* DM_REFUSED_TAG: the tag at its limit */
    char arena[DM_NAME_MAX];
    char rule[DM_NAME_MAX];   /* "default" when no rule matched */
    uint64_t request;         /* bytes asked for */
    uint64_t limit, live;     /* the arena's (tag's, worker's) limit and live bytes
                                 at the refusal */
    bool fallback_tried;      /* `fallback` was tried and had no room either */
} dm_failure_t;
DM_API void dm_runtime_last_failure(dm_failure_t *out);

/* Refusals by one tag's limit (name) or by the worker limit (name NULL), for
 * any thread to explain a MemoryError another thread raised: how many so far,
 * and the last one's request, limit and live bytes. DM_ENOENT when the tag
 * was never counted. Takes the runtime mutex: not for allocation paths. */
typedef struct dm_refusals {
    uint64_t count, request, limit, live;
} dm_refusals_t;
DM_API int dm_runtime_refusals(const char *name, dm_refusals_t *out);

/* What policy `p`'s worker_limit comes to here and now (explain): its bytes,
 * the memory limit a share is of and where that comes from (DATAMEM_MEMORY_LIMIT,
 * the cgroup's limit, physical memory: read now, as an install would), and,
 * for a share of a cgroup's limit (one budget for every process in that
 * cgroup), that cgroup's directory and what it holds now: anonymous pages and
 * shmem, what counts against the budget. 0, or an error with one line in
 * `why` (a share of a limit that cannot be read). Reads files: never on an
 * allocation path. */
typedef struct dm_budget {
    uint64_t limit;      /* UINT64_MAX: `p` sets no worker_limit */
    uint64_t base;       /* the limit a share is of; 0 for a size */
    char source[16];     /* "policy", "env", "cgroup v1", "cgroup v2", "ram" */
    char group[4096];    /* the budget's cgroup directory, "" when per process */
    uint64_t held;       /* what that cgroup holds now; UINT64_MAX: no group, unreadable */
} dm_budget_t;
DM_API int dm_runtime_budget(const dm_policy_t *p, dm_budget_t *out, char *why, size_t cap);

/* Where the CUDA runtime is (`pinned: cuda`), e.g. from DATAMEM_CUDART; NULL or
 * "" tries libcudart.so and its usual versions. Takes effect at the next
 * install that needs it. */
DM_API void dm_runtime_set_cudart(const char *path);

/* Which arena owns `p` (name), or NULL if datamem does not own it. */
DM_API const char *dm_owner_arena(const void *p);

/* The rule that serves (size, dt) for the calling thread in context `c` now,
 * as the allocation path picks it: its name, "default" for the default arena,
 * NULL when no policy is in force. For the profiler (pyext's recording
 * handler), never on the allocation path: it may bind the thread. The name is
 * the table's: copy it before the thread's next allocation. */
DM_API const char *dm_runtime_rule_of(const dm_ctx_t *c, size_t size, int dt);

/* ---- stats -------------------------------------------------------------- */

#define DM_STATS_ARENAS_MAX 256
#define DM_STATS_UNENFORCED_MAX 16 /* limited tags named in dm_stats_t.unenforced */

/* datamem's own counters, summed over threads; per arena and per rule (a
 * rule's nfree is always 0: frees know the arena, not the rule). */
typedef struct dm_counts {
    uint64_t nalloc, nfree, nrealloc, nfail, nfallback, ndtype_known;
    uint64_t bytes_requested; /* sum of sizes asked for */
    uint64_t nlimit;          /* allocations refused by the arena's limit */
} dm_counts_t;

typedef struct dm_arena_stats {
    char name[DM_NAME_MAX];
    bool in_policy;           /* named by the policy in force */
    size_t alignment;
    int hugepages;            /* dm_thp_t */
    int numa;                 /* dm_numa_mode_t */
    uint64_t numa_nodes;
    bool per_node;
    int njemalloc;            /* jemalloc arenas behind it */
    dm_counts_t counts;
    uint64_t nplacement_errors; /* mbind/madvise failures */
    uint64_t ngrowth_purges;    /* dirty pages purged as the arena grew (decay.budget) */
    /* from jemalloc (refreshed through "epoch") */
    uint64_t allocated, active, resident, mapped, retained, dirty, muzzy;
    uint64_t je_nmalloc, je_ndalloc;
    int64_t dirty_decay_ms, muzzy_decay_ms; /* what its jemalloc arenas run with; -1 never */
    uint64_t reserved;        /* address space reserved for the arena */
    uint64_t hugepage_bytes;  /* THP-backed bytes in its ranges (dm_stats_hugepages) */
    uint64_t limit;           /* `limit`; UINT64_MAX = none */
    bool tracked;             /* live bytes counted (the arena has had a limit) */
    uint64_t live;            /* bytes of live blocks (usable sizes) when tracked */
    bool lock;                /* `lock` */
    int pinned;               /* dm_pin_t */
    uint64_t locked_bytes;    /* bytes mlock'ed now */
    uint64_t pinned_bytes;    /* bytes registered with the GPU runtime now */
    uint64_t reuse_bytes;     /* freed blocks >= 4 MiB kept for their size's next allocation */
    uint64_t lent_bytes;      /* bytes kept blocks ever lent to new blocks (moved, not zeroed) */
    /* `backing` (file-backed arenas; all 0 for RAM ones) */
    bool backed;
    uint64_t backing_max;            /* backing.max; UINT64_MAX = none */
    uint64_t backing_reserved_bytes; /* disk blocks reserved for its memory (fallocate) */
    uint64_t backing_disk_bytes;     /* what its file holds on disk (st_blocks) */
    uint64_t backing_full;           /* reservations refused: max reached or disk full */
    uint64_t backing_resident_max;   /* backing.resident_max; UINT64_MAX = none */
    uint64_t backing_resident_bytes; /* of its reserved pages, those in memory now */
    uint64_t backing_paged_out_bytes; /* paged out to keep under resident_max */
    uint64_t backing_fork_copies;    /* fork children given their own copy of the file */
    uint64_t backing_fork_failures;  /* fork children left a copy-on-write view instead */
} dm_arena_stats_t;

typedef struct dm_rule_stats {
    char name[DM_NAME_MAX];
    char arena[DM_NAME_MAX];
    dm_counts_t counts;
} dm_rule_stats_t;

/* Live and peak bytes of the arrays made under one tag (tally.c). A block
 * made in a context with several tags counts under each. */
typedef struct dm_tag_stats {
    char name[DM_NAME_MAX];   /* "(untagged)": blocks made with no tag */
    uint64_t live, peak;      /* usable bytes */
    uint64_t limit;           /* tag_limits; UINT64_MAX = none */
    uint64_t refused;         /* allocations its limit refused */
} dm_tag_stats_t;

typedef struct dm_stats {
    int narenas;
    dm_arena_stats_t arenas[DM_STATS_ARENAS_MAX];
    int nrules;               /* rules of the policy in force, plus "default" */
    dm_rule_stats_t *rules;   /* malloc'ed by dm_stats_snapshot */
    uint64_t policy_hash;
    char policy_path[256];
    uint64_t reloads, reload_failures;
    double last_reload_time;  /* unix seconds of the last successful load */
    uint64_t foreign_frees;   /* dm_free of a pointer datamem does not own */
    uint64_t cached_bytes;    /* freed blocks held in threads' block caches */
    int64_t lend_frames;      /* frames holding lent pages, each maybe a mapping (bigblock.c) */
    int64_t lend_frames_max;  /* lending stops at this many */
    uint64_t lend_capped;     /* frame moves not made at that cap */
    int nthreads;             /* threads that have allocated through datamem */
    int ncontexts;
    int tables_live;          /* dispatch tables alive: the one in force plus
                                 retired ones a thread has not let go of yet */
    bool last_reload_failed;  /* the last load attempt failed (last good policy kept) */
    double snapshot_time;     /* unix seconds when the snapshot was taken */
    /* Bytes per tag (tag_bytes, tag_limits, worker_limit; DATAMEM_TAG_BYTES=1). */
    bool tally_on;
    uint64_t tally_live, tally_peak;  /* all counted blocks */
    uint64_t worker_limit;            /* UINT64_MAX = none */
    uint64_t worker_refused;          /* times the worker limit said no */
    uint64_t worker_spilled;          /* of them, allocations worker_spill served
                                         instead (the rest failed: MemoryError) */
    uint64_t worker_beside;           /* resident anonymous bytes beside the counted
                                         arrays, as the worker limit last read them
                                         (0 without a worker limit): they count
                                         against it */
    char worker_limit_source[16];     /* "", "policy", "env", "cgroup", "ram" */
    int ntags;
    dm_tag_stats_t *tags;             /* malloc'ed by dm_stats_snapshot */
    /* Tag names counted under the row "(other)" because the table of tags
     * (DM_TALLY_TAGS_MAX rows, tally.c) or of context ids was full of ones
     * holding bytes: each time a context was made so. */
    uint64_t tags_overflowed;
    /* Tags with a tag_limits limit that count under "(other)" right now, in a
     * held context made while the tables were full: their limit is not
     * applied. How many distinct names, and the first DM_STATS_UNENFORCED_MAX
     * of them in name order. */
    uint64_t tags_unenforced;
    int nunenforced;
    char unenforced[DM_STATS_UNENFORCED_MAX][DM_NAME_MAX];
} dm_stats_t;

/* Fills `out` (caller frees out->rules with dm_stats_release). */
DM_API int dm_stats_snapshot(dm_stats_t *out);
DM_API void dm_stats_release(dm_stats_t *s);

/* Records a failed reload attempt (counted in stats). */
DM_API void dm_runtime_note_reload_failure(void);

/* Call in a forked child (Python: os.register_at_fork) to restart the
 * runtime's threads (policy watcher) that did not survive the fork. */
DM_API void dm_runtime_after_fork_child(void);

/* ---- for the services (service/): what they observe ----------------------
 *
 * The engine calls no service. Services (stats export, the file watcher)
 * register here and the engine tells them about installs and forks. */

/* After every successful install, outside the runtime's lock, on the
 * installing thread: `p` is the policy it published (valid for the call only),
 * `seq` the install's sequence number (a later install has a larger one).
 * Calls come one at a time and in install order: one that a later install
 * overtook is not made. The hook must not install a policy itself. */
typedef void (*dm_install_hook_t)(const dm_policy_t *p, uint64_t seq, void *arg);
/* From dm_runtime_after_fork_child, in the child. */
typedef void (*dm_fork_hook_t)(void *arg);
#define DM_OBSERVERS_MAX 8
/* Registers an observer (either hook may be NULL); DM_ERANGE when full. */
DM_API int dm_runtime_observe(dm_install_hook_t on_install, dm_fork_hook_t on_fork_child,
                              void *arg);

/* Each arena's THP-backed bytes, by arena index as in dm_stats_t (cap must be
 * DM_STATS_ARENAS_MAX): PAGEMAP_SCAN over the arenas' committed ranges, or
 * /proc/self/smaps. Costs a walk: callers cache. */
DM_API int dm_runtime_hugepages(uint64_t *out, int cap);

/* The project's one directory rule (docs/security.md): a descriptor
 * (O_RDONLY|O_DIRECTORY|O_NOFOLLOW, close-on-exec) on directory `path`, made
 * first with `mode` when `create` and it is absent, only if that descriptor is
 * a directory owned by this user (the effective uid) and not writable by group
 * or others, and every directory on the way owned by the user or root and
 * writable by no one else (docs/security.md). Returns the fd, or DM_EIO (cannot
 * create or open it) or DM_EUNSAFE (a symbolic link, owned by another user,
 * writable by others, or a directory on the way that is),
 * with one line in `why` naming the path and what is wrong with it. */
DM_API int dm_dir_open_owned(const char *path, bool create, unsigned mode, char *why, size_t cap);

/* datamem's log line (stderr, a newline added). Never on the fast path. */
DM_API void dm_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- testing hooks (fault injection) ------------------------------------ */

/* The next `n` extent allocations fail (simulated out-of-memory); -1 = all. */
DM_API void dm_fault_extent_alloc(int64_t n);
/* The next `n` placements (mbind/madvise of a new extent) count as failed. */
DM_API void dm_fault_placement(int64_t n);
/* The next `n` page-locks (mlock of a new extent, `lock: true`) fail with ENOMEM. */
DM_API void dm_fault_lock(int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* DATAMEM_H */
