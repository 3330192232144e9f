/*
 * diag.c: error codes and compiler-style diagnostics.
 *
 * A dm_diags_t is caller-owned and fixed-size: adding an entry copies into it and
 * never allocates, so any path (including out-of-memory ones) may report. Entries
 * past DM_DIAG_MAX are only counted. Not thread-safe per dm_diags_t (one parse
 * owns one), reentrant otherwise.
 */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "policy/internal.h"

const char *dm_strerror(int code) {
    switch (code) {
#define DM_E_CASE(name, val, msg)                                              \
    case (val):                                                                \
        return msg;
        DM_ERRNO_MAP(DM_E_CASE)
#undef DM_E_CASE
    default:
        return "unknown error";
    }
}

void dm_diags_init(dm_diags_t *d, const char *file) {
    memset(d, 0, sizeof *d);
    snprintf(d->file, sizeof d->file, "%s", file ? file : "");
}

/* The kept entry with this severity, path and message, or NULL. */
static dm_diag_t *same_cause(dm_diags_t *d, dm_severity_t sev, const char *path,
                             const char *msg) {
    for (int i = 0; i < d->n; i++) {
        dm_diag_t *e = &d->items[i];
        if (e->severity == sev && strcmp(e->path, path) == 0 &&
            strcmp(e->msg, msg) == 0)
            return e;
    }
    return NULL;
}

/* An entry that repeats a kept one (same severity, path and message: one
 * cause at many places, e.g. 81 aliases in a hostile file) is folded into it
 * as a count, with its notes, rather than kept: otherwise one cause fills
 * every slot and hides the others. */
void dm__diag_vadd(dm__dsrc_t *s, dm_severity_t sev, int line, int col,
                   const char *path, const char *fmt, va_list ap) {
    dm_diags_t *d = s->d;
    char msg[sizeof d->items[0].msg];
    dm_diag_t *same = NULL;
    if (!path)
        path = "";
    if (sev == DM_SEV_NOTE && d->folding)
        return;
    if (sev == DM_SEV_ERROR)
        d->nerrors++;
    else if (sev == DM_SEV_WARNING)
        d->nwarnings++;
    vsnprintf(msg, sizeof msg, fmt, ap);
    d->folding = sev != DM_SEV_NOTE && (same = same_cause(d, sev, path, msg));
    if (d->folding)
        same->repeats++;
    if (d->folding || d->n >= DM_DIAG_MAX)
        return;
    dm_diag_t *e = &d->items[d->n++];
    e->severity = sev;
    e->line = line > 0 ? line : 0;
    e->col = line > 0 && col > 0 ? col : 0;
    e->repeats = 0;
    snprintf(e->path, sizeof e->path, "%s", path);
    memcpy(e->msg, msg, sizeof msg);
    dm__text_source_line(s->buf, s->len, e->line, e->source, sizeof e->source);
}

void dm__diag_add(dm__dsrc_t *s, dm_severity_t sev, int line, int col,
                  const char *path, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dm__diag_vadd(s, sev, line, col, path, fmt, ap);
    va_end(ap);
}

/* Position of the group (an entry and the notes after it) that i starts. */
static long group_key(const dm_diags_t *d, int i) {
    return (long)d->items[i].line * 100000L + d->items[i].col;
}

void dm__diag_sort(dm_diags_t *d) {
    int start[DM_DIAG_MAX], ng = 0;
    static const dm_diag_t zero;
    dm_diag_t tmp[DM_DIAG_MAX];
    for (int i = 0; i < d->n; i++)
        if (i == 0 || d->items[i].severity != DM_SEV_NOTE)
            start[ng++] = i;
    /* insertion sort of group starts: stable, n <= DM_DIAG_MAX */
    for (int a = 1; a < ng; a++) {
        int v = start[a], b = a;
        for (; b > 0 && group_key(d, start[b - 1]) > group_key(d, v); b--)
            start[b] = start[b - 1];
        start[b] = v;
    }
    int o = 0;
    for (int g = 0; g < ng; g++) {
        int i = start[g];
        do
            tmp[o++] = d->items[i++];
        while (i < d->n && d->items[i].severity == DM_SEV_NOTE);
    }
    for (int i = 0; i < o; i++)
        d->items[i] = tmp[i];
    for (int i = o; i < d->n; i++)
        d->items[i] = zero;
}

