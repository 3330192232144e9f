/*
 * thread.c: the per-thread state (dm__thread_t, thread.h) and binding a thread
 * to the table in force. A thread's state is a __thread variable reached on
 * the fast path through the initial-exec anchor (alloc.c, tls_fast). A thread
 * joins the registry the first time it binds or makes an explicit jemalloc
 * cache, so that stats can add its counters and fork can retire it; at exit a
 * pthread key destructor gives its cached blocks back, folds its counters
 * into its arenas and table, and drops its table reference.
 *
 * Binding (dm__thread_bind) happens when the table in force or the caller's
 * context differs from the thread's: it takes a reference on the new table,
 * flushes the block cache, picks the thread's jemalloc arena (auto_bind) and
 * finds the view for (context, thread name). The allocation paths never bind
 * otherwise, and never lock. A bound thread holds a reference on its context
 * (`held`, context.c) until it binds another or exits, so the pointer it
 * compares callers' contexts with always names the context it bound.
 *
 * Thread safety: the registry, counter folding and binding run under
 * dm__mem_mu; a thread's state is written by its own thread (stats read
 * its counters relaxed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/context.h"
#include "runtime/dispatch.h"
#include "runtime/thread.h"

__thread dm__thread_t dm__thread_self;
dm__thread_t *dm__thread_registry; /* live threads, under dm__mem_mu */
int dm__thread_n;
static pthread_key_t exit_key;     /* its destructor retires an exiting thread */

/* Adds one set of counters to another (under dm__mem_mu). */
static void ctrs_add(dm__ctrs_t *dst, const dm__ctrs_t *src) {
    DM_CTR_ADD(dst->nalloc, DM_CTR_GET(src->nalloc));
    DM_CTR_ADD(dst->nfree, DM_CTR_GET(src->nfree));
    DM_CTR_ADD(dst->nrealloc, DM_CTR_GET(src->nrealloc));
    DM_CTR_ADD(dst->nfail, DM_CTR_GET(src->nfail));
    DM_CTR_ADD(dst->nfallback, DM_CTR_GET(src->nfallback));
    DM_CTR_ADD(dst->ndtype_known, DM_CTR_GET(src->ndtype_known));
    DM_CTR_ADD(dst->bytes, DM_CTR_GET(src->bytes));
    DM_CTR_ADD(dst->nlimit, DM_CTR_GET(src->nlimit));
}

/* Called with dm__mem_mu held: the thread's per-rule counts go to its table. */
static void fold_rules(dm__thread_t *t) {
    dm__dispatch_t *tab = t->table;
    if (!tab || !t->rule_ctrs)
        return;
    for (int i = 0; i < tab->nslots; i++)
        ctrs_add(&tab->rule_ctrs[i], &t->rule_ctrs[i]);
    free(t->rule_ctrs);
    t->rule_ctrs = NULL;
}

/* pthread key destructor: the thread is exiting. */
static void thread_exit(void *arg) {
    dm__thread_t *t = arg;
    t->fast = false;
    t->exiting = true; /* frees after this point bypass the (gone) caches */
    dm__tally_held_return(&t->tally_held);
    dm__bcache_flush(t);
    if (t->auto_je) { /* jemalloc's own destructor may run after this one */
        t->auto_je = NULL;
        dmje_mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    }
    pthread_mutex_lock(&dm__mem_mu);
    for (int i = 0; i < dm__arena_count(); i++)
        ctrs_add(&dm__arena_at(i)->dead, &t->ctrs[i]);
    fold_rules(t);
    if (t->prev)
        t->prev->next = t->next;
    else
        dm__thread_registry = t->next;
    if (t->next)
        t->next->prev = t->prev;
    dm__dispatch_t *tab = t->table;
    t->table = NULL;
    t->registered = false;
    dm__context_drop(t->held);
    t->held = NULL;
    pthread_mutex_unlock(&dm__mem_mu);
    for (int i = 0; i < DM_JE_MAX; i++) {
        unsigned f = t->tcache[i];
        if (f && f != (unsigned)MALLOCX_TCACHE_NONE)
            dm__arena_tcache_destroy((f >> 8) - 1);
        t->tcache[i] = (unsigned)MALLOCX_TCACHE_NONE;
    }
    if (tab)
        dm__dispatch_release(tab);
    /* Counted out last: a stats reader that sees the thread gone sees its
     * caches' blocks back in their arenas (tests wait for the count to drop
     * and then count jemalloc's live blocks). */
    pthread_mutex_lock(&dm__mem_mu);
    dm__thread_n--;
    pthread_mutex_unlock(&dm__mem_mu);
}

