/*
 * parse.c: walks the YAML tree along the schema table and fills a dm_policy_t.
 *
 * Nothing here names a key: every mapping is read against the rows of
 * schema.def whose parent it is, and every value is converted by its row's
 * type. Errors go to the diagnostics and the walk goes on, so that one pass
 * reports everything; arena names are only recorded here and resolved by
 * validate.c once every arena is known. A rule's match lists are read by
 * parse_match.c. Reentrant: all state is in dm__pctx_t.
 */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "policy/internal.h"
#include "policy/schema.h"

#define ROW(r) (&dm__schema_rows[r])
#define NODE(c, i) dm__ynode((c)->yt, (i))
#define TEXT(c, i) dm__ytext((c)->yt, (i))
#define WHY_MAX 384

typedef void parse_fn(dm__pctx_t *c, int row, int node, void *sect);

/* ---- reporting ---------------------------------------------------------- */

void dm__parse_report(dm__pctx_t *c, dm_severity_t sev, int node, const char *fmt, ...) {
    const dm__ynode_t *n = node >= 0 ? NODE(c, node) : NULL;
    va_list ap;
    va_start(ap, fmt);
    dm__diag_vadd(c->ds, sev, n ? n->line : 0, n ? n->col : 0, c->path, fmt, ap);
    va_end(ap);
}
#define ERR(c, node, ...) dm__parse_report((c), DM_SEV_ERROR, (node), __VA_ARGS__)
#define NOTE(c, node, ...) dm__parse_report((c), DM_SEV_NOTE, (node), __VA_ARGS__)

static size_t path_push(dm__pctx_t *c, const char *fmt, ...) DM__PRINTF(2, 3);
static size_t path_push(dm__pctx_t *c, const char *fmt, ...) {
    size_t old = c->plen;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->path + old, sizeof c->path - old, fmt, ap);
    va_end(ap);
    c->plen = strlen(c->path);
    return old;
}

static void path_pop(dm__pctx_t *c, size_t old) {
    c->plen = old;
    c->path[old] = '\0';
}

static size_t path_push_key(dm__pctx_t *c, const char *key) {
    return path_push(c, c->plen ? ".%s" : "%s", key);
}

/* ---- what a scalar looks like ------------------------------------------- */

static bool parse_i64(const char *s, int64_t *v) {
    bool neg = *s == '-';
    uint64_t u = 0;
    s += neg;
    if (!*s)
        return false;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || u > (UINT64_MAX - 9) / 10)
            return false;
        u = u * 10 + (uint64_t)(*s - '0');
    }
    if (u > (uint64_t)INT64_MAX + neg)
        return false;
    *v = neg ? (int64_t)(0 - u) : (int64_t)u;
    return true;
}

/* "a string 'x'", "an integer 5", "a boolean yes", "null". */
static const char *describe_scalar(const char *s, bool quoted, char *buf,
                                   size_t cap) {
    char q[DM__QUOTE_CAP];
    int64_t v;
    bool b;
    dm__text_quote(q, sizeof q, s, strlen(s));
    if (!quoted && dm__units_yaml_null(s))
        snprintf(buf, cap, "null");
    else if (!quoted && dm__units_bool_parse(s, &b) == 0)
        snprintf(buf, cap, "a boolean %s", s);
    else if (!quoted && parse_i64(s, &v))
        snprintf(buf, cap, "an integer %s", s);
    else
        snprintf(buf, cap, "a string %s", q);
    return buf;
}

static const char *describe(dm__pctx_t *c, int node, char *buf, size_t cap) {
    const dm__ynode_t *n = NODE(c, node);
    if (n->kind != DM_YN_SCALAR)
        return n->kind == DM_YN_MAP ? "a mapping" : "a list";
    return describe_scalar(TEXT(c, node), n->quoted, buf, cap);
}

static void expect_error(dm__pctx_t *c, const char *expected, int node) {
    char d[DM__QUOTE_CAP + 16];
    ERR(c, node, "expected %s, got %s", expected, describe(c, node, d, sizeof d));
}

static void type_error(dm__pctx_t *c, int row, int node) {
    expect_error(c, dm__schema_stype_info[ROW(row)->type].expected, node);
}

