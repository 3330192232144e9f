/*
 * buf.c: the services' text buffer (buf.h): grows by doubling from 4 KiB,
 * stays NUL-terminated, and latches `failed` on out of memory.
 *
 * Thread safety: works on caller-owned buffers only.
 */
#include <stdarg.h>
#include <stdbool.h>
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

/* Length of the well-formed UTF-8 sequence at p (n bytes left), or 0 when
 * the byte at p begins none (RFC 3629: no overlong forms, no surrogates, no
 * code point past U+10FFFF). */
static size_t utf8_len(const unsigned char *p, size_t n) {
    unsigned char c = p[0];
    if (c < 0x80)
        return 1;
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf; /* bounds of the second byte */
    if (c >= 0xc2 && c <= 0xdf)
        len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0; /* overlong */
        else if (c == 0xed)
            hi = 0x9f; /* UTF-16 surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90; /* overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* past U+10FFFF */
    } else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return len;
}

void dm__buf_text(dm_buf_t *b, const char *s, size_t n, dm_text_esc_t how) {
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    while (p < end) {
        size_t k = utf8_len(p, (size_t)(end - p));
        unsigned char c = *p;
        if (k > 1 || (k == 1 && c >= 0x20 && c != 0x7f && c != '"' && c != '\\'))
            dm__buf_put(b, (const char *)p, k);
        else if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            dm__buf_put(b, e, 2);
        } else if (k == 1 && how == DM_TEXT_JSON)
            dm__buf_printf(b, "\\u%04x", c); /* a control character, DEL */
        else if (k == 1 && c == '\n')
            dm__buf_put(b, "\\n", 2);
        else /* not UTF-8, or a control the label format has no escape for */
            dm__buf_printf(b, "\\\\x%02x", c);
        p += k ? k : 1;
    }
}

void dm__buf_json_str(dm_buf_t *b, const char *s) {
    dm__buf_put(b, "\"", 1);
    dm__buf_text(b, s, strlen(s), DM_TEXT_JSON);
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
