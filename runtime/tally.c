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
 * While no count can have a limit, a thread holds the bytes of the small
 * blocks it frees in the counts, for its next ones to take up (tally.h, "a
 * thread's held frees"); the stats take them out.
 *
 * The shadow: for each 1 GiB address segment that has held a counted block, a
 * sparse array (MAP_NORESERVE, 128 MiB of address space, pages appear when
 * first written) with a 16-bit entry per 16 bytes: the block's context id + 1.
 * Counted blocks are at least 16 bytes and 16-aligned (alignment >= 16), so
 * two live blocks never share an entry. Resident cost: one page of shadow per
 * 32 KiB of small blocks, per 8 MiB span of big ones.
 *
 * Tags: a table of DM_TALLY_TAGS_MAX rows, found by name through a hash.
 * Row 0 is "(untagged)" (the root context), row 1 "(other)". A context takes
 * a reference on its tags' rows when it is made (context.c) and gives them
 * back when it is freed; a row nobody refers to holds no bytes and stays in
 * the stats (live 0, its peak) until its slot is needed: rows without a limit
 * are reused first, oldest idle first, and once none is idle, idle limited
 * ones (oldest first: their refusals leave the stats). When every row is
 * referenced, a new name counts under "(other)".
 * Limits are set from the policy's tag_limits (the first glob that matches)
 * when a row is made and at install.
 *
 * Context ids: DM_CTX_MAX, in the shadow as id + 1. Id 0 is the root, id 1
 * the static context "(other)" stands for; the others go to contexts as they
 * are made and come back when they are freed, which happens only once no
 * live block carries the id (each holds a reference: dm__tally_record takes
 * it, dm__tally_release_slow gives it back last). A context made while every
 * id is held counts its blocks under id 1 and row "(other)".
 *
 * Tags counted under "(other)" (a context's `uncounted` bits): each counts in
 * `tags_overflowed`. Such a context is on the list `uncounted_ctxs` while it
 * lives; as soon as an id and a row are free (dm__tally_could_count) the next
 * lookup of its tag set retires it and makes a counted one (context.c). A tag
 * with a limit is never off silently: the snapshot lists the limited tags of
 * held contexts on that list (`tags_unenforced`), and stderr names each such
 * tag once, for the first SAID_MAX names; past that one line says further
 * ones go unnamed there (the stats still list them). Unlimited names meeting
 * full tables get one line for the process.
 *
 * Thread safety: rows, ids and configuration change under dm__mem_mu;
 * counts are atomics; shadow entries are atomics written by the allocating
 * thread and cleared (a load and a store) by the freeing one; a thread's held
 * frees are its own, read by stats under dm__mem_mu (held_read). A block's allocation
 * happens-before its free, so the free sees its entry, and the row and context
 * behind it (held by the block) are the ones it was counted under.
 */
#include <fnmatch.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/os.h"
#include "runtime/tally.h"

#define SHADOW_BYTES ((DM_SEG_SIZE >> DM_TALLY_GRAIN_SHIFT) * sizeof(uint16_t))

uint16_t *_Atomic dm__tally_shadow[DM_TALLY_NSEGS];
_Atomic bool dm__tally_counting;

typedef dm__tally_row_t tally_tag_t;

#define ROW_UNTAGGED 0
#define ROW_OTHER 1
#define ID_OTHER 1
#define ID_FIRST DM_TALLY_ID_FIRST
#define TAG_BUCKETS 8192
#define SAID_MAX 64 /* limited tags named on stderr as counted under "(other)" */
_Static_assert(DM_CTX_TAGS_MAX <= 64, "a context's `uncounted` has a bit per tag");
enum { IDLE_PLAIN, IDLE_LIMITED, NIDLE };

tally_tag_t dm__tally_rows[DM_TALLY_TAGS_MAX];
static int ntags;                         /* rows ever used; under dm__mem_mu */
static uint16_t tag_heads[TAG_BUCKETS];   /* row + 1, 0 = empty (dm__mem_mu) */
typedef struct { int16_t head, tail; } idle_list_t; /* rows, oldest first */
static idle_list_t idle[NIDLE] = {{-1, -1}, {-1, -1}};
/* by shadow entry: [id + 1] the context with that id, [0] NULL (not counted) */
struct dm_ctx *_Atomic dm__tally_by_entry[DM_CTX_MAX + 1];
static uint16_t free_ids[DM_CTX_MAX];     /* ids given back (dm__mem_mu) */
static int nfree_ids, next_id = ID_FIRST;
static uint64_t overflowed;               /* names counted under "(other)" */
static struct dm_ctx *uncounted_ctxs;     /* live contexts with uncounted tags (mu) */
static char said[SAID_MAX][DM_NAME_MAX];  /* limited tags named on stderr (mu) */
static int nsaid;                         /* under dm__mem_mu, as below */
static bool said_full, said_other;        /* the lines past `said`, for unlimited names */
/* Whether freed bytes may be held (tally.h): counting is on, and neither the
 * policy's tag_limits nor a worker limit can put a limit on a count (limits
 * come from the policy only; set at each install). */
_Atomic bool dm__tally_holding;
tally_tag_t dm__tally_total = {.limit = UINT64_MAX}; /* every counted block */
static bool on;                           /* under dm__mem_mu */
static const dm_policy_t *limits_from;    /* the policy in force (dm__mem_mu) */
static char worker_source[16];
static uint16_t root_rows[1] = {ROW_UNTAGGED}, other_rows[1] = {ROW_OTHER};
static struct dm_ctx other_ctx = {.id = ID_OTHER, .ntally = 1, .tally = other_rows};

static inline uint64_t less(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }

/* The limit of tag `name` under the policy in force. */
static uint64_t limit_for(const char *name) {
    const dm_policy_t *p = limits_from;
    for (int i = 0; p && i < p->ntag_limits; i++)
        if (fnmatch(p->tag_limits[i].tag, name, 0) == 0)
            return p->tag_limits[i].limit;
    return UINT64_MAX;
}


uint64_t dm__tally_hash(const char *const *s, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++)
        for (const unsigned char *p = (const unsigned char *)s[i];; p++) {
            h = (h ^ *p) * 1099511628211ull;
            if (!*p)
                break;
        }
    return h;
}

/* ---- idle rows: two FIFO lists threaded through the rows ---------------------- */

static void idle_push(int i) {
    int l = atomic_load_explicit(&dm__tally_rows[i].limit, memory_order_relaxed) == UINT64_MAX
                ? IDLE_PLAIN : IDLE_LIMITED;
    dm__tally_rows[i].idle = (int8_t)l;
    dm__tally_rows[i].next = -1;
    dm__tally_rows[i].prev = idle[l].tail;
    if (idle[l].tail >= 0)
        dm__tally_rows[idle[l].tail].next = (int16_t)i;
    else
        idle[l].head = (int16_t)i;
    idle[l].tail = (int16_t)i;
}

static void idle_remove(int i) {
    int l = dm__tally_rows[i].idle;
    if (l < 0)
        return;
    if (dm__tally_rows[i].prev >= 0)
        dm__tally_rows[dm__tally_rows[i].prev].next = dm__tally_rows[i].next;
    else
        idle[l].head = dm__tally_rows[i].next;
    if (dm__tally_rows[i].next >= 0)
        dm__tally_rows[dm__tally_rows[i].next].prev = dm__tally_rows[i].prev;
    else
        idle[l].tail = dm__tally_rows[i].prev;
    dm__tally_rows[i].idle = -1;
}

/* ---- rows by name --------------------------------------------------------------- */

static int row_find(uint64_t h, const char *name) {
    for (int i = tag_heads[h & (TAG_BUCKETS - 1)] - 1; i >= 0; i = dm__tally_rows[i].hnext - 1)
        if (dm__tally_rows[i].hash == h && strcmp(dm__tally_rows[i].name, name) == 0)
            return i;
    return -1;
}

static void row_unlink(int i) {
    uint16_t *pp = &tag_heads[dm__tally_rows[i].hash & (TAG_BUCKETS - 1)];
    while (*pp && *pp != i + 1)
        pp = &dm__tally_rows[*pp - 1].hnext;
    if (*pp)
        *pp = dm__tally_rows[i].hnext;
}

/* A row for a new name: a fresh one, else the oldest idle (plain first); -1
 * when every row is referenced. Its counts start at zero. */
static int row_new(uint64_t h, const char *name) {
    int i = -1;
    if (ntags < DM_TALLY_TAGS_MAX) {
        i = ntags++;
    } else {
        for (int l = 0; l < NIDLE && i < 0; l++)
            i = idle[l].head;
        if (i < 0)
            return -1;
        idle_remove(i);
        row_unlink(i);
    }
    tally_tag_t *t = &dm__tally_rows[i];
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->hash = h;
    t->refs = 0;
    t->idle = -1;
    atomic_store_explicit(&t->live, 0, memory_order_relaxed);
    atomic_store_explicit(&t->peak, 0, memory_order_relaxed);
    atomic_store_explicit(&t->refused, 0, memory_order_relaxed);
    atomic_store_explicit(&t->last_request, 0, memory_order_relaxed);
    atomic_store_explicit(&t->last_limit, 0, memory_order_relaxed);
    atomic_store_explicit(&t->last_live, 0, memory_order_relaxed);
    atomic_store_explicit(&t->limit, limit_for(name), memory_order_relaxed);
    t->hnext = tag_heads[h & (TAG_BUCKETS - 1)];
    tag_heads[h & (TAG_BUCKETS - 1)] = (uint16_t)(i + 1);
    return i;
}

/* Limited tag `name` counts under "(other)": said on stderr once per name for
 * the first SAID_MAX names, then one line that further ones go unnamed. */
static void say_unenforced(const char *name, uint64_t limit) {
    for (int i = 0; i < nsaid; i++)
        if (strcmp(said[i], name) == 0)
            return;
    if (nsaid == SAID_MAX) {
        if (!said_full)
            dm__log("datamem: %d tags with a tag_limits limit were named here as counted under "
                    "'(other)'; further ones are not named on stderr (tag_bytes.unenforced_tags "
                    "lists those held now)", SAID_MAX);
        said_full = true;
        return;
    }
    snprintf(said[nsaid++], DM_NAME_MAX, "%s", name);
    dm__log("datamem: tag '%s' counts under '(other)' (every one of the %d tag rows or %d tag "
            "set ids is held): its tag_limits limit of %" PRIu64 " bytes is not applied to "
            "arrays of that tag set until one is free and the tag is entered again "
            "(tag_bytes.unenforced_tags lists it meanwhile)",
            name, DM_TALLY_TAGS_MAX, DM_CTX_MAX, limit);
}

/* Tag `name` of a context being made counts under "(other)". An unlimited
 * name is said once for the process; a limited one by say_unenforced. */
static void note_other(const char *name) {
    overflowed++;
    uint64_t limit = limit_for(name);
    if (limit != UINT64_MAX) {
        say_unenforced(name, limit);
        return;
    }
    if (said_other)
        return;
    said_other = true;
    dm__log("datamem: tag '%s' counts under '(other)': every one of the %d tag rows or %d tag "
            "set ids is held; names that meet full tables from now on count there too, "
            "without a line each (tag_bytes.overflowed counts them)",
            name, DM_TALLY_TAGS_MAX, DM_CTX_MAX);
}

/* A reference on the row of `name`: found, made, or "(other)". */
static int row_ref(const char *name) {
    uint64_t h = dm__tally_hash(&name, 1);
    int i = row_find(h, name);
    if (i < 0 && (i = row_new(h, name)) < 0)
        return ROW_OTHER;
    if (dm__tally_rows[i].refs++ == 0)
        idle_remove(i);
    return i;
}

static void row_unref(int i) {
    if (i > ROW_OTHER && --dm__tally_rows[i].refs == 0)
        idle_push(i);
}

/* ---- contexts ------------------------------------------------------------------- */

void dm__tally_root_init(struct dm_ctx *root) {
    snprintf(dm__tally_rows[ROW_UNTAGGED].name, DM_NAME_MAX, "(untagged)");
    snprintf(dm__tally_rows[ROW_OTHER].name, DM_NAME_MAX, "(other)");
    for (int i = ROW_UNTAGGED; i <= ROW_OTHER; i++) {
        atomic_store_explicit(&dm__tally_rows[i].limit, UINT64_MAX, memory_order_relaxed);
        dm__tally_rows[i].idle = -1;
    }
    ntags = ROW_OTHER + 1;
    root->tally = root_rows;
    root->ntally = 1;
    root->id = 0;
    atomic_store_explicit(&dm__tally_by_entry[1], root, memory_order_release);
    atomic_store_explicit(&dm__tally_by_entry[ID_OTHER + 1], &other_ctx, memory_order_release);
}

static bool id_free(void) { return nfree_ids > 0 || next_id < DM_CTX_MAX; }

static bool row_free(void) {
    return ntags < DM_TALLY_TAGS_MAX || idle[IDLE_PLAIN].head >= 0 ||
           idle[IDLE_LIMITED].head >= 0;
}

bool dm__tally_crowded(void) { return !id_free() || !row_free(); }

bool dm__tally_could_count(const struct dm_ctx *c) {
    if (!c->uncounted || !id_free())
        return false;
    if (c->id == ID_OTHER || row_free())
        return true; /* a new context gets an id (and rows as far as they go) */
    for (int i = 0; i < c->ntags; i++) /* a row another set made meanwhile */
        if ((c->uncounted >> i & 1) && row_find(dm__tally_hash((const char *const *)&c->tags[i], 1),
                                                c->tags[i]) >= 0)
            return true;
    return false;
}

bool dm__tally_ctx_init(struct dm_ctx *c) {
    c->tally = calloc((size_t)c->ntags, sizeof(uint16_t));
    if (!c->tally)
        return false;
    /* every id held: all its tags count under "(other)" (id 1) */
    int id = nfree_ids ? free_ids[--nfree_ids] : next_id < DM_CTX_MAX ? next_id++ : -1;
    int n = 0;
    bool other = false;
    c->uncounted = 0;
    for (int i = 0; i < c->ntags; i++) {
        int r = id < 0 ? ROW_OTHER : row_ref(c->tags[i]);
        if (r == ROW_OTHER) {
            c->uncounted |= 1ull << i;
            note_other(c->tags[i]);
            if (other)
                continue; /* "(other)" once: a block counts there once */
            other = true;
        }
        c->tally[n++] = (uint16_t)r;
    }
    c->ntally = n;
    if (c->uncounted) { /* on the list, for the stats and a later upgrade */
        c->oprev = NULL;
        c->onext = uncounted_ctxs;
        if (uncounted_ctxs)
            uncounted_ctxs->oprev = c;
        uncounted_ctxs = c;
    }
    if (id < 0) {
        c->id = ID_OTHER;
        return true;
    }
    c->id = (uint16_t)id;
    atomic_store_explicit(&dm__tally_by_entry[id + 1], c, memory_order_release);
    return true;
}

void dm__tally_ctx_fini(struct dm_ctx *c) {
    if (c->uncounted) {
        if (c->oprev)
            c->oprev->onext = c->onext;
        else
            uncounted_ctxs = c->onext;
        if (c->onext)
            c->onext->oprev = c->oprev;
    }
    if (c->id >= ID_FIRST) {
        for (int i = 0; i < c->ntally; i++)
            row_unref(c->tally[i]);
        atomic_store_explicit(&dm__tally_by_entry[c->id + 1], NULL, memory_order_relaxed);
        free_ids[nfree_ids++] = c->id;
    }
    free(c->tally);
    c->tally = NULL;
}

bool dm__tally_configure(const dm_policy_t *p, const dm__budget_worker_t *w) {
    limits_from = p;
    const char *env = getenv("DATAMEM_TAG_BYTES");
    on = on || p->tag_bytes || p->ntag_limits > 0 || p->worker_limit[0] ||
         (env && strcmp(env, "1") == 0);
    if (on)
        atomic_store_explicit(&dm__tally_counting, true, memory_order_relaxed);
    for (int i = ROW_OTHER + 1; i < ntags; i++) {
        tally_tag_t *t = &dm__tally_rows[i];
        atomic_store_explicit(&t->limit, limit_for(t->name), memory_order_relaxed);
        if (dm__tally_rows[i].idle >= 0) { /* idle: onto the list its limit now says */
            idle_remove(i);
            idle_push(i);
        }
    }
    for (const struct dm_ctx *c = uncounted_ctxs; c; c = c->onext) /* limits new to them */
        for (int i = 0; i < c->ntags; i++) {
            uint64_t limit = (c->uncounted >> i & 1) ? limit_for(c->tags[i]) : UINT64_MAX;
            if (limit != UINT64_MAX && atomic_load_explicit(&c->refs, memory_order_relaxed))
                say_unenforced(c->tags[i], limit);
        }
    snprintf(worker_source, sizeof(worker_source), "%s", w->source);
    dm__beside_configure(w->group, w->group_version, &dm__tally_total.live);
    atomic_store_explicit(&dm__tally_total.limit, w->limit, memory_order_relaxed);
    atomic_store_explicit(&dm__tally_holding,
                          on && p->ntag_limits == 0 && w->limit == UINT64_MAX,
                          memory_order_relaxed);
    return on;
}

/* Context c's count k: -1 the worker total, i >= 0 its i-th tag's row. */
static inline tally_tag_t *count_of(const struct dm_ctx *c, int k) {
    return k < 0 ? &dm__tally_total : &dm__tally_rows[c->tally[k]];
}

static __attribute__((noinline)) void raise_peak(tally_tag_t *t, uint64_t now) {
    uint64_t pk = atomic_load_explicit(&t->peak, memory_order_relaxed);
    while (now > pk && !atomic_compare_exchange_weak_explicit(&t->peak, &pk, now,
                                                             memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

/* Adds n to t's live bytes unless that passes `limit` (a compare-and-swap:
 * the count never passes it, not even for an instant); the peak follows. */
static bool add_within(tally_tag_t *t, uint64_t n, uint64_t limit) {
    uint64_t b = atomic_load_explicit(&t->live, memory_order_relaxed);
    do {
        if (b + n > limit || b + n < b)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&t->live, &b, b + n, memory_order_relaxed,
                                                    memory_order_relaxed));
    raise_peak(t, b + n);
    return true;
}

/* A limited count: adds n unless that passes its limit. The worker total's
 * limit is less the memory beside the arenas; where that refuses, the arenas'
 * idle pages and glibc's free ones go back first (dm__beside_relieved says how
 * often) and the memory beside is read again. */
static __attribute__((noinline)) bool add_limited(tally_tag_t *t, uint64_t n) {
    uint64_t limit = atomic_load_explicit(&t->limit, memory_order_relaxed);
    if (t != &dm__tally_total)
        return add_within(t, n, limit);
    if (add_within(t, n, less(limit, dm__beside_now())))
        return true;
    return dm__beside_relieved() && add_within(t, n, less(limit, dm__beside_now()));
}

/* Adds n to a count unless that passes its limit; the peak follows. A count
 * without a limit costs one atomic add and a compare with its peak. */
static inline __attribute__((always_inline)) bool add_capped(tally_tag_t *t, uint64_t n) {
    if (DM_UNLIKELY(atomic_load_explicit(&t->limit, memory_order_relaxed) != UINT64_MAX))
        return add_limited(t, n);
    uint64_t now = atomic_fetch_add_explicit(&t->live, n, memory_order_relaxed) + n;
    if (DM_UNLIKELY(now > atomic_load_explicit(&t->peak, memory_order_relaxed)))
        raise_peak(t, now);
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
    tally_tag_t *t = count_of(c, failed);
    uint64_t limit = atomic_load_explicit(&t->limit, memory_order_relaxed);
    uint64_t live = atomic_load_explicit(&t->live, memory_order_relaxed);
    if (failed < 0) /* what counted against the worker limit: arrays and beside */
        live += dm__beside_last();
    note_refusal(t, request, limit, live);
    if (failed < 0) {
        f->kind = DM_REFUSED_WORKER;
        f->tag[0] = 0;
    } else {
        for (int i = 0; i < failed; i++)
            sub(&dm__tally_rows[c->tally[i]], n);
        sub(&dm__tally_total, n);
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

/* Reserves n in c's counts from k on (refusal: false, nothing reserved). */
static bool reserve_from(const struct dm_ctx *c, int k, uint64_t n, uint64_t request,
                         dm_failure_t *f) {
    for (; k < c->ntally; k++)
        if (!add_capped(count_of(c, k), n))
            return refuse(c, k, n, request, f);
    return true;
}

bool dm__tally_reserve(const struct dm_ctx *c, uint64_t n, uint64_t request, dm_failure_t *f) {
    return reserve_from(c, -1, n, request, f);
}

static inline void unreserve(const struct dm_ctx *c, uint64_t n) {
    sub(&dm__tally_total, n);
    for (int i = 0; i < c->ntally; i++)
        sub(&dm__tally_rows[c->tally[i]], n);
}

void dm__tally_unreserve(const struct dm_ctx *c, uint64_t n) { unreserve(c, n); }

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

/* The shadow of p's segment, made if it has none (NULL: no memory, or p is
 * past the address space the shadows cover). */
static inline uint16_t *shadow_of(const void *p) {
    uint16_t *sh = dm__tally_shadow_peek(p);
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    return DM_LIKELY(sh != NULL) || seg >= DM_TALLY_NSEGS ? sh : shadow_make(seg);
}

bool dm__tally_charge_from(const struct dm_ctx *c, void *p, uint64_t n, uint64_t request,
                           dm_failure_t *f, int k, uint64_t now) {
    uint16_t *sh = shadow_of(p);
    if (DM_UNLIKELY(!sh)) /* no memory for the shadow: the block goes uncounted */
        return true;
    if (now) /* count k is added: its peak rises */
        raise_peak(count_of(c, k++), now);
    if (!reserve_from(c, k, n, request, f))
        return false;
    dm__tally_mark(c, sh, p);
    return true;
}

void dm__tally_record(const struct dm_ctx *c, void *p, uint64_t n, bool exact) {
    uint64_t usable = exact ? n : dm__block_usable(p);
    uint16_t *sh = shadow_of(p);
    if (DM_UNLIKELY(!sh)) { /* no memory for the shadow: the block goes uncounted */
        dm__tally_unreserve(c, n);
        return;
    }
    if (usable != n) { /* the block is not the size reserved (another arena's rounding) */
        if (usable > n) { /* counted as it is, past a limit by this padding at most */
            uint64_t d = usable - n;
            atomic_fetch_add_explicit(&dm__tally_total.live, d, memory_order_relaxed);
            for (int i = 0; i < c->ntally; i++)
                atomic_fetch_add_explicit(&dm__tally_rows[c->tally[i]].live, d,
                                          memory_order_relaxed);
        } else {
            dm__tally_unreserve(c, n - usable);
        }
    }
    dm__tally_mark(c, sh, p);
}

/* A block of c, n bytes, leaves its counts; its reference on c goes back. */
static void count_out(const struct dm_ctx *c, uint64_t n) {
    unreserve(c, n);
    if (c->id >= ID_FIRST)
        dm__context_drop_made(c); /* last: c may be freed from here on */
}

void dm__tally_held_return(dm__tally_held_t *h) {
    uint64_t v = atomic_load_explicit(&h->held, memory_order_relaxed);
    if (!v)
        return;
    const struct dm_ctx *c = atomic_load_explicit(&h->ctx, memory_order_relaxed);
    /* first: a fork child that finds the word cleared and the counts not yet
     * taken down reads more, never less, than is live */
    atomic_store_explicit(&h->held, 0, memory_order_relaxed);
    uint64_t blocks = v / DM_TALLY_HELD_BLOCK, bytes = v % DM_TALLY_HELD_BLOCK;
    if (bytes)
        unreserve(c, bytes);
    if (blocks && c->id >= ID_FIRST) /* last: c may be freed from here on */
        atomic_fetch_sub_explicit(&((struct dm_ctx *)c)->refs, blocks, memory_order_release);
}

void dm__tally_release_held_slow(dm__tally_held_t *h, const struct dm_ctx *c, uint64_t n) {
    if (!atomic_load_explicit(&dm__tally_holding, memory_order_relaxed) || n > DM_TALLY_HELD_MAX) {
        /* a limit may apply (what h holds from before the policy goes back
         * when the thread binds its table), or past the bound: counted out */
        count_out(c, n);
        return;
    }
    /* another context, or past the bound: what h holds goes back, then the
     * block is held anew (h switching to its context) */
    dm__tally_held_return(h);
    if (atomic_load_explicit(&h->ctx, memory_order_relaxed) != c) {
        uint32_t s = atomic_load_explicit(&h->seq, memory_order_relaxed);
        /* a reader that sees the new ctx (release) sees seq past s too */
        atomic_store_explicit(&h->seq, s + 1, memory_order_relaxed);
        atomic_store_explicit(&h->ctx, c, memory_order_release);
        atomic_store_explicit(&h->seq, s + 2, memory_order_release);
    }
    /* release: a reader that sees these bytes sees the seq that named c */
    atomic_store_explicit(&h->held, DM_TALLY_HELD_BLOCK + n, memory_order_release);
}

/* h's context and held bytes as one reading (0: none held). Acquire loads in
 * order, no fences (TSan has none): bytes held under a new ctx were stored
 * after seq moved past an even value, so a reader that sees them reads seq
 * moved, unless it began after the move and so read that ctx. */
static uint64_t held_read(dm__tally_held_t *h, const struct dm_ctx **c) {
    uint32_t s1, s2;
    uint64_t v;
    do {
        s1 = atomic_load_explicit(&h->seq, memory_order_acquire);
        *c = atomic_load_explicit(&h->ctx, memory_order_acquire);
        v = atomic_load_explicit(&h->held, memory_order_acquire);
        s2 = atomic_load_explicit(&h->seq, memory_order_acquire);
    } while ((s1 & 1) || s1 != s2);
    return v % DM_TALLY_HELD_BLOCK;
}

void dm__tally_release_slow(const void *p) {
    unsigned id1 = dm__tally_entry_clear(p);
    if (id1)
        count_out(atomic_load_explicit(&dm__tally_by_entry[id1], memory_order_acquire),
                  dm__block_usable(p));
}

int dm_runtime_refusals(const char *name, dm_refusals_t *out) {
    memset(out, 0, sizeof(*out));
    const tally_tag_t *t = name ? NULL : &dm__tally_total;
    pthread_mutex_lock(&dm__mem_mu); /* the row is not reused meanwhile */
    if (name && ntags) {
        int i = row_find(dm__tally_hash(&name, 1), name);
        t = i >= 0 ? &dm__tally_rows[i] : NULL;
    }
    if (t) {
        out->count = atomic_load_explicit(&t->refused, memory_order_acquire);
        out->request = atomic_load_explicit(&t->last_request, memory_order_relaxed);
        out->limit = atomic_load_explicit(&t->last_limit, memory_order_relaxed);
        out->live = atomic_load_explicit(&t->last_live, memory_order_relaxed);
    }
    pthread_mutex_unlock(&dm__mem_mu);
    return t ? 0 : DM_ENOENT;
}

static int by_live(const void *a, const void *b) {
    const dm_tag_stats_t *x = a, *y = b;
    if (x->live != y->live)
        return x->live < y->live ? 1 : -1;
    if (x->peak != y->peak)
        return x->peak < y->peak ? 1 : -1;
    return strcmp(x->name, y->name);
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The limited tags that held contexts count under "(other)": how many distinct
 * names, and the first DM_STATS_UNENFORCED_MAX by name. */
static int unenforced_snapshot(dm_stats_t *out) {
    out->tags_unenforced = 0;
    out->nunenforced = 0;
    size_t n = 0, cap = 0;
    for (const struct dm_ctx *c = uncounted_ctxs; c; c = c->onext)
        cap += (size_t)__builtin_popcountll(c->uncounted);
    if (!cap || !limits_from || !limits_from->ntag_limits)
        return 0;
    char **names = malloc(cap * sizeof(char *));
    if (!names)
        return DM_ENOMEM;
    for (const struct dm_ctx *c = uncounted_ctxs; c; c = c->onext) {
        if (!atomic_load_explicit(&c->refs, memory_order_acquire))
            continue; /* idle: nobody allocates in it (a lookup would retire or hold it) */
        for (int i = 0; i < c->ntags; i++)
            if ((c->uncounted >> i & 1) && limit_for(c->tags[i]) != UINT64_MAX)
                names[n++] = c->tags[i];
    }
    qsort(names, n, sizeof(char *), by_name);
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && strcmp(names[i], names[i - 1]) == 0)
            continue;
        if (out->nunenforced < DM_STATS_UNENFORCED_MAX)
            snprintf(out->unenforced[out->nunenforced++], DM_NAME_MAX, "%s", names[i]);
        out->tags_unenforced++;
    }
    free(names);
    return 0;
}

static uint64_t less_held(uint64_t live, uint64_t held) { return live > held ? live - held : 0; }

static int snapshot_less(dm_stats_t *out, uint64_t held_total, const uint64_t *held_rows) {
    out->tally_on = on;
    out->tally_live = less_held(atomic_load_explicit(&dm__tally_total.live, memory_order_relaxed),
                                held_total);
    out->tally_peak = atomic_load_explicit(&dm__tally_total.peak, memory_order_relaxed);
    out->worker_limit = atomic_load_explicit(&dm__tally_total.limit, memory_order_relaxed);
    out->worker_refused = atomic_load_explicit(&dm__tally_total.refused, memory_order_relaxed);
    out->worker_spilled = atomic_load_explicit(&dm__tally_total.spilled, memory_order_relaxed);
    out->worker_beside = out->worker_limit == UINT64_MAX
                             ? 0 : dm__beside_last();
    snprintf(out->worker_limit_source, sizeof(out->worker_limit_source), "%s", worker_source);
    out->tags_overflowed = overflowed;
    out->ntags = 0;
    out->tags = NULL;
    if (unenforced_snapshot(out) != 0)
        return DM_ENOMEM;
    if (!on || ntags == 0)
        return 0;
    out->tags = calloc((size_t)ntags, sizeof(dm_tag_stats_t));
    if (!out->tags)
        return DM_ENOMEM;
    int n = 0;
    for (int i = 0; i < ntags; i++) {
        if (i == ROW_OTHER && !overflowed) /* "(other)": once a name went there */
            continue;
        dm_tag_stats_t *o = &out->tags[n++];
        memcpy(o->name, dm__tally_rows[i].name, sizeof(o->name)); /* both DM_NAME_MAX, NUL-ended */
        o->live = less_held(atomic_load_explicit(&dm__tally_rows[i].live, memory_order_relaxed),
                            held_rows ? held_rows[i] : 0);
        o->peak = atomic_load_explicit(&dm__tally_rows[i].peak, memory_order_relaxed);
        o->limit = atomic_load_explicit(&dm__tally_rows[i].limit, memory_order_relaxed);
        o->refused = atomic_load_explicit(&dm__tally_rows[i].refused, memory_order_relaxed);
    }
    out->ntags = n;
    qsort(out->tags, (size_t)n, sizeof(dm_tag_stats_t), by_live);
    return 0;
}

int dm__tally_snapshot(dm_stats_t *out, dm__tally_held_t *const *held, int nheld) {
    /* the threads' held frees, by row: their contexts are held by the blocks
     * (and freed only under dm__mem_mu, which the caller holds) */
    uint64_t held_total = 0, *held_rows = NULL;
    for (int i = 0; i < nheld; i++) {
        const struct dm_ctx *c;
        uint64_t b = held_read(held[i], &c);
        if (!b)
            continue;
        if (!held_rows && !(held_rows = calloc(DM_TALLY_TAGS_MAX, sizeof(uint64_t))))
            return DM_ENOMEM;
        held_total += b;
        for (int k = 0; k < c->ntally; k++)
            held_rows[c->tally[k]] += b;
    }
    int rc = snapshot_less(out, held_total, held_rows);
    free(held_rows);
    return rc;
}
