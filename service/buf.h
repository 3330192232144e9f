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
/* Text from outside (a policy path, argv, a thread, arena or tag name) as
 * valid UTF-8, escaped for where it goes: every emitter of the services
 * writes such text through here, so all they serve and write is valid UTF-8.
 * A byte that does not begin a well-formed UTF-8 sequence (a Latin-1 file
 * name, a name cut inside a character) becomes the four characters \xNN,
 * as Python's "backslashreplace" writes it (the byte is named, not lost; a
 * name that holds the text \xNN itself reads the same). Then:
 *   DM_TEXT_JSON   the inside of a JSON string: `"` and `\` escaped, control
 *                  characters and DEL as \u00NN;
 *   DM_TEXT_LABEL  a Prometheus label value (format 0.0.4): `"`, `\` and
 *                  newline escaped, the other controls and DEL as the text
 *                  \xNN (the format has no escape for them). */
typedef enum { DM_TEXT_JSON, DM_TEXT_LABEL } dm_text_esc_t;
void dm__buf_text(dm_buf_t *b, const char *s, size_t n, dm_text_esc_t how);
/* A JSON string literal of `s` (dm__buf_text's DM_TEXT_JSON, in quotes). */
void dm__buf_json_str(dm_buf_t *b, const char *s);
/* Hands the text over (*out, *len; len may be NULL) or frees it and returns
 * DM_ENOMEM. */
int dm__buf_finish(dm_buf_t *b, char **out, size_t *len);

#endif /* DM_SERVICE_BUF_H */