static bool is_null(dm__pctx_t *c, int node) {
    const dm__ynode_t *n = NODE(c, node);
    return n->kind == DM_YN_SCALAR && !n->quoted && dm__units_yaml_null(TEXT(c, node));
}

/* The node's text when it is a scalar that is not null; else a type error. */
const char *dm__parse_scalar_of(dm__pctx_t *c, int row, int node) {
    if (NODE(c, node)->kind != DM_YN_SCALAR || is_null(c, node)) {
        type_error(c, row, node);
        return NULL;
    }
    return TEXT(c, node);
}

/* ---- scalar conversion (user values and schema defaults alike) ---------- */

static void store(void *sect, const dm__schema_row_t *r, uint64_t v) {
    char *f = (char *)sect + r->off;
    if (r->size == 1) {
        bool b = v != 0;
        memcpy(f, &b, 1);
    } else if (r->size == 4) {
        uint32_t x = (uint32_t)v;
        memcpy(f, &x, 4);
    } else if (r->size == 8) {
        memcpy(f, &v, 8);
    }
}

static int why_fail(char *why, const char *fmt, ...) DM__PRINTF(2, 3);
static int why_fail(char *why, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, WHY_MAX, fmt, ap);
    va_end(ap);
    return -1;
}

static int range_error(const dm__schema_row_t *r, const char *s, char *why) {
    const char *unit = r->type == DM_ST_DURATION ? " milliseconds" : "";
    const char *never = (r->flags & DM_SF_NEVER) ? ", or never" : "";
    if (r->min == r->max)
        return why_fail(why, "must be %llu, got %s", (unsigned long long)r->min, s);
    return why_fail(why, "%s is out of range: must be between %llu and %llu%s "
                    "inclusive%s", s, (unsigned long long)r->min,
                    (unsigned long long)r->max, unit, never);
}

static bool out_of_range(const dm__schema_row_t *r, uint64_t v) {
    return (r->min || r->max) && (v < r->min || v > r->max);
}

static int conv_int(const dm__schema_row_t *r, const char *s, bool quoted,
                    void *sect, char *why) {
    int64_t v;
    char d[DM__QUOTE_CAP + 16];
    if (quoted || !parse_i64(s, &v))
        return why_fail(why, "expected an integer, got %s",
                        describe_scalar(s, quoted, d, sizeof d));
    if (v < 0 || out_of_range(r, (uint64_t)v))
        return range_error(r, s, why);
    store(sect, r, (uint64_t)v);
    return 0;
}

/* Sizes and durations: the unit parsers' verdict, then bounds. */
static int conv_measure(const dm__schema_row_t *r, const char *s, void *sect,
                        char *why) {
    bool is_size = r->type == DM_ST_SIZE;
    size_t sz = 0;
    int64_t ms = 0;
    char q[DM__QUOTE_CAP];
    int rc = is_size ? dm_parse_size(s, &sz) : dm_parse_duration_ms(s, &ms);
    uint64_t v = is_size ? (uint64_t)sz : (uint64_t)ms;
    bool never = !is_size && ms < 0;
    if (is_size && (r->flags & DM_SF_NEVER) && strcmp(s, "never") == 0) {
        store(sect, r, UINT64_MAX); /* a size that is never reached */
        return 0;
    }
    dm__text_quote(q, sizeof q, s, strlen(s));
    if (rc == DM_ERANGE)
        return why_fail(why, "%s %s is too large%s", is_size ? "size" : "duration",
                        q, is_size ? " (at most 18446744073709551615 bytes)" : "");
    if (rc && is_size)
        return why_fail(why, "invalid size %s: expected bytes (e.g. 4096) "
                        "or a number and a unit (" DM_SIZE_UNIT_NAMES "; 1.5GiB: a "
                        "fraction must come to whole bytes)%s", q,
                        (r->flags & DM_SF_NEVER) ? ", or never" : "");
    if (rc)
        return why_fail(why, "invalid duration %s: expected milliseconds "
                        "(e.g. 250) or a number and a unit (" DM_DURATION_UNIT_NAMES
                        "), whole milliseconds%s", q,
                        (r->flags & DM_SF_NEVER) ? ", or never" : "");
    if (never ? !(r->flags & DM_SF_NEVER) : out_of_range(r, v))
        return range_error(r, s, why);
    if ((r->flags & DM_SF_POW2) && (v & (v - 1)))
        return why_fail(why, "%s is not a power of two", s);
    store(sect, r, v);
    return 0;
}

