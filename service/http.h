/*
 * http.h: the stats endpoint's server (http.c): one thread per listening socket
 * (TCP or Unix), its limits, and its own counters. It renders nothing itself:
 * whoever starts a server hands it the function that renders a snapshot
 * (dm_http_render_t), so the server depends on no module above it and a test
 * can serve a fixed body. Internal: never installed.
 *
 * Thread safety: start and stop are serialised by the caller (export.c's
 * mutex); the counters are relaxed atomics, readable from any thread.
 */
#ifndef DM_SERVICE_HTTP_H
#define DM_SERVICE_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Renders a fresh snapshot in `format` (DM_STATS_PROMETHEUS or DM_STATS_JSON)
 * into a malloc'ed buffer (*out, *len); 0 or a negative code (the request is
 * answered 500). Called on the server's thread. */
typedef int (*dm_http_render_t)(int format, char **out, size_t *len);

typedef struct dm_http dm_http_t;

/* Binds host:port (port 0: any free port) and serves; `url` gets
 * "http://host:port/metrics" with the numeric address actually bound. */
int dm__http_start_tcp(const char *hostport, dm_http_render_t render, dm_http_t **out,
                       char *url, size_t cap);
/* Binds a Unix socket at `path` (mode 0600) and serves. */
int dm__http_start_unix(const char *path, dm_http_render_t render, dm_http_t **out);
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

#endif /* DM_SERVICE_HTTP_H */
