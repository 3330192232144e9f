/*
 * tally.c: live and peak bytes per context tag ("which task holds the
 * bytes"), tag limits (`tag_limits`) and the worker limit (`worker_limit`).
 *
 * Counting is on when the policy asks for it (tag_bytes, tag_limits,
 * worker_limit) or DATAMEM_TAG_BYTES=1; once on it stays on for the process,
 * so every block counted at its allocation is uncounted at its free. While it
 * is on, every allocation reserves the block's usable size against the worker
 * limit and each of its context's tags, allocates, and records the block's
 * context in a shadow table; any thread's free reads the shadow back and takes
 * the bytes out. Small blocks keep the block cache (alloc.c, bcache_tallied):
 * their usable size is their class, which the allocation knows from the
 * thread's memo and the free from the block's tag word, so neither asks
 * jemalloc; other sizes take alloc_tallied. The counts are therefore exact
 * wherever a block is freed, and a limit is never passed by concurrent
 * threads (a compare-and-swap per limited count, as arena limits do).
 *
 * The shadow: for each 1 GiB address segment that has held a counted block, a
 * sparse array (MAP_NORESERVE, 128 MiB of address space, pages appear when
 * first written) with a 16-bit entry per 16 bytes: the block's context id + 1.
 * Counted blocks are at least 16 bytes and 16-aligned (alignment >= 16), so
 * two live blocks never share an entry. Resident cost: one page of shadow per
 * 32 KiB of small blocks, per 8 MiB span of big ones.
 *
 * Tags: a registry of up to DM_TALLY_TAGS_MAX names, entry 0 "(untagged)" for
 * the root context. Contexts are interned (context.c) and get their tags' ids
 * once, when made. Limits are set at install from the policy's tag_limits
 * (the first glob that matches).
 *
 * Thread safety: registry growth and configuration under dm__runtime_mu; counts are
 * atomics; shadow entries are atomics written by the allocating thread and
 * cleared (exchange) by the freeing one. A block's allocation happens-before
 * its free, so the free sees its entry.
 */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/os.h"
#include "runtime/tally.h"

#define NSEGS (1u << (DM_VA_BITS - DM_SEG_SHIFT))
#define SHADOW_BYTES ((DM_SEG_SIZE >> DM_TALLY_GRAIN_SHIFT) * sizeof(uint16_t))

uint16_t *_Atomic dm__tally_shadow[NSEGS];
_Atomic bool dm__tally_counting;

typedef struct tally_tag {
    const char *name;          /* the interned context's string: lives forever */
    _Atomic uint64_t live, peak, refused;
    _Atomic uint64_t limit;    /* UINT64_MAX = none */
    /* the last refusal (dm_runtime_refusals): written after `refused` grows */
    _Atomic uint64_t last_request, last_limit, last_live;
} tally_tag_t;

static tally_tag_t tags[DM_TALLY_TAGS_MAX];
static int ntags;                         /* under dm__runtime_mu */
static const struct dm_ctx *by_id[DM_CTX_MAX];
static int nctx;                          /* under dm__runtime_mu */
static tally_tag_t total = {.limit = UINT64_MAX}; /* every counted block */
static bool on;                           /* under dm__runtime_mu */
static const dm_policy_t *limits_from;    /* the policy in force (dm__runtime_mu) */
static char worker_source[16];

/* The limit of tag `name` under the policy in force. */
static uint64_t limit_for(const char *name) {
    const dm_policy_t *p = limits_from;
    for (int i = 0; p && i < p->ntag_limits; i++)
        if (fnmatch(p->tag_limits[i].tag, name, 0) == 0)
            return p->tag_limits[i].limit;
    return UINT64_MAX;
}

static int tag_id(const char *name) {
    for (int i = 1; i < ntags; i++)
        if (strcmp(tags[i].name, name) == 0)
            return i;
    if (ntags >= DM_TALLY_TAGS_MAX)
        return 0; /* counted as untagged: said in docs/cluster.md */
    tally_tag_t *t = &tags[ntags];
    t->name = name;
    atomic_store_explicit(&t->limit, limit_for(name), memory_order_relaxed);
    return ntags++;
}

