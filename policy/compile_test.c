/*
 * compile_test.c: the compiled table and its views against the obvious
 * evaluation (try every rule in order), over random policies, contexts, sizes
 * and dtypes from fixed seeds, with the edge sizes 0, 1, every bound +-1 and
 * SIZE_MAX; plus the explain/dump text and the view layout invariants.
 */
#include <fnmatch.h>
#include <stdlib.h>

#include "policy/policy.h"
#include "testing/test.h"

/* ---- the reference: straightforward evaluation ------------------------- */

typedef struct {
    const char *thread;
    const char *tags[4];
    int ntags;
} ctx_t;

static bool ref_rule(const dm_rule_spec_t *r, const ctx_t *c, size_t size, int dt) {
    if (size < r->size_min || size > r->size_max)
        return false;
    if (r->dtypes && (dt == DM_DT_UNKNOWN || dt < 0 || dt >= 32 || !(r->dtypes >> dt & 1)))
        return false;
    bool any = r->nthreads == 0;
    for (int i = 0; i < r->nthreads; i++)
        any |= fnmatch(r->threads[i], c->thread, 0) == 0;
    if (!any)
        return false;
    for (int i = 0; i < r->ntags; i++) {
        bool set = false;
        for (int k = 0; k < c->ntags; k++)
            set |= strcmp(c->tags[k], r->tags[i]) == 0;
        if (!set)
            return false;
    }
    return true;
}

static int ref_lookup(const dm_policy_t *p, const ctx_t *c, size_t size, int dt) {
    for (int i = 0; i < p->nrules; i++)
        if (ref_rule(&p->rules[i], c, size, dt))
            return i;
    return p->nrules;
}

/* ---- random policies ----------------------------------------------------- */

static uint64_t rng_state;
static uint64_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}
static uint64_t rnd_below(uint64_t n) { return rnd() % n; }

static size_t rnd_size(void) {
    static const size_t edge[] = {0, 1, 2, 63, 64, 65, 4095, 4096, 1 << 20, (8u << 20) - 1,
                                  8u << 20, SIZE_MAX / 2, SIZE_MAX - 1, SIZE_MAX};
    return rnd_below(3) ? edge[rnd_below(sizeof edge / sizeof edge[0])]
                        : (size_t)(rnd() >> rnd_below(64));
}

static const char *const globs[] = {"loader-*", "main", "w?rker", "*", "[lm]*", "x"};
static const char *const tagnames[] = {"ingest", "batch", "gpu"};
static const char *const threads[] = {"main", "loader-1", "worker", "lx", "", "x"};

static void rnd_rule(dm_rule_spec_t *r, int i, int narenas) {
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "r%d", i);
    size_t a = rnd_size(), b = rnd_size();
    r->size_min = rnd_below(3) ? (a < b ? a : b) : 0;
    r->size_max = rnd_below(3) ? (a < b ? b : a) : SIZE_MAX;
    if (r->size_min > r->size_max)
        r->size_min = r->size_max;
    if (rnd_below(2))
        r->dtypes = (dm_dtype_mask_t)rnd() & (dm_dtype_mask_t)rnd(); /* any bit, 0 too */
    if (rnd_below(4) == 0)
        for (int k = (int)rnd_below(3); k >= 0; k--)
            snprintf(r->threads[r->nthreads++], DM_NAME_MAX, "%s", globs[rnd_below(6)]);
    if (rnd_below(4) == 0)
        for (int k = (int)rnd_below(2); k >= 0; k--)
            snprintf(r->tags[r->ntags++], DM_NAME_MAX, "%s", tagnames[rnd_below(3)]);
    r->arena = (int)rnd_below((uint64_t)narenas);
}

static dm_policy_t *rnd_policy(int nrules) {
    dm_policy_t *p = calloc(1, sizeof *p);
    p->version = 1;
    p->narenas = 1 + (int)rnd_below(4);
    for (int i = 0; i < p->narenas; i++)
        snprintf(p->arenas[i].name, DM_NAME_MAX, "a%d", i);
    p->default_arena = (int)rnd_below((uint64_t)p->narenas);
    p->fallback_arena = -1;
    p->nrules = nrules;
    p->rules = calloc((size_t)(nrules ? nrules : 1), sizeof *p->rules);
    for (int i = 0; i < nrules; i++)
        rnd_rule(&p->rules[i], i, p->narenas);
    return p;
}

static void rnd_ctx(ctx_t *c) {
    c->thread = threads[rnd_below(6)];
    c->ntags = 0;
    for (int i = 0; i < 3; i++)
        if (rnd_below(2))
            c->tags[c->ntags++] = tagnames[i];
}

/* ---- checks --------------------------------------------------------------- */

static void check_layout(const dm_view_t *v, const dm_table_t *t, const char *why) {
    EXPECT_TRUE(v->nbounds >= 1 && v->bounds[0] == 0, why);
    EXPECT_TRUE(v->nbounds <= 2 * (uint32_t)dm_table_nrules(t) + 1, why);
    for (uint32_t i = 1; i < v->nbounds; i++)
        if (v->bounds[i] <= v->bounds[i - 1])
            TEST_FAIL_("bounds not strictly increasing at %u (%s)", i, why);
    EXPECT_UINT_EQ(v->row_width, dm_table_uses_dtype(t) ? DM_DT_SLOTS : 1, why);
    EXPECT_UINT_EQ(v->dt_mask, v->row_width - 1, why);
}

