/*
 * reference.c: writes docs/policy-reference.md from the schema table, the
 * value types, the units and the dtype kinds, so that the reference cannot
 * drift from the parser. //policy:reference_test fails when the checked-in
 * file differs from this output. Writes only to the FILE it is given.
 */
#include <string.h>

#include "policy/internal.h"
#include "policy/schema.h"

#define ROW(r) (&dm__schema_rows[r])

static void put_default(FILE *f, const dm__schema_row_t *r) {
    if (r->flags & DM_SF_REQUIRED)
        fprintf(f, "required");
    else if (!r->dflt)
        fprintf(f, "-");
    else if (!r->dflt[0])
        fprintf(f, "`\"\"`");
    else
        fprintf(f, "`%s`", r->dflt);
}

/* The "accepted" cell: bounds, enum words, lengths. */
static void put_accepted(FILE *f, const dm__schema_row_t *r) {
    char list[256];
    dm__schema_enum_list(r->enums, list, sizeof list);
    switch (r->type) {
    case DM_ST_INT: case DM_ST_SIZE: case DM_ST_DURATION: case DM_ST_NODES:
        if (r->min == r->max && r->min)
            fprintf(f, "%llu", (unsigned long long)r->min);
        else if (r->min || r->max)
            fprintf(f, "%llu .. %llu%s", (unsigned long long)r->min,
                    (unsigned long long)r->max,
                    r->type == DM_ST_DURATION ? " ms" : "");
        else
            fprintf(f, "any");
        if (r->flags & DM_SF_POW2)
            fprintf(f, ", power of two");
        if (r->flags & DM_SF_NEVER)
            fprintf(f, ", or `never`");
        if (r->enums)
            fprintf(f, ", or `%s`", list);
        return;
    case DM_ST_ENUM: case DM_ST_NUMA:
        fprintf(f, "%s", list);
        return;
    case DM_ST_ARENAS:
        fprintf(f, "%llu .. %llu arenas", (unsigned long long)r->min,
                (unsigned long long)r->max);
        return;
    case DM_ST_RULES:
        fprintf(f, "at most %llu rules", (unsigned long long)r->max);
        return;
    case DM_ST_TAG_LIMITS:
        fprintf(f, "at most %llu entries", (unsigned long long)r->max);
        return;
    case DM_ST_GLOBS: case DM_ST_TAGS:
        fprintf(f, "up to %d, each %llu .. %llu bytes", dm__schema_list_cap((int)(r - ROW(0))),
                (unsigned long long)r->min, (unsigned long long)r->max);
        return;
    case DM_ST_SHARE:
        fprintf(f, "1 byte .. 2^64 - 1 bytes, or 0.1%% .. 100%%, or empty");
        return;
    case DM_ST_STRING: case DM_ST_HOSTPORT: case DM_ST_NAME: case DM_ST_GLOB:
        fprintf(f, "%llu .. %llu bytes", (unsigned long long)r->min,
                (unsigned long long)r->max);
        return;
    default:
        fprintf(f, "-");
    }
}

static void put_keys(FILE *f) {
    char path[128];
    fprintf(f, "## Keys\n\n"
               "`<name>` stands for an arena name, `[]` for any rule of the list. "
               "\"Reload: yes\" means a reload applies a change; \"no\" means a "
               "reload that changes it fails, saying why, and the policy in force "
               "stays: the change takes a restart.\n\n"
               "| Key | Type | Default | Accepted | Reload | Description |\n"
               "|---|---|---|---|---|---|\n");
    for (int i = 1; i < DM_SK_COUNT; i++) {
        const dm__schema_row_t *r = ROW(i);
        dm__schema_path(i, path, sizeof path);
        fprintf(f, "| `%s` | %s | ", path, dm__schema_stype_info[r->type].name);
        put_default(f, r);
        fprintf(f, " | ");
        put_accepted(f, r);
        fprintf(f, " | %s | %s Example: `%s` |\n",
                (r->flags & DM_SF_RELOAD) ? "yes" : "no", r->doc, r->example);
    }
}

static void put_types(FILE *f) {
    fprintf(f, "\n## Types\n\n| Type | Accepted |\n|---|---|\n");
    for (int t = 0; t < DM_ST_COUNT; t++)
        fprintf(f, "| %s | %s |\n", dm__schema_stype_info[t].name,
                dm__schema_stype_info[t].expected);
    fprintf(f, "\nA null value (`~`, `null` or nothing after the colon) is not a "
               "value: leave the key out to get its default. A null section "
               "(`stats:`) is an empty one.\n");
}

static void put_units(FILE *f) {
    fprintf(f, "\n## Sizes\n\nA whole number of bytes (`4096`), or a number and a "
               "unit, with or without a space (`64KiB`, `8 MiB`, `1.5GiB`). A "
               "decimal fraction (at most 12 digits) needs a unit and must come "
               "to a whole number of bytes: `1.5GiB` is 1610612736 bytes, `1.1KiB` "
               "(1126.4 bytes) is an error, never rounded. Units are "
               "case-sensitive; no others (`k`, `kb`, `M`) are accepted. Sizes "
               "that do not fit in 64 bits are errors. A decimal unit gets a "
               "warning, since the binary one is almost always meant (`4MB is "
               "4,000,000 bytes; did you mean 4MiB?`); write the bytes (`4000000`) "
               "to keep a decimal size without it.\n\n| Unit | Bytes |\n|---|---|\n");
#define DM_UNIT_DOC(suffix, mult)                                              \
    fprintf(f, "| `%s` | %llu |\n", suffix, (unsigned long long)(mult));
    DM_SIZE_UNITS(DM_UNIT_DOC)
    fprintf(f, "\n## Durations\n\nWhole milliseconds (`250`), or a number and a "
               "unit: `250ms`, `10s`, `1.5s` (a fraction of a second must come to "
               "whole milliseconds). Where accepted, `never` or `-1` means never. "
               "A bare number other than 0 gets a warning (`dirty: 10` is 10 ms, "
               "where 10 s was likelier meant): write the unit.\n\n"
               "| Unit | Milliseconds |\n|---|---|\n");
    DM_DURATION_UNITS(DM_UNIT_DOC)
#undef DM_UNIT_DOC
    fprintf(f, "\n## Booleans\n\n`true`, `yes`, `on` and `false`, `no`, `off` "
               "(YAML 1.1), each also Capitalised or in UPPER case, unquoted. A "
               "quoted `\"true\"` is a string, not a boolean.\n");
}