bool dm__tally_ctx_init(struct dm_ctx *c, bool root) {
    if (ntags == 0) {
        tags[0].name = "(untagged)";
        atomic_store_explicit(&tags[0].limit, UINT64_MAX, memory_order_relaxed);
        ntags = 1;
    }
    if (nctx >= DM_CTX_MAX)
        return false;
    int n = c->ntags ? c->ntags : 1;
    c->tally = calloc((size_t)n, sizeof(uint16_t));
    if (!c->tally)
        return false;
    for (int i = 0; i < c->ntags; i++)
        c->tally[i] = (uint16_t)tag_id(c->tags[i]);
    if (root || c->ntags == 0)
        c->tally[0] = 0;
    c->ntally = n;
    c->id = (uint16_t)nctx;
    by_id[nctx++] = c;
    return true;
}

bool dm__tally_configure(const dm_policy_t *p) {
    limits_from = p;
    const char *env = getenv("DATAMEM_TAG_BYTES");
    on = on || p->tag_bytes || p->ntag_limits > 0 || p->worker_limit[0] ||
         (env && strcmp(env, "1") == 0);
    if (on)
        atomic_store_explicit(&dm__tally_counting, true, memory_order_relaxed);
    for (int i = 1; i < ntags; i++)
        atomic_store_explicit(&tags[i].limit, limit_for(tags[i].name), memory_order_relaxed);
    uint64_t bytes = 0, wl = UINT64_MAX;
    unsigned permille = 0;
    worker_source[0] = 0;
    if (p->worker_limit[0] && dm_parse_share(p->worker_limit, &bytes, &permille) == 0) {
        if (permille) {
            uint64_t base = dm__os_memory_limit(worker_source, sizeof(worker_source));
            if (base)
                wl = base > UINT64_MAX / 1000 ? base / 1000 * permille : base * permille / 1000;
        } else {
            wl = bytes;
            snprintf(worker_source, sizeof(worker_source), "policy");
        }
    }
    atomic_store_explicit(&total.limit, wl, memory_order_relaxed);
    return on;
}

#define REFUSED UINT64_MAX /* add_limited: the count would pass its limit */

/* Adds n to a limited count unless that passes its limit (a compare-and-swap:
 * the count never passes it, not even for an instant); returns the count
 * before, or REFUSED. */
static __attribute__((noinline)) uint64_t add_limited(tally_tag_t *t, uint64_t n, uint64_t limit) {
    uint64_t b = atomic_load_explicit(&t->live, memory_order_relaxed);
    for (;;) {
        if (b + n > limit || b + n < b)
            return REFUSED;
        if (atomic_compare_exchange_weak_explicit(&t->live, &b, b + n, memory_order_relaxed,
                                                  memory_order_relaxed))
            return b;
    }
}

