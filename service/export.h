/*
 * export.h: what the stats-export files share (metrics.c renders, export.c
 * decides what runs and owns the textfile and discovery files, http.c serves).
 * Internal: never installed, nothing here is exported from the extension.
 *
 * Thread safety: the buffer functions work on caller-owned buffers; the
 * renderers read a caller-owned dm_stats_t and touch no shared state.
 */
#ifndef DM_SERVICE_EXPORT_H
#define DM_SERVICE_EXPORT_H

#include <stdbool.h>
#include <stddef.h>

#include "service/datamem_service.h"

/* A growable, NUL-terminated text buffer (malloc'ed); `failed` latches on out of
 * memory, so renderers write without checking each step. */
typedef struct dm_buf {
    char *p;
    size_t len, cap;
    bool failed;
} dm_buf_t;

void dm__buf_put(dm_buf_t *b, const char *s, size_t n);
void dm__buf_puts(dm_buf_t *b, const char *s);
void dm__buf_printf(dm_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal: quotes, backslash, control characters escaped. */
void dm__buf_json_str(dm_buf_t *b, const char *s);
/* Hands the text over (*out, *len) or frees it and returns DM_ENOMEM. */
int dm__buf_finish(dm_buf_t *b, char **out, size_t *len);

/* metrics.c. `const_labels` (already escaped, e.g. `pid="12"`, or NULL) is
 * added to every sample: the textfile uses it when several processes write
 * next to each other. */
void dm__metrics_text(const dm_stats_t *s, const char *const_labels, dm_buf_t *out);
typedef struct dm_svc_stats dm_svc_stats_t;
/* `svc` (or NULL) adds what the services know: "http" (the endpoint's
 * counters) and "threads_not_covered". */
void dm__metrics_json(const dm_stats_t *s, const dm_svc_stats_t *svc, dm_buf_t *out);

/* export.c: a fresh snapshot (with hugepage bytes) rendered in `format`. */
int dm__export_render(int format, const char *const_labels, char **out, size_t *len);

/* http.c: one server thread per listening socket (TCP or Unix). */
typedef struct dm_http dm_http_t;
/* Binds host:port (port 0: any free port) and serves; `url` gets
 * "http://host:port/metrics" with the numeric address actually bound. */
int dm__http_start_tcp(const char *hostport, dm_http_t **out, char *url, size_t cap);
/* Binds a Unix socket at `path` (mode 0600) and serves. */
int dm__http_start_unix(const char *path, dm_http_t **out);
/* Whether every address `hostport` resolves to is a loopback one; DM_ERANGE
 * for a malformed host:port (port outside 0-65535 included). */
int dm__http_check_address(const char *hostport, bool *loopback);
/* Stops the server thread, closes its socket, unlinks a Unix socket path. */
void dm__http_stop(dm_http_t *h);
/* In a forked child: the daemon's thread does not exist here. Closes the
 * inherited listening socket (so only the parent answers on it) and frees the
 * handle without touching the daemon (its few other fds stay open). */
void dm__http_forget_in_child(dm_http_t *h);
void dm__http_atfork_child(void); /* fork child: reset the log lock */

/* export.c: the policy's stats section after each install (outside the
 * engine's lock); the child's own endpoint after fork. */
void dm__export_configure(const dm_stats_spec_t *spec, uint64_t seq);
void dm__export_restart_in_child(void);

/* watch.c: the policy file watcher, told of installs and forks. */
void dm__watch_init(void);
void dm__watch_on_install(const dm_policy_t *p);
void dm__watch_on_fork_child(void);

/* The endpoint's own counters (all endpoints of the process): responses by
 * status code, connections dropped by reason. */
#define DM_HTTP_CODES {200, 400, 404, 405, 408, 414, 431, 500, 503}
#define DM_HTTP_NCODES 9
enum { DM_HTTP_DROP_DEADLINE, DM_HTTP_DROP_EVICTED, DM_HTTP_DROP_REFUSED, DM_HTTP_NDROP };
typedef struct dm_http_counters {
    int code[DM_HTTP_NCODES];
    uint64_t requests[DM_HTTP_NCODES];
    uint64_t dropped[DM_HTTP_NDROP];
} dm_http_counters_t;
void dm__http_counters(dm_http_counters_t *c);

/* What the services add to a snapshot: the endpoint's counters, the Python
 * threads that do not allocate through datamem (dm_stats_set_threads_not_covered)
 * and the process around the arenas (dm_stats_process). */
#define DM_UNCOVERED_NAMES_MAX 1024
struct dm_svc_stats {
    dm_http_counters_t http;
    int threads_not_covered;
    char uncovered_names[DM_UNCOVERED_NAMES_MAX]; /* NUL-separated, at most this */
    dm_process_stats_t process;
};
void dm__svc_stats(dm_svc_stats_t *out);
/* metrics.c: families datamem_http_*, datamem_threads_not_covered and the
 * process's (datamem_process_resident_bytes, datamem_outside_arenas_resident_bytes,
 * datamem_pyarrow_allocated_bytes). */
void dm__metrics_service_text(const dm_svc_stats_t *svc, const char *const_labels, dm_buf_t *out);

#endif /* DM_SERVICE_EXPORT_H */
