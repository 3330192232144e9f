/*
 * install.c: compiling and publishing a policy (dm_runtime_install,
 * dm_runtime_load). The next table is compiled aside and every jemalloc arena
 * it needs is made before anything visible changes, so a failure leaves the
 * policy in force untouched; then the arenas take their new settings and the
 * table is published with one release-store (dispatch.c). The observers hear
 * of it afterwards, outside the lock.
 *
 * Thread safety: installs serialise on dm__mem_mu; the reload counts are
 * guarded by it.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/arena.h"
#include "runtime/bigblock.h"
#include "runtime/context.h"
#include "runtime/dispatch.h"
#include "runtime/install.h"
#include "runtime/os.h"
#include "runtime/spill.h"
#include "runtime/tally.h"
#include "runtime/thread.h"

static uint64_t reloads, reload_failures; /* under dm__mem_mu */
static double last_reload_time;
static bool last_reload_failed;           /* under dm__mem_mu */
/* DATAMEM_CUDART, handed down by the Python layer (the runtime never calls
 * getenv); "" = the usual names. Read at install. */
static char cudart_path[256];

void dm_runtime_set_cudart(const char *path) {
    pthread_mutex_lock(&dm__mem_mu);
    snprintf(cudart_path, sizeof(cudart_path), "%s", path ? path : "");
    pthread_mutex_unlock(&dm__mem_mu);
}

static int install_fail(dm_diags_t *d, int rc, const char *what) {
    if (d && d->n < DM_DIAG_MAX) {
        dm_diag_t *e = &d->items[d->n++];
        memset(e, 0, sizeof(*e));
        e->severity = DM_SEV_ERROR;
        snprintf(e->msg, sizeof(e->msg), "%s: %s", what, dm_strerror(rc));
        d->nerrors++;
    }
    return rc;
}

/* The table for `p`, not yet published, or NULL with the error reported in d
 * (p is freed then). */
static dm__dispatch_t *compile(dm_policy_t *p, dm_diags_t *d, int *rc) {
    dm_table_t *tt = NULL;
    *rc = dm_table_compile(p, &tt);
    if (*rc) {
        dm_policy_free(p);
        install_fail(d, *rc, "cannot compile the policy");
        return NULL;
    }
    dm__dispatch_t *tab = dm__dispatch_new(tt, p, dm_table_nrules(tt) + 1);
    if (!tab) {
        dm_table_free(tt);
        dm_policy_free(p);
        *rc = install_fail(d, DM_ENOMEM, "cannot install the policy");
    }
    return tab;
}

/* pinned: cuda needs the CUDA runtime before any of its extents exist. */
static int load_gpu_runtime(const dm_policy_t *p, dm_diags_t *d) {
    for (int i = 0; i < p->narenas; i++) {
        char why[200];
        if (p->arenas[i].pinned != DM_PIN_CUDA ||
            dm__os_gpu_load(cudart_path, why, sizeof(why)) == 0)
            continue;
        if (d && d->n < DM_DIAG_MAX) {
            dm_diag_t *e = &d->items[d->n++];
            memset(e, 0, sizeof(*e));
            e->severity = DM_SEV_ERROR;
            e->line = p->arenas[i].line;
            e->col = p->arenas[i].col;
            snprintf(e->path, sizeof(e->path), "arenas.%s.pinned", p->arenas[i].name);
            snprintf(e->msg, sizeof(e->msg),
                     "cuda: %s; install the CUDA runtime (libcudart), set DATAMEM_CUDART to its "
                     "path, or use `lock: true` for page-locked memory without a GPU", why);
            d->nerrors++;
        }
        return DM_EINVALID;
    }
    return 0;
}

static void arena_error(dm_diags_t *d, const dm_arena_spec_t *a, const char *key, const char *fmt,
                        ...) __attribute__((format(printf, 4, 5)));
static void arena_error(dm_diags_t *d, const dm_arena_spec_t *a, const char *key, const char *fmt,
                        ...) {
    if (!d || d->n >= DM_DIAG_MAX)
        return;
    dm_diag_t *e = &d->items[d->n++];
    memset(e, 0, sizeof(*e));
    e->severity = DM_SEV_ERROR;
    e->line = a->line;
    e->col = a->col;
    snprintf(e->path, sizeof(e->path), "arenas.%s.%s", a->name, key);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    d->nerrors++;
}

/* Called with dm__mem_mu held, before any arena is made: every backing
 * directory passes the directory rule and takes a file, and an arena that
 * exists keeps the backing it was made with (its arrays live there). */
