/*
 * page.h: the stats endpoint's page (service/page/index.html), compiled into the
 * library by tools/embed_page.py (the generated page_html.c). Internal.
 *
 * Thread safety: constant data.
 */
#ifndef DM_RUNTIME_PAGE_H
#define DM_RUNTIME_PAGE_H

#include <stddef.h>

/* The page's bytes (UTF-8 HTML, static, *len bytes) and the
 * Content-Security-Policy to serve with it (*policy: it allows the page's own
 * inline style and script by hash, and requests to its own origin only). */
const char *dm__page_index(size_t *len, const char **policy);

#endif /* DM_RUNTIME_PAGE_H */
