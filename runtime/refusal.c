/*
 * refusal.c: what an allocation does when its arena fails it or a limit says
 * no. An arena's own failure or limit (`limit`, `backing.max`, a full disk)
 * tries the table's `fallback` arena; a tag's or the worker limit's refusal
 * goes to the spill arena that limit names (tag_limits[].spill, worker_spill),
 * never to `fallback`, which could be RAM. What is not served becomes the
 * thread's last failure (dm_runtime_last_failure: the limit, the rule, the
 * arena, the bytes live), counted per arena and per rule, and logged at most
 * once a second (log_refusal). alloc.c calls here only once an allocation has
 * failed: nothing on this path is on the fast one. This file decides and
 * records; alloc.c serves (the fallback or spill slot named here), so the
 * allocation paths call down into it and never the other way.
 *
 * Thread safety: the calling thread's state and relaxed counters, and the
 * table it holds a reference to (t->table).
 */
#include "runtime/refusal.h"

#include <fnmatch.h>
#include <stdatomic.h>
#include <stdio.h>

#include "runtime/tally.h"

/* "8 bytes", "1.5 KiB", "64.0 MiB", "2.0 GiB" */
static void fmt_bytes(char *buf, size_t cap, uint64_t v) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (v < 1024) {
        snprintf(buf, cap, "%llu bytes", (unsigned long long)v);
        return;
    }
    double x = (double)v / 1024.0;
    int u = 0;
    while (x >= 1024.0 && u < 3)
        x /= 1024.0, u++;
    snprintf(buf, cap, "%.1f %s", x, units[u]);
}

/* The refusal's line on stderr. NumPy's MemoryError text is fixed ("Unable to
 * allocate ... for an array with shape ..."), so a refusal by a limit also says
 * which arena, rule, limit and request it was: at most one line a second (a job
 * that catches MemoryError in a loop is not flooded), with the number not shown.
 * datamem.last_failure() gives the same for the calling thread. */
static void log_refusal(const dm_failure_t *f) {
    static _Atomic int64_t last_s;
    static _Atomic uint64_t quiet;
    if (!dm__mem_log_due(&last_s)) {
        atomic_fetch_add_explicit(&quiet, 1, memory_order_relaxed);
        return;
    }
    uint64_t more = atomic_exchange_explicit(&quiet, 0, memory_order_relaxed);
    char more_text[64] = "";
    if (more)
        snprintf(more_text, sizeof(more_text), " (%llu more refusals not shown)",
                 (unsigned long long)more);
    char lim[32], live[32], req[32];
    fmt_bytes(lim, sizeof(lim), f->limit);
    fmt_bytes(live, sizeof(live), f->live);
    fmt_bytes(req, sizeof(req), f->request);
    if (f->kind == DM_REFUSED_TAG)
        dm__log("datamem: MemoryError: tag '%s' is at its limit of %s with %s live: a "
                "request of %s was refused%s", f->tag, lim, live, req, more_text);
    else if (f->kind == DM_REFUSED_WORKER)
        dm__log("datamem: MemoryError: the worker limit of %s is reached with %s live: a "
                "request of %s was refused%s", lim, live, req, more_text);
    else
        dm__log("datamem: MemoryError: arena '%s' (rule '%s') is at its limit of %s with %s "
                "live: a request of %s was refused%s%s", f->arena, f->rule, lim, live, req,
                f->fallback_tried ? "; the fallback arena had no room either" : "", more_text);
}

/* The rule's name as failures say it: its own, or "default". */
static const char *rule_name(const dm__thread_t *t, int rule) {
    const dm_policy_t *pol = t->table->policy;
    return rule < pol->nrules ? pol->rules[rule].name : "default";
}

/* The thread's last failure names rule `rule`. */
static void name_rule(dm__thread_t *t, int rule) {
    snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s", rule_name(t, rule));
}

/* A limit's refusal is counted for slot `s` and rule `rule`, which it names. */
static void count_limit(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule) {
    name_rule(t, rule);
    DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
    DM_CTR_ADD(t->rule_ctrs[rule].nlimit, 1);
}

