/*
 * buf.c: the services' text buffer (buf.h): grows by doubling from 4 KiB,
 * stays NUL-terminated, and latches `failed` on out of memory.
 *
 * Thread safety: works on caller-owned buffers only.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/datamem.h"
#include "service/buf.h"

static bool buf_reserve(dm_buf_t *b, size_t extra) {
    if (b->failed)
        return false;
    if (b->len + extra + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void dm__buf_put(dm_buf_t *b, const char *s, size_t n) {
    if (!buf_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void dm__buf_puts(dm_buf_t *b, const char *s) { dm__buf_put(b, s, strlen(s)); }

void dm__buf_printf(dm_buf_t *b, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = true;
        return;
    }
    if ((size_t)n < sizeof(small)) {
        dm__buf_put(b, small, (size_t)n);
        return;
    }
    if (!buf_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void dm__buf_json_str(dm_buf_t *b, const char *s) {
    dm__buf_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2] = {'\\', (char)*p};
            dm__buf_put(b, e, 2);
        } else if (*p < 0x20) {
            dm__buf_printf(b, "\\u%04x", *p);
        } else {
            dm__buf_put(b, (const char *)p, 1);
        }
    }
    dm__buf_put(b, "\"", 1);
}

int dm__buf_finish(dm_buf_t *b, char **out, size_t *len) {
    if (!b->failed && !b->p)
        buf_reserve(b, 0);
    if (b->failed) {
        free(b->p);
        *out = NULL;
        return DM_ENOMEM;
    }
    *out = b->p;
    if (len)
        *len = b->len;
    return 0;
}
