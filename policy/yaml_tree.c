/*
 * yaml_tree.c: the only file that talks to libyaml. Turns the bytes of a
 * policy into a tree of scalars, mappings and sequences with 1-based positions.
 *
 * Defences against hostile input, before and while libyaml reads it: the text
 * must be UTF-8 (checked here first, so the error has a line and column);
 * anchors and aliases are refused (no alias bombs: nothing is ever expanded);
 * nesting deeper than DM__YDEPTH_MAX and more than DM__YNODES_MAX nodes are
 * refused; a second document is an error. Reentrant: all state is in the
 * dm__ytree_t and the yaml_parser_t on the stack.
 */
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "policy/internal.h"

typedef struct builder {
    dm__ytree_t *t;
    dm__dsrc_t *ds;
    int stack[DM__YDEPTH_MAX + 1]; /* open containers */
    int last[DM__YDEPTH_MAX + 1];  /* their last child so far */
    int depth;
    int ndocs;
    int rc;    /* first failure, 0 if none */
    bool stop; /* the tree cannot be completed: read no further */
} builder_t;

static void fail(builder_t *b, int rc, const yaml_mark_t *m, const char *fmt,
                 ...) DM__PRINTF(4, 5);
static void fail(builder_t *b, int rc, const yaml_mark_t *m, const char *fmt,
                 ...) {
    va_list ap;
    va_start(ap, fmt);
    dm__diag_vadd(b->ds, DM_SEV_ERROR, m ? (int)m->line + 1 : 0,
                  m ? (int)m->column + 1 : 0, "", fmt, ap);
    va_end(ap);
    if (!b->rc)
        b->rc = rc;
}

static int grow(void **p, size_t elem, size_t need, size_t *cap) {
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap * 2 : 64;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q)
        return -1;
    *p = q, *cap = n;
    return 0;
}

/* Stores text, NUL-terminated; returns its offset or -1. */
static int64_t add_text(dm__ytree_t *t, const char *s, size_t len) {
    if (len > UINT32_MAX / 2 || grow((void **)&t->text, 1, t->tlen + len + 1,
                                     &t->tcap))
        return -1;
    memcpy(t->text + t->tlen, s, len);
    t->text[t->tlen + len] = '\0';
    t->tlen += len + 1;
    return (int64_t)(t->tlen - len - 1);
}

/* Appends a node under the open container; returns its index or -1. */
static int add_node(builder_t *b, dm__ykind_t kind, const yaml_mark_t *m) {
    dm__ytree_t *t = b->t;
    size_t cap = t->cap;
    if (t->nnodes >= DM__YNODES_MAX) {
        fail(b, DM_EINVALID, m, "more than %d YAML nodes", DM__YNODES_MAX);
        b->stop = true;
        return -1;
    }
    if (grow((void **)&t->nodes, sizeof *t->nodes, t->nnodes + 1, &cap)) {
        fail(b, DM_ENOMEM, NULL, "out of memory");
        b->stop = true;
        return -1;
    }
    t->cap = (uint32_t)cap;
    int i = (int)t->nnodes++;
    dm__ynode_t *n = &t->nodes[i];
    memset(n, 0, sizeof *n);
    n->kind = (uint8_t)kind;
    n->line = (int)m->line + 1, n->col = (int)m->column + 1;
    n->first = n->next = -1;
    if (b->depth == 0) {
        t->root = i;
    } else {
        int p = b->stack[b->depth - 1], l = b->last[b->depth - 1];
        if (l < 0)
            t->nodes[p].first = i;
        else
            t->nodes[l].next = i;
        t->nodes[p].n++;
        b->last[b->depth - 1] = i;
    }
    return i;
}

static void on_scalar(builder_t *b, const yaml_event_t *e) {
    int i = add_node(b, DM_YN_SCALAR, &e->start_mark);
    if (i < 0)
        return;
    const char *v = (const char *)e->data.scalar.value;
    size_t len = e->data.scalar.length;
    if (memchr(v, '\0', len)) {
        fail(b, DM_EINVALID, &e->start_mark, "NUL characters are not allowed");
        len = strlen(v);
    }
    int64_t off = add_text(b->t, v, len);
    if (off < 0) {
        fail(b, DM_ENOMEM, NULL, "out of memory");
        b->stop = true;
        return;
    }
    dm__ynode_t *n = &b->t->nodes[i];
    n->text = (uint32_t)off, n->len = (uint32_t)len;
    n->quoted = e->data.scalar.style != YAML_PLAIN_SCALAR_STYLE;
}

static void on_open(builder_t *b, dm__ykind_t kind, const yaml_mark_t *m) {
    if (b->depth >= DM__YDEPTH_MAX) {
        fail(b, DM_ESYNTAX, m, "nesting deeper than %d levels", DM__YDEPTH_MAX);
        b->stop = true;
        return;
    }
    int i = add_node(b, kind, m);
    if (i < 0)
        return;
    b->stack[b->depth] = i;
    b->last[b->depth] = -1;
    b->depth++;
}