static const char *const sev_name[] = {"error", "warning", "note"};

/* The line under the source: blanks (tabs where the source has them) up to
 * the column, then a caret. */
static void put_caret(dm__sbuf_t *b, const dm_diag_t *e) {
    const unsigned char *s = (const unsigned char *)e->source;
    int c = 1;
    for (; c < e->col && *s; c++) {
        dm__text_sb_putc(b, *s == '\t' ? '\t' : ' ', 1);
        s++;
        while ((*s & 0xC0) == 0x80) /* rest of a UTF-8 character */
            s++;
    }
    if (e->col - c > 0)
        dm__text_sb_putc(b, ' ', (size_t)(e->col - c < 200 ? e->col - c : 200));
    dm__text_sb_printf(b, "^\n");
}

/* `quote`: put the offending source line (and a caret) under it. */
static void format_one(dm__sbuf_t *b, const dm_diags_t *d, int i, bool quote) {
    const dm_diag_t *e = &d->items[i];
    const char *file = d->file[0] ? d->file : "<policy>";
    if (e->line > 0)
        dm__text_sb_printf(b, "%s:%d:%d: ", file, e->line, e->col);
    else
        dm__text_sb_printf(b, "%s: ", file);
    dm__text_sb_printf(b, "%s: %s%s%s", sev_name[e->severity % 3], e->path,
                  e->path[0] ? ": " : "", e->msg);
    if (e->repeats > 0)
        dm__text_sb_printf(b, " (and %d more like this)", e->repeats);
    dm__text_sb_printf(b, "\n");
    if (quote && e->line > 0 && e->source[0]) {
        dm__text_sb_printf(b, "%s\n", e->source);
        put_caret(b, e);
    }
}

int dm_diag_format(const dm_diags_t *d, int i, char *buf, size_t cap) {
    dm__sbuf_t b;
    dm__text_sb_init(&b, buf, cap);
    if (i >= 0 && i < d->n)
        format_one(&b, d, i, true);
    return dm__text_sb_done(&b);
}

/* `every`: quote the source line under each diagnostic that has one; else under
 * the first only (and under others on that same line). */
static int format_all(const dm_diags_t *d, char *buf, size_t cap, bool every) {
    dm__sbuf_t b;
    int kept = 0;
    dm__text_sb_init(&b, buf, cap);
    int quoted = 0; /* the line quoted, 0 while none */
    for (int i = 0; i < d->n; i++) {
        const dm_diag_t *e = &d->items[i];
        bool quote = e->line > 0 && e->source[0] && (every || !quoted || e->line == quoted);
        format_one(&b, d, i, quote);
        if (quote && !quoted)
            quoted = e->line;
        if (d->items[i].severity != DM_SEV_NOTE)
            kept += 1 + d->items[i].repeats;
    }
    int more = d->nerrors + d->nwarnings - kept;
    if (more > 0)
        dm__text_sb_printf(&b, "... and %d more (%d error%s and %d warning%s in all)\n",
                      more, d->nerrors, DM__PLURAL(d->nerrors),
                      d->nwarnings, DM__PLURAL(d->nwarnings));
    return dm__text_sb_done(&b);
}

/* One source line at most, the first diagnostic's that has one (again under
 * the others on that same line, with their carets): the rest say where
 * (file:line:col) without quoting. A job's report (start-up, reload) never
 * copies a file out line by line, whatever file the policy path turned out
 * to name (docs/security.md). */
int dm_diags_format_all(const dm_diags_t *d, char *buf, size_t cap) {
    return format_all(d, buf, cap, false);
}

/* `python -m datamem check FILE`: the user named the file and reads it with
 * their own rights, so each diagnostic gets its line and caret. */
int dm_diags_format_quoted(const dm_diags_t *d, char *buf, size_t cap) {
    return format_all(d, buf, cap, true);
}