static void put_dtypes(FILE *f) {
    fprintf(f, "\n## Dtypes\n\n`match.dtype` takes dtype names and kinds. A rule "
               "with a dtype part never matches an allocation whose dtype is "
               "unknown.\n\nNames:");
    for (int dt = 1; dt < DM_DT_COUNT; dt++)
        fprintf(f, "%s `%s`", dt > 1 ? "," : "", dm_dtype_name(dt));
    fprintf(f, ".\n\n| Kind | Means |\n|---|---|\n");
#define DM_KIND_DOC(name, mask, doc) fprintf(f, "| `%s` | %s |\n", name, doc);
    DM_DTYPE_KINDS(DM_KIND_DOC)
#undef DM_KIND_DOC
}

static void put_rest(FILE *f) {
    fprintf(f, "\n## Names, globs and tags\n\nArena, rule and tag names match "
               "`[A-Za-z_][A-Za-z0-9_-]*` and are 1 to %d bytes. Thread globs use "
               "fnmatch(3) syntax (`*`, `?`, `[...]`, `\\` escapes); an unclosed "
               "`[` is an error. `datamem.tag()` refuses a name outside this "
               "pattern (ValueError), since no rule could match it.\n",
            DM_NAME_MAX - 1);
    fprintf(f, "\n## Thread names\n\nA `thread` glob matches the Python thread's "
               "name, and Python's own names are easy to get wrong:\n\n"
               "| Threads | Named | Glob |\n|---|---|---|\n"
               "| `threading.Thread(target=f)` | `Thread-1 (f)`, `Thread-2 (f)` | "
               "`Thread-*` |\n"
               "| `ThreadPoolExecutor(thread_name_prefix=\"etl\")` | `etl_0`, `etl_1` | "
               "`etl_*` |\n"
               "| `ThreadPoolExecutor()` | `ThreadPoolExecutor-0_0`, ... | "
               "`ThreadPoolExecutor-*` |\n"
               "| asyncio's default executor (`run_in_executor(None, ...)`, "
               "`asyncio.to_thread`) | `asyncio_0`, `asyncio_1` | `asyncio_*` |\n"
               "| threads not started by `threading` | `Dummy-1`, ... | `Dummy-*` |\n"
               "\n`etl-*` matches no thread of a pool with prefix `etl`. "
               "`python -m datamem check` and `explain` warn about such a glob "
               "(`X-*` for any X but `Thread`, `ThreadPoolExecutor` and `Dummy`); "
               "start-up does not, because a job may name its own threads `etl-1`. "
               "For those, `etl-[0-9]*` says so and is not warned about.\n");
    fprintf(f, "\n## Matching\n\nRules are tried in order; the first whose every "
               "given part matches wins, and an allocation no rule matches goes to "
               "`default`. A rule matches when `size.min <= size <= size.max`, the "
               "dtype is in `dtype` (if given), the thread name matches one of "
               "`thread` (if given) and every tag in `tag` is set.\n");
    fprintf(f, "\n## Diagnostics\n\nErrors read like a compiler's, "
               "`file:line:column: error: key.path: message`, followed by the "
               "line and a caret (`python -m datamem check` quotes each diagnostic's "
               "line; a job's own report quotes the first one's only, see "
               "docs/security.md); all are reported in one pass. A misspelt key or "
               "enum value gets the nearest accepted one (`did you mean 'on'?`; "
               "a YAML 1.1 boolean such as `yes` or `no` suggests `on` or `off`). "
               "Refused outright: "
               "files over %u bytes, text that is not UTF-8, several documents, "
               "anchors and aliases, nesting deeper than %d levels, a tab in "
               "the indentation (YAML allows only spaces there), and a path that "
               "is not a regular file (a FIFO, directory, device or socket: "
               "symbolic links are followed). One cause at many places is one "
               "diagnostic with a count, `(and N more like this)`. Warnings "
               "(`warning:`) do not stop a policy from loading; start-up prints "
               "them once to stderr: a rule that an earlier rule fully shadows, "
               "an arena that nothing uses, a decimal size unit, a duration "
               "without a unit. `check` and `explain` add advice that may not "
               "apply to every job (see Thread names).\n",
            DM_POLICY_FILE_MAX, DM__YDEPTH_MAX);
    fprintf(f, "\n## Example\n\n```yaml\n%s```\n", dm__schema_example);
}

int dm__reference_write(FILE *f) {
    fprintf(f, "# Policy reference (version 1)\n\n"
               "<!-- Generated from policy/schema.def; do not edit. Regenerate "
               "with: bazel run //policy:gen_reference -- --write -->\n\n%s\n\n",
            ROW(DM_SK_ROOT)->doc);
    put_keys(f);
    put_types(f);
    put_units(f);
    put_dtypes(f);
    put_rest(f);
    return ferror(f) ? -1 : 0;
}