static int conv_bool(const dm__schema_row_t *r, const char *s, bool quoted,
                     void *sect, char *why) {
    bool b;
    char d[DM__QUOTE_CAP + 16];
    if (quoted || dm__units_bool_parse(s, &b))
        return why_fail(why, "expected a boolean (true/false, yes/no, "
                        "on/off), got %s", describe_scalar(s, quoted, d, sizeof d));
    store(sect, r, b);
    return 0;
}

static bool hostport_valid(const char *s) {
    const char *colon = strrchr(s, ':');
    int64_t port;
    if (!*s)
        return true;
    if (!colon || colon == s || !parse_i64(colon + 1, &port) || colon[1] == '-')
        return false;
    return port >= 0 && port <= 65535;
}

static int conv_string(const dm__schema_row_t *r, const char *s, void *sect,
                       char *why) {
    size_t len = strlen(s), max = r->max ? r->max : r->size - 1;
    char q[DM__QUOTE_CAP];
    dm__text_quote(q, sizeof q, s, len);
    if (len > max || len >= r->size)
        return why_fail(why, "%s is %zu bytes long; at most %zu allowed",
                        q, len, max);
    if (r->type == DM_ST_HOSTPORT && !hostport_valid(s))
        return why_fail(why, "invalid address %s: expected host:port with "
                        "a port from 0 to 65535, or \"\" for off", q);
    const char *gwhy = NULL;
    if (r->type == DM_ST_GLOB && !dm_glob_valid(s, NULL, &gwhy))
        return why_fail(why, "invalid glob %s: %s", q, gwhy);
    uint64_t share_bytes;
    unsigned share_pm;
    int src = r->type == DM_ST_SHARE ? dm_parse_share(s, &share_bytes, &share_pm) : 0;
    if (src == DM_ERANGE)
        return why_fail(why, "%s is out of range: a share is 0.1%% to 100%%, a size "
                        "at most 18446744073709551615 bytes", q);
    if (src)
        return why_fail(why, "invalid value %s: expected a size of at least 1 byte "
                        "(e.g. 8GiB), a share of the memory limit (e.g. 85%% or "
                        "92.5%%), or \"\" for none", q);
    if (r->type == DM_ST_NAME && !dm__units_name_valid(s))
        return why_fail(why, "invalid name %s: names match "
                        "[A-Za-z_][A-Za-z0-9_-]* and are 1 to %d bytes", q,
                        DM_NAME_MAX - 1);
    memcpy((char *)sect + r->off, s, len + 1);
    return 0;
}

/* The enum value nearest to `s`, or NULL: a YAML 1.1 boolean (yes, true, no,
 * false, y, n; any case) means on or off where the row has them, anything
 * else the closest spelling, as for keys. */
static const char *enum_nearest(const char *enums, const char *s, char *buf, size_t cap) {
    static const char *const yes[] = {"yes", "y", "true", "on"};
    static const char *const no[] = {"no", "n", "false", "off"};
    for (size_t k = 0; k < sizeof yes / sizeof *yes; k++) {
        if (strcasecmp(s, yes[k]) == 0 && dm__schema_enum_index(enums, "on") >= 0)
            return "on";
        if (strcasecmp(s, no[k]) == 0 && dm__schema_enum_index(enums, "off") >= 0)
            return "off";
    }
    const char *cands[16];
    int n = 0;
    size_t used = 0;
    for (const char *e = enums; e && *e && n < 16;) {
        size_t len = strcspn(e, "|");
        if (used + len + 1 > cap)
            break;
        memcpy(buf + used, e, len);
        buf[used + len] = '\0';
        cands[n++] = buf + used;
        used += len + 1;
        e += len + (e[len] == '|');
    }
    return dm__text_nearest(s, cands, n);
}

static int conv_enum(const dm__schema_row_t *r, const char *s, void *sect,
                     char *why) {
    char q[DM__QUOTE_CAP], list[128], names[128];
    int i = dm__schema_enum_index(r->enums, s);
    dm__schema_enum_list(r->enums, list, sizeof list);
    if (i < 0) {
        const char *near = enum_nearest(r->enums, s, names, sizeof names);
        dm__text_quote(q, sizeof q, s, strlen(s));
        if (near)
            return why_fail(why, "invalid value %s (did you mean '%s'?); accepted values "
                            "are %s", q, near, list);
        return why_fail(why, "invalid value %s; accepted values are %s", q, list);
    }
    store(sect, r, (uint64_t)i);
    return 0;
}

