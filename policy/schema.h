/*
 * schema.h: the policy schema as data (internal to policy/).
 *
 * schema.def declares every key once; this header turns it into the row table
 * dm__schema_rows[] that the parser walks, the reference generator prints and
 * schema_test checks. Value types, size and duration units and dtype kinds are
 * declared here the same way, once, for the same three readers. Everything is
 * const data: safe from any thread.
 */
#ifndef DM_POLICY_SCHEMA_H
#define DM_POLICY_SCHEMA_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "policy/policy.h"

/* Value types: X(ID, NAME, EXPECTED, WRONG). NAME is the docs' type column,
 * EXPECTED completes "expected ...", WRONG is a value of the wrong type
 * (schema_test feeds it to every row of that type). */
#define DM_SCHEMA_TYPES(X)                                                     \
    X(MAP, "mapping", "a mapping", "[1]")                                      \
    X(ARENAS, "mapping of arenas", "a mapping of arena names to settings",     \
      "[1]")                                                                   \
    X(RULES, "list of rules", "a list of rules", "{a: 1}")                     \
    X(INT, "integer", "an integer", "{a: 1}")                                  \
    X(SIZE, "size", "a size (bytes, e.g. 4096 or 64KiB)", "{a: 1}")            \
    X(DURATION, "duration", "a duration (e.g. 250ms, 10s or never)", "[1]")    \
    X(BOOL, "boolean", "a boolean (true/false, yes/no, on/off)", "[1]")        \
    X(STRING, "string", "a string", "{a: 1}")                                  \
    X(ENUM, "enum", "a string", "[1]")                                         \
    X(NAME, "name", "a name", "[1]")                                           \
    X(ARENA_REF, "arena name", "an arena name", "{a: 1}")                      \
    X(NUMA, "numa", "none, local, or a mapping with one of bind, "             \
      "interleave, preferred", "[0]")                                          \
    X(NODES, "nodes", "a node number or a list of node numbers", "{a: 1}")     \
    X(SIZE_RANGE, "size range", "a mapping with min and/or max", "5")          \
    X(DTYPES, "dtypes", "a dtype name or kind, or a list of them", "{a: 1}")   \
    X(GLOBS, "globs", "a glob or a list of globs", "{a: 1}")                   \
    X(TAGS, "tags", "a tag or a list of tags", "{a: 1}")                       \
    X(TAG_LIMITS, "list of tag limits", "a list of tag limits", "{a: 1}")      \
    X(GLOB, "glob", "a glob", "[1]")                                           \
    X(SHARE, "size or share", "a size (e.g. 8GiB) or a share of the memory "   \
      "limit (e.g. 85%)", "[1]")                                               \
    X(HOSTPORT, "host:port", "a \"host:port\" string", "[1]")

typedef enum {
#define DM_ST_ENUM(id, name, expected, wrong) DM_ST_##id,
    DM_SCHEMA_TYPES(DM_ST_ENUM)
#undef DM_ST_ENUM
    DM_ST_COUNT
} dm__stype_t;

typedef struct dm__schema_stype_info {
    const char *name;     /* docs' type column */
    const char *expected; /* "expected %s" */
    const char *wrong;    /* a YAML value of another type */
} dm__stype_info_t;

extern const dm__stype_info_t dm__schema_stype_info[DM_ST_COUNT];

/* Row flags. */
#define DM_SF_REQUIRED 0x1u /* a missing key is an error */
#define DM_SF_RELOAD 0x2u   /* a reload may change it (else: restart) */
#define DM_SF_NEVER 0x4u    /* duration also accepts never / -1; size: never */
#define DM_SF_POW2 0x8u     /* size must be a power of two */
#define DM_SF_SINGLE 0x10u  /* nodes: exactly one number, not a list */

typedef enum {
#define DM_SCHEMA_ROW(id, ...) DM_SK_##id,
#include "policy/schema.def"
#undef DM_SCHEMA_ROW
    DM_SK_COUNT
} dm__skey_t;

typedef struct dm__schema_row {
    const char *id;      /* "ALIGNMENT" */
    int parent;          /* DM_SK_* of the enclosing row */
    const char *key;     /* "alignment" */
    dm__stype_t type;
    size_t off, size;    /* field in the section struct; size 0 = none */
    const char *dflt;    /* default as YAML text, NULL = none */
    uint64_t min, max;   /* inclusive bounds, 0/0 = none */
    const char *enums;   /* "a|b|c" or NULL */
    unsigned flags;      /* DM_SF_* */
    const char *example; /* a valid value, YAML flow syntax */
    const char *doc;
} dm__schema_row_t;

extern const dm__schema_row_t dm__schema_rows[DM_SK_COUNT];