/* Called with dm__mem_mu held: the thread joins the registry (stats, fork). */
void dm__thread_register(dm__thread_t *t) {
    if (t->registered || t->exiting)
        return;
    t->registered = true;
    t->next = dm__thread_registry;
    t->prev = NULL;
    if (dm__thread_registry)
        dm__thread_registry->prev = t;
    dm__thread_registry = t;
    dm__thread_n++;
    pthread_setspecific(exit_key, t);
}

void dm__thread_init(void) { pthread_key_create(&exit_key, thread_exit); }

void dm_thread_set_name(const char *name) {
    dm__thread_t *t = &dm__thread_self;
    snprintf(t->thread_name, sizeof(t->thread_name), "%s", name ? name : "");
    t->ctx = &dm__context_stale; /* rebind: thread rules may now match differently */
    t->auto_stale = true;
}

/* Behind the block cache, the arena that serves this thread's small arrays is
 * used through jemalloc's plain malloc()/free(), whose fast paths only work with
 * the thread's own automatic cache and arena (mallocx with an explicit cache has
 * none in 5.3: 259 instructions per pair at 64 B, against 116 for malloc+free;
 * bench/callgrind.sh).
 * So the thread is bound ("thread.arena") to that arena, chosen from its
 * thread-name view without tags, and every block of that arena — any size, so
 * that allocation and free use the same cache — goes through the automatic
 * cache. The cache is flushed before any change of binding, so it only ever
 * holds blocks of the bound arena. Other arenas keep their explicit caches.
 * Called with dm__mem_mu held. */

static void auto_bind(dm__thread_t *t, dm__dispatch_t *tab) {
    dm__arena_je_t *cand = NULL;
    const dm_view_t *rv = dm__dispatch_view(tab, &dm__context_root, t->thread_name);
    if (rv) {
        const dm__dispatch_slot_t *s = &tab->slots[dm_view_lookup(rv, 64, DM_DT_UNKNOWN)];
        if (s->je && s->flags == 0)
            cand = s->je;
    }
    t->auto_stale = false;
    if (cand == t->auto_je)
        return;
    t->auto_je = NULL;
    dmje_mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    unsigned idx = cand ? cand->index : 0;
    if (cand && dmje_mallctl("thread.arena", NULL, NULL, &idx, sizeof(idx)) == 0)
        t->auto_je = cand;
}

/* Called with dm__mem_mu held, by a thread just bound to `tab`: once the
 * table holds views_sweep_at views, the ones no thread is bound to are freed
 * (dispatch.c); a thread's `view` is written only under that mutex, and every
 * thread bound to `tab` is in the registry. */
static void views_sweep(dm__dispatch_t *tab) {
    if (tab->nviews < tab->views_sweep_at)
        return;
    for (dm__thread_t *t = dm__thread_registry; t; t = t->next)
        if (t->table == tab && t->view)
            dm__dispatch_view_mark(tab, t->view);
    dm__dispatch_views_sweep(tab);
}

/* Binds the calling thread to the table in force and context `key` (NULL:
 * the root), with the view they select; false when there is no table or no
 * memory for the view. The allocation paths call it when the table or the
 * context changed (alloc.c, route). */