/* numa as a scalar: only the modes that take no nodes. */
static int conv_numa(const dm__schema_row_t *r, const char *s, void *sect,
                     char *why) {
    char q[DM__QUOTE_CAP];
    int i = dm__schema_enum_index(r->enums, s);
    if (i == DM_NUMA_NONE || i == DM_NUMA_LOCAL) {
        store(sect, r, (uint64_t)i);
        return 0;
    }
    if (i > DM_NUMA_LOCAL)
        return why_fail(why, "%s needs nodes: write {%s: [0, 1]}", s, s);
    return why_fail(why, "invalid value %s; accepted values are none, "
                    "local, or a mapping with one of bind, interleave, preferred",
                    dm__text_quote(q, sizeof q, s, strlen(s)));
}

/* Converts scalar text for row r into sect; -1 with `why` on failure. Only
 * for the types scalar_type() accepts. */
static int convert(const dm__schema_row_t *r, const char *s, bool quoted,
                   void *sect, char *why) {
    switch (r->type) {
    case DM_ST_INT:
        return conv_int(r, s, quoted, sect, why);
    case DM_ST_SIZE:
    case DM_ST_DURATION:
        return conv_measure(r, s, sect, why);
    case DM_ST_BOOL:
        return conv_bool(r, s, quoted, sect, why);
    case DM_ST_ENUM:
        return conv_enum(r, s, sect, why);
    case DM_ST_NUMA:
        return conv_numa(r, s, sect, why);
    case DM_ST_ARENA_REF: /* only "" gets here: no arena */
        store(sect, r, (uint64_t)(int64_t)-1);
        return 0;
    default:
        return conv_string(r, s, sect, why);
    }
}

static bool scalar_type(dm__stype_t t) {
    return t == DM_ST_INT || t == DM_ST_SIZE || t == DM_ST_DURATION ||
           t == DM_ST_BOOL || t == DM_ST_STRING || t == DM_ST_HOSTPORT ||
           t == DM_ST_ENUM || t == DM_ST_NAME || t == DM_ST_NUMA ||
           t == DM_ST_ARENA_REF || t == DM_ST_GLOB || t == DM_ST_SHARE;
}

/* Fills the defaults of every scalar row of one section (the rest is zero). */
static void apply_defaults(dm__sect_t kind, void *sect) {
    char why[WHY_MAX];
    for (int r = 1; r < DM_SK_COUNT; r++) {
        const dm__schema_row_t *row = ROW(r);
        if (row->dflt && row->size && scalar_type(row->type) &&
            dm__schema_sect(r) == kind)
            (void)convert(row, row->dflt, false, sect, why); /* schema_test
                                                               checks these */
    }
}

/* ---- mappings ------------------------------------------------------------ */

static void parse_value(dm__pctx_t *c, int row, int node, void *sect);

static void unknown_key(dm__pctx_t *c, int prow, int key) {
    const char *cands[32];
    char q[DM__QUOTE_CAP], list[256];
    int n = 0;
    dm__sbuf_t b;
    dm__text_sb_init(&b, list, sizeof list);
    for (int r = 1; r < DM_SK_COUNT && n < 32; r++) {
        if (ROW(r)->parent == prow) {
            dm__text_sb_printf(&b, "%s%s", n ? ", " : "", ROW(r)->key);
            cands[n++] = ROW(r)->key;
        }
    }
    dm__text_sb_done(&b);
    const char *k = TEXT(c, key), *near = dm__text_nearest(k, cands, n);
    dm__text_quote(q, sizeof q, k, strlen(k));
    if (near)
        ERR(c, key, "unknown key %s (did you mean '%s'?)", q, near);
    else
        ERR(c, key, "unknown key %s; accepted keys are %s", q, list);
}