static int check_backing(const dm_policy_t *p, dm_diags_t *d) {
    int rc = 0;
    for (int i = 0; i < p->narenas; i++) {
        const dm_arena_spec_t *a = &p->arenas[i];
        dm__arena_t *old = dm__arena_find(a->name);
        dm__arena_je_t *ja = old ? dm__arena_je_for_node(old, -1) : NULL;
        const char *had = ja && ja->spill ? ja->spill->dir : NULL;
        char why[sizeof(((dm_diag_t *)0)->msg)], fix[sizeof(((dm_diag_t *)0)->msg)];
        if (ja && !had != !a->backing.dir[0]) {
            arena_error(d, a, "backing", "arena '%s' %s since it was made; its arrays live "
                        "there, so this takes a restart (or use an arena of another name)",
                        a->name, had ? "is file-backed" : "has been in RAM");
            rc = DM_EINVALID;
        } else if (had && strcmp(had, a->backing.dir) != 0) {
            arena_error(d, a, "backing.dir", "arena '%s' spills to %s since it was made; a new "
                        "directory takes a restart (or use an arena of another name)", a->name,
                        had);
            rc = DM_EINVALID;
        } else if (!ja && a->backing.dir[0] &&
                   dm__spill_check_dir(a->backing.dir, why, sizeof(why), fix, sizeof(fix)) != 0) {
            int at = d ? d->n : 0;
            arena_error(d, a, "backing.dir", "%s", why);
            if (fix[0]) /* a directory that is not there: what to run, as a note */
                arena_error(d, a, "backing.dir", "%s", fix);
            for (int j = at; d && j < d->n; j++) { /* at the dir: key, not the arena's */
                if (a->backing.line > 0)
                    d->items[j].line = a->backing.line, d->items[j].col = a->backing.col;
                if (j > at)
                    d->items[j].severity = DM_SEV_NOTE, d->nerrors--;
            }
            rc = DM_EUNSAFE;
        }
    }
    return rc;
}

/* Called with dm__mem_mu held. Creates every jemalloc arena the policy needs before
 * anything visible changes, so a failure leaves the running policy untouched
 * (at worst an unused arena exists, as after any reload that drops one). */
static int ensure_arenas(const dm_policy_t *p, dm__arena_t **out) {
    for (int i = 0; i < p->narenas; i++) {
        dm__arena_t *a = dm__arena_get(p->arenas[i].name, &p->arenas[i]);
        if (!a)
            return DM_EARENA;
        int rc = dm__arena_ensure(a, &p->arenas[i]);
        if (rc)
            return rc;
        out[i] = a;
    }
    return 0;
}

/* The policy's worker limit resolved before anything changes: a share of a
 * memory limit that cannot be read fails the install (the policy in force
 * stays), with one diagnostic at worker_limit. */
static int worker_limit(const dm_policy_t *p, dm__budget_worker_t *w, dm_diags_t *d) {
    char why[sizeof(d->items[0].msg)];
    int rc = dm__budget_worker_limit(p, w, why, sizeof(why));
    if (rc && d && d->n < DM_DIAG_MAX) {
        dm_diag_t *e = &d->items[d->n++];
        memset(e, 0, sizeof(*e));
        e->severity = DM_SEV_ERROR;
        snprintf(e->path, sizeof(e->path), "worker_limit");
        snprintf(e->msg, sizeof(e->msg), "%s", why);
        d->nerrors++;
    }
    return rc;
}

/* Called with dm__mem_mu held, the arenas made: they take the policy's
 * settings, and the table's slots name them. */
static void fill_slots(dm__dispatch_t *tab, dm__arena_t **byspec, const dm__budget_worker_t *w) {
    const dm_policy_t *p = tab->policy;
    dm__arena_mark_all_unused();
    for (int i = 0; i < p->narenas; i++)
        dm__arena_apply(byspec[i], &p->arenas[i]);
    for (int r = 0; r < tab->nslots; r++) {
        int ai = dm_table_rule_arena(tab->table, r);
        dm__dispatch_slot_init(&tab->slots[r], byspec[ai], &p->arenas[ai]);
    }
    for (int i = 0; i < p->narenas; i++) /* spill targets (spill.c) */
        dm__dispatch_slot_init(&tab->spill_slots[i], byspec[i], &p->arenas[i]);
    tab->fallback = p->fallback_arena;
    if (p->fallback_arena >= 0)
        dm__dispatch_slot_init(&tab->fallback_slot, byspec[p->fallback_arena],
                               &p->arenas[p->fallback_arena]);
    tab->tally = dm__tally_configure(p, w);
}

