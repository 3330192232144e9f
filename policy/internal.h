/*
 * internal.h: what the files of policy/ share and nobody else sees.
 *
 *  - dm__dsrc_t: a dm_diags_t plus the source text, so that a diagnostic can
 *    copy the offending line. Adding never allocates.
 *  - dm__sbuf_t: snprintf-semantics appending into a caller's buffer.
 *  - dm__ytree_t: the YAML document as a small node tree (yaml_tree.c), the
 *    only place that talks to libyaml.
 *  - dm__pctx_t: the state of one parse (parse.c and parse_match.c fill,
 *    validate.c checks).
 *
 * Nothing here keeps global state; every function works on what it is given.
 */
#ifndef DM_POLICY_INTERNAL_H
#define DM_POLICY_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/diag.h"
#include "policy/policy.h"

#define DM__PRINTF(f, a) __attribute__((format(printf, f, a)))
/* "%d rule%s", n, DM__PLURAL(n): "1 rule", "2 rules", "0 rules". */
#define DM__PLURAL(n) ((n) == 1 ? "" : "s")

/* ---- diagnostics with source ------------------------------------------ */

typedef struct dm__dsrc {
    dm_diags_t *d;
    const char *buf; /* the policy text (may lack a NUL) */
    size_t len;
} dm__dsrc_t;

void dm__diag_add(dm__dsrc_t *s, dm_severity_t sev, int line, int col,
                  const char *path, const char *fmt, ...) DM__PRINTF(6, 7);
void dm__diag_vadd(dm__dsrc_t *s, dm_severity_t sev, int line, int col,
                   const char *path, const char *fmt, va_list ap);
/* Orders entries by position; a note stays after the entry it explains. */
void dm__diag_sort(dm_diags_t *d);

/* 1-based line and column (in characters, as libyaml counts) of byte `off`. */
void dm__text_pos(const char *buf, size_t len, size_t off, int *line, int *col);
/* Copies line `line` of buf into dst, made safe to print; "" if none. */
void dm__text_source_line(const char *buf, size_t len, int line, char *dst,
                     size_t cap);
/* The 1-based column of the first tab in the indentation (the leading
 * blanks) of `line` when column `col` lies in that indentation or at the
 * token after it; else 0. Columns count bytes, which is characters here:
 * blanks are ASCII. */
int dm__text_indent_tab(const char *buf, size_t len, int line, int col);
/* Offset of the first byte that is not valid UTF-8, or `len`. */
size_t dm__text_utf8_check(const char *buf, size_t len);
/* Writes `s` (len bytes) quoted, control and non-UTF-8 bytes escaped, cut to
 * about 48 characters; returns buf. */
const char *dm__text_quote(char *buf, size_t cap, const char *s, size_t len);
#define DM__QUOTE_CAP 80

/* Nearest candidate by edit distance, or NULL when none is close. */
const char *dm__text_nearest(const char *word, const char *const *cands, int n);

/* ---- string building -------------------------------------------------- */

typedef struct dm__sbuf {
    char *p;
    size_t cap;
    size_t len; /* what would have been written: may exceed cap */
} dm__sbuf_t;

void dm__text_sb_init(dm__sbuf_t *b, char *p, size_t cap);
void dm__text_sb_printf(dm__sbuf_t *b, const char *fmt, ...) DM__PRINTF(2, 3);
void dm__text_sb_putc(dm__sbuf_t *b, char c, size_t count);
/* NUL-terminates and returns the snprintf-style length (clamped to INT_MAX). */
int dm__text_sb_done(dm__sbuf_t *b);

/* ---- small value checks shared by parse.c and units.c ------------------- */

bool dm__units_name_valid(const char *s);   /* [A-Za-z_][A-Za-z0-9_-]*, 1..63 */
int dm__units_bool_parse(const char *s, bool *out); /* 0 or -1 */
bool dm__units_yaml_null(const char *s);    /* "", "~", null, Null, NULL */

