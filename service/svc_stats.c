/*
 * svc_stats.c: what the services add to a snapshot (svc_stats.h): the
 * endpoint's counters (http.c's) and the Python threads that do not allocate
 * through datamem, as the Python layer last counted them
 * (dm_stats_set_threads_not_covered).
 *
 * Thread safety: the thread list is guarded by `uncovered_mu`, reset in a fork
 * child (dm__svc_stats_atfork_child: a scrape may have held it).
 */
#include <pthread.h>
#include <string.h>

#include "service/datamem_service.h"
#include "service/http.h"
#include "service/svc_stats.h"

static pthread_mutex_t uncovered_mu = PTHREAD_MUTEX_INITIALIZER;
static int uncovered_n;
static char uncovered_names[DM_UNCOVERED_NAMES_MAX];

void dm_stats_set_threads_not_covered(const char *const *names, int n) {
    pthread_mutex_lock(&uncovered_mu);
    size_t off = 0;
    int kept = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(names[i]);
        if (off + l + 2 > sizeof(uncovered_names))
            break; /* the count stays exact; the list is cut */
        memcpy(uncovered_names + off, names[i], l + 1);
        off += l + 1;
        kept++;
    }
    uncovered_names[off] = 0;
    uncovered_n = n;
    (void)kept;
    pthread_mutex_unlock(&uncovered_mu);
}

void dm__svc_stats_read(dm_svc_stats_t *out) {
    dm__http_counters(&out->http);
    pthread_mutex_lock(&uncovered_mu);
    out->threads_not_covered = uncovered_n;
    memcpy(out->uncovered_names, uncovered_names, sizeof(uncovered_names));
    pthread_mutex_unlock(&uncovered_mu);
    dm_watch_counts(&out->watch_reloads, &out->watch_unchanged);
}

void dm__svc_stats_atfork_child(void) { pthread_mutex_init(&uncovered_mu, NULL); }
