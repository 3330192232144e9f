/*
 * validate.c: the checks that need the whole policy. Resolves every arena name
 * that parse.c recorded (default, fallback, each rule's arena) and, when the
 * policy has no error, warns about what is legal but suspicious: a rule that an
 * earlier rule fully shadows, and an arena nothing uses. (Warnings wait for a
 * clean policy because a policy with errors would give misleading ones.)
 * Reentrant: works only on the dm__pctx_t it is given.
 */
#include <stdio.h>
#include <string.h>

#include "policy/internal.h"

static void resolve_one(dm__pctx_t *c, const dm__aref_t *ref) {
    const dm_policy_t *p = c->p;
    const dm__ynode_t *n = dm__ynode(c->yt, ref->node);
    const char *name = dm__ytext(c->yt, ref->node), *cands[DM_ARENAS_MAX];
    char q[DM__QUOTE_CAP], list[256];
    dm__sbuf_t b;
    dm__text_sb_init(&b, list, sizeof list);
    for (int i = 0; i < p->narenas; i++) {
        if (strcmp(p->arenas[i].name, name) == 0) {
            *ref->dst = i;
            return;
        }
        cands[i] = p->arenas[i].name;
        dm__text_sb_printf(&b, "%s%s", i ? ", " : "", cands[i]);
    }
    dm__text_sb_done(&b);
    const char *near = dm__text_nearest(name, cands, p->narenas);
    dm__text_quote(q, sizeof q, name, strlen(name));
    if (near)
        dm__diag_add(c->ds, DM_SEV_ERROR, n->line, n->col, ref->path,
                     "arena %s is not defined (did you mean '%s'?)", q, near);
    else
        dm__diag_add(c->ds, DM_SEV_ERROR, n->line, n->col, ref->path,
                     "arena %s is not defined%s%s", q,
                     p->narenas ? "; defined arenas are " : "", list);
}

/* Whether string s is one of the n names in v. */
static bool has_name(const char (*v)[DM_NAME_MAX], int n, const char *s) {
    for (int i = 0; i < n; i++)
        if (strcmp(v[i], s) == 0)
            return true;
    return false;
}

/* Whether rule a matches every allocation that rule b matches. */
static bool covers(const dm_rule_spec_t *a, const dm_rule_spec_t *b) {
    if (a->nmodules || a->nfunctions) /* a call-site rule: no claim about b's sites */
        return false;
    if (a->size_min > b->size_min || a->size_max < b->size_max)
        return false;
    if (a->dtypes && (!b->dtypes || (b->dtypes & ~a->dtypes)))
        return false;
    if (a->nthreads && !has_name(a->threads, a->nthreads, "*")) {
        if (!b->nthreads)
            return false;
        for (int i = 0; i < b->nthreads; i++)
            if (!has_name(a->threads, a->nthreads, b->threads[i]))
                return false;
    }
    for (int i = 0; i < a->ntags; i++)
        if (!has_name(b->tags, b->ntags, a->tags[i]))
            return false;
    return true;
}

static void warn_shadowed(dm__pctx_t *c) {
    const dm_policy_t *p = c->p;
    char path[32];
    for (int j = 1; j < p->nrules; j++) {
        const dm_rule_spec_t *b = &p->rules[j];
        for (int i = 0; i < j; i++) {
            const dm_rule_spec_t *a = &p->rules[i];
            if (!covers(a, b))
                continue;
            snprintf(path, sizeof path, "rules[%d]", j);
            dm__diag_add(c->ds, DM_SEV_WARNING, b->line, b->col, path,
                         "rule '%s' never matches: earlier rule '%s' matches "
                         "everything it does", b->name, a->name);
            dm__diag_add(c->ds, DM_SEV_NOTE, a->line, a->col, "",
                         "rule '%s' is here", a->name);
            break;
        }
    }
}

static void warn_unused(dm__pctx_t *c) {
    const dm_policy_t *p = c->p;
    bool used[DM_ARENAS_MAX] = {false};
    char path[DM_NAME_MAX + 8];
    used[p->default_arena] = true;
    if (p->fallback_arena >= 0)
        used[p->fallback_arena] = true;
    if (p->worker_spill >= 0)
        used[p->worker_spill] = true;
    for (int i = 0; i < p->ntag_limits; i++)
        if (p->tag_limits[i].spill >= 0)
            used[p->tag_limits[i].spill] = true;
    for (int i = 0; i < p->nrules; i++)
        used[p->rules[i].arena] = true;
    for (int i = 0; i < p->narenas; i++) {
        if (used[i])
            continue;
        snprintf(path, sizeof path, "arenas.%s", p->arenas[i].name);
        dm__diag_add(c->ds, DM_SEV_WARNING, p->arenas[i].line, p->arenas[i].col,
                     path, "arena '%s' is not used by any rule, default or "
                     "fallback", p->arenas[i].name);
    }
}