/* Reads a mapping against the children of `prow`; returns the keys read. */
static int walk_map(dm__pctx_t *c, int prow, int node, void *sect) {
    int seen[DM_SK_COUNT], nseen = 0;
    const dm__ynode_t *n = NODE(c, node);
    for (int r = 0; r < DM_SK_COUNT; r++)
        seen[r] = -1;
    if (n->kind != DM_YN_MAP && !is_null(c, node)) {
        /* an arena's or a rule's body: the row is the container's */
        if (prow == DM_SK_ARENAS || prow == DM_SK_RULES || prow == DM_SK_TAG_LIMITS)
            expect_error(c, "a mapping", node);
        else
            type_error(c, prow, node);
        return 0;
    }
    for (int k = n->first; k >= 0; k = NODE(c, NODE(c, k)->next)->next) {
        int v = NODE(c, k)->next, row;
        char d[DM__QUOTE_CAP + 16];
        if (NODE(c, k)->kind != DM_YN_SCALAR) {
            ERR(c, k, "a key must be a string, got %s", describe(c, k, d, sizeof d));
        } else if ((row = dm__schema_child(prow, TEXT(c, k), NODE(c, k)->len)) < 0) {
            unknown_key(c, prow, k);
        } else if (seen[row] >= 0) {
            ERR(c, k, "duplicate key '%s'", ROW(row)->key);
            NOTE(c, seen[row], "'%s' first defined here", ROW(row)->key);
        } else {
            size_t old = path_push_key(c, ROW(row)->key);
            seen[row] = k, nseen++;
            if (row == DM_SK_BACKING_DIR) { /* where a directory's error points */
                dm_backing_spec_t *b = &((dm_arena_spec_t *)sect)->backing;
                b->line = NODE(c, k)->line, b->col = NODE(c, k)->col;
            }
            parse_value(c, row, v, sect);
            path_pop(c, old);
        }
    }
    for (int r = 1; r < DM_SK_COUNT; r++)
        if (ROW(r)->parent == prow && (ROW(r)->flags & DM_SF_REQUIRED) &&
            seen[r] < 0)
            ERR(c, node, "missing required key '%s'", ROW(r)->key);
    return nseen;
}

static void parse_map(dm__pctx_t *c, int row, int node, void *sect) {
    walk_map(c, row, node, sect);
}

/* ---- legal but probably not meant --------------------------------------- */

/* "4000000" -> "4,000,000". */
static void with_commas(uint64_t v, char *buf, size_t cap) {
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%llu", (unsigned long long)v), o = 0;
    for (int i = 0; i < n && (size_t)o + 2 < cap; i++) {
        if (i && (n - i) % 3 == 0)
            buf[o++] = ',';
        buf[o++] = digits[i];
    }
    buf[o] = '\0';
}

/* A size in a decimal unit (4MB = 4,000,000 bytes) where the binary one
 * (4MiB) was almost certainly meant: allocation sizes, alignments and page
 * budgets all come in powers of two. The units come from DM_SIZE_UNITS: a
 * unit whose multiple is a power of 1000 is decimal, "XB" pairs with "XiB". */
static void warn_decimal_size(dm__pctx_t *c, int node, const char *s) {
    static const struct {
        const char *suffix;
        uint64_t mult;
    } units[] = {
#define DM_UNIT_ROW(suffix, mult) {suffix, mult},
        DM_SIZE_UNITS(DM_UNIT_ROW)
#undef DM_UNIT_ROW
    };
    const char *u = s;
    uint64_t v = 0;
    while (*u >= '0' && *u <= '9')
        v = v * 10 + (uint64_t)(*u++ - '0'); /* bounded: the value parsed */
    while (*u == ' ')
        u++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(u, units[i].suffix) != 0 || units[i].mult % 1000 || v == 0)
            continue;
        char bytes[32];
        with_commas(v * units[i].mult, bytes, sizeof bytes);
        dm__parse_report(c, DM_SEV_WARNING, node, "%s is %s bytes; did you mean %.*s%.*siB? "
               "(write %llu to keep decimal bytes)", s, bytes, (int)(u - s), s,
               (int)strlen(u) - 1, u, (unsigned long long)(v * units[i].mult));
        return;
    }
}

/* A duration written as a bare number: "dirty: 10" is 10 milliseconds, where
 * 10 seconds is the likelier intent. 0 and -1 (never) mean the same in any
 * unit, so they pass. */
