/*
 * context.c: contexts, the interned sets of tags (datamem.h: dm_ctx_with_tag)
 * that select a view of the dispatch table and, while bytes are counted, the
 * tally rows a block counts under (tally.c).
 *
 * A process may meet any number of distinct tag sets over its life (a Dask
 * worker makes one per task key prefix, for weeks), so contexts are reference
 * counted and recycled. `refs` counts every holder, in one atomic so that
 * "nothing refers to it" is one load:
 *   - each reference dm_ctx_with_tag handed out, until dm_ctx_release (the
 *     Python layer: one per NEP 49 handler capsule, given back when the
 *     capsule dies; NumPy's ContextVar and every array hold the capsule);
 *   - the thread bound to it (thread.c, `held`): a binding is compared by
 *     pointer, so a bound context must never be freed and its address handed
 *     to another set of tags;
 *   - each live counted block (tally.c): a free, on any thread, finds the
 *     block's tags through the context id in the shadow.
 * Why counts and not generation numbers: every cached pointer (a capsule's,
 * a thread's binding) is a holder, so nothing caches a freed context and a
 * pointer compare stays exact; and a free needs the tags behind an id, which
 * a generation would not keep alive.
 *
 * A count goes from 0 to 1 only here, under dm__mem_mu, when a lookup finds
 * an idle context; every other increment is made by someone already holding
 * one, and decrements never lock (release). A context at 0 stays interned,
 * idle, for the next lookup of its tags; sweep() frees the idle ones under the
 * mutex (acquire: what their last holders did happens before), with their
 * strings and tally id, when the interned count reaches `sweep_at` (twice what
 * a sweep left held, at least DM_CTX_MAX: amortized O(1) per context made) or,
 * at most once per SWEEP_GAP contexts made, when tally ids or tag rows run
 * out. Memory is bounded by what is held (capsules of live arrays, threads,
 * counted blocks) plus DM_CTX_MAX idle contexts.
 *
 * A context made while tally ids or tag rows were all held counts some tags
 * under "(other)" (tally.c: `uncounted`), for its life. A lookup that finds
 * such a context retires it once the tally could count it now
 * (dm__tally_could_count; a sweep first, at most once per SWEEP_GAP such
 * lookups, when the tables are full of idle contexts): the lookup and every
 * later one make or find a new, counted context, while the retired one stays
 * valid for the threads, capsules and blocks that hold it, and is freed by a
 * sweep once they let go. Its tags' counts move over with no race: blocks
 * counted under "(other)" are uncounted from "(other)" at their free.
 *
 * Thread safety: interning and sweeping under dm__mem_mu; `refs` atomic; a
 * context's tags never change.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime/context.h"
#include "runtime/mem.h"
#include "runtime/tally.h"

#define BUCKETS 8192 /* hash chains of interned contexts */
#define SWEEP_GAP 64 /* contexts made between sweeps forced by full tally tables */

struct dm_ctx dm__context_root;
struct dm_ctx dm__context_stale;
static struct dm_ctx *buckets[BUCKETS]; /* under dm__mem_mu, as below */
static int ninterned;                   /* contexts in buckets */
static int sweep_at = DM_CTX_MAX;
static int made_since_sweep;
static int uncounted_since_sweep; /* lookups that found a context counted under "(other)" */
static _Atomic uint64_t retirements; /* contexts retired so far (dm_ctx_retirements) */

const dm_ctx_t *dm_ctx_root(void) { return &dm__context_root; }

int dm__context_count(void) { return ninterned + 1; }

