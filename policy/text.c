/*
 * text.c: byte-level text helpers for diagnostics: positions that agree with
 * libyaml's marks, UTF-8 validation, safe quoting of untrusted text, the
 * nearest-name search behind "did you mean", and an snprintf-style buffer.
 *
 * Pure functions on their arguments; no allocation, no globals.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "policy/internal.h"

/* ---- positions --------------------------------------------------------- */

/* Length of the line break at i (libyaml's: \n, \r, \r\n, NEL, LS, PS), or 0. */
static size_t break_len(const unsigned char *b, size_t len, size_t i) {
    if (b[i] == '\n')
        return 1;
    if (b[i] == '\r')
        return (i + 1 < len && b[i + 1] == '\n') ? 2 : 1;
    if (b[i] == 0xC2 && i + 1 < len && b[i + 1] == 0x85)
        return 2;
    if (b[i] == 0xE2 && i + 2 < len && b[i + 1] == 0x80 &&
        (b[i + 2] == 0xA8 || b[i + 2] == 0xA9))
        return 3;
    return 0;
}

/* Bytes of the (possibly invalid) character at i: never 0, never past len. */
static size_t char_len(const unsigned char *b, size_t len, size_t i) {
    size_t n = b[i] < 0x80 ? 1 : (b[i] & 0xE0) == 0xC0 ? 2
             : (b[i] & 0xF0) == 0xE0 ? 3 : (b[i] & 0xF8) == 0xF0 ? 4 : 1;
    return (i + n > len) ? len - i : n;
}

static size_t skip_bom(const unsigned char *b, size_t len) {
    return (len >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF) ? 3 : 0;
}

void dm__text_pos(const char *buf, size_t len, size_t off, int *line, int *col) {
    const unsigned char *b = (const unsigned char *)buf;
    int l = 1, c = 1;
    size_t i = skip_bom(b, len);
    while (i < off && i < len) {
        size_t k = break_len(b, len, i);
        if (k) {
            l++, c = 1, i += k;
        } else {
            c++, i += char_len(b, len, i);
        }
    }
    *line = l, *col = c;
}

/* [*start, *end) of 1-based `line`; false when the text is shorter. */
static bool line_span(const unsigned char *b, size_t len, int line,
                      size_t *start, size_t *end) {
    size_t i = skip_bom(b, len);
    for (int l = 1; l < line; l++) {
        size_t k = 0;
        while (i < len && !(k = break_len(b, len, i)))
            i++;
        if (i >= len)
            return false;
        i += k;
    }
    *start = i;
    while (i < len && !break_len(b, len, i))
        i++;
    *end = i;
    return true;
}

/* ---- UTF-8 ------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at i (RFC 3629: no overlongs, no
 * surrogates, <= U+10FFFF), or 0. */
static size_t utf8_seq(const unsigned char *b, size_t len, size_t i) {
    unsigned c = b[i];
    size_t n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        n = 3, lo = (c == 0xE0) ? 0xA0 : 0x80, hi = (c == 0xED) ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4)
        n = 4, lo = (c == 0xF0) ? 0x90 : 0x80, hi = (c == 0xF4) ? 0x8F : 0xBF;
    else
        return 0;
    if (i + n > len || b[i + 1] < lo || b[i + 1] > hi)
        return 0;
    for (size_t k = 2; k < n; k++)
        if ((b[i + k] & 0xC0) != 0x80)
            return 0;
    return n;
}

size_t dm__text_utf8_check(const char *buf, size_t len) {
    const unsigned char *b = (const unsigned char *)buf;
    for (size_t i = 0; i < len;) {
        size_t n = utf8_seq(b, len, i);
        if (!n)
            return i;
        i += n;
    }
    return len;
}

/* Copies [start, end) into dst (cap bytes), replacing control characters and
 * invalid UTF-8 by '?', never cutting a character in two. */
static void copy_clean(char *dst, size_t cap, const unsigned char *b,
                       size_t start, size_t end) {
    size_t o = 0;
    for (size_t i = start; i < end;) {
        size_t n = utf8_seq(b, end, i);
        if (!n || (n == 1 && b[i] < 0x20 && b[i] != '\t') || b[i] == 0x7F)
            n = 0;
        if (o + (n ? n : 1) >= cap)
            break;
        if (n) {
            memcpy(dst + o, b + i, n);
            o += n, i += n;
        } else {
            dst[o++] = '?', i++;
        }
    }
    dst[o] = '\0';
}

