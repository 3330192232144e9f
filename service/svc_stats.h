/*
 * svc_stats.h: what the services add to a snapshot (svc_stats.c): the
 * endpoint's counters, the Python threads that do not allocate through datamem
 * (dm_stats_set_threads_not_covered), the policy watcher's counts and the
 * process around the arenas
 * (dm_stats_process). Internal: never installed.
 *
 * Thread safety: dm__svc_stats_read may be called from any thread.
 */
#ifndef DM_SERVICE_SVC_STATS_H
#define DM_SERVICE_SVC_STATS_H

#include "service/datamem_service.h"
#include "service/http.h"

#define DM_UNCOVERED_NAMES_MAX 1024
typedef struct dm_svc_stats {
    dm_http_counters_t http;
    int threads_not_covered;
    char uncovered_names[DM_UNCOVERED_NAMES_MAX]; /* NUL-separated, at most this */
    uint64_t watch_reloads, watch_unchanged;      /* dm_watch_counts */
    dm_process_stats_t process;
} dm_svc_stats_t;

/* The counters, the uncovered threads and the watcher's counts; `process` is left to the caller
 * (dm_stats_process needs the snapshot). */
void dm__svc_stats_read(dm_svc_stats_t *out);
/* Fork child: a scrape may have held the lock of the uncovered-threads list. */
void dm__svc_stats_atfork_child(void);

#endif /* DM_SERVICE_SVC_STATS_H */
