/*
 * schema.c: schema.def expanded into the row table, and the lookups on it
 * (child by key, key path, enum words). Const data and pure functions only.
 */
#include <stddef.h>
#include <string.h>

#include "policy/internal.h"
#include "policy/schema.h"

#define DM_F(type, member) offsetof(type, member), sizeof(((type *)0)->member)
#define DM_NOFIELD 0, 0

const dm__schema_row_t dm__schema_rows[DM_SK_COUNT] = {
#define DM_SCHEMA_ROW(id, parent, key, type, field, dflt, min, max, enums,      \
                      flags, example, doc)                                     \
    [DM_SK_##id] = {#id,    DM_SK_##parent, key,   DM_ST_##type, field,         \
                    dflt,   min,            max,   enums,        flags,         \
                    example, doc},
#include "policy/schema.def"
#undef DM_SCHEMA_ROW
};

const dm__stype_info_t dm__schema_stype_info[DM_ST_COUNT] = {
#define DM_ST_ROW(id, name, expected, wrong) [DM_ST_##id] = {name, expected, wrong},
    DM_SCHEMA_TYPES(DM_ST_ROW)
#undef DM_ST_ROW
};

const char dm__schema_example[] =
    "version: 1\n"
    "default: general\n"
    "fallback: spare\n"
    "arenas:\n"
    "  general: {}\n"
    "  big:\n"
    "    alignment: 2MiB\n"
    "    hugepages: on\n"
    "    numa: {interleave: all}\n"
    "    decay: {dirty: 30s, muzzy: 5s}\n"
    "  loaders:\n"
    "    numa: local\n"
    "  spare:\n"
    "    decay: {dirty: never}\n"
    "rules:\n"
    "  - name: huge\n"
    "    match:\n"
    "      size: {min: 8MiB}\n"
    "      dtype: number\n"
    "    arena: big\n"
    "  - name: loading\n"
    "    match:\n"
    "      thread: [\"loader_*\"]\n"
    "      tag: ingest\n"
    "    arena: loaders\n"
    "stats:\n"
    "  http: \"127.0.0.1:0\"\n"
    "  interval: 10s\n"
    "reload:\n"
    "  watch: true\n"
    "  debounce: 50ms\n";

int dm__schema_list_cap(int row) {
    if (row == DM_SK_MATCH_MODULE || row == DM_SK_MATCH_FUNCTION)
        return DM_SITE_GLOBS_MAX;
    dm__stype_t t = dm__schema_rows[row].type;
    return t == DM_ST_GLOBS || t == DM_ST_TAGS ? DM_GLOBS_MAX : 0;
}

dm__sect_t dm__schema_sect(int row) {
    for (int r = row; r != DM_SK_ROOT; r = dm__schema_rows[r].parent) {
        if (dm__schema_rows[r].parent == DM_SK_ARENAS)
            return DM_SECT_ARENA;
        if (dm__schema_rows[r].parent == DM_SK_RULES)
            return DM_SECT_RULE;
        if (dm__schema_rows[r].parent == DM_SK_TAG_LIMITS)
            return DM_SECT_TAG_LIMIT;
    }
    return DM_SECT_POLICY;
}

int dm__schema_child(int parent, const char *key, size_t len) {
    for (int r = 1; r < DM_SK_COUNT; r++) {
        const dm__schema_row_t *s = &dm__schema_rows[r];
        if (s->parent == parent && strlen(s->key) == len &&
            memcmp(s->key, key, len) == 0)
            return r;
    }
    return -1;
}

/* What separates a row's key from its children's in a path. */
static const char *child_sep(int row) {
    return row == DM_SK_ARENAS                              ? ".<name>."
           : row == DM_SK_RULES || row == DM_SK_TAG_LIMITS ? "[]."
                                                            : ".";
}

int dm__schema_path(int row, char *buf, size_t cap) {
    int chain[16], n = 0;
    dm__sbuf_t b;
    for (int r = row; r != DM_SK_ROOT && n < 16; r = dm__schema_rows[r].parent)
        chain[n++] = r;
    dm__text_sb_init(&b, buf, cap);
    while (n-- > 0)
        dm__text_sb_printf(&b, "%s%s", dm__schema_rows[chain[n]].key,
                      n ? child_sep(chain[n]) : "");
    return dm__text_sb_done(&b);
}

int dm__schema_enum_index(const char *enums, const char *word) {
    size_t wl = strlen(word);
    int i = 0;
    for (const char *s = enums; s && *s; i++) {
        size_t n = strcspn(s, "|");
        if (n == wl && memcmp(s, word, n) == 0)
            return i;
        s += n + (s[n] == '|');
    }
    return -1;
}

void dm__schema_enum_list(const char *enums, char *buf, size_t cap) {
    dm__sbuf_t b;
    dm__text_sb_init(&b, buf, cap);
    for (const char *s = enums; s && *s;) {
        size_t n = strcspn(s, "|");
        dm__text_sb_printf(&b, "%s%.*s", s == enums ? "" : ", ", (int)n, s);
        s += n + (s[n] == '|');
    }
    dm__text_sb_done(&b);
}
