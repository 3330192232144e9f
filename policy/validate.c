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

void dm__validate_policy(dm__pctx_t *c) {
    check_site_rules(c);
    for (int i = 0; i < c->nrefs; i++)
        resolve_one(c, &c->refs[i]);
    if (c->ds->d->nerrors || c->nomem)
        return;
    warn_shadowed(c);
    warn_unused(c);
}