bool dm__thread_bind(dm__thread_t *t, const dm_ctx_t *key) {
    const dm_ctx_t *c = key ? key : &dm__context_root; /* NULL means the root context */
    dm__dispatch_t *old = NULL;
    bool ok = false;
    pthread_mutex_lock(&dm__mem_mu);
    dm__thread_register(t);
    dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    if (!tab)
        goto out;
    if (t->table != tab) {
        dm__ctrs_t *ctr = calloc((size_t)tab->nslots, sizeof(dm__ctrs_t));
        if (!ctr)
            goto out;
        fold_rules(t);
        /* A new policy may put limits on what the thread held (tally.h) */
        dm__tally_held_return(&t->tally_held);
        /* A new policy: cached blocks of arenas it may no longer use go back.
         * (Bins are per arena, so nothing else needs a flush.) */
        if (!t->exiting)
            dm__bcache_flush(t);
        old = t->table;
        atomic_fetch_add_explicit(&tab->refs, 1, memory_order_relaxed);
        t->table = tab;
        t->rule_ctrs = ctr;
        t->auto_stale = true;
    }
    if (t->auto_stale && !t->exiting)
        auto_bind(t, tab);
    const dm_view_t *v = dm__dispatch_view(tab, c, t->thread_name);
    if (v) {
        t->view = v;
        t->ctx = key; /* cache under what callers pass, NULL included */
        if (t->held != c) { /* the caller holds c: the binding takes its own */
            dm__context_hold(c);
            dm__context_drop(t->held);
            t->held = c;
        }
        ok = true;
        views_sweep(tab);
    } else {
        t->ctx = &dm__context_stale;
    }
    memset(t->memo, 0, sizeof(t->memo)); /* learnt again for the new view */
out:
    t->fast = ok && !t->exiting;
    pthread_mutex_unlock(&dm__mem_mu);
    if (old)
        dm__dispatch_release(old);
    return ok;
}


/* fork() copies only the calling thread. In the child the threads that did
 * not survive are retired the way thread_exit retires a thread: their
 * per-thread blocks are still linked in the registry, and glibc hands their
 * memory to the child's next threads (a new thread reusing a node's address
 * made the list a cycle, and every stats snapshot then spun under
 * dm__mem_mu).
 *
 * jemalloc's fork handler leaves the child's arenas listing only the surviving
 * thread's automatic cache: every explicit cache made before the fork (the
 * caller's included) is unlisted but still points at its old neighbours, and
 * destroying one (tcache.destroy, which unlinks it) rewrites them: the
 * surviving cache's links became stale pointers and its next rebind crashed
 * (tests/python/engine/test_processes.py, test_fork_while_threads_grow_arenas: every
 * child, SIGSEGV in tcache_arena_dissociate). So the child never
 * destroys them: the gone threads' stay as they were, with what they cached,
 * as jemalloc leaves the gone threads' automatic caches; the caller forgets its
 * own and makes new ones as it needs them. Their slots stay taken (4096 per
 * process, docs/operations.md).
 *
 * In the child, dm__mem_mu held: unlinks every registered thread but the
 * caller and returns them as a list (through `next`), their counts folded. */
dm__thread_t *dm__thread_fork_unlink(void) {
    dm__thread_t *self = pthread_getspecific(exit_key), *gone = NULL;
    memset(dm__thread_self.tcache, 0, sizeof(dm__thread_self.tcache));
    for (dm__thread_t *t = dm__thread_registry, *next; t; t = next) {
        next = t->next;
        if (t == self)
            continue;
        for (int i = 0; i < dm__arena_count(); i++)
            ctrs_add(&dm__arena_at(i)->dead, &t->ctrs[i]);
        fold_rules(t);
        t->registered = false;
        t->next = gone;
        gone = t;
    }
    dm__thread_registry = self && self->registered ? self : NULL;
    if (dm__thread_registry)
        dm__thread_registry->prev = dm__thread_registry->next = NULL;
    dm__thread_n = dm__thread_registry ? 1 : 0;
    return gone;
}

/* In the child, no lock held (the frees may reach the arenas' extent hooks):
 * what the gone threads held goes back. Their block caches are freed (a
 * thread caught mid-pop leaves one counted block that its caller never got,
 * which is then freed here: nobody in the child holds it), their table
 * references dropped; their explicit jemalloc caches are left alone (above). */
void dm__thread_fork_release(dm__thread_t *gone) {
    for (dm__thread_t *t = gone, *next; t; t = next) {
        next = t->next;
        dm__bcache_flush(t);
        dm__tally_held_return(&t->tally_held);
        memset(t->tcache, 0, sizeof(t->tcache));
        if (t->table)
            dm__dispatch_release(t->table);
        t->table = NULL;
        dm__context_drop(t->held);
        t->held = NULL;
        t->next = t->prev = NULL;
    }
}
