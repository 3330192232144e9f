/*
 * parse_match.c: reads a rule's match lists (match.dtype, match.thread,
 * match.module, match.function, match.tag) for parse.c's walk: a scalar or a
 * list of them, each checked as its row's type asks (a dtype name or kind with
 * a nearest-name suggestion, a glob, a tag name) and stored in the rule, with
 * the lint for thread globs that no Python thread pool's names can match.
 * Reentrant: all state is in the dm__pctx_t it is given.
 */
#include <string.h>

#include "policy/internal.h"
#include "policy/schema.h"

#define ROW(r) (&dm__schema_rows[r])
#define NODE(c, i) dm__ynode((c)->yt, (i))
#define TEXT(c, i) dm__ytext((c)->yt, (i))
#define ERR(c, node, ...) dm__parse_report((c), DM_SEV_ERROR, (node), __VA_ARGS__)

static void unknown_dtype(dm__pctx_t *c, int node) {
    static const char *const kinds[] = {
#define DM_KIND_NAME(name, mask, doc) name,
        DM_DTYPE_KINDS(DM_KIND_NAME)
#undef DM_KIND_NAME
    };
    const char *cands[DM_DT_COUNT + sizeof kinds / sizeof kinds[0]];
    int n = 0;
    char q[DM__QUOTE_CAP];
    for (int i = 1; i < DM_DT_COUNT; i++)
        cands[n++] = dm_dtype_name(i);
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        cands[n++] = kinds[i];
    const char *s = TEXT(c, node), *near = dm__text_nearest(s, cands, n);
    dm__text_quote(q, sizeof q, s, strlen(s));
    if (near)
        ERR(c, node, "unknown dtype %s (did you mean '%s'?)", q, near);
    else
        ERR(c, node, "unknown dtype %s; use a dtype name such as float32 or a "
            "kind: int, uint, integer, float, complex, number, ...", q);
}

/* A thread glob "X-*" where X could name a thread pool: Python's pools name
 * their threads X_0, X_1, ... (ThreadPoolExecutor(thread_name_prefix=X);
 * asyncio's default executor uses "asyncio"), so "X-*" matches none of them
 * and the rule silently never applies. Lint only (DM_PARSE_LINT:
 * check and explain, not every start-up), because a job may well name its own
 * threads "worker-1" (the demo does). Python's own dashed names pass:
 * "Thread-*" (threading's default, "Thread-3 (run)"), "ThreadPoolExecutor-*"
 * (an executor without a prefix, "ThreadPoolExecutor-0_1") and "Dummy-*"
 * (threads not started by threading); so does a prefix that is not a plain
 * name. */
static void warn_pool_glob(dm__pctx_t *c, int node, const char *s) {
    static const char *const dash_named[] = {"Thread", "ThreadPoolExecutor", "Dummy"};
    size_t n = strlen(s);
    if (n < 3 || strcmp(s + n - 2, "-*") != 0 ||
        strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                  "0123456789_.-") != n - 1)
        return;
    int k = (int)(n - 2);
    for (size_t i = 0; i < sizeof dash_named / sizeof dash_named[0]; i++)
        if (strlen(dash_named[i]) == (size_t)k && strncmp(s, dash_named[i], (size_t)k) == 0)
            return;
    if (k == 7 && strncmp(s, "asyncio", 7) == 0)
        dm__parse_report(c, DM_SEV_WARNING, node, "'%s' matches no thread of asyncio's default "
               "executor (its threads are named asyncio_0, asyncio_1, ...); did you "
               "mean 'asyncio_*'?", s);
    else
        dm__parse_report(c, DM_SEV_WARNING, node, "'%s' matches no thread of ThreadPoolExecutor("
               "thread_name_prefix='%.*s') (its threads are named %.*s_0, %.*s_1, ...); "
               "did you mean '%.*s_*'?", s, k, s, k, s, k, s, k, s);
}

static void parse_list_item(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__schema_row_t *r = ROW(row);
    dm_rule_spec_t *rule = sect;
    const char *s = dm__parse_scalar_of(c, row, node), *why = NULL;
    char q[DM__QUOTE_CAP];
    if (!s)
        return;
    dm__text_quote(q, sizeof q, s, strlen(s));
    if (r->type == DM_ST_DTYPES) {
        dm_dtype_mask_t m = dm__units_dtype_mask(s);
        if (!m)
            unknown_dtype(c, node);
        rule->dtypes |= m;
        return;
    }
    bool glob = r->type == DM_ST_GLOBS;
    int *count = glob ? &rule->nthreads : &rule->ntags;
    char(*dst)[DM_NAME_MAX] = glob ? rule->threads : rule->tags;
    int cap = dm__schema_list_cap(row);
    if (row == DM_SK_MATCH_MODULE || row == DM_SK_MATCH_FUNCTION) {
        bool mod = row == DM_SK_MATCH_MODULE;
        count = mod ? &rule->nmodules : &rule->nfunctions;
        dst = mod ? rule->modules : rule->functions;
    }
    if (strlen(s) > r->max)
        ERR(c, node, "%s is %zu bytes long; at most %llu allowed", q, strlen(s),
            (unsigned long long)r->max);
    else if (glob && !dm_glob_valid(s, NULL, &why))
        ERR(c, node, "invalid glob %s: %s", q, why);
    else if (!glob && !dm__units_name_valid(s))
        ERR(c, node, "invalid tag %s: tags match [A-Za-z_][A-Za-z0-9_-]*", q);
    else if (*count == cap)
        ERR(c, node, "too many entries: at most %d", cap);
    else {
        memcpy(dst[(*count)++], s, strlen(s) + 1);
        if (row == DM_SK_MATCH_THREAD && c->lint)
            warn_pool_glob(c, node, s);
    }
}

void dm__parse_match_list(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__ynode_t *n = NODE(c, node);
    if (n->kind == DM_YN_SEQ) {
        for (int i = n->first; i >= 0; i = NODE(c, i)->next)
            parse_list_item(c, row, i, sect);
    } else {
        parse_list_item(c, row, node, sect);
    }
}