/* Sizes worth asking a view about: edges, every bound and its neighbours. */
static int probe_sizes(const dm_view_t *v, size_t *out, int cap) {
    int n = 0;
    static const size_t edge[] = {0, 1, 2, SIZE_MAX - 1, SIZE_MAX};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++)
        out[n++] = edge[i];
    for (uint32_t i = 0; i < v->nbounds && n + 3 <= cap; i++) {
        out[n++] = v->bounds[i];
        out[n++] = v->bounds[i] - 1; /* wraps to SIZE_MAX for 0: fine */
        out[n++] = v->bounds[i] + 1;
    }
    while (n < cap)
        out[n++] = rnd_size();
    return n;
}

static long checked;

static void check_view(const dm_policy_t *p, const dm_table_t *t, const ctx_t *c,
                       const char *why) {
    dm_context_t dc = {c->thread, c->tags, c->ntags, NULL, NULL};
    uint64_t key[DM_RULES_MAX / 64 + 1];
    size_t sizes[400];
    char msg[160], expl[1 << 14];
    dm_table_ctx_key(t, &dc, key);
    dm_view_t *v = dm_table_view_build(t, key);
    EXPECT_TRUE(v != NULL, why);
    if (!v)
        return;
    check_layout(v, t, why);
    int n = probe_sizes(v, sizes, 400);
    for (int i = 0; i < n; i++) {
        for (int dt = 0; dt < 32; dt++) {
            int want = ref_lookup(p, c, sizes[i], dt), got = dm_view_lookup(v, sizes[i], dt);
            checked++;
            if (got != want) {
                snprintf(msg, sizeof msg, "%s: size %zu dtype %d thread '%s' ntags %d",
                         why, sizes[i], dt, c->thread, c->ntags);
                EXPECT_INT_EQ(got, want, msg);
                break;
            }
            if (dt < DM_DT_COUNT && i % 7 == 0)
                EXPECT_INT_EQ(dm_table_explain(t, &dc, sizes[i], dt, expl, sizeof expl),
                              want, why);
        }
    }
    dm_view_free(v);
}

static void test_random(void) {
    static const int nrules[] = {0, 1, 2, 3, 5, 8, 13, 30, 64, 100};
    char why[64];
    for (uint64_t seed = 1; seed <= 60; seed++) {
        rng_state = seed * 0x9E3779B97F4A7C15ull;
        dm_policy_t *p = rnd_policy(nrules[seed % 10]);
        dm_table_t *t;
        snprintf(why, sizeof why, "seed %llu", (unsigned long long)seed);
        EXPECT_INT_EQ(dm_table_compile(p, &t), 0, why);
        free(p->rules);
        p->rules = NULL; /* the table must not point into the policy */
        p->nrules = 0;
        const dm_policy_t *tp = dm_table_policy(t);
        for (int k = 0; k < 12; k++) {
            ctx_t c;
            rnd_ctx(&c);
            check_view(tp, t, &c, why);
        }
        EXPECT_INT_EQ(dm_table_rule_arena(t, tp->nrules), tp->default_arena, why);
        EXPECT_INT_EQ(dm_table_rule_arena(t, -1), -1, why);
        dm_table_free(t);
        free(p);
    }
    printf("%ld lookups compared\n", checked);
}

/* ---- fixed cases ---------------------------------------------------------- */