void dm__text_source_line(const char *buf, size_t len, int line, char *dst,
                     size_t cap) {
    size_t s, e;
    dst[0] = '\0';
    if (buf && line > 0 && line_span((const unsigned char *)buf, len, line, &s, &e))
        copy_clean(dst, cap, (const unsigned char *)buf, s, e);
}

int dm__text_indent_tab(const char *buf, size_t len, int line, int col) {
    const unsigned char *b = (const unsigned char *)buf;
    size_t s, e, i;
    if (!buf || line <= 0 || !line_span(b, len, line, &s, &e))
        return 0;
    for (i = s; i < e && b[i] == ' '; i++)
        ;
    if (i >= e || b[i] != '\t')
        return 0;
    size_t tab = i; /* the first tab; the blanks go on to the first token */
    while (i < e && (b[i] == ' ' || b[i] == '\t'))
        i++;
    return col >= 1 && (size_t)col <= i - s + 1 ? (int)(tab - s) + 1 : 0;
}

const char *dm__text_quote(char *buf, size_t cap, const char *s, size_t len) {
    const unsigned char *b = (const unsigned char *)s;
    dm__sbuf_t sb;
    dm__text_sb_init(&sb, buf, cap);
    dm__text_sb_putc(&sb, '\'', 1);
    for (size_t i = 0; i < len;) {
        size_t n = utf8_seq(b, len, i);
        if (sb.len + 8 >= cap) {
            dm__text_sb_printf(&sb, "...");
            break;
        }
        if (n > 1) {
            dm__text_sb_printf(&sb, "%.*s", (int)n, s + i);
        } else if (n == 1 && b[i] >= 0x20 && b[i] < 0x7F) {
            dm__text_sb_printf(&sb, "%s%c", b[i] == '\'' || b[i] == '\\' ? "\\" : "",
                          b[i]);
        } else {
            dm__text_sb_printf(&sb, "\\x%02x", b[i]);
            n = 1;
        }
        i += n;
    }
    dm__text_sb_putc(&sb, '\'', 1);
    dm__text_sb_done(&sb);
    return buf;
}

/* ---- nearest name ------------------------------------------------------ */

#define DIST_MAXLEN 64

/* Optimal string alignment distance (a swap of neighbours costs 1). */
static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    int d[3][DIST_MAXLEN + 1]; /* rows i-2, i-1, i */
    if (la > DIST_MAXLEN || lb > DIST_MAXLEN)
        return INT_MAX;
    for (size_t j = 0; j <= lb; j++)
        d[0][j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int *cur = d[i % 3], *prev = d[(i + 2) % 3], *pp = d[(i + 1) % 3];
        cur[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int cost = a[i - 1] != b[j - 1];
            int v = prev[j - 1] + cost;
            if (prev[j] + 1 < v)
                v = prev[j] + 1;
            if (cur[j - 1] + 1 < v)
                v = cur[j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                pp[j - 2] + 1 < v)
                v = pp[j - 2] + 1;
            cur[j] = v;
        }
    }
    return d[la % 3][lb];
}

const char *dm__text_nearest(const char *word, const char *const *cands, int n) {
    int len = (int)strlen(word);
    int limit = len / 3 < 1 ? 1 : len / 3 > 3 ? 3 : len / 3;
    const char *best = NULL;
    int bestd = limit + 1;
    for (int i = 0; i < n; i++) {
        int d = edit_distance(word, cands[i]);
        if (d < bestd)
            bestd = d, best = cands[i];
    }
    return best;
}

/* ---- string building --------------------------------------------------- */

void dm__text_sb_init(dm__sbuf_t *b, char *p, size_t cap) {
    b->p = p, b->cap = cap, b->len = 0;
    if (cap)
        p[0] = '\0';
}

void dm__text_sb_printf(dm__sbuf_t *b, const char *fmt, ...) {
    size_t room = b->len < b->cap ? b->cap - b->len : 0;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(room ? b->p + b->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        b->len += (size_t)n;
}

void dm__text_sb_putc(dm__sbuf_t *b, char c, size_t count) {
    for (size_t i = 0; i < count; i++, b->len++)
        if (b->len + 1 < b->cap)
            b->p[b->len] = c;
}

int dm__text_sb_done(dm__sbuf_t *b) {
    if (b->cap)
        b->p[b->len < b->cap ? b->len : b->cap - 1] = '\0';
    return b->len > INT_MAX ? INT_MAX : (int)b->len;
}