/* ---- the YAML tree ---------------------------------------------------- */

#define DM__YDEPTH_MAX 32        /* deeper nesting is refused */
#define DM__YNODES_MAX (1 << 17) /* more nodes are refused */

typedef enum { DM_YN_SCALAR, DM_YN_MAP, DM_YN_SEQ } dm__ykind_t;

typedef struct dm__ynode {
    uint8_t kind;   /* dm__ykind_t */
    uint8_t quoted; /* scalar written '...', "..." or as a block */
    int line, col;  /* 1-based */
    uint32_t text;  /* scalar: offset of its NUL-terminated text */
    uint32_t len;
    int32_t first;  /* first child (map: key, value, key, ...), or -1 */
    int32_t next;   /* next sibling, or -1 */
    uint32_t n;     /* children */
} dm__ynode_t;

typedef struct dm__ytree {
    dm__ynode_t *nodes;
    uint32_t nnodes, cap;
    char *text;
    size_t tlen, tcap;
    int root; /* -1: no document */
} dm__ytree_t;

/* Builds the tree of ds->buf. Returns 0, DM_ESYNTAX (not YAML, not UTF-8, too
 * deep), DM_EINVALID (YAML a policy refuses: anchors, several documents) or
 * DM_ENOMEM; errors are in ds. Free with dm__yaml_tree_free either way. */
int dm__yaml_tree_load(dm__ytree_t *t, dm__dsrc_t *ds);
void dm__yaml_tree_free(dm__ytree_t *t);

static inline const dm__ynode_t *dm__ynode(const dm__ytree_t *t, int i) {
    return &t->nodes[i];
}
static inline const char *dm__ytext(const dm__ytree_t *t, int i) {
    return t->text + t->nodes[i].text;
}

/* ---- one parse -------------------------------------------------------- */

#define DM__PATH_MAX 256

/* An arena name to resolve once every arena is known. */
typedef struct dm__aref {
    int *dst;   /* where the index goes */
    int node;   /* the name's node */
    char path[DM__PATH_MAX];
} dm__aref_t;

typedef struct dm__pctx {
    dm__dsrc_t *ds;
    const dm__ytree_t *yt;
    const dm_topology_t *topo;
    dm_policy_t *p;
    char path[DM__PATH_MAX]; /* key path of the value being read */
    size_t plen;
    dm__aref_t *refs;        /* nrules + 2 entries at most */
    int nrefs, refcap;
    int arena_key[DM_ARENAS_MAX]; /* node of each arena's name */
    bool lint;               /* DM_PARSE_LINT: advice for the author too */
    bool nomem;
} dm__pctx_t;

/* parse.c: fills c->p from the tree. validate.c: resolves arena names and
 * adds the checks that need the whole policy (shadowed rules, unused arenas). */
void dm__parse_walk(dm__pctx_t *c, int root);
void dm__validate_policy(dm__pctx_t *c);

/* parse.c, for the value readers beside it: a diagnostic at node's position
 * under the current key path (node < 0: none); the node's text when it is a
 * scalar that is not null, else NULL with a type error for `row`. */
void dm__parse_report(dm__pctx_t *c, dm_severity_t sev, int node, const char *fmt, ...)
    DM__PRINTF(4, 5);
const char *dm__parse_scalar_of(dm__pctx_t *c, int row, int node);
/* parse_match.c: a rule's match list (dtype, thread, module, function, tag). */
void dm__parse_match_list(dm__pctx_t *c, int row, int node, void *sect);

/* Rule matching shared by compile.c and explain.c (ctx may be NULL). */
bool dm__compile_ctx_match(const dm_rule_spec_t *r, const dm_context_t *ctx);
bool dm__compile_site_match(const dm_rule_spec_t *r, const char *module, const char *function);
bool dm__compile_thread_match(const dm_rule_spec_t *r, const char *thread);
bool dm__compile_ctx_has_tag(const dm_context_t *ctx, const char *tag);

#endif /* DM_POLICY_INTERNAL_H */