/* Call-site rules each own a bit of a 64-bit site mask. */
static void check_site_rules(dm__pctx_t *c) {
    const dm_policy_t *p = c->p;
    int n = 0;
    for (int i = 0; i < p->nrules; i++) {
        const dm_rule_spec_t *r = &p->rules[i];
        if (!(r->nmodules || r->nfunctions) || ++n <= DM_SITE_RULES_MAX)
            continue;
        char path[32];
        snprintf(path, sizeof path, "rules[%d]", i);
        dm__diag_add(c->ds, DM_SEV_ERROR, r->line, r->col, path,
                     "too many rules with a module or function part: at most %d",
                     DM_SITE_RULES_MAX);
        return;
    }
}

/* A file-backed arena: an absolute directory, and none of the settings that
 * place or pin pages, which a file's pages (the page cache's) cannot take. */
static void check_backing(dm__pctx_t *c, const dm_arena_spec_t *a) {
    char path[DM_NAME_MAX + 24];
    const char *what = a->hugepages != DM_THP_SYSTEM ? "hugepages"
                       : a->numa != DM_NUMA_NONE    ? "numa"
                       : a->per_node                ? "per_node"
                       : a->lock                    ? "lock"
                       : a->pinned != DM_PIN_NONE   ? "pinned"
                                                    : NULL;
    if (!a->backing.dir[0])
        return;
    snprintf(path, sizeof path, "arenas.%s.backing.dir", a->name);
    if (a->backing.dir[0] != '/')
        dm__diag_add(c->ds, DM_SEV_ERROR, a->line, a->col, path,
                     "'%s' is not an absolute path", a->backing.dir);
    snprintf(path, sizeof path, "arenas.%s.backing", a->name);
    if (what)
        dm__diag_add(c->ds, DM_SEV_ERROR, a->line, a->col, path,
                     "a file-backed arena cannot take '%s': its pages are the page cache's "
                     "(leave %s out, or use another arena)", what, what);
}

/* A spill arena without backing keeps what it serves in RAM; worker_spill
 * without worker_limit never serves anything. */
static void warn_spill(dm__pctx_t *c) {
    const dm_policy_t *p = c->p;
    char path[40];
    for (int i = 0; i < p->ntag_limits; i++) {
        const dm_tag_limit_spec_t *t = &p->tag_limits[i];
        if (t->spill < 0 || p->arenas[t->spill].backing.dir[0])
            continue;
        snprintf(path, sizeof path, "tag_limits[%d].spill", i);
        dm__diag_add(c->ds, DM_SEV_WARNING, t->line, t->col, path,
                     "arena '%s' has no backing: what the limit refuses stays in RAM",
                     p->arenas[t->spill].name);
    }
    const dm__ynode_t *n = NULL; /* where worker_spill was written */
    for (int i = 0; i < c->nrefs; i++)
        if (c->refs[i].dst == &c->p->worker_spill)
            n = dm__ynode(c->yt, c->refs[i].node);
    if (p->worker_spill >= 0 && !p->worker_limit[0])
        dm__diag_add(c->ds, DM_SEV_WARNING, n ? n->line : 0, n ? n->col : 0, "worker_spill",
                     "has no effect without worker_limit");
    else if (p->worker_spill >= 0 && !p->arenas[p->worker_spill].backing.dir[0])
        dm__diag_add(c->ds, DM_SEV_WARNING, n ? n->line : 0, n ? n->col : 0, "worker_spill",
                     "arena '%s' has no backing: what worker_limit refuses stays in RAM",
                     p->arenas[p->worker_spill].name);
}

void dm__validate_policy(dm__pctx_t *c) {
    check_site_rules(c);
    for (int i = 0; i < c->nrefs; i++)
        resolve_one(c, &c->refs[i]);
    for (int i = 0; i < c->p->narenas; i++)
        check_backing(c, &c->p->arenas[i]);
    if (c->ds->d->nerrors || c->nomem)
        return;
    warn_shadowed(c);
    warn_unused(c);
    warn_spill(c);
}
