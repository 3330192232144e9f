/*
 * compile.c: a validated policy -> an immutable dispatch table, and the table
 * specialised to one context -> a view that answers (size, dtype) -> rule.
 *
 * A rule with a thread or tag part is a "context rule" and owns one bit of a
 * context key; a view keeps the rules without a context part plus the context
 * rules whose bit is set. The view is an interval table: the sorted starts of
 * every kept rule's size range and of the gap after it (bounds[0] == 0), and for
 * each interval a row of DM_DT_SLOTS rule indices (one per dtype), or a single
 * slot when no rule in the table names a dtype. Within one interval every kept
 * rule either covers all of it or none of it, so each slot is "the first kept
 * rule, in policy order, that matches this interval and dtype" and lookup is a
 * binary search over bounds plus one index.
 *
 * Tables and views are immutable after they are returned: any number of
 * threads may read them. Building allocates; nothing else does.
 */
#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

#include "policy/internal.h"

struct dm_table {
    dm_policy_t pol;  /* deep copy: pol.rules points into this allocation */
    int nsite;        /* call-site rules (module / function) */
    int16_t site_rule[DM_SITE_RULES_MAX]; /* site bit -> rule index, ascending */
    int nctx;         /* context rules */
    int key_words;    /* uint64_t words in a context key */
    bool uses_dtype;  /* some rule names a dtype */
    int16_t *ctx_bit; /* per rule: its bit in a context key, or -1 */
};

static bool is_ctx_rule(const dm_rule_spec_t *r) {
    return r->nthreads > 0 || r->ntags > 0;
}

static bool is_site_rule(const dm_rule_spec_t *r) {
    return r->nmodules > 0 || r->nfunctions > 0;
}

/* A compiled table trusts nothing about where the policy came from. */
static bool policy_sane(const dm_policy_t *p) {
    int nsite = 0;
    if (p->nrules < 0 || p->nrules > DM_RULES_MAX || (p->nrules && !p->rules) ||
        p->narenas < 1 || p->narenas > DM_ARENAS_MAX ||
        p->default_arena < 0 || p->default_arena >= p->narenas ||
        p->fallback_arena < -1 || p->fallback_arena >= p->narenas)
        return false;
    for (int i = 0; i < p->nrules; i++) {
        const dm_rule_spec_t *r = &p->rules[i];
        if (r->arena < 0 || r->arena >= p->narenas || r->nthreads < 0 ||
            r->nthreads > DM_GLOBS_MAX || r->ntags < 0 || r->ntags > DM_GLOBS_MAX ||
            r->nmodules < 0 || r->nmodules > DM_SITE_GLOBS_MAX || r->nfunctions < 0 ||
            r->nfunctions > DM_SITE_GLOBS_MAX)
            return false;
        nsite += is_site_rule(r);
    }
    return nsite <= DM_SITE_RULES_MAX;
}

int dm_table_compile(const dm_policy_t *p, dm_table_t **out) {
    size_t n = (size_t)(p->nrules > 0 ? p->nrules : 0);
    *out = NULL;
    if (!policy_sane(p))
        return DM_EINVALID;
    dm_table_t *t = malloc(sizeof *t + n * sizeof(dm_rule_spec_t) +
                           n * sizeof(int16_t));
    if (!t)
        return DM_ENOMEM;
    t->pol = *p;
    t->pol.rules = (dm_rule_spec_t *)(t + 1);
    t->ctx_bit = (int16_t *)(t->pol.rules + n);
    if (n)
        memcpy(t->pol.rules, p->rules, n * sizeof(dm_rule_spec_t));
    t->nctx = 0;
    t->nsite = 0;
    t->uses_dtype = false;
    for (size_t i = 0; i < n; i++) {
        const dm_rule_spec_t *r = &t->pol.rules[i];
        t->ctx_bit[i] = is_ctx_rule(r) ? (int16_t)t->nctx++ : -1;
        t->uses_dtype |= r->dtypes != 0;
        if (is_site_rule(r))
            t->site_rule[t->nsite++] = (int16_t)i;
    }
    t->key_words = (t->nctx + 63) / 64;
    *out = t;
    return 0;
}

