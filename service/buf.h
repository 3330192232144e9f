/*
 * buf.h: a growable, NUL-terminated text buffer (malloc'ed) that the renderers,
 * the endpoint and the discovery file write into. `failed` latches on out of
 * memory, so a writer goes on without checking each step and learns the
 * outcome once, from dm__buf_finish. Internal: never installed.
 *
 * Thread safety: works on caller-owned buffers only.
 */
#ifndef DM_SERVICE_BUF_H
#define DM_SERVICE_BUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct dm_buf {
    char *p;
    size_t len, cap;
    bool failed;
} dm_buf_t;

void dm__buf_put(dm_buf_t *b, const char *s, size_t n);
void dm__buf_puts(dm_buf_t *b, const char *s);
void dm__buf_printf(dm_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal: quotes, backslash, control characters escaped. */
void dm__buf_json_str(dm_buf_t *b, const char *s);
/* Hands the text over (*out, *len; len may be NULL) or frees it and returns
 * DM_ENOMEM. */
int dm__buf_finish(dm_buf_t *b, char **out, size_t *len);

#endif /* DM_SERVICE_BUF_H */