static dm_table_t *compile_yaml(const char *y) {
    static dm_diags_t d;
    dm_policy_t *p;
    dm_table_t *t = NULL;
    char text[4096];
    int rc = dm_policy_parse(y, strlen(y), "c.yaml", NULL, &p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    EXPECT_INT_EQ(rc, 0, text);
    if (p)
        EXPECT_INT_EQ(dm_table_compile(p, &t), 0, "compile");
    dm_policy_free(p);
    return t;
}

static const char policy[] =
    "version: 1\ndefault: general\n"
    "arenas: {general: {}, big: {}, floats: {}, loaders: {}}\n"
    "rules:\n"
    "  - {name: big, match: {size: {min: 8MiB, max: 1GiB}}, arena: big}\n"
    "  - {name: floats, match: {dtype: float32}, arena: floats}\n"
    "  - {name: loaders, match: {thread: loader-*, tag: ingest}, arena: loaders}\n";

static void test_explain(void) {
    dm_table_t *t = compile_yaml(policy);
    char buf[2048];
    const char *tags[] = {"ingest"};
    dm_context_t main_ctx = {"main", NULL, 0, NULL, NULL}, loader = {"loader-3", tags, 1, NULL, NULL};
    if (!t)
        return;
    EXPECT_INT_EQ(dm_table_explain(t, &main_ctx, 1 << 20, DM_DT_FLOAT64, buf, sizeof buf),
                  3, "default");
    EXPECT_STR_EQ(buf,
                  "rule 'big': size 1048576 is below min 8388608\n"
                  "rule 'floats': dtype float64 not in [float32]\n"
                  "rule 'loaders': thread 'main' does not match 'loader-*'; "
                  "tag 'ingest' not set\n"
                  "-> default arena 'general'\n", "explain text");
    EXPECT_INT_EQ(dm_table_explain(t, &loader, 2ull << 30, DM_DT_UNKNOWN, buf, sizeof buf),
                  2, "loaders");
    EXPECT_STR_EQ(buf,
                  "rule 'big': size 2147483648 is above max 1073741824\n"
                  "rule 'floats': dtype unknown not in [float32]\n"
                  "-> rule 'loaders' -> arena 'loaders'\n", "explain match");
    EXPECT_INT_EQ(dm_table_explain(t, NULL, 8 << 20, DM_DT_FLOAT32, buf, 8), 0,
                  "first rule; tiny buffer");
    EXPECT_INT_EQ((int)strlen(buf), 7, "truncated, terminated");

    EXPECT_INT_EQ(dm_table_nrules(t), 3, "nrules");
    EXPECT_INT_EQ(dm_table_narenas(t), 4, "narenas");
    EXPECT_STR_EQ(dm_table_rule_name(t, 1), "floats", "rule name");
    EXPECT_TRUE(dm_table_rule_name(t, 3) == NULL, "default has no rule name");
    EXPECT_STR_EQ(dm_table_arena_name(t, 3), "loaders", "arena name");
    EXPECT_TRUE(dm_table_uses_dtype(t) && dm_table_uses_context(t), "uses");
    EXPECT_INT_EQ(dm_table_ctx_key_words(t), 1, "one context rule");

    int n = dm_table_dump(t, buf, sizeof buf);
    EXPECT_INT_EQ(n, (int)strlen(buf), "dump fits");
    EXPECT_CONTAINS(buf, "  0 big: size [8388608, 1073741824] -> arena big\n", "dump rule");
    EXPECT_CONTAINS(buf, "  2 loaders: size [0, 18446744073709551615], thread "
                         "['loader-*'], tag ['ingest'] -> arena loaders\n", "ctx rule");
    EXPECT_CONTAINS(buf, "view without context: 3 intervals\n"
                         "  [0, 8388607]: (default); floats for float32\n"
                         "  [8388608, 1073741824]: big\n"
                         "  [1073741825, 18446744073709551615]: (default); floats for float32\n",
                   "intervals");
    char small[16];
    EXPECT_INT_EQ(dm_table_dump(t, small, sizeof small), n, "dump length when truncated");
    dm_table_free(t);
}

static void test_views(void) {
    dm_table_t *t = compile_yaml(
        "version: 1\ndefault: a\narenas: {a: {}, b: {}}\n"
        "rules: [{name: top, match: {size: {min: 18446744073709551615}}, arena: b},\n"
        "        {name: zero, match: {size: {max: 0}}, arena: b}]\n");
    if (!t)
        return;
    dm_view_t *v = dm_table_view_build(t, NULL);
    EXPECT_UINT_EQ(v->nbounds, 3, "0, 1, SIZE_MAX");
    EXPECT_UINT_EQ(v->row_width, 1, "no dtype rule: one slot");
    EXPECT_INT_EQ(dm_view_lookup(v, 0, DM_DT_FLOAT64), 1, "zero");
    EXPECT_INT_EQ(dm_view_lookup(v, 1, 5), 2, "default");
    EXPECT_INT_EQ(dm_view_lookup(v, SIZE_MAX - 1, 0), 2, "default");
    EXPECT_INT_EQ(dm_view_lookup(v, SIZE_MAX, 0), 0, "SIZE_MAX is matched");
    EXPECT_INT_EQ(dm_table_rule_arena(t, 2), 0, "default arena");
    dm_view_free(v);
    dm_table_free(t);

    dm_policy_t bad = {.narenas = 1, .nrules = 1, .default_arena = 1};
    dm_table_t *t2 = (dm_table_t *)&bad;
    EXPECT_INT_EQ(dm_table_compile(&bad, &t2), DM_EINVALID, "default out of range");
    EXPECT_TRUE(t2 == NULL, "*out = NULL");
}

/* The dump says "1 rule" / "1 arena", never "1 rules" / "1 arenas". */
static void test_dump_plurals(void) {
    char buf[4096];
    dm_table_t *t = compile_yaml("version: 1\ndefault: a\narenas: {a: {}}\n"
                                 "rules: [{name: r, match: {dtype: float32}, arena: a}]\n");
    if (!t)
        return;
    dm_table_dump(t, buf, sizeof buf);
    EXPECT_CONTAINS(buf, "): 1 arena, 1 rule, 0 context words, dtype yes\n", "singular");
    EXPECT_CONTAINS(buf, "view without context: 1 interval\n", "one interval");
    dm_table_free(t);
}

int main(void) {
    test_dump_plurals();
    test_explain();
    test_views();
    test_random();
    return TEST_EXIT();
}