void dm_table_free(dm_table_t *t) { free(t); }

int dm_table_nrules(const dm_table_t *t) { return t->pol.nrules; }
bool dm_table_uses_dtype(const dm_table_t *t) { return t->uses_dtype; }
bool dm_table_uses_context(const dm_table_t *t) { return t->nctx > 0; }
int dm_table_ctx_key_words(const dm_table_t *t) { return t->key_words; }
int dm_table_narenas(const dm_table_t *t) { return t->pol.narenas; }
const dm_policy_t *dm_table_policy(const dm_table_t *t) { return &t->pol; }

int dm_table_rule_arena(const dm_table_t *t, int rule) {
    if (rule == t->pol.nrules)
        return t->pol.default_arena;
    return (rule >= 0 && rule < t->pol.nrules) ? t->pol.rules[rule].arena : -1;
}

const char *dm_table_rule_name(const dm_table_t *t, int rule) {
    return (rule >= 0 && rule < t->pol.nrules) ? t->pol.rules[rule].name : NULL;
}

const char *dm_table_arena_name(const dm_table_t *t, int arena) {
    return (arena >= 0 && arena < t->pol.narenas) ? t->pol.arenas[arena].name : NULL;
}

/* ---- context keys ------------------------------------------------------- */

bool dm__compile_ctx_has_tag(const dm_context_t *ctx, const char *tag) {
    for (int i = 0; ctx && i < ctx->ntags; i++)
        if (ctx->tags[i] && strcmp(ctx->tags[i], tag) == 0)
            return true;
    return false;
}

bool dm__compile_thread_match(const dm_rule_spec_t *r, const char *thread) {
    bool any = r->nthreads == 0;
    for (int i = 0; !any && i < r->nthreads; i++)
        any = fnmatch(r->threads[i], thread, 0) == 0;
    return any;
}

bool dm__compile_ctx_match(const dm_rule_spec_t *r, const dm_context_t *ctx) {
    bool ok = dm__compile_thread_match(r, (ctx && ctx->thread) ? ctx->thread : "");
    for (int i = 0; ok && i < r->ntags; i++)
        ok = dm__compile_ctx_has_tag(ctx, r->tags[i]);
    return ok;
}

static bool any_glob(const char (*v)[DM_NAME_MAX], int n, const char *s) {
    bool any = n == 0;
    for (int i = 0; !any && i < n; i++)
        any = fnmatch(v[i], s, 0) == 0;
    return any;
}

bool dm__compile_site_match(const dm_rule_spec_t *r, const char *module, const char *function) {
    if (!is_site_rule(r))
        return true;
    if (!module || !function) /* unknown site */
        return false;
    return any_glob(r->modules, r->nmodules, module) &&
           any_glob(r->functions, r->nfunctions, function);
}

/* ---- call sites ------------------------------------------------------------ */

bool dm_table_uses_site(const dm_table_t *t) { return t->nsite > 0; }

uint64_t dm_table_site_mask(const dm_table_t *t, const char *module, const char *function) {
    uint64_t m = 0;
    for (int b = 0; b < t->nsite; b++)
        if (dm__compile_site_match(&t->pol.rules[t->site_rule[b]], module, function))
            m |= UINT64_C(1) << b;
    return m;
}

int dm_table_site_pick(const dm_table_t *t, const dm_view_t *v, uint64_t mask, size_t size,
                       int dt, int rule) {
    for (mask &= v->site_ok; mask; mask &= mask - 1) {
        int i = t->site_rule[__builtin_ctzll(mask)];
        if (i >= rule) /* bits ascend with rule order: nothing earlier is left */
            break;
        const dm_rule_spec_t *r = &t->pol.rules[i];
        if (size < r->size_min || size > r->size_max)
            continue;
        if (r->dtypes && (dt <= DM_DT_UNKNOWN || dt >= 32 || !(r->dtypes >> dt & 1)))
            continue;
        return i;
    }
    return rule;
}

