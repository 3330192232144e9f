/*
 * schema_test.c: walks every row of schema.def (Redis's "CONFIG sanity"):
 * each key parses with its example value, refuses a value of the wrong type
 * with an "expected ..." error at the key's path, gives the same result when
 * set to its documented default as when left out, is reported missing when
 * required, and appears in the generated reference.
 */
#include <stdlib.h>

#include "policy/internal.h"
#include "policy/policy.h"
#include "policy/schema.h"
#include "testing/test.h"

#define ROW(r) (&dm__schema_rows[r])

static dm_diags_t d;
static char text[1 << 16];

/* True for the rows whose children sit in one arena or one rule. */
static bool is_container(int r) {
    return r == DM_SK_ARENAS || r == DM_SK_RULES || r == DM_SK_TAG_LIMITS;
}

/* The row's top-level ancestor. */
static int top_of(int row) {
    int r = row;
    while (ROW(r)->parent != DM_SK_ROOT)
        r = ROW(r)->parent;
    return r;
}

/* Appends item to a flow collection being built in b. */
static void item(dm__sbuf_t *b, bool *first, const char *s) {
    if (s[0])
        dm__text_sb_printf(b, "%s%s", *first ? "" : ", ", s);
    *first &= !s[0];
}

/* "k1: {k2: {key: value}}" for row inside its arena, rule or the root;
 * "k1: {k2: {}}" when value is NULL. */
static void nested(int row, const char *value, char *out, size_t cap) {
    int chain[16], n = 0;
    dm__sbuf_t b;
    dm__text_sb_init(&b, out, cap);
    for (int r = row; n < 16; r = ROW(r)->parent) {
        chain[n++] = r;
        if (is_container(ROW(r)->parent) || ROW(r)->parent == DM_SK_ROOT)
            break;
    }
    /* without a value the sections around the row stay ("backing: {}"), so a
     * required key inside one is missing there; the row's required siblings
     * in such a section come with their examples */
    for (int i = n - 1; i > 0; i--)
        dm__text_sb_printf(&b, "%s: {", ROW(chain[i])->key);
    for (int r = 1; n > 1 && r < DM_SK_COUNT; r++)
        if (r != row && ROW(r)->parent == ROW(row)->parent && (ROW(r)->flags & DM_SF_REQUIRED))
            dm__text_sb_printf(&b, "%s: %s%s", ROW(r)->key, ROW(r)->example, value ? ", " : "");
    if (value)
        dm__text_sb_printf(&b, "%s: %s", ROW(row)->key, value);
    dm__text_sb_putc(&b, '}', (size_t)n - 1);
    dm__text_sb_done(&b);
}

/* A whole policy (flow syntax) with `row` set to `value`, or left out when
 * value is NULL; everything else minimal: arenas general and spare, one rule
 * when the row is inside a rule. */
static void policy_with(int row, const char *value, char *out, size_t cap) {
    char in[1024], sub[1200];
    int top = top_of(row), r = row;
    bool first = true, sfirst = true;
    dm__sbuf_t b, sb;
    while (!is_container(ROW(r)->parent) && ROW(r)->parent != DM_SK_ROOT)
        r = ROW(r)->parent;
    nested(row, value, in, sizeof in);
    dm__text_sb_init(&b, out, cap);
    dm__text_sb_init(&sb, sub, sizeof sub);
    dm__text_sb_printf(&b, "{");
    item(&b, &first, top == DM_SK_VERSION ? "" : "version: 1");
    item(&b, &first, top == DM_SK_DEFAULT ? "" : "default: general");
    if (ROW(r)->parent == DM_SK_ARENAS) {
        dm__text_sb_printf(&sb, "arenas: {general: {%s}, spare: {}}", in);
    } else {
        item(&b, &first, top == DM_SK_ARENAS ? "" : "arenas: {general: {}, spare: {}}");
        if (ROW(r)->parent == DM_SK_RULES) {
            dm__text_sb_printf(&sb, "rules: [{");
            item(&sb, &sfirst, row == DM_SK_RULE_NAME ? "" : "name: r0");
            item(&sb, &sfirst, row == DM_SK_RULE_ARENA ? "" : "arena: general");
            item(&sb, &sfirst, in);
            dm__text_sb_printf(&sb, "}]");
        } else if (ROW(r)->parent == DM_SK_TAG_LIMITS) {
            dm__text_sb_printf(&sb, "tag_limits: [{");
            item(&sb, &sfirst, row == DM_SK_TAG_LIMIT_TAG ? "" : "tag: \"t*\"");
            item(&sb, &sfirst, row == DM_SK_TAG_LIMIT_LIMIT ? "" : "limit: 1MiB");
            item(&sb, &sfirst, in);
            dm__text_sb_printf(&sb, "}]");
        } else {
            dm__text_sb_printf(&sb, "%s", in);
        }
    }
    dm__text_sb_done(&sb);
    item(&b, &first, sub);
    dm__text_sb_printf(&b, "}");
    dm__text_sb_done(&b);
}