static __attribute__((noinline)) void raise_peak(tally_tag_t *t, uint64_t now, uint64_t pk) {
    while (now > pk && !atomic_compare_exchange_weak_explicit(&t->peak, &pk, now,
                                                             memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

/* Adds n unless that passes the limit; the peak follows. Inlined into every
 * reservation: a count without a limit costs one atomic add and a compare
 * with its peak. */
static inline __attribute__((always_inline)) bool add_capped(tally_tag_t *t, uint64_t n) {
    uint64_t limit = atomic_load_explicit(&t->limit, memory_order_relaxed);
    uint64_t before;
    if (DM_LIKELY(limit == UINT64_MAX))
        before = atomic_fetch_add_explicit(&t->live, n, memory_order_relaxed);
    else if ((before = add_limited(t, n, limit)) == REFUSED)
        return false;
    uint64_t now = before + n, pk = atomic_load_explicit(&t->peak, memory_order_relaxed);
    if (DM_UNLIKELY(now > pk))
        raise_peak(t, now, pk);
    return true;
}

static void note_refusal(tally_tag_t *t, uint64_t request, uint64_t limit, uint64_t live) {
    atomic_store_explicit(&t->last_request, request, memory_order_relaxed);
    atomic_store_explicit(&t->last_limit, limit, memory_order_relaxed);
    atomic_store_explicit(&t->last_live, live, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->refused, 1, memory_order_release);
}

static inline void sub(tally_tag_t *t, uint64_t n) {
    atomic_fetch_sub_explicit(&t->live, n, memory_order_relaxed);
}

/* Count `failed` (-1: the worker total; else the context's i-th tag) refused
 * n bytes: what was added before it is taken back, the refusal noted in the
 * count and in f (with the count's limit and live bytes as read now). */
static __attribute__((noinline)) bool refuse(const struct dm_ctx *c, int failed, uint64_t n,
                                             uint64_t request, dm_failure_t *f) {
    tally_tag_t *t = failed < 0 ? &total : &tags[c->tally[failed]];
    uint64_t limit = atomic_load_explicit(&t->limit, memory_order_relaxed);
    uint64_t live = atomic_load_explicit(&t->live, memory_order_relaxed);
    note_refusal(t, request, limit, live);
    if (failed < 0) {
        f->kind = DM_REFUSED_WORKER;
        f->tag[0] = 0;
    } else {
        for (int i = 0; i < failed; i++)
            sub(&tags[c->tally[i]], n);
        sub(&total, n);
        f->kind = DM_REFUSED_TAG;
        snprintf(f->tag, sizeof(f->tag), "%s", t->name);
    }
    f->seq++;
    f->arena[0] = 0;
    f->rule[0] = 0;
    f->request = request;
    f->limit = limit;
    f->live = live;
    f->fallback_tried = false;
    return false;
}

static inline __attribute__((always_inline)) bool reserve(const struct dm_ctx *c, uint64_t n,
                                                          uint64_t request, dm_failure_t *f) {
    if (!add_capped(&total, n))
        return refuse(c, -1, n, request, f);
    for (int i = 0; i < c->ntally; i++)
        if (!add_capped(&tags[c->tally[i]], n))
            return refuse(c, i, n, request, f);
    return true;
}

bool dm__tally_reserve(const struct dm_ctx *c, uint64_t n, uint64_t request, dm_failure_t *f) {
    return reserve(c, n, request, f);
}

static inline void unreserve(const struct dm_ctx *c, uint64_t n) {
    sub(&total, n);
    for (int i = 0; i < c->ntally; i++)
        sub(&tags[c->tally[i]], n);
}

void dm__tally_unreserve(const struct dm_ctx *c, uint64_t n) { unreserve(c, n); }

static inline _Atomic uint16_t *entry(uint16_t *sh, const void *p) {
    return (_Atomic uint16_t *)&sh[((uintptr_t)p & (DM_SEG_SIZE - 1)) >> DM_TALLY_GRAIN_SHIFT];
}

/* The segment's shadow, made on first use (a lost race unmaps its copy). */
static __attribute__((noinline)) uint16_t *shadow_make(uintptr_t seg) {
    uint16_t *sh = NULL, *fresh = dm__os_map_sparse(SHADOW_BYTES);
    if (!fresh)
        return NULL;
    if (atomic_compare_exchange_strong_explicit(&dm__tally_shadow[seg], &sh, fresh,
                                                memory_order_acq_rel, memory_order_acquire))
        return fresh;
    dm__os_release(fresh, SHADOW_BYTES);
    return sh;
}

static inline uint16_t *shadow_of(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    if (DM_UNLIKELY(seg >= NSEGS))
        return NULL;
    uint16_t *sh = atomic_load_explicit(&dm__tally_shadow[seg], memory_order_acquire);
    return DM_LIKELY(sh != NULL) ? sh : shadow_make(seg);
}

bool dm__tally_charge(const struct dm_ctx *c, void *p, uint64_t n, uint64_t request,
                      dm_failure_t *f) {
    uint16_t *sh = shadow_of(p);
    if (DM_UNLIKELY(!sh)) /* no memory for the shadow: the block goes uncounted */
        return true;
    if (!reserve(c, n, request, f))
        return false;
    atomic_store_explicit(entry(sh, p), (uint16_t)(c->id + 1), memory_order_relaxed);
    return true;
}

void dm__tally_record(const struct dm_ctx *c, void *p, uint64_t n, bool exact) {
    uint64_t usable = exact ? n : dmje_sallocx(p, 0);
    uint16_t *sh = shadow_of(p);
    if (DM_UNLIKELY(!sh)) { /* no memory for the shadow: the block goes uncounted */
        dm__tally_unreserve(c, n);
        return;
    }
    if (usable != n) { /* the block is not the size reserved (another arena's rounding) */
        if (usable > n) { /* counted as it is, past a limit by this padding at most */
            uint64_t d = usable - n;
            atomic_fetch_add_explicit(&total.live, d, memory_order_relaxed);
            for (int i = 0; i < c->ntally; i++)
                atomic_fetch_add_explicit(&tags[c->tally[i]].live, d, memory_order_relaxed);
        } else {
            dm__tally_unreserve(c, n - usable);
        }
    }
    atomic_store_explicit(entry(sh, p), (uint16_t)(c->id + 1), memory_order_relaxed);
}

/* The block's context, its shadow entry cleared (NULL: not counted). */
static inline __attribute__((always_inline)) const struct dm_ctx *release_entry(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    uint16_t *sh = seg < NSEGS ? atomic_load_explicit(&dm__tally_shadow[seg], memory_order_acquire)
                               : NULL;
    uint16_t v = sh ? atomic_exchange_explicit(entry(sh, p), 0, memory_order_relaxed) : 0;
    return v ? by_id[v - 1] : NULL;
}

void dm__tally_release_sized(const void *p, uint64_t usable) {
    const struct dm_ctx *c = release_entry(p);
    if (c)
        unreserve(c, usable);
}

void dm__tally_release_slow(const void *p) {
    const struct dm_ctx *c = release_entry(p);
    if (c)
        unreserve(c, dmje_sallocx((void *)p, 0));
}

int dm_runtime_refusals(const char *name, dm_refusals_t *out) {
    memset(out, 0, sizeof(*out));
    const tally_tag_t *t = name ? NULL : &total;
    pthread_mutex_lock(&dm__runtime_mu);
    for (int i = 0; name && !t && i < ntags; i++)
        if (strcmp(tags[i].name, name) == 0)
            t = &tags[i];
    pthread_mutex_unlock(&dm__runtime_mu);
    if (!t)
        return DM_ENOENT;
    out->count = atomic_load_explicit(&t->refused, memory_order_acquire);
    out->request = atomic_load_explicit(&t->last_request, memory_order_relaxed);
    out->limit = atomic_load_explicit(&t->last_limit, memory_order_relaxed);
    out->live = atomic_load_explicit(&t->last_live, memory_order_relaxed);
    return 0;
}

static int by_live(const void *a, const void *b) {
    const dm_tag_stats_t *x = a, *y = b;
    if (x->live != y->live)
        return x->live < y->live ? 1 : -1;
    if (x->peak != y->peak)
        return x->peak < y->peak ? 1 : -1;
    return strcmp(x->name, y->name);
}

int dm__tally_snapshot(dm_stats_t *out) {
    out->tally_on = on;
    out->tally_live = atomic_load_explicit(&total.live, memory_order_relaxed);
    out->tally_peak = atomic_load_explicit(&total.peak, memory_order_relaxed);
    out->worker_limit = atomic_load_explicit(&total.limit, memory_order_relaxed);
    out->worker_refused = atomic_load_explicit(&total.refused, memory_order_relaxed);
    snprintf(out->worker_limit_source, sizeof(out->worker_limit_source), "%s", worker_source);
    out->ntags = 0;
    out->tags = NULL;
    if (!on || ntags == 0)
        return 0;
    out->tags = calloc((size_t)ntags, sizeof(dm_tag_stats_t));
    if (!out->tags)
        return DM_ENOMEM;
    for (int i = 0; i < ntags; i++) {
        dm_tag_stats_t *o = &out->tags[i];
        snprintf(o->name, sizeof(o->name), "%s", tags[i].name);
        o->live = atomic_load_explicit(&tags[i].live, memory_order_relaxed);
        o->peak = atomic_load_explicit(&tags[i].peak, memory_order_relaxed);
        o->limit = atomic_load_explicit(&tags[i].limit, memory_order_relaxed);
        o->refused = atomic_load_explicit(&tags[i].refused, memory_order_relaxed);
    }
    out->ntags = ntags;
    qsort(out->tags, (size_t)ntags, sizeof(dm_tag_stats_t), by_live);
    return 0;
}
