/*
 * dispatch.c: the published dispatch tables. Each install compiles the next
 * policy into a dm__dispatch_t (the compiled table, one slot per rule saying
 * which arena and jemalloc flags serve it, per-rule counters) and publishes it
 * in dm__dispatch_current with one release-store; the allocation paths read
 * it with one acquire-load. A table is reference counted: the global pointer
 * holds one reference and every thread bound to it another, so a retired table
 * is freed as soon as the last thread moves on or exits, and the fast path
 * never touches a table it does not hold. Threads that never allocate again
 * keep at most one old table each; reloads never accumulate tables.
 *
 * Also here: each table's views (one per context key, built on first use) and
 * what the services ask of the table in force (call-site masks, dtype use, a
 * copy of its policy). Views are keyed by which context rules a context
 * matches, not by context, so recycled contexts (context.c) find them; a
 * table keeps up to `views_sweep_at` of them (DM_VIEWS_MAX, or twice what the
 * last sweep kept), then frees those no thread is bound to
 * (dm__dispatch_views_sweep, once thread.c has marked the bound ones):
 * policies with many tag rules meet unboundedly many keys over a process's
 * life.
 *
 * Thread safety: publication, view building and reading the table in force
 * for the services run under dm__mem_mu; references are atomic.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime/context.h"
#include "runtime/dispatch.h"
#include "runtime/mem.h"

_Atomic(dm__dispatch_t *) dm__dispatch_current;
static _Atomic int tables_live; /* published or retired but still referenced */

int dm__dispatch_live(void) { return atomic_load_explicit(&tables_live, memory_order_relaxed); }

dm__dispatch_t *dm__dispatch_new(dm_table_t *tt, dm_policy_t *p, int nslots) {
    dm__dispatch_t *tab = calloc(1, sizeof(*tab));
    dm__dispatch_slot_t *slots = calloc((size_t)nslots, sizeof(dm__dispatch_slot_t));
    dm__ctrs_t *rc_ctr = calloc((size_t)nslots, sizeof(dm__ctrs_t));
    if (!tab || !slots || !rc_ctr) {
        free(tab), free(slots), free(rc_ctr);
        return NULL;
    }
    atomic_fetch_add_explicit(&tables_live, 1, memory_order_relaxed);
    tab->table = tt;
    tab->policy = p;
    tab->slots = slots;
    tab->nslots = nslots;
    tab->uses_dtype = dm_table_uses_dtype(tt);
    tab->rule_ctrs = rc_ctr;
    tab->views_sweep_at = DM_VIEWS_MAX;
    atomic_store_explicit(&tab->refs, 1, memory_order_relaxed);
    return tab;
}

void dm__dispatch_destroy(dm__dispatch_t *t) {
    atomic_fetch_sub_explicit(&tables_live, 1, memory_order_relaxed);
    for (dm__dispatch_view_t *e = t->views, *next; e; e = next) {
        next = e->next;
        dm_view_free(e->view);
        free(e);
    }
    dm_table_free(t->table);
    dm_policy_free(t->policy);
    free(t->slots);
    free(t->rule_ctrs);
    free(t);
}

void dm__dispatch_release(dm__dispatch_t *t) {
    if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) == 1)
        dm__dispatch_destroy(t);
}

void dm__dispatch_slot_init(dm__dispatch_slot_t *s, dm__arena_t *a, const dm_arena_spec_t *spec) {
    s->arena = a;
    s->arena_id = (uint16_t)a->id;
    s->je = spec->per_node ? NULL : atomic_load_explicit(&a->single, memory_order_relaxed);
    s->tracked = atomic_load_explicit(&a->tracked, memory_order_relaxed);
    /* Alignment <= 64: round the size up instead of MALLOCX_ALIGN, which sends
     * requests above ~14 KiB past the thread cache (340-375 ns instead of ~100 ns
     * for 16 KiB; performance-baseline). jemalloc's size classes that are
     * multiples of 64 are 64-aligned, and large extents are page + k*64
     * (runtime_test checks every size up to 1 MiB). */
    if (spec->alignment <= 64) {
        s->round = spec->alignment - 1;
        s->flags = 0;
    } else {
        s->round = 0;
        s->flags = MALLOCX_ALIGN(spec->alignment);
    }
}

/* Called with dm__mem_mu held: view `v` of `tab` is bound to a thread, so the
 * next sweep keeps it. */
void dm__dispatch_view_mark(dm__dispatch_t *tab, const dm_view_t *v) {
    for (dm__dispatch_view_t *e = tab->views; e; e = e->next)
        if (e->view == v) {
            e->in_use = true;
            return;
        }
}

/* Called with dm__mem_mu held, once every view a thread is bound to is marked
 * (thread.c walks the registry): frees the views of `tab` not marked, clears
 * the marks, and sets when the next sweep is due. */