void dm__context_root_tally_init(void) {
    if (!dm__context_root.tally)
        dm__tally_root_init(&dm__context_root);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static struct dm_ctx *find(uint64_t h, const char *const *want, int n) {
    for (struct dm_ctx *c = buckets[h & (BUCKETS - 1)]; c; c = c->next) {
        if (c->hash != h || c->ntags != n ||
            atomic_load_explicit(&c->retired, memory_order_relaxed))
            continue;
        int i = 0;
        while (i < n && strcmp(c->tags[i], want[i]) == 0)
            i++;
        if (i == n)
            return c;
    }
    return NULL;
}

static void destroy(struct dm_ctx *c) {
    for (int i = 0; c->tags && i < c->ntags; i++)
        free(c->tags[i]);
    free(c->tags);
    free(c);
}

/* Frees every idle context (refs 0): nobody can take a reference meanwhile,
 * since the only 0 -> 1 step is a lookup under the same mutex. */
static void sweep(void) {
    for (int b = 0; b < BUCKETS; b++)
        for (struct dm_ctx **pp = &buckets[b]; *pp;) {
            struct dm_ctx *c = *pp;
            if (atomic_load_explicit(&c->refs, memory_order_acquire) != 0) {
                pp = &c->next;
                continue;
            }
            *pp = c->next;
            dm__tally_ctx_fini(c);
            destroy(c);
            ninterned--;
        }
    sweep_at = ninterned * 2 > DM_CTX_MAX ? ninterned * 2 : DM_CTX_MAX;
    made_since_sweep = 0;
    uncounted_since_sweep = 0;
}

/* Whether interned context `c`, which counts some tags under "(other)", is
 * retired (no longer found) because a context made now would count more of
 * them. When the tables are full, a sweep may free ids and rows held by idle
 * contexts: at most once per SWEEP_GAP such lookups, c held meanwhile. */
static bool retire_uncounted(struct dm_ctx *c) {
    if (!dm__tally_could_count(c)) {
        if (++uncounted_since_sweep < SWEEP_GAP || !dm__tally_crowded())
            return false;
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
        sweep();
        atomic_fetch_sub_explicit(&c->refs, 1, memory_order_relaxed);
        if (!dm__tally_could_count(c))
            return false;
    }
    atomic_store_explicit(&c->retired, true, memory_order_relaxed);
    atomic_fetch_add_explicit(&retirements, 1, memory_order_release); /* after the flag */
    return true;
}

/* A new context for the sorted tags `want`, one reference held. */
static struct dm_ctx *make(uint64_t h, const char *const *want, int n) {
    if (ninterned >= sweep_at || (made_since_sweep >= SWEEP_GAP && dm__tally_crowded()))
        sweep();
    struct dm_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->tags = calloc((size_t)n, sizeof(char *));
    bool ok = c->tags != NULL;
    for (int i = 0; ok && i < n; i++)
        ok = (c->tags[i] = strdup(want[i])) != NULL;
    c->ntags = n;
    c->hash = h;
    c->interned = true;
    atomic_init(&c->refs, 1);
    if (!ok || !dm__tally_ctx_init(c)) {
        destroy(c);
        return NULL;
    }
    c->next = buckets[h & (BUCKETS - 1)];
    buckets[h & (BUCKETS - 1)] = c;
    ninterned++;
    made_since_sweep++;
    return c;
}

const dm_ctx_t *dm_ctx_with_tag(const dm_ctx_t *base, const char *tag) {
    if (!base)
        base = &dm__context_root;
    if (!tag || strlen(tag) >= DM_NAME_MAX)
        return NULL;
    for (int i = 0; i < base->ntags; i++)
        if (strcmp(base->tags[i], tag) == 0) {
            dm__context_hold(base); /* the caller holds base */
            return base;
        }
    if (base->ntags >= DM_CTX_TAGS_MAX)
        return NULL;
    const char *want[DM_CTX_TAGS_MAX];
    int n = 0;
    for (int i = 0; i < base->ntags; i++)
        want[n++] = base->tags[i];
    want[n++] = tag;
    qsort(want, (size_t)n, sizeof(want[0]), cmp_str);
    uint64_t h = dm__tally_hash(want, n);

    pthread_mutex_lock(&dm__mem_mu);
    dm__context_root_tally_init();
    struct dm_ctx *c = find(h, want, n);
    if (c && c->uncounted && retire_uncounted(c))
        c = NULL; /* a counted one is made in its place */
    if (c)
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    else
        c = make(h, want, n);
    pthread_mutex_unlock(&dm__mem_mu);
    return c;
}

void dm_ctx_release(const dm_ctx_t *c) { dm__context_drop(c); }

bool dm_ctx_retired(const dm_ctx_t *c) {
    return c && c->interned && atomic_load_explicit(&c->retired, memory_order_relaxed);
}

uint64_t dm_ctx_retirements(void) {
    return atomic_load_explicit(&retirements, memory_order_acquire);
}

int dm_ctx_tags(const dm_ctx_t *c, const char **tags, int cap) {
    for (int i = 0; i < c->ntags && i < cap; i++)
        tags[i] = c->tags[i];
    return c->ntags;
}