static void warn_bare_duration(dm__pctx_t *c, int node, const char *s) {
    const char *d = s;
    while (*d >= '0' && *d <= '9')
        d++;
    if (d == s || *d || strspn(s, "0") == strlen(s))
        return;
    size_t n = strlen(s);
    if (n > 3 && strcmp(s + n - 3, "000") == 0) /* whole seconds */
        dm__parse_report(c, DM_SEV_WARNING, node, "%s is read as %s ms; write %sms or %.*ss",
               s, s, s, (int)n - 3, s);
    else
        dm__parse_report(c, DM_SEV_WARNING, node, "%s is read as %s ms; write %sms, or %ss "
               "if you meant seconds", s, s, s, s);
}

static void parse_scalar(dm__pctx_t *c, int row, int node, void *sect) {
    char why[WHY_MAX];
    const char *s = dm__parse_scalar_of(c, row, node);
    if (!s)
        return;
    if (convert(ROW(row), s, NODE(c, node)->quoted, sect, why))
        ERR(c, node, "%s", why);
    else if (ROW(row)->type == DM_ST_SIZE)
        warn_decimal_size(c, node, s);
    else if (ROW(row)->type == DM_ST_DURATION)
        warn_bare_duration(c, node, s);
}

static void parse_arena_ref(dm__pctx_t *c, int row, int node, void *sect) {
    const char *s = dm__parse_scalar_of(c, row, node);
    if (!s)
        return;
    if (!*s) {
        if (ROW(row)->flags & DM_SF_REQUIRED)
            ERR(c, node, "expected an arena name, got an empty string");
        else
            convert(ROW(row), s, true, sect, NULL);
        return;
    }
    size_t cap = (size_t)c->refcap;
    if (c->nrefs == c->refcap) {
        cap = cap ? cap * 2 : 16;
        dm__aref_t *r = realloc(c->refs, cap * sizeof *r);
        if (!r) {
            c->nomem = true;
            return;
        }
        c->refs = r, c->refcap = (int)cap;
    }
    dm__aref_t *ref = &c->refs[c->nrefs++];
    ref->dst = (int *)((char *)sect + ROW(row)->off);
    ref->node = node;
    snprintf(ref->path, sizeof ref->path, "%s", c->path);
}

static void parse_numa(dm__pctx_t *c, int row, int node, void *sect) {
    if (NODE(c, node)->kind == DM_YN_MAP) {
        int k = walk_map(c, row, node, sect);
        if (k > 1 || NODE(c, node)->n == 0)
            ERR(c, node, "give exactly one of bind, interleave, preferred");
        return;
    }
    parse_scalar(c, row, node, sect);
}

static void parse_size_range(dm__pctx_t *c, int row, int node, void *sect) {
    const dm_rule_spec_t *r = sect;
    walk_map(c, row, node, sect);
    if (r->size_min > r->size_max)
        ERR(c, node, "empty size range: min %zu is greater than max %zu",
            r->size_min, r->size_max);
}

/* ---- NUMA nodes ---------------------------------------------------------- */

/* "0-1,4" for a node mask. */
static void format_nodes(uint64_t m, char *buf, size_t cap) {
    dm__sbuf_t b;
    dm__text_sb_init(&b, buf, cap);
    for (int i = 0; i < 64; i++) {
        if (!(m >> i & 1))
            continue;
        int j = i;
        while (j + 1 < 64 && (m >> (j + 1) & 1))
            j++;
        dm__text_sb_printf(&b, b.len ? ",%d" : "%d", i);
        if (j > i)
            dm__text_sb_printf(&b, "-%d", j);
        i = j;
    }
    if (!b.len)
        dm__text_sb_printf(&b, "none");
    dm__text_sb_done(&b);
}

static void parse_node_number(dm__pctx_t *c, int row, int node, uint64_t *mask) {
    const dm__schema_row_t *r = ROW(row);
    const char *s = dm__parse_scalar_of(c, row, node);
    int64_t v;
    char have[256];
    if (!s)
        return;
    if (NODE(c, node)->quoted || !parse_i64(s, &v)) {
        expect_error(c, "a node number", node);
    } else if (v < 0 || out_of_range(r, (uint64_t)v)) {
        ERR(c, node, "node %s is out of range: must be between %llu and %llu "
            "inclusive", s, (unsigned long long)r->min, (unsigned long long)r->max);
    } else if (c->topo && !(c->topo->nodes >> v & 1)) {
        format_nodes(c->topo->nodes, have, sizeof have);
        ERR(c, node, "node %s does not exist (this machine has %s)", s, have);
    } else {
        *mask |= 1ull << v;
    }
}

