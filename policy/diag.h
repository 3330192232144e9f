/*
 * diag.h: error codes and caller-owned diagnostics.
 *
 * Every fallible datamem call returns 0 or a negative DM_E* code; the codes are
 * listed once below and the same list generates dm_strerror(). Human-readable
 * detail travels in a dm_diags_t the caller owns: filling it never allocates, so it
 * is safe on any path (a fixed number of entries, the rest only counted).
 */
#ifndef DM_DIAG_H
#define DM_DIAG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DM_ERRNO_MAP(X)                                                        \
    X(OK, 0, "success")                                                        \
    X(NOMEM, -1, "out of memory")                                              \
    X(IO, -2, "cannot read file")                                              \
    X(TOOBIG, -3, "file too large")                                            \
    X(SYNTAX, -4, "YAML syntax error")                                         \
    X(INVALID, -5, "invalid policy")                                           \
    X(ARENA, -6, "cannot create arena")                                        \
    X(STATE, -7, "not allowed in the current state")                           \
    X(RANGE, -8, "value out of range")                                         \
    X(SYS, -9, "system call failed")                                           \
    X(DENIED, -10, "refused: not a loopback address")                          \
    X(UNSAFE, -11, "refused: not owned by this user, or writable by others")  \
    X(NOENT, -12, "no such entry")                                             \
    X(SUPERSEDED, -13, "another policy was installed meanwhile")

typedef enum {
#define DM_E_ENUM(name, val, msg) DM_E##name = (val),
    DM_ERRNO_MAP(DM_E_ENUM)
#undef DM_E_ENUM
} dm_err_t;

const char *dm_strerror(int code);

typedef enum { DM_SEV_ERROR = 0, DM_SEV_WARNING = 1, DM_SEV_NOTE = 2 } dm_severity_t;

#define DM_DIAG_MAX 32 /* entries kept; later ones are only counted */

typedef struct dm_diag {
    dm_severity_t severity;
    int line, col;      /* 1-based; 0 when not tied to a position */
    char path[128];     /* key path, e.g. "arenas.big.alignment" */
    char msg[384];
    char source[160];   /* the offending source line, "" if none */
    int repeats;        /* later entries with the same severity, path and
                           message, folded into this one (not kept) */
} dm_diag_t;

typedef struct dm_diags {
    char file[256];     /* file name used in messages */
    int n;              /* entries in items (<= DM_DIAG_MAX) */
    int nerrors;        /* all errors, including dropped ones */
    int nwarnings;
    int folding;        /* the last entry was folded: drop its notes too */
    dm_diag_t items[DM_DIAG_MAX];
} dm_diags_t;

void dm_diags_init(dm_diags_t *d, const char *file);

/* Formats one entry like a compiler: "file:line:col: error: path: msg", then the
 * source line and a caret; "(and N more like this)" after the message when
 * N repeats were folded into it. Returns the length written (snprintf
 * semantics). */
int dm_diag_format(const dm_diags_t *d, int i, char *buf, size_t cap);

/* Formats every entry, and a "... and N more" line when some were dropped.
 * Only the first entry with a source line quotes it (and its caret); the
 * others give file:line:col only, so a report never quotes more than one line
 * of whatever file it read. */
int dm_diags_format_all(const dm_diags_t *d, char *buf, size_t cap);

/* As dm_diags_format_all, with the source line and caret under every entry
 * that has one: for a file the user named to a checker (`python -m datamem
 * check`), never for the policy a job runs under. */
int dm_diags_format_quoted(const dm_diags_t *d, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* DM_DIAG_H */