const dm__dispatch_slot_t *dm__refusal_failed(dm__thread_t *t, const dm__dispatch_slot_t *s,
                                              int rule, dm__refusal_t *r) {
    r->limited = t->limit_refused;
    t->limit_refused = false;
    const dm__dispatch_t *tab = t->table;
    DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
    DM_CTR_ADD(t->rule_ctrs[rule].nfail, 1);
    if (r->limited)
        count_limit(t, s, rule);
    if (tab->fallback < 0 || tab->fallback_slot.arena == s->arena) {
        if (r->limited)
            log_refusal(&t->last_failure);
        return NULL;
    }
    r->first = t->last_failure;
    return &tab->fallback_slot;
}

void *dm__refusal_fallback(dm__thread_t *t, int rule, const dm__refusal_t *r, void *p) {
    const dm__dispatch_slot_t *f = &t->table->fallback_slot;
    if (p) {
        DM_CTR_ADD(t->ctrs[f->arena_id].nfallback, 1);
        DM_CTR_ADD(t->rule_ctrs[rule].nfallback, 1);
        return p;
    }
    DM_CTR_ADD(t->ctrs[f->arena_id].nfail, 1);
    if (t->limit_refused) { /* the fallback's own limit */
        t->limit_refused = false;
        DM_CTR_ADD(t->ctrs[f->arena_id].nlimit, 1);
        name_rule(t, rule);
    }
    if (r->limited) { /* report the rule's own arena, noting the fallback had no room */
        dm_failure_t first = r->first;
        first.seq = t->last_failure.seq;
        first.fallback_tried = true;
        t->last_failure = first;
    }
    if (r->limited || t->last_failure.seq != r->first.seq)
        log_refusal(&t->last_failure);
    return NULL;
}

/* The spill arena the limit that refused names (tag_limits[].spill for a tag's,
 * worker_spill for the worker's), or NULL. */
static const dm__dispatch_slot_t *spill_target(const dm__dispatch_t *tab, const dm_failure_t *f) {
    const dm_policy_t *p = tab->policy;
    int a = -1;
    if (f->kind == DM_REFUSED_WORKER) {
        a = p->worker_spill;
    } else if (f->kind == DM_REFUSED_TAG) {
        for (int i = 0; i < p->ntag_limits; i++) /* the entry that gave the tag its limit */
            if (fnmatch(p->tag_limits[i].tag, f->tag, 0) == 0) {
                a = p->tag_limits[i].spill;
                break;
            }
    }
    return a >= 0 ? &tab->spill_slots[a] : NULL;
}

const dm__dispatch_slot_t *dm__refusal_spill_target(const dm__thread_t *t) {
    return spill_target(t->table, &t->refusal);
}

void *dm__refusal_spilled(dm__thread_t *t, const dm__dispatch_slot_t *sp, int rule, void *p) {
    t->limit_refused = false; /* the spill arena's own limit: the refusal stands */
    if (!p)
        return NULL;
    DM_CTR_ADD(t->ctrs[sp->arena_id].nfallback, 1);
    DM_CTR_ADD(t->rule_ctrs[rule].nfallback, 1);
    if (t->refusal.kind == DM_REFUSED_WORKER)
        atomic_fetch_add_explicit(&dm__tally_total.spilled, 1, memory_order_relaxed);
    return p;
}

void *dm__refusal_tallied(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule) {
    uint64_t seq = t->last_failure.seq;
    t->last_failure = t->refusal;
    t->last_failure.seq = seq + 1;
    DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
    DM_CTR_ADD(t->rule_ctrs[rule].nfail, 1);
    count_limit(t, s, rule);
    snprintf(t->last_failure.arena, sizeof(t->last_failure.arena), "%s", s->arena->name);
    log_refusal(&t->last_failure);
    return NULL;
}

void dm__refusal_realloc(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule) {
    t->limit_refused = false;
    count_limit(t, s, rule);
    log_refusal(&t->last_failure);
}
