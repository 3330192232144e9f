/*
 * http.c: the stats endpoint — GET /metrics (Prometheus text 0.0.4) and GET
 * /stats.json — served by libmicrohttpd's own thread, so it answers while
 * Python holds the GIL (the handler never touches Python).
 *
 * We bind the listening socket ourselves and hand it to MHD
 * (MHD_OPTION_LISTEN_SOCKET): one path for TCP and Unix sockets, our own
 * message for "address in use", and the bound port for port 0. Requests are
 * bounded: headers must fit a 16 KiB connection pool, a connection idle for 10 s
 * is closed, at most 16 connections per endpoint. Only GET and HEAD are
 * answered (405 otherwise, with Allow), only the two paths (404 otherwise).
 *
 * libmicrohttpd is loaded with dlopen the first time an endpoint starts, not
 * linked: Debian's libmicrohttpd12 pulls in GnuTLS, whose constructor costs
 * about 4.4 ms at every interpreter start (measured here: `python -S -c` with and
 * without loading it, 20 runs, medians) — paid by every worker of every job,
 * most of which never serve stats. Without the library the endpoint is off
 * with a logged reason; the job runs on.
 *
 * Thread safety: start and stop are serialised by export.c's mutex. The
 * handler runs on MHD's thread and only reads a fresh snapshot.
 */
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <microhttpd.h>

#include "runtime/export.h"
#include "runtime/internal.h"

#define HTTP_CONN_MEMORY (16 * 1024) /* request line + headers must fit */
#define HTTP_CONN_LIMIT 16u
#define HTTP_TIMEOUT_S 10u
#define HTTP_BACKLOG 64

struct dm_http {
    struct MHD_Daemon *daemon;
    int fd;              /* the listening socket (MHD closes it on stop) */
    char unix_path[108]; /* "" for TCP */
    pid_t pid;           /* who bound it: only that process unlinks the path */
};

/* ---- libmicrohttpd, loaded on first use ------------------------------------ */

static struct {
    struct MHD_Daemon *(*start_daemon)(unsigned int, uint16_t, MHD_AcceptPolicyCallback, void *,
                                       MHD_AccessHandlerCallback, void *, ...);
    void (*stop_daemon)(struct MHD_Daemon *);
    struct MHD_Response *(*response_from_buffer_free)(size_t, void *,
                                                      MHD_ContentReaderFreeCallback);
    enum MHD_Result (*add_header)(struct MHD_Response *, const char *, const char *);
    enum MHD_Result (*queue_response)(struct MHD_Connection *, unsigned int,
                                      struct MHD_Response *);
    void (*destroy_response)(struct MHD_Response *);
    bool ok;
    char error[256];
} mhd;

static pthread_once_t mhd_once = PTHREAD_ONCE_INIT;

static void mhd_load(void) {
    void *h = dlopen("libmicrohttpd.so.12", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        h = dlopen("libmicrohttpd.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(mhd.error, sizeof(mhd.error), "%s (install libmicrohttpd12)", dlerror());
        return;
    }
#define SYM(field, name)                                                        \
    do {                                                                        \
        *(void **)&mhd.field = dlsym(h, name);                                  \
        if (!mhd.field) {                                                       \
            snprintf(mhd.error, sizeof(mhd.error), "libmicrohttpd lacks %s", name); \
            return;                                                             \
        }                                                                       \
    } while (0)
    SYM(start_daemon, "MHD_start_daemon");
    SYM(stop_daemon, "MHD_stop_daemon");
    SYM(response_from_buffer_free, "MHD_create_response_from_buffer_with_free_callback");
    SYM(add_header, "MHD_add_response_header");
    SYM(queue_response, "MHD_queue_response");
    SYM(destroy_response, "MHD_destroy_response");
#undef SYM
    mhd.ok = true; /* the handle stays open for the process */
}

/* ---- the handler --------------------------------------------------------------- */

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, const char *ctype,
                             char *body, size_t len) {
    struct MHD_Response *r = mhd.response_from_buffer_free(len, body, free);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    mhd.add_header(r, "Content-Type", ctype);
    mhd.add_header(r, "Cache-Control", "no-store");
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        mhd.add_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = mhd.queue_response(c, status, r);
    mhd.destroy_response(r);
    return ret;
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned status, const char *text) {
    char *body = strdup(text);
    if (!body)
        return MHD_NO;
    return reply(c, status, "text/plain; charset=utf-8", body, strlen(body));
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed: use GET\n");
    int format;
    const char *ctype;
    if (strcmp(url, "/metrics") == 0) {
        format = DM_STATS_PROMETHEUS;
        ctype = "text/plain; version=0.0.4; charset=utf-8";
    } else if (strcmp(url, "/stats.json") == 0) {
        format = DM_STATS_JSON;
        ctype = "application/json";
    } else {
        return reply_text(c, MHD_HTTP_NOT_FOUND, "not found: try /metrics or /stats.json\n");
    }
    char *body = NULL;
    size_t len = 0;
    if (dm__export_render(format, NULL, &body, &len) != 0)
        return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "cannot take a snapshot\n");
    return reply(c, MHD_HTTP_OK, ctype, body, len);
}

static void on_log(void *cls, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n')
        msg[--n] = 0;
    dm__log("datamem: stats: %s", msg);
}

/* ---- sockets ---------------------------------------------------------------------- */