static void parse_nodes(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__schema_row_t *r = ROW(row), *mode = ROW(r->parent);
    dm_arena_spec_t *a = sect;
    const dm__ynode_t *n = NODE(c, node);
    uint64_t mask = 0;
    store(sect, mode, (uint64_t)dm__schema_enum_index(mode->enums, r->key));
    if (n->kind == DM_YN_SCALAR && r->enums &&
        dm__schema_enum_index(r->enums, TEXT(c, node)) >= 0) {
        a->numa_all = true;
    } else if (n->kind == DM_YN_SEQ && !(r->flags & DM_SF_SINGLE)) {
        if (n->n == 0)
            ERR(c, node, "expected at least one node");
        for (int i = n->first; i >= 0; i = NODE(c, i)->next)
            parse_node_number(c, row, i, &mask);
    } else if (n->kind == DM_YN_SCALAR) {
        parse_node_number(c, row, node, &mask);
    } else {
        type_error(c, row, node);
    }
    store(sect, r, mask);
}

/* ---- arenas and rules ----------------------------------------------------- */

/* Whether an arena called like key node k can be added; reports why not. */
static bool arena_key_ok(dm__pctx_t *c, int row, int k) {
    dm_policy_t *p = c->p;
    char q[DM__QUOTE_CAP], d[DM__QUOTE_CAP + 16];
    const char *name = TEXT(c, k);
    if (NODE(c, k)->kind != DM_YN_SCALAR) {
        ERR(c, k, "expected an arena name, got %s", describe(c, k, d, sizeof d));
        return false;
    }
    if (!dm__units_name_valid(name)) {
        ERR(c, k, "invalid arena name %s: names match [A-Za-z_][A-Za-z0-9_-]* "
            "and are 1 to %d bytes", dm__text_quote(q, sizeof q, name, strlen(name)),
            DM_NAME_MAX - 1);
        return false;
    }
    for (int j = 0; j < p->narenas; j++) {
        if (strcmp(p->arenas[j].name, name) == 0) {
            ERR(c, k, "duplicate arena '%s'", name);
            NOTE(c, c->arena_key[j], "arena '%s' first defined here", name);
            return false;
        }
    }
    if ((uint64_t)p->narenas >= ROW(row)->max) {
        ERR(c, k, "too many arenas: at most %llu", (unsigned long long)ROW(row)->max);
        return false;
    }
    return true;
}

static void parse_arenas(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__ynode_t *n = NODE(c, node);
    dm_policy_t *p = sect;
    if (n->kind != DM_YN_MAP && !is_null(c, node)) {
        type_error(c, row, node);
        return;
    }
    for (int k = n->first; k >= 0; k = NODE(c, NODE(c, k)->next)->next) {
        if (!arena_key_ok(c, row, k))
            continue;
        dm_arena_spec_t *a = &p->arenas[p->narenas];
        memset(a, 0, sizeof *a);
        apply_defaults(DM_SECT_ARENA, a);
        snprintf(a->name, sizeof a->name, "%s", TEXT(c, k));
        a->line = NODE(c, k)->line, a->col = NODE(c, k)->col;
        c->arena_key[p->narenas++] = k;
        size_t old = path_push(c, ".%s", a->name);
        walk_map(c, row, NODE(c, k)->next, a);
        path_pop(c, old);
    }
    if (n->n == 0)
        ERR(c, node, "at least one arena is required");
}

/* The value node of `key` in mapping `map`, or -1. */
static int map_get(dm__pctx_t *c, int map, const char *key) {
    if (NODE(c, map)->kind != DM_YN_MAP)
        return -1;
    for (int k = NODE(c, map)->first; k >= 0; k = NODE(c, NODE(c, k)->next)->next)
        if (NODE(c, k)->kind == DM_YN_SCALAR && strcmp(TEXT(c, k), key) == 0)
            return NODE(c, k)->next;
    return -1;
}