/* The section a row's field lives in. */
typedef enum { DM_SECT_POLICY, DM_SECT_ARENA, DM_SECT_RULE, DM_SECT_TAG_LIMIT } dm__sect_t;
dm__sect_t dm__schema_sect(int row);

/* Child row of `parent` called `key` (len bytes), or -1. */
int dm__schema_child(int parent, const char *key, size_t len);

/* "arenas.<name>.decay.dirty", "rules[].match.size.min"; returns the length. */
int dm__schema_path(int row, char *buf, size_t cap);

/* How many entries a list row (globs, tags) may hold: DM_SITE_GLOBS_MAX for
 * match.module and match.function (each is tried against the call site's
 * name on every allocation the rule sees), DM_GLOBS_MAX for the others; 0 for
 * a row that is no such list. The parser's cap and the reference's "up to N"
 * both come from here. */
int dm__schema_list_cap(int row);

/* Position of `word` in a "a|b|c" list, or -1. */
int dm__schema_enum_index(const char *enums, const char *word);
/* Writes "a, b, c" (or "a, b or c" style is not used: plain commas). */
void dm__schema_enum_list(const char *enums, char *buf, size_t cap);

/* Size units, X(SUFFIX, BYTES); durations X(SUFFIX, MILLISECONDS). */
#define DM_SIZE_UNITS(X)                                                       \
    X("B", 1ull)                                                               \
    X("KiB", 1ull << 10)                                                       \
    X("MiB", 1ull << 20)                                                       \
    X("GiB", 1ull << 30)                                                       \
    X("TiB", 1ull << 40)                                                       \
    X("KB", 1000ull)                                                           \
    X("MB", 1000000ull)                                                        \
    X("GB", 1000000000ull)                                                     \
    X("TB", 1000000000000ull)
#define DM_SIZE_UNIT_NAMES "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"

#define DM_DURATION_UNITS(X)                                                   \
    X("ms", 1)                                                                 \
    X("s", 1000)
#define DM_DURATION_UNIT_NAMES "ms, s"

/* Booleans: the YAML 1.1 words, each also Capitalised and UPPER case. */
#define DM_BOOL_WORDS "true|yes|on|false|no|off"

/* dtype kinds: X(NAME, MASK, DOC). A rule's dtype entry is a dtype name from
 * DM_DTYPE_LIST (except unknown) or one of these. */
#define DM_DTB(sym) (1u << DM_DT_##sym)
#define DM_DTM_INT (DM_DTB(INT8) | DM_DTB(INT16) | DM_DTB(INT32) | DM_DTB(INT64))
#define DM_DTM_UINT                                                            \
    (DM_DTB(UINT8) | DM_DTB(UINT16) | DM_DTB(UINT32) | DM_DTB(UINT64))
#define DM_DTM_FLOAT                                                           \
    (DM_DTB(FLOAT16) | DM_DTB(FLOAT32) | DM_DTB(FLOAT64) | DM_DTB(LONGDOUBLE))
#define DM_DTM_COMPLEX                                                         \
    (DM_DTB(COMPLEX64) | DM_DTB(COMPLEX128) | DM_DTB(CLONGDOUBLE))
#define DM_DTYPE_KINDS(X)                                                      \
    X("bool", DM_DTB(BOOL), "bool")                                            \
    X("int", DM_DTM_INT, "signed integers")                                    \
    X("uint", DM_DTM_UINT, "unsigned integers")                                \
    X("integer", DM_DTM_INT | DM_DTM_UINT, "int and uint")                     \
    X("float", DM_DTM_FLOAT, "float16, float32, float64, longdouble")          \
    X("complex", DM_DTM_COMPLEX, "complex64, complex128, clongdouble")         \
    X("number", DM_DTM_INT | DM_DTM_UINT | DM_DTM_FLOAT | DM_DTM_COMPLEX,      \
      "int, uint, float and complex")                                          \
    X("object", DM_DTB(OBJECT), "object")                                      \
    X("bytes", DM_DTB(BYTES), "bytes (S)")                                     \
    X("str", DM_DTB(STR), "str (U)")                                           \
    X("void", DM_DTB(VOID), "void (V, structured)")                            \
    X("datetime", DM_DTB(DATETIME), "datetime64")                              \
    X("timedelta", DM_DTB(TIMEDELTA), "timedelta64")

/* dtype name or kind -> mask; 0 if unknown ("unknown" itself is refused). */
dm_dtype_mask_t dm__units_dtype_mask(const char *name);

/* A complete, valid policy used by the reference and checked by schema_test. */
extern const char dm__schema_example[];

/* Writes docs/policy-reference.md. Returns 0 or -1 (write error). */
int dm__reference_write(FILE *f);

#endif /* DM_POLICY_SCHEMA_H */