void dm_table_ctx_key(const dm_table_t *t, const dm_context_t *ctx,
                      uint64_t *key) {
    if (t->key_words)
        memset(key, 0, (size_t)t->key_words * sizeof *key);
    for (int i = 0; i < t->pol.nrules; i++) {
        int b = t->ctx_bit[i];
        if (b >= 0 && dm__compile_ctx_match(&t->pol.rules[i], ctx))
            key[b / 64] |= 1ull << (b % 64);
    }
}

/* ---- views ---------------------------------------------------------------- */

static int cmp_size(const void *a, const void *b) {
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

/* Sorted, unique interval starts of the kept rules; returns how many. */
static uint32_t collect_bounds(const dm_table_t *t, const int *kept, int nkept,
                               size_t *bounds) {
    uint32_t n = 0, u = 0;
    bounds[n++] = 0;
    for (int k = 0; k < nkept; k++) {
        const dm_rule_spec_t *r = &t->pol.rules[kept[k]];
        bounds[n++] = r->size_min;
        if (r->size_max != SIZE_MAX)
            bounds[n++] = r->size_max + 1;
    }
    qsort(bounds, n, sizeof *bounds, cmp_size);
    for (uint32_t i = 0; i < n; i++)
        if (u == 0 || bounds[i] != bounds[u - 1])
            bounds[u++] = bounds[i];
    return u;
}

/* One row: for interval start lo, the first kept rule per dtype slot. */
static void fill_row(const dm_table_t *t, const int *kept, int nkept, size_t lo,
                     uint32_t width, uint16_t *row) {
    uint32_t open = width == 1 ? 1u : 0xFFFFFFFFu; /* slots not yet decided */
    for (uint32_t s = 0; s < width; s++)
        row[s] = (uint16_t)t->pol.nrules;
    for (int k = 0; k < nkept && open; k++) {
        const dm_rule_spec_t *r = &t->pol.rules[kept[k]];
        if (lo < r->size_min || lo > r->size_max)
            continue;
        /* a dtype rule never matches DM_DT_UNKNOWN (slot 0) */
        uint32_t m = (width == 1 || !r->dtypes) ? open
                                                : (r->dtypes & ~1u) & open;
        for (uint32_t s = 0; s < width; s++)
            if (m >> s & 1)
                row[s] = (uint16_t)kept[k];
        open &= ~m;
    }
}

dm_view_t *dm_table_view_build(const dm_table_t *t, const uint64_t *key) {
    int n = t->pol.nrules, nkept = 0;
    int *kept = malloc((size_t)(n ? n : 1) * sizeof *kept);
    size_t *tmp = malloc((size_t)(2 * n + 1) * sizeof *tmp);
    dm_view_t *v = NULL;
    if (!kept || !tmp)
        goto out;
    uint64_t site_ok = 0;
    for (int i = 0, sb = 0; i < n; i++) {
        int b = t->ctx_bit[i];
        bool ctx_ok = b < 0 || (key && (key[b / 64] >> (b % 64) & 1));
        if (is_site_rule(&t->pol.rules[i])) { /* decided per allocation, not here */
            if (ctx_ok)
                site_ok |= UINT64_C(1) << sb;
            sb++;
        } else if (ctx_ok) {
            kept[nkept++] = i;
        }
    }
    uint32_t nb = collect_bounds(t, kept, nkept, tmp);
    uint32_t width = t->uses_dtype ? DM_DT_SLOTS : 1;
    v = malloc(sizeof *v + nb * sizeof(size_t) + (size_t)nb * width * sizeof(uint16_t));
    if (!v)
        goto out;
    size_t *bounds = (size_t *)(v + 1);
    uint16_t *slots = (uint16_t *)(bounds + nb);
    memcpy(bounds, tmp, nb * sizeof *bounds);
    for (uint32_t i = 0; i < nb; i++)
        fill_row(t, kept, nkept, bounds[i], width, slots + (size_t)i * width);
    v->site_ok = site_ok;
    v->nbounds = nb;
    v->dt_mask = width - 1;
    v->row_width = width;
    v->bounds = bounds;
    v->slots = slots;
out:
    free(kept);
    free(tmp);
    return v;
}

void dm_view_free(dm_view_t *v) { free(v); }
