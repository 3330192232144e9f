/*
 * render.h: a fresh snapshot of this process, with hugepage bytes and what the
 * services add, rendered (render.c): what GET /metrics, /stats.json, the
 * textfile and dm_stats_render_current serve. Internal: never installed.
 *
 * Thread safety: any thread; the hugepage cache has its own lock.
 */
#ifndef DM_SERVICE_RENDER_H
#define DM_SERVICE_RENDER_H

#include <stddef.h>

/* `format`: DM_STATS_PROMETHEUS or DM_STATS_JSON; `const_labels` as
 * dm__metrics_text's (Prometheus only). free(*out). */
int dm__render_current(int format, const char *const_labels, char **out, size_t *len);
/* Fork child: a scrape may have held the hugepage cache's lock. */
void dm__render_atfork_child(void);

#endif /* DM_SERVICE_RENDER_H */