static void check_rule_name(dm__pctx_t *c, int i, int node) {
    const dm_rule_spec_t *rules = c->p->rules;
    if (!rules[i].name[0])
        return;
    for (int j = 0; j < i; j++) {
        if (strcmp(rules[j].name, rules[i].name) == 0) {
            ERR(c, map_get(c, node, "name"), "duplicate rule name '%s'", rules[i].name);
            dm__diag_add(c->ds, DM_SEV_NOTE, rules[j].line, rules[j].col, "",
                         "rule '%s' first defined here", rules[j].name);
            return;
        }
    }
}

/* The entries of a list section (rules, tag_limits) that will be read: 0 when
 * it is null, -1 when it is not a list (reported), at most the row's max (more
 * reported). */
static int64_t list_count(dm__pctx_t *c, int row, int node, const char *what) {
    const dm__ynode_t *n = NODE(c, node);
    if (is_null(c, node))
        return 0;
    if (n->kind != DM_YN_SEQ) {
        type_error(c, row, node);
        return -1;
    }
    if (n->n > ROW(row)->max) {
        ERR(c, node, "too many %s: %u (at most %llu)", what, n->n,
            (unsigned long long)ROW(row)->max);
        return (int64_t)ROW(row)->max;
    }
    return n->n;
}

static void parse_rules(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__ynode_t *n = NODE(c, node);
    dm_policy_t *p = sect;
    int64_t count = list_count(c, row, node, "rules");
    if (count < 0 || (count == 0 && is_null(c, node)))
        return;
    p->rules = calloc((size_t)(count ? count : 1), sizeof *p->rules);
    if (!p->rules) {
        c->nomem = true;
        return;
    }
    int i = 0;
    for (int k = n->first; k >= 0 && i < count; k = NODE(c, k)->next) {
        dm_rule_spec_t *r = &p->rules[i];
        apply_defaults(DM_SECT_RULE, r);
        r->line = NODE(c, k)->line, r->col = NODE(c, k)->col;
        size_t old = path_push(c, "[%d]", i);
        walk_map(c, row, k, r);
        path_pop(c, old);
        p->nrules = ++i;
        old = path_push(c, "[%d].name", i - 1);
        check_rule_name(c, i - 1, k);
        path_pop(c, old);
    }
}

static void parse_tag_limits(dm__pctx_t *c, int row, int node, void *sect) {
    const dm__ynode_t *n = NODE(c, node);
    dm_policy_t *p = sect;
    int64_t count = list_count(c, row, node, "tag limits");
    int i = 0;
    for (int k = count > 0 ? n->first : -1; k >= 0 && i < count; k = NODE(c, k)->next) {
        dm_tag_limit_spec_t *t = &p->tag_limits[i];
        memset(t, 0, sizeof *t);
        apply_defaults(DM_SECT_TAG_LIMIT, t);
        t->line = NODE(c, k)->line, t->col = NODE(c, k)->col;
        size_t old = path_push(c, "[%d]", i);
        walk_map(c, row, k, t);
        path_pop(c, old);
        p->ntag_limits = ++i;
    }
}

static void parse_value(dm__pctx_t *c, int row, int node, void *sect) {
    static parse_fn *const parsers[DM_ST_COUNT] = {
        [DM_ST_MAP] = parse_map,         [DM_ST_ARENAS] = parse_arenas,
        [DM_ST_RULES] = parse_rules,     [DM_ST_ARENA_REF] = parse_arena_ref,
        [DM_ST_NUMA] = parse_numa,       [DM_ST_NODES] = parse_nodes,
        [DM_ST_SIZE_RANGE] = parse_size_range, [DM_ST_TAG_LIMITS] = parse_tag_limits,
        [DM_ST_DTYPES] = dm__parse_match_list, [DM_ST_GLOBS] = dm__parse_match_list,
        [DM_ST_TAGS] = dm__parse_match_list,
    };
    parse_fn *f = parsers[ROW(row)->type];
    (f ? f : parse_scalar)(c, row, node, sect);
}

void dm__parse_walk(dm__pctx_t *c, int root) {
    apply_defaults(DM_SECT_POLICY, c->p);
    if (root < 0 || is_null(c, root)) {
        dm__diag_add(c->ds, DM_SEV_ERROR, 0, 0, "",
                     "the policy is empty; expected a mapping with version, "
                     "default and arenas");
        return;
    }
    walk_map(c, DM_SK_ROOT, root, c->p);
}