/* "127.0.0.1:9100", "[::1]:0", "localhost:9100" -> host and port strings. */
static int split_hostport(const char *hp, char *host, size_t hcap, char *port, size_t pcap) {
    const char *colon = strrchr(hp, ':');
    if (!colon || colon == hp || !colon[1])
        return DM_ERANGE;
    const char *h = hp;
    size_t hl = (size_t)(colon - hp);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= hcap || strlen(colon + 1) >= pcap)
        return DM_ERANGE;
    memcpy(host, h, hl);
    host[hl] = 0;
    snprintf(port, pcap, "%s", colon + 1);
    return 0;
}

static int listen_tcp(const char *hostport, char *url, size_t cap) {
    char host[128], port[16];
    if (split_hostport(hostport, host, sizeof(host), port, sizeof(port)) != 0) {
        dm__log("datamem: stats: cannot listen on \"%s\": expected host:port", hostport);
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0) {
        dm__log("datamem: stats: cannot listen on %s: %s", hostport, gai_strerror(gai));
        return -1;
    }
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1; /* rebinding a fixed port right after a restart (TIME_WAIT) */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, HTTP_BACKLOG) != 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        dm__log("datamem: stats: cannot listen on %s: %s%s", hostport, strerror(err),
                err == EADDRINUSE ? " (another process has it: use port 0 and "
                                    "`python -m datamem ls` for multi-process jobs)"
                                  : "");
        return -1;
    }
    /* The URL names the address actually bound, loopback for a wildcard. */
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char num[INET6_ADDRSTRLEN + 2] = "", serv[16] = "";
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    getnameinfo((struct sockaddr *)&ss, sl, num, sizeof(num), serv, sizeof(serv),
                NI_NUMERICHOST | NI_NUMERICSERV);
    bool v6 = ss.ss_family == AF_INET6;
    if (strcmp(num, "0.0.0.0") == 0)
        snprintf(num, sizeof(num), "127.0.0.1");
    else if (strcmp(num, "::") == 0)
        snprintf(num, sizeof(num), "::1");
    snprintf(url, cap, v6 ? "http://[%s]:%s/metrics" : "http://%s:%s/metrics", num, serv);
    return fd;
}

/* Binds `path`, replacing a stale socket (nobody accepts on it) but never a
 * live one or a file that is not a socket. Mode 0600: only this user. */
static int listen_unix(const char *path) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        dm__log("datamem: stats: Unix socket path too long (at most %zu bytes): %s",
                sizeof(sa.sun_path) - 1, path);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            dm__log("datamem: stats: cannot listen on %s: a file that is not a socket is there",
                    path);
            return -1;
        }
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        bool live = probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        if (probe >= 0)
            close(probe);
        if (live) {
            dm__log("datamem: stats: cannot listen on %s: Address already in use "
                    "(another process serves it)", path);
            return -1;
        }
        unlink(path);
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        dm__log("datamem: stats: cannot listen on %s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    /* Before listen(), nobody can connect: no window with a wider mode. */
    if (chmod(path, 0600) != 0 || listen(fd, HTTP_BACKLOG) != 0) {
        dm__log("datamem: stats: cannot listen on %s: %s", path, strerror(errno));
        close(fd);
        unlink(path);
        return -1;
    }
    return fd;
}

/* ---- daemons -------------------------------------------------------------------- */

static int start(int fd, const char *unix_path, dm_http_t **out) {
    dm_http_t *h = calloc(1, sizeof(*h));
    if (!h) {
        close(fd);
        return DM_ENOMEM;
    }
    h->fd = fd;
    h->pid = getpid();
    snprintf(h->unix_path, sizeof(h->unix_path), "%s", unix_path ? unix_path : "");
    /* MHD's thread takes no signals: they belong to the job's main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    h->daemon = mhd.start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ERROR_LOG, 0, NULL, NULL,
        on_request, NULL,
        MHD_OPTION_EXTERNAL_LOGGER, on_log, NULL,
        MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_CONN_MEMORY,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned int)HTTP_CONN_LIMIT,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)HTTP_TIMEOUT_S,
        MHD_OPTION_END);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!h->daemon) {
        dm__log("datamem: stats: libmicrohttpd could not start");
        close(fd);
        if (h->unix_path[0])
            unlink(h->unix_path);
        free(h);
        return DM_ESYS;
    }
    *out = h;
    return 0;
}

static bool loaded(void) {
    pthread_once(&mhd_once, mhd_load);
    if (!mhd.ok)
        dm__log("datamem: stats: endpoint unavailable: %s", mhd.error);
    return mhd.ok;
}

int dm__http_start_tcp(const char *hostport, dm_http_t **out, char *url, size_t cap) {
    if (!loaded())
        return DM_ESYS;
    int fd = listen_tcp(hostport, url, cap);
    return fd < 0 ? DM_ESYS : start(fd, NULL, out);
}

int dm__http_start_unix(const char *path, dm_http_t **out) {
    if (!loaded())
        return DM_ESYS;
    int fd = listen_unix(path);
    return fd < 0 ? DM_ESYS : start(fd, path, out);
}

void dm__http_stop(dm_http_t *h) {
    if (!h)
        return;
    mhd.stop_daemon(h->daemon); /* joins MHD's thread, closes the socket */
    if (h->unix_path[0] && h->pid == getpid())
        unlink(h->unix_path);
    free(h);
}

void dm__http_forget_in_child(dm_http_t *h) {
    close(h->fd);
    free(h);
}
