/*
 * stats.c: dm_stats_snapshot, the engine's numbers in one struct: per policy
 * arena its settings, counters (those of exited threads, folded into the
 * arena, plus every live thread's) and jemalloc's stats; per rule of the table
 * in force its counters; the block cache's bytes; reloads, threads, contexts,
 * tags (tally.c).
 *
 * Thread safety: the snapshot is taken under dm__mem_mu (threads cannot
 * join, leave or rebind meanwhile); per-thread counters are read relaxed while
 * their threads keep counting.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/alloc.h"
#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/context.h"
#include "runtime/dispatch.h"
#include "runtime/install.h"
#include "runtime/tally.h"
#include "runtime/thread.h"

/* One thread's (or the folded) counters into a snapshot. */
static void counts_add(dm_counts_t *o, const dm__ctrs_t *c) {
    o->nalloc += DM_CTR_GET(c->nalloc);
    o->nfree += DM_CTR_GET(c->nfree);
    o->nrealloc += DM_CTR_GET(c->nrealloc);
    o->nfail += DM_CTR_GET(c->nfail);
    o->nfallback += DM_CTR_GET(c->nfallback);
    o->ndtype_known += DM_CTR_GET(c->ndtype_known);
    o->bytes_requested += DM_CTR_GET(c->bytes);
    o->nlimit += DM_CTR_GET(c->nlimit);
}

/* The tags' figures (under dm__mem_mu): their live bytes less what the
 * threads hold of their frees (tally.h). */
static int tally_snapshot(dm_stats_t *out) {
    dm__tally_held_t **held = calloc((size_t)dm__thread_n + 1, sizeof(*held));
    int nheld = 0;
    for (dm__thread_t *t = dm__thread_registry; held && t; t = t->next)
        held[nheld++] = &t->tally_held;
    int rc = held ? dm__tally_snapshot(out, held, nheld) : DM_ENOMEM;
    free(held);
    return rc;
}

int dm_stats_snapshot(dm_stats_t *out) {
    memset(out, 0, sizeof(*out));
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    out->snapshot_time = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    uint64_t epoch = 1;
    size_t esz = sizeof(epoch);
    pthread_mutex_lock(&dm__mem_mu);
    /* Kept big blocks that waited out their arena's decay.dirty go back now:
     * with an exporter running this is their clock when the job is idle.
     * (dm__mem_mu, then an arena's reuse_mu: the order fork's handlers take.) */
    dm__bigblock_expire_all();
    dmje_mallctl("epoch", &epoch, &esz, &epoch, esz);
    out->narenas = dm__arena_count();
    for (int i = 0; i < out->narenas; i++) {
        dm__arena_t *a = dm__arena_at(i);
        dm_arena_stats_t *o = &out->arenas[i];
        snprintf(o->name, sizeof(o->name), "%s", a->name);
        o->in_policy = atomic_load_explicit(&a->in_policy, memory_order_relaxed);
        o->alignment = atomic_load_explicit(&a->alignment, memory_order_relaxed);
        o->hugepages = atomic_load_explicit(&a->place.thp, memory_order_relaxed);
        o->numa = atomic_load_explicit(&a->place.numa, memory_order_relaxed);
        o->numa_nodes = atomic_load_explicit(&a->place.numa_nodes, memory_order_relaxed);
        o->per_node = atomic_load_explicit(&a->per_node, memory_order_relaxed);
        o->nplacement_errors = DM_CTR_GET(a->place.placement_errors);
        o->ngrowth_purges = DM_CTR_GET(a->growth_purges);
        size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
        o->limit = limit == SIZE_MAX ? UINT64_MAX : (uint64_t)limit;
        o->tracked = atomic_load_explicit(&a->tracked, memory_order_acquire);
        o->live = o->tracked ? atomic_load_explicit(&a->live, memory_order_relaxed) : 0;
        o->lock = atomic_load_explicit(&a->place.lock, memory_order_relaxed);
        o->pinned = atomic_load_explicit(&a->place.pinned, memory_order_relaxed);
        o->locked_bytes = atomic_load_explicit(&a->place.locked_bytes, memory_order_relaxed);
        o->pinned_bytes = atomic_load_explicit(&a->place.pinned_bytes, memory_order_relaxed);
        counts_add(&o->counts, &a->dead);
        for (dm__thread_t *t = dm__thread_registry; t; t = t->next)
            counts_add(&o->counts, &t->ctrs[i]);
        dm__arena_je_stats(a, o);
    }
    dm__dispatch_t *tab = atomic_load_explicit(&dm__dispatch_current, memory_order_relaxed);
    if (tab) {
        out->nrules = tab->nslots;
        out->rules = calloc((size_t)tab->nslots, sizeof(dm_rule_stats_t));
        for (int r = 0; out->rules && r < tab->nslots; r++) {
            dm_rule_stats_t *rs = &out->rules[r];
            const dm_policy_t *p = tab->policy;
            snprintf(rs->name, sizeof(rs->name), "%s",
                     r < p->nrules ? p->rules[r].name : "default");
            snprintf(rs->arena, sizeof(rs->arena), "%s", tab->slots[r].arena->name);
            counts_add(&rs->counts, &tab->rule_ctrs[r]);
            for (dm__thread_t *t = dm__thread_registry; t; t = t->next)
                if (t->table == tab && t->rule_ctrs)
                    counts_add(&rs->counts, &t->rule_ctrs[r]);
            rs->counts.nfree = 0; /* frees know the arena, not the rule */
        }
        out->policy_hash = tab->policy->hash;
    }
    for (dm__thread_t *t = dm__thread_registry; t; t = t->next)
        for (unsigned k = 0; k < DM_SC_COUNT; k++)
            out->cached_bytes += (uint64_t)dm__bcache_count(&t->bins[k]) * dm_sc_size(k);
    if (tab) {
        snprintf(out->policy_path, sizeof(out->policy_path), "%s", tab->policy->path);
    }
    dm__install_stats(out);
    out->nthreads = dm__thread_n;
    out->ncontexts = dm__context_count();
    int trc = tally_snapshot(out);
    out->tables_live = dm__dispatch_live();
    pthread_mutex_unlock(&dm__mem_mu);
    out->foreign_frees = dm__alloc_foreign_frees();
    out->lend_frames = dm__bigblock_moved_frames();
    out->lend_frames_max = dm__bigblock_lend_cap();
    out->lend_capped = dm__bigblock_capped_moves();
    if (trc) {
        dm_stats_release(out);
        return trc;
    }
    return 0;
}

void dm_stats_release(dm_stats_t *s) {
    free(s->rules);
    s->rules = NULL;
    free(s->tags);
    s->tags = NULL;
    s->ntags = 0;
}