/* Called with dm__mem_mu held: publishes tab and counts the reload;
 * returns the install number, and the table replaced in *old. */
static uint64_t publish(dm__dispatch_t *tab, dm__dispatch_t **old) {
    tab->seq = reloads + 1;
    *old = dm__dispatch_publish(tab);
    reloads++;
    last_reload_failed = false;
    dm__bigblock_expire_all(); /* new decay times and limits apply to kept blocks at once */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    last_reload_time = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    return reloads;
}

/* Called with dm__mem_mu held: whether the policy in force was loaded from
 * `path` and, unless `hash` is 0, has that content hash (NULL: any policy may be
 * replaced). */
static bool in_force_from(const char *path, uint64_t hash) {
    if (!path)
        return true;
    dm__dispatch_t *cur = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    return cur && strcmp(cur->policy->path, path) == 0 && (!hash || cur->policy->hash == hash);
}

/* dm_runtime_install, or with `only_over` a reload that yields to any install
 * of another policy (dm_runtime_reload), or of other bytes than `over_hash`. */
static int install(dm_policy_t *p, dm_diags_t *d, const char *only_over, uint64_t over_hash) {
    dm_runtime_init();
    int rc;
    dm__dispatch_t *tab = compile(p, d, &rc);
    if (!tab)
        return rc;
    dm__budget_worker_t worker;
    if ((rc = load_gpu_runtime(p, d)) || (rc = worker_limit(p, &worker, d))) {
        dm__dispatch_destroy(tab);
        return rc;
    }
    dm__arena_t *byspec[DM_ARENAS_MAX];
    pthread_mutex_lock(&dm__mem_mu);
    if (!in_force_from(only_over, over_hash)) { /* checked before any arena is made */
        pthread_mutex_unlock(&dm__mem_mu);
        dm__dispatch_destroy(tab);
        return DM_ESUPERSEDED;
    }
    rc = check_backing(p, d);
    if (rc) {
        pthread_mutex_unlock(&dm__mem_mu);
        dm__dispatch_destroy(tab);
        return rc;
    }
    rc = ensure_arenas(p, byspec);
    if (rc) {
        bool full = dm__arena_count() >= DM_RT_ARENAS_MAX;
        pthread_mutex_unlock(&dm__mem_mu);
        dm__dispatch_destroy(tab);
        /* Arenas live for the process (arrays outlive policies): their names
         * are a table that fills, and a policy naming one more is refused
         * while the one in force stays. */
        char what[160] = "cannot create arenas";
        if (full)
            snprintf(what, sizeof(what), "cannot create arenas: a process can name at most %d "
                     "arenas over its life and has; reuse names it already has",
                     DM_RT_ARENAS_MAX);
        return install_fail(d, rc, what);
    }
    fill_slots(tab, byspec, &worker);
    dm__dispatch_t *old;
    uint64_t seq = publish(tab, &old);
    /* Observers read the policy outside dm__mem_mu: our reference keeps it alive
     * even if another install retires the table meanwhile. */
    atomic_fetch_add_explicit(&tab->refs, 1, memory_order_relaxed);
    pthread_mutex_unlock(&dm__mem_mu);
    if (old)
        dm__dispatch_release(old);
    dm__runtime_notify_install(tab->policy, seq);
    dm__dispatch_release(tab);
    return 0;
}

int dm_runtime_install(dm_policy_t *p, dm_diags_t *d) { return install(p, d, NULL, 0); }

static int load(const char *path, dm_diags_t *d, bool reload, uint64_t over_hash) {
    dm_runtime_init();
    dm_topology_t topo;
    dm_runtime_topology(&topo);
    dm_policy_t *p = NULL;
    int rc = dm_policy_load(path, &topo, &p, d);
    if (rc == 0)
        rc = install(p, d, reload ? path : NULL, over_hash);
    if (rc && rc != DM_ESUPERSEDED)
        dm_runtime_note_reload_failure();
    return rc;
}

int dm_runtime_load(const char *path, dm_diags_t *d) { return load(path, d, false, 0); }

int dm_runtime_reload(const char *path, uint64_t over_hash, dm_diags_t *d) {
    return load(path, d, true, over_hash);
}

void dm_runtime_note_reload_failure(void) {
    pthread_mutex_lock(&dm__mem_mu);
    reload_failures++;
    last_reload_failed = true;
    pthread_mutex_unlock(&dm__mem_mu);
}

void dm__install_stats(dm_stats_t *out) {
    out->reloads = reloads;
    out->reload_failures = reload_failures;
    out->last_reload_time = last_reload_time;
    out->last_reload_failed = last_reload_failed;
}