void dm__dispatch_views_sweep(dm__dispatch_t *tab) {
    tab->nviews = 0;
    for (dm__dispatch_view_t **pp = &tab->views; *pp;) {
        dm__dispatch_view_t *e = *pp;
        if (e->in_use) {
            e->in_use = false;
            tab->nviews++;
            pp = &e->next;
            continue;
        }
        *pp = e->next;
        dm_view_free(e->view);
        free(e);
    }
    tab->views_sweep_at = tab->nviews * 2 > DM_VIEWS_MAX ? tab->nviews * 2 : DM_VIEWS_MAX;
}

/* Called with dm__mem_mu held: the view of `tab` for the thread's context,
 * built once per (table, context key) and kept with the table while a thread
 * is bound to it or there are fewer than views_sweep_at (the binding thread
 * sweeps past that: thread.c, dm__thread_bind). */
const dm_view_t *dm__dispatch_view(dm__dispatch_t *tab, const dm_ctx_t *c, const char *thread) {
    int words = dm_table_ctx_key_words(tab->table);
    uint64_t stack_key[16];
    uint64_t *key = words <= 16 ? stack_key : calloc((size_t)words, sizeof(uint64_t));
    if (!key)
        return NULL;
    dm_context_t ctx = {thread, (const char *const *)c->tags, c->ntags, NULL, NULL};
    dm_table_ctx_key(tab->table, &ctx, key);
    const dm_view_t *v = NULL;
    for (dm__dispatch_view_t *e = tab->views; e && !v; e = e->next)
        if (memcmp(e->key, key, (size_t)words * sizeof(uint64_t)) == 0)
            v = e->view;
    if (!v) {
        dm__dispatch_view_t *e = calloc(1, sizeof(*e) + (size_t)words * sizeof(uint64_t));
        dm_view_t *nv = e ? dm_table_view_build(tab->table, key) : NULL;
        if (nv) {
            memcpy(e->key, key, (size_t)words * sizeof(uint64_t));
            e->view = nv;
            e->next = tab->views;
            tab->views = e;
            tab->nviews++;
            v = nv;
        } else {
            free(e);
        }
    }
    if (key != stack_key)
        free(key);
    return v;
}

_Atomic int dm_runtime_site_rules;
static _Atomic uint64_t site_gen; /* install number of the table in force */
/* Whether the table in force has a dtype rule. A flag of its own, not read
 * through dm__dispatch_current: a caller holds no reference to the table, which
 * an install and the last bound thread's move may free between the pointer's
 * load and the read (ThreadSanitizer found it, scripts/tsan-ft.sh). */
static _Atomic bool wants_dtype;

dm__dispatch_t *dm__dispatch_publish(dm__dispatch_t *tab) {
    dm__dispatch_t *old = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    atomic_store_explicit(&dm__dispatch_current, tab, memory_order_release);
    atomic_store_explicit(&site_gen, tab->seq, memory_order_release);
    atomic_store_explicit(&dm_runtime_site_rules, dm_table_uses_site(tab->table),
                          memory_order_release);
    atomic_store_explicit(&wants_dtype, tab->uses_dtype, memory_order_release);
    return old;
}

uint64_t dm_runtime_site_mask(const char *module, const char *function, uint64_t *gen) {
    uint64_t m = 0;
    pthread_mutex_lock(&dm__mem_mu); /* the table in force cannot be retired meanwhile */
    dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    if (tab)
        m = dm_table_site_mask(tab->table, module, function);
    *gen = tab ? tab->seq : 0;
    pthread_mutex_unlock(&dm__mem_mu);
    return m;
}

uint64_t dm_runtime_site_gen(void) { return atomic_load_explicit(&site_gen, memory_order_acquire); }

bool dm_runtime_active(void) {
    return atomic_load_explicit(&dm__dispatch_current, memory_order_acquire) != NULL;
}

bool dm_runtime_wants_dtype(void) { return atomic_load_explicit(&wants_dtype, memory_order_acquire); }

dm_policy_t *dm_runtime_policy_copy(void) {
    dm_policy_t *copy = NULL;
    pthread_mutex_lock(&dm__mem_mu);
    dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    if (tab && (copy = malloc(sizeof(*copy)))) {
        *copy = *tab->policy;
        copy->rules = malloc(sizeof(dm_rule_spec_t) * (size_t)(copy->nrules ? copy->nrules : 1));
        if (copy->rules && copy->nrules) /* rules may be NULL when there are none */
            memcpy(copy->rules, tab->policy->rules, sizeof(dm_rule_spec_t) * (size_t)copy->nrules);
        else if (!copy->rules)
            free(copy), copy = NULL;
    }
    pthread_mutex_unlock(&dm__mem_mu);
    return copy;
}
