/*
 * metrics.h: a snapshot as Prometheus text exposition (format 0.0.4) and as
 * JSON (metrics.c). Internal: never installed; dm_stats_render is the public
 * form (datamem_service.h).
 *
 * Thread safety: pure functions of their arguments.
 */
#ifndef DM_SERVICE_METRICS_H
#define DM_SERVICE_METRICS_H

#include "service/buf.h"
#include "service/datamem_service.h"
#include "service/svc_stats.h"

/* `const_labels` (already escaped, e.g. `pid="12"`, or NULL) is added to every
 * sample: the textfile uses it when several processes write next to each other. */
void dm__metrics_text(const dm_stats_t *s, const char *const_labels, dm_buf_t *out);
/* `svc` (or NULL) adds what the services know: "http" (the endpoint's
 * counters), "threads_not_covered" and the process's numbers. "tags" holds
 * the `tags_max` biggest and "(other)" (DM_STATS_JSON_TAGS for /stats.json,
 * INT_MAX for datamem.stats(): every row). */
void dm__metrics_json(const dm_stats_t *s, const dm_svc_stats_t *svc, int tags_max,
                      dm_buf_t *out);
/* Families datamem_http_*, datamem_threads_not_covered and the process's
 * (datamem_process_resident_bytes, datamem_outside_arenas_resident_bytes,
 * datamem_pyarrow_allocated_bytes). */
void dm__metrics_service_text(const dm_svc_stats_t *svc, const char *const_labels, dm_buf_t *out);

#endif /* DM_SERVICE_METRICS_H */