static const yaml_char_t *event_anchor(const yaml_event_t *e) {
    switch (e->type) {
    case YAML_SCALAR_EVENT:
        return e->data.scalar.anchor;
    case YAML_SEQUENCE_START_EVENT:
        return e->data.sequence_start.anchor;
    case YAML_MAPPING_START_EVENT:
        return e->data.mapping_start.anchor;
    case YAML_ALIAS_EVENT:
        return e->data.alias.anchor;
    default:
        return NULL;
    }
}

/* Handles one event; returns false at the end of what we read. */
static bool on_event(builder_t *b, const yaml_event_t *e) {
    if (event_anchor(e))
        fail(b, DM_EINVALID, &e->start_mark,
             "anchors and aliases are not allowed in a policy");
    switch (e->type) {
    case YAML_DOCUMENT_START_EVENT:
        if (++b->ndocs > 1) {
            fail(b, DM_EINVALID, &e->start_mark,
                 "a policy is one YAML document; found a second one");
            return false;
        }
        return true;
    case YAML_SCALAR_EVENT:
        on_scalar(b, e);
        return true;
    case YAML_ALIAS_EVENT: /* refused above; a null stands in */
        add_node(b, DM_YN_SCALAR, &e->start_mark);
        return true;
    case YAML_SEQUENCE_START_EVENT:
        on_open(b, DM_YN_SEQ, &e->start_mark);
        return true;
    case YAML_MAPPING_START_EVENT:
        on_open(b, DM_YN_MAP, &e->start_mark);
        return true;
    case YAML_SEQUENCE_END_EVENT:
    case YAML_MAPPING_END_EVENT:
        b->depth -= b->depth > 0;
        return true;
    case YAML_STREAM_END_EVENT:
        return false;
    default:
        return true;
    }
}

/* libyaml's error, at its own position: readers give a byte offset, scanners
 * and parsers a mark, plus a context ("while parsing a block mapping") that
 * becomes a note where it started. */
static void syntax_error(builder_t *b, const yaml_parser_t *p) {
    const char *problem = p->problem ? p->problem : "invalid YAML";
    int tab;
    if (p->error == YAML_MEMORY_ERROR) {
        fail(b, DM_ENOMEM, NULL, "out of memory");
    } else if (p->error == YAML_READER_ERROR) {
        yaml_mark_t m = {0, 0, 0};
        int line, col;
        dm__text_pos(b->ds->buf, b->ds->len, p->problem_offset, &line, &col);
        m.line = (size_t)line - 1, m.column = (size_t)col - 1;
        fail(b, DM_ESYNTAX, &m, "%s", problem);
    } else if ((tab = dm__text_indent_tab(b->ds->buf, b->ds->len,
                                     (int)p->problem_mark.line + 1,
                                     (int)p->problem_mark.column + 1)) > 0) {
        /* libyaml's words for this ("found character that cannot start any
         * token", "found a tab character that violates indentation") do not
         * say what to do; its context note points elsewhere. */
        yaml_mark_t m = p->problem_mark;
        m.column = (size_t)tab - 1;
        fail(b, DM_ESYNTAX, &m, "tabs are not allowed for indentation in YAML; "
             "use spaces");
    } else {
        fail(b, DM_ESYNTAX, &p->problem_mark, "%s", problem);
        if (p->context)
            dm__diag_add(b->ds, DM_SEV_NOTE, (int)p->context_mark.line + 1,
                         (int)p->context_mark.column + 1, "", "%s", p->context);
    }
}

static bool check_utf8(builder_t *b) {
    size_t bad = dm__text_utf8_check(b->ds->buf, b->ds->len);
    if (bad == b->ds->len)
        return true;
    int line, col;
    dm__text_pos(b->ds->buf, b->ds->len, bad, &line, &col);
    yaml_mark_t m = {bad, (size_t)line - 1, (size_t)col - 1};
    fail(b, DM_ESYNTAX, &m, "invalid UTF-8 (byte 0x%02x); a policy must be UTF-8 text",
         (unsigned char)b->ds->buf[bad]);
    return false;
}

int dm__yaml_tree_load(dm__ytree_t *t, dm__dsrc_t *ds) {
    builder_t b = {.t = t, .ds = ds};
    yaml_parser_t p;
    yaml_event_t e;
    memset(t, 0, sizeof *t);
    t->root = -1;
    if (!check_utf8(&b))
        return b.rc;
    if (!yaml_parser_initialize(&p))
        return DM_ENOMEM;
    yaml_parser_set_input_string(&p, (const unsigned char *)(ds->len ? ds->buf : ""),
                                 ds->len);
    for (bool more = true; more;) {
        if (!yaml_parser_parse(&p, &e)) {
            syntax_error(&b, &p);
            break;
        }
        more = on_event(&b, &e);
        yaml_event_delete(&e);
        if (b.stop)
            break;
    }
    yaml_parser_delete(&p);
    return b.rc;
}

void dm__yaml_tree_free(dm__ytree_t *t) {
    free(t->nodes);
    free(t->text);
    memset(t, 0, sizeof *t);
    t->root = -1;
}
