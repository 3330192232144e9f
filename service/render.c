/*
 * render.c: a fresh snapshot of this process rendered: dm_stats_snapshot, the
 * hugepage bytes of each arena (dm_stats_hugepages, cached), what the services
 * add (svc_stats.c) and the process around the arenas (process.c), as
 * Prometheus text or JSON (metrics.c). The endpoint (http.c, through the
 * render function export.c hands it), the textfile (textfile.c) and
 * dm_stats_render_current all serve this.
 *
 * Thread safety: any thread. The hugepage cache is guarded by `hp_mu`, reset
 * in a fork child (dm__render_atfork_child: a scrape may have held it).
 */
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "service/buf.h"
#include "service/datamem_service.h"
#include "service/metrics.h"
#include "service/render.h"
#include "service/svc_stats.h"

/* ---- hugepages ----------------------------------------------------------- */

static pthread_mutex_t hp_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t hp_cache[DM_STATS_ARENAS_MAX];
static struct timespec hp_when;
static bool hp_valid;

int dm_stats_hugepages(dm_stats_t *s) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int rc = 0;
    pthread_mutex_lock(&hp_mu);
    int64_t age_ms = (now.tv_sec - hp_when.tv_sec) * 1000 +
                     (now.tv_nsec - hp_when.tv_nsec) / 1000000;
    if (!hp_valid || age_ms > DM_HUGEPAGE_MAX_AGE_MS || age_ms < 0) {
        uint64_t fresh[DM_STATS_ARENAS_MAX] = {0};
        rc = dm_runtime_hugepages(fresh, DM_STATS_ARENAS_MAX);
        if (rc == 0) {
            memcpy(hp_cache, fresh, sizeof(hp_cache));
            hp_when = now;
            hp_valid = true;
        }
    }
    for (int i = 0; i < s->narenas && i < DM_STATS_ARENAS_MAX; i++) {
        s->arenas[i].hugepage_bytes = hp_cache[i];
        /* jemalloc's `resident` is its own page accounting; a transparent
         * hugepage backs all 2 MiB of its range, pages jemalloc never touched
         * included, so the kernel's THP count is a floor for what is resident
         * (top once showed hugepage 268 MiB above resident 264 MiB). A
         * file-backed arena's resident bytes are the kernel's own count
         * (mincore), fresher than this cache. */
        if (!s->arenas[i].backed && s->arenas[i].resident < hp_cache[i])
            s->arenas[i].resident = hp_cache[i];
    }
    pthread_mutex_unlock(&hp_mu);
    return rc;
}

void dm__render_atfork_child(void) { pthread_mutex_init(&hp_mu, NULL); }

/* ---- rendering ------------------------------------------------------------ */

int dm__render_current(int format, const char *const_labels, char **out, size_t *len) {
    dm_stats_t *s = malloc(sizeof(*s));
    if (!s)
        return DM_ENOMEM;
    int rc = dm_stats_snapshot(s);
    if (rc == 0) {
        dm_stats_hugepages(s);
        dm_buf_t b = {0};
        dm_svc_stats_t svc;
        dm__svc_stats_read(&svc);
        dm_stats_process(s, &svc.process);
        if (format != DM_STATS_PROMETHEUS) {
            dm__metrics_json(s, &svc, format == DM_STATS_JSON_ALL ? INT_MAX : DM_STATS_JSON_TAGS,
                             &b);
        } else {
            dm__metrics_text(s, const_labels, &b);
            dm__metrics_service_text(&svc, const_labels, &b);
        }
        rc = dm__buf_finish(&b, out, len);
    }
    dm_stats_release(s);
    free(s);
    return rc;
}

int dm_stats_render_current(int format, char **out, size_t *len) {
    if (format != DM_STATS_JSON && format != DM_STATS_JSON_ALL && format != DM_STATS_PROMETHEUS)
        return DM_ERANGE;
    return dm__render_current(format, NULL, out, len);
}