/* The diagnostic path of a row as the policy above reports it. */
static void diag_path(int row, char *out, size_t cap) {
    char p[128], *s;
    dm__schema_path(row, p, sizeof p);
    if ((s = strstr(p, ".<name>")))
        snprintf(out, cap, "%.*s.general%s", (int)(s - p), p, s + 7);
    else if ((s = strstr(p, "[]")))
        snprintf(out, cap, "%.*s[0]%s", (int)(s - p), p, s + 2);
    else
        snprintf(out, cap, "%s", p);
}

static int parse(const char *yaml, dm_policy_t **p) {
    int rc = dm_policy_parse(yaml, strlen(yaml), "s.yaml", NULL, p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    return rc;
}

/* As `check` parses: with the advice for a policy's author (DM_PARSE_LINT). */
static int parse_lint(const char *yaml, dm_policy_t **p) {
    int rc = dm_policy_parse_ex(yaml, strlen(yaml), "s.yaml", NULL, DM_PARSE_LINT, p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    return rc;
}

/* The row's example is valid and draws no warning from `check` either: the
 * reference shows it as the way to write the key (`thread: ["loader-*"]` drew
 * "matches no thread of ThreadPoolExecutor(thread_name_prefix='loader')"). */
static void check_example(int row, const char *id) {
    char y[2048], path[128];
    dm_policy_t *p;
    policy_with(row, ROW(row)->example, y, sizeof y);
    EXPECT_INT_EQ(parse_lint(y, &p), 0, id);
    diag_path(row, path, sizeof path);
    /* Warnings about the minimal policy around the row are not the example's:
     * its `spare` arena is plain (no user, no backing) and it has no
     * worker_limit. */
    int own = 0;
    for (int i = 0; i < d.n; i++)
        own += d.items[i].severity == DM_SEV_WARNING &&
               strncmp(d.items[i].path, path, strlen(path)) == 0 &&
               !strstr(d.items[i].msg, "'spare'") &&
               !strstr(d.items[i].msg, "without worker_limit");
    EXPECT_INT_EQ(own, 0, id);
    if (d.nerrors || own)
        fprintf(stderr, "  policy: %s\n%s", y, text);
    dm_policy_free(p);
}

/* A list row holds dm__schema_list_cap entries and refuses one more, saying
 * how many; the reference's Accepted cell gives the same number (it said "up
 * to 16" of module and function globs, where the parser took at most 4). */
static void check_list_cap(int row, const char *id, const char *doc) {
    int cap = dm__schema_list_cap(row);
    if (!cap)
        return;
    char y[4096], list[2048], path[128], want[256];
    for (int n = cap; n <= cap + 1; n++) {
        dm__sbuf_t b;
        dm__text_sb_init(&b, list, sizeof list);
        dm__text_sb_printf(&b, "[");
        for (int i = 0; i < n; i++)
            dm__text_sb_printf(&b, "%sx%d", i ? ", " : "", i);
        dm__text_sb_printf(&b, "]");
        dm__text_sb_done(&b);
        policy_with(row, list, y, sizeof y);
        dm_policy_t *p = NULL;
        int rc = parse(y, &p);
        snprintf(want, sizeof want, "too many entries: at most %d", cap);
        if (n == cap) {
            EXPECT_INT_EQ(rc, 0, id);
        } else {
            EXPECT_INT_EQ(rc, DM_EINVALID, id);
            EXPECT_CONTAINS(text, want, id);
        }
        dm_policy_free(p);
    }
    dm__schema_path(row, path, sizeof path);
    snprintf(want, sizeof want, "| `%s` | %s | `[]` | up to %d, each ", path,
             dm__schema_stype_info[ROW(row)->type].name, cap);
    EXPECT_CONTAINS(doc, want, id);
}

static void check_wrong_type(int row, const char *id) {
    char y[2048], path[128], want[256];
    dm_policy_t *p;
    policy_with(row, dm__schema_stype_info[ROW(row)->type].wrong, y, sizeof y);
    EXPECT_INT_EQ(parse(y, &p), DM_EINVALID, id);
    diag_path(row, path, sizeof path);
    snprintf(want, sizeof want, "expected %s, got ", dm__schema_stype_info[ROW(row)->type].expected);
    bool found = false;
    for (int i = 0; i < d.n; i++)
        found |= strcmp(d.items[i].path, path) == 0 && strstr(d.items[i].msg, want);
    EXPECT_TRUE(found, id);
    if (!found)
        fprintf(stderr, "  policy: %s\n  wanted at %s: %s\n%s", y, path, want, text);
    dm_policy_free(p);
}

/* The section struct a row's field is in. */
static const char *section(const dm_policy_t *p, int row) {
    switch (dm__schema_sect(row)) {
    case DM_SECT_ARENA:
        return (const char *)&p->arenas[0];
    case DM_SECT_RULE:
        return (const char *)&p->rules[0];
    case DM_SECT_TAG_LIMIT:
        return (const char *)&p->tag_limits[0];
    default:
        return (const char *)p;
    }
}

static void check_default(int row, const char *id) {
    char y1[2048], y2[2048];
    dm_policy_t *set = NULL, *unset = NULL;
    const dm__schema_row_t *r = ROW(row);
    if (!r->dflt || !r->size)
        return;
    policy_with(row, r->dflt[0] ? r->dflt : "\"\"", y1, sizeof y1);
    policy_with(row, NULL, y2, sizeof y2);
    EXPECT_INT_EQ(parse(y1, &set), 0, id);
    EXPECT_INT_EQ(parse(y2, &unset), 0, id);
    if (set && unset)
        EXPECT_TRUE(memcmp(section(set, row) + r->off, section(unset, row) + r->off,
                           r->size) == 0, id);
    dm_policy_free(set);
    dm_policy_free(unset);
}

static void check_required(int row, const char *id) {
    char y[2048], want[128];
    dm_policy_t *p;
    if (!(ROW(row)->flags & DM_SF_REQUIRED))
        return;
    policy_with(row, NULL, y, sizeof y);
    EXPECT_INT_EQ(parse(y, &p), DM_EINVALID, id);
    snprintf(want, sizeof want, "missing required key '%s'", ROW(row)->key);
    EXPECT_CONTAINS(text, want, id);
}

static void check_row_shape(int row, const char *id) {
    const dm__schema_row_t *r = ROW(row);
    EXPECT_TRUE(r->key && r->doc && r->doc[0] && r->example, id);
    EXPECT_TRUE(r->parent < row || row == DM_SK_ROOT, "parents come first");
    EXPECT_TRUE(dm__schema_child(r->parent, r->key, strlen(r->key)) == row, id);
    if (r->type == DM_ST_ENUM)
        EXPECT_TRUE(r->enums && dm__schema_enum_index(r->enums, r->dflt) >= 0, id);
}

int main(void) {
    char *doc = NULL, path[128], want[160];
    size_t doclen = 0;
    FILE *f = open_memstream(&doc, &doclen);
    EXPECT_INT_EQ(dm__reference_write(f), 0, "reference");
    fclose(f);
    for (int row = 1; row < DM_SK_COUNT; row++) {
        const char *id = ROW(row)->id;
        check_row_shape(row, id);
        check_example(row, id);
        check_wrong_type(row, id);
        check_default(row, id);
        check_required(row, id);
        check_list_cap(row, id, doc);
        dm__schema_path(row, path, sizeof path);
        snprintf(want, sizeof want, "| `%s` | %s |", path,
                 dm__schema_stype_info[ROW(row)->type].name);
        EXPECT_CONTAINS(doc, want, id);
    }
    /* the root: one mapping */
    dm_policy_t *p;
    EXPECT_INT_EQ(parse("[1]", &p), DM_EINVALID, "root list");
    EXPECT_CONTAINS(text, "s.yaml:1:1: error: expected a mapping, got a list", "root");
    EXPECT_CONTAINS(doc, dm__schema_example, "the example is in the reference");
    EXPECT_INT_EQ(parse_lint(dm__schema_example, &p), 0, "the example");
    EXPECT_INT_EQ(d.nwarnings, 0, "the example draws no warning from check");
    if (d.n)
        fprintf(stderr, "%s", text);
    dm_policy_free(p);
    free(doc);
    return TEST_EXIT();
}
