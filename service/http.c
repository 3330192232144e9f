/*
 * http.c: the stats endpoint — GET /metrics (Prometheus text 0.0.4) and GET
 * /stats.json — served by a small HTTP/1.1 server of our own on one C thread per
 * endpoint, so it answers while Python holds the GIL (it never touches Python).
 *
 * Why our own server and not libmicrohttpd: its only timeout is an idle
 * timeout, reset by every byte, so 17 clients that each send one header byte
 * every 4 s hold every slot and no scrape gets through; and every malformed
 * request writes ~310 bytes to the job's stderr. What a stats endpoint
 * needs is small — GET and HEAD of three paths, one response per connection —
 * and every limit below is ours to choose and test:
 *
 * - a *total* deadline per connection, not an idle one: the request (line and
 *   headers, at most HTTP_REQ_MAX bytes) must be complete HTTP_REQUEST_DEADLINE_MS
 *   after accept, the response written HTTP_RESPONSE_DEADLINE_MS after accept;
 * - at most HTTP_CONN_MAX connections per endpoint and HTTP_CONN_PER_CLIENT per
 *   client (TCP: its address; Unix socket: its uid). A new connection over
 *   either bound evicts that client's (or everyone's) oldest connection still
 *   sending its request: a flood of slow clients can delay a real scrape by one
 *   round trip, never lock it out (tests/python/stats/test_http.py: a scrape
 *   succeeds while 200 slow clients are connected);
 * - a connection takes a slot only once its first bytes have arrived, and a
 *   request that is complete then is answered there and then: a scraper slow
 *   to send after its handshake holds no slot yet, so no flood can evict it
 *   before its request is read. The kernel does this for TCP
 *   (TCP_DEFER_ACCEPT) until its SYN queue overflows: a handshake completed by
 *   a SYN cookie reaches accept() at its bare ACK. Such connections, and Unix
 *   ones, wait as *pending* (HTTP_PENDING_MAX, the oldest closed first, the
 *   request deadline applies) until bytes arrive;
 * - bad requests (4xx) are counted per status code (datamem_http_requests_total)
 *   and logged at most once per HTTP_LOG_INTERVAL_S with the number suppressed.
 *
 * Each response closes its connection (Connection: close): scrapes are seconds
 * apart, and one request per connection keeps the state machine trivial.
 *
 * What a snapshot looks like is not this file's business: a server renders
 * /metrics and /stats.json through the dm_http_render_t it was started with
 * (export.c hands it render.c's renderer). So http.c depends only on buf.c and
 * the page, and nothing it calls calls back into the module that started it.
 *
 * Thread safety: start and stop are serialised by the caller (export.c's
 * mutex); the server thread owns its connections; counters are relaxed atomics
 * read by the metrics renderer (a scrape reports its own request once it has
 * been answered).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "service/buf.h"
#include "service/datamem_service.h"
#include "service/http.h"
#include "service/sock.h"
#include "service/page.h"

#define HTTP_REQ_MAX 8192                 /* request line + headers */
#define HTTP_CONN_MAX 64                  /* open connections per endpoint */
#define HTTP_CONN_PER_CLIENT 16           /* per client address / uid */
#define HTTP_REQUEST_DEADLINE_MS 5000     /* accept -> whole request received */
#define HTTP_RESPONSE_DEADLINE_MS 15000   /* accept -> whole response sent */
#define HTTP_LOG_INTERVAL_S 60            /* at most one bad-request line per this */
#define HTTP_PENDING_MAX 64               /* accepted, no byte yet: no slot */
#define HTTP_BACKLOG 1024                 /* SYN queue: capped by net.core.somaxconn */

typedef struct conn {
    int fd;
    bool writing;           /* request read, response being sent */
    bool pending;           /* accepted, nothing received yet: holds no slot */
    bool readable;          /* pending, and poll saw it readable */
    int64_t slot_ms;        /* when it took its slot (eviction order) */
    uint8_t peer[17];       /* family byte + address (TCP) or uid (Unix) */
    int64_t accepted_ms;    /* CLOCK_MONOTONIC */
    size_t in_len;
    char in[HTTP_REQ_MAX + 1];
    char *out;              /* malloc'ed response */
    size_t out_len, out_off;
} conn_t;

struct dm_http {
    pthread_t thread;
    int fd;                 /* the listening socket */
    int wake;               /* eventfd: stop */
    bool is_unix;
    char unix_path[108];    /* "" for TCP */
    dev_t unix_dev;         /* the socket file dm__sock_listen made */
    ino_t unix_ino;
    pid_t pid;              /* who bound it: only that process unlinks the path */
    dm_http_render_t render; /* /metrics and /stats.json */
    int nconns;             /* slot holders and pending alike */
    conn_t *conns[HTTP_CONN_MAX + HTTP_PENDING_MAX];
};

/* ---- counters and the throttled log ------------------------------------------ */

static const int code_list[DM_HTTP_NCODES] = DM_HTTP_CODES;
static _Atomic uint64_t n_code[DM_HTTP_NCODES];
static _Atomic uint64_t n_dropped[DM_HTTP_NDROP]; /* deadline, evicted, refused */

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static time_t log_last;          /* when a bad-request line was last written */
static uint64_t log_suppressed;  /* bad requests since then, not logged */

void dm__http_counters(dm_http_counters_t *c) {
    for (int i = 0; i < DM_HTTP_NCODES; i++) {
        c->code[i] = code_list[i];
        c->requests[i] = atomic_load_explicit(&n_code[i], memory_order_relaxed);
    }
    for (int i = 0; i < DM_HTTP_NDROP; i++)
        c->dropped[i] = atomic_load_explicit(&n_dropped[i], memory_order_relaxed);
}

static void count_code(int code) {
    for (int i = 0; i < DM_HTTP_NCODES; i++)
        if (code_list[i] == code) {
            atomic_fetch_add_explicit(&n_code[i], 1, memory_order_relaxed);
            return;
        }
}

static void count_drop(int reason) {
    atomic_fetch_add_explicit(&n_dropped[reason], 1, memory_order_relaxed);
}

/* In a fork child: the server threads that could hold the log's lock are gone. */
void dm__http_atfork_child(void) { pthread_mutex_init(&log_mu, NULL); }

/* One line per HTTP_LOG_INTERVAL_S at most, whatever a client sends. */
static void log_bad(const char *why) {
    time_t now = time(NULL);
    pthread_mutex_lock(&log_mu);
    if (log_last && now - log_last < HTTP_LOG_INTERVAL_S) {
        log_suppressed++;
        pthread_mutex_unlock(&log_mu);
        return;
    }
    uint64_t before = log_suppressed;
    log_last = now;
    log_suppressed = 0;
    pthread_mutex_unlock(&log_mu);
    if (before)
        dm_log("datamem: stats: bad request: %s (and %llu more since the last report; at "
                "most one line per %d s, all counted in datamem_http_requests_total)",
                why, (unsigned long long)before, HTTP_LOG_INTERVAL_S);
    else
        dm_log("datamem: stats: bad request: %s (further ones: at most one line per %d s, "
                "all counted in datamem_http_requests_total)", why, HTTP_LOG_INTERVAL_S);
}

/* ---- responses ----------------------------------------------------------------- */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static const char *reason(int code) {
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Internal Server Error";
    }
}

/* Builds the whole response in c->out; `body` is copied (or, for HEAD, only
 * its length is sent). */
static void respond(conn_t *c, int code, const char *ctype, const char *extra_headers,
                    const char *body, size_t len, bool head) {
    count_code(code);
    dm_buf_t b = {0};
    dm__buf_printf(&b,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                   "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                   "%sConnection: close\r\n\r\n",
                   code, reason(code), ctype, len, extra_headers ? extra_headers : "");
    if (!head)
        dm__buf_put(&b, body, len);
    c->writing = true;
    c->out_off = 0;
    if (dm__buf_finish(&b, &c->out, &c->out_len) != 0) {
        c->out = NULL;
        c->out_len = 0; /* nothing to send: the connection closes */
    }
}

static void respond_text(conn_t *c, int code, const char *text, bool head) {
    respond(c, code, "text/plain; charset=utf-8",
            code == 405 ? "Allow: GET, HEAD\r\n" : NULL, text, strlen(text), head);
}

static bool token_char(char ch) {
    return ch > 32 && ch < 127 && !strchr("()<>@,;:\\\"/[]?={}", ch);
}

/* A whole request is in c->in (ends with an empty line): parse its request
 * line and answer. Headers are not needed for anything we serve. */
static void handle_request(dm_http_t *h, conn_t *c) {
    char *line_end = strstr(c->in, "\r\n");
    if (!line_end) { /* a bare-LF request */
        line_end = strchr(c->in, '\n');
    }
    *line_end = 0;
    char *method = c->in, *sp1 = strchr(method, ' ');
    char *target = sp1 ? sp1 + 1 : NULL, *sp2 = target ? strchr(target, ' ') : NULL;
    char *version = sp2 ? sp2 + 1 : NULL;
    bool ok = sp1 && sp2 && sp1 > method && *target == '/' &&
              (strcmp(version, "HTTP/1.1") == 0 || strcmp(version, "HTTP/1.0") == 0);
    for (char *p = method; ok && p < sp1; p++)
        ok = token_char(*p);
    for (char *p = target; ok && p < sp2; p++)
        ok = *p > 32 && *p < 127;
    if (!ok) {
        log_bad("malformed request line");
        respond_text(c, 400, "bad request\n", false);
        return;
    }
    *sp1 = *sp2 = 0;
    char *query = strchr(target, '?');
    if (query)
        *query = 0;
    bool head = strcmp(method, "HEAD") == 0;
    if (!head && strcmp(method, "GET") != 0) {
        log_bad("method not allowed");
        respond_text(c, 405, "method not allowed: use GET\n", head);
        return;
    }
    int format;
    const char *ctype;
    if (strcmp(target, "/metrics") == 0) {
        format = DM_STATS_PROMETHEUS;
        ctype = "text/plain; version=0.0.4; charset=utf-8";
    } else if (strcmp(target, "/stats.json") == 0) {
        format = DM_STATS_JSON;
        ctype = "application/json";
    } else if (strcmp(target, "/") == 0 || strcmp(target, "/index.html") == 0) {
        /* The page: static bytes; its CSP allows only its own style and script. */
        size_t plen;
        const char *csp, *page = dm__page_index(&plen, &csp);
        char hdr[1024];
        snprintf(hdr, sizeof(hdr), "Content-Security-Policy: %s\r\n", csp);
        respond(c, 200, "text/html; charset=utf-8", hdr, page, plen, head);
        return;
    } else {
        respond_text(c, 404, "not found: try /, /metrics or /stats.json\n", head);
        return;
    }
    char *body = NULL;
    size_t len = 0;
    if (h->render(format, &body, &len) != 0) {
        respond_text(c, 500, "cannot take a snapshot\n", head);
        return;
    }
    respond(c, 200, ctype, NULL, body, len, head);
    free(body);
}

/* ---- connections ------------------------------------------------------------------ */

static void conn_close(dm_http_t *h, int i) {
    conn_t *c = h->conns[i];
    shutdown(c->fd, SHUT_RDWR); /* the client sees the end even if a fork child holds a copy */
    close(c->fd);
    free(c->out);
    free(c);
    h->conns[i] = h->conns[--h->nconns];
    h->conns[h->nconns] = NULL;
}

static bool same_peer(const conn_t *a, const uint8_t *peer) {
    return !peer || memcmp(a->peer, peer, sizeof(a->peer)) == 0;
}

/* The slot holder that took its slot first and is still sending its request,
 * of `peer` (or anyone's if NULL); -1 if none. */
static int oldest_reading(dm_http_t *h, const uint8_t *peer) {
    int best = -1;
    for (int i = 0; i < h->nconns; i++) {
        conn_t *c = h->conns[i];
        if (c->pending || c->writing || !same_peer(c, peer))
            continue;
        if (best < 0 || c->slot_ms < h->conns[best]->slot_ms)
            best = i;
    }
    return best;
}

static int slot_count(dm_http_t *h, const uint8_t *peer) {
    int n = 0;
    for (int i = 0; i < h->nconns; i++)
        n += !h->conns[i]->pending && same_peer(h->conns[i], peer);
    return n;
}

static int index_of(dm_http_t *h, const conn_t *c) {
    for (int i = 0; i < h->nconns; i++)
        if (h->conns[i] == c)
            return i;
    return -1;
}

/* `c` (pending, or not yet in the set) has bytes to read: it takes a slot,
 * evicting over the bounds that client's (or everyone's) oldest connection
 * still sending its request. False when it is refused: every slot it could
 * take is sending a response. Indices in h->conns may change. */
static bool slot_take(dm_http_t *h, conn_t *c) {
    int mine = slot_count(h, c->peer), all = slot_count(h, NULL), victim = -1;
    if (mine >= HTTP_CONN_PER_CLIENT)
        victim = oldest_reading(h, c->peer);
    else if (all >= HTTP_CONN_MAX)
        victim = oldest_reading(h, NULL);
    if (victim >= 0) {
        conn_close(h, victim);
        count_drop(DM_HTTP_DROP_EVICTED);
    } else if (mine >= HTTP_CONN_PER_CLIENT || all >= HTTP_CONN_MAX) {
        count_drop(DM_HTTP_DROP_REFUSED);
        return false;
    }
    c->pending = false;
    c->slot_ms = now_ms();
    return true;
}

static int bytes_waiting(int fd) {
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 ? n : -1;
}

static void peer_key(dm_http_t *h, int fd, const struct sockaddr_storage *ss, uint8_t *key) {
    memset(key, 0, 17);
    if (h->is_unix) {
        struct ucred cred;
        socklen_t cl = sizeof(cred);
        key[0] = AF_UNIX;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0)
            memcpy(key + 1, &cred.uid, sizeof(cred.uid));
    } else if (ss->ss_family == AF_INET) {
        key[0] = AF_INET;
        memcpy(key + 1, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        key[0] = AF_INET6;
        memcpy(key + 1, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
    }
}

static bool conn_read(dm_http_t *h, conn_t *c);
static bool conn_write(conn_t *c);

/* `c`, holding a slot and in the set, reads what has arrived; a request that is
 * complete is answered now, so a burst of newer connections cannot evict it
 * before its turn. */
static void conn_first_read(dm_http_t *h, conn_t *c) {
    if (!conn_read(h, c) || (c->writing && (!c->out || !conn_write(c))))
        conn_close(h, index_of(h, c));
}

/* Pending connections that poll saw readable: bytes (take a slot and read
 * them), or the end (close; no slot taken for it). */
static void promote_readable(dm_http_t *h) {
    for (int i = 0; i < h->nconns;) {
        conn_t *c = h->conns[i];
        if (!c->pending || !c->readable) {
            i++;
            continue;
        }
        c->readable = false;
        if (bytes_waiting(c->fd) <= 0 || !slot_take(h, c)) {
            conn_close(h, index_of(h, c));
            i = 0; /* the set changed: look again (it is small) */
            continue;
        }
        conn_first_read(h, c);
        i = 0;
    }
}

/* A new pending connection; over HTTP_PENDING_MAX the oldest pending goes. */
static void pending_add(dm_http_t *h, conn_t *c) {
    int n = 0, oldest = -1;
    for (int i = 0; i < h->nconns; i++) {
        if (!h->conns[i]->pending)
            continue;
        n++;
        if (oldest < 0 || h->conns[i]->accepted_ms < h->conns[oldest]->accepted_ms)
            oldest = i;
    }
    if (n >= HTTP_PENDING_MAX) {
        conn_close(h, oldest);
        count_drop(DM_HTTP_DROP_EVICTED);
    }
    c->pending = true;
    h->conns[h->nconns++] = c;
}

static void accept_some(dm_http_t *h) {
    for (int k = 0; k < 32; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(h->fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or a transient error: poll again */
        conn_t *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            count_drop(DM_HTTP_DROP_REFUSED);
            continue;
        }
        c->fd = fd;
        c->accepted_ms = now_ms();
        peer_key(h, fd, &ss, c->peer);
        if (bytes_waiting(fd) <= 0) { /* a SYN cookie's bare ACK, a Unix client */
            pending_add(h, c);
            continue;
        }
        if (!slot_take(h, c)) {
            close(fd); /* every slot is sending a response: come back shortly */
            free(c);
            continue;
        }
        h->conns[h->nconns++] = c;
        conn_first_read(h, c);
    }
}

/* Returns false when the connection is done (closed by the caller). */
static bool conn_read(dm_http_t *h, conn_t *c) {
    for (;;) {
        ssize_t n = recv(c->fd, c->in + c->in_len, HTTP_REQ_MAX - c->in_len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK;
        if (n == 0)
            return false; /* the client went away before finishing its request */
        c->in_len += (size_t)n;
        c->in[c->in_len] = 0;
        if (strstr(c->in, "\r\n\r\n") || strstr(c->in, "\n\n")) {
            handle_request(h, c);
            return true;
        }
        if (c->in_len == HTTP_REQ_MAX) {
            log_bad("request headers over 8 KiB");
            respond_text(c, 431, "request headers too large\n", false);
            return true;
        }
    }
}

static bool conn_write(conn_t *c) {
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK;
        c->out_off += (size_t)n;
    }
    shutdown(c->fd, SHUT_WR);
    return false;
}

static void *serve(void *arg) {
    dm_http_t *h = arg;
    struct pollfd pfd[HTTP_CONN_MAX + HTTP_PENDING_MAX + 2];
    for (;;) {
        int64_t now = now_ms(), wait = -1;
        for (int i = 0; i < h->nconns;) { /* deadlines */
            conn_t *c = h->conns[i];
            int64_t due = c->accepted_ms +
                          (c->writing ? HTTP_RESPONSE_DEADLINE_MS : HTTP_REQUEST_DEADLINE_MS);
            if (due <= now) {
                if (!c->writing && c->in_len)
                    log_bad("request not complete within its deadline");
                count_drop(DM_HTTP_DROP_DEADLINE);
                conn_close(h, i);
                continue;
            }
            if (wait < 0 || due - now < wait)
                wait = due - now;
            i++;
        }
        pfd[0] = (struct pollfd){.fd = h->wake, .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = h->fd, .events = POLLIN};
        for (int i = 0; i < h->nconns; i++)
            pfd[i + 2] = (struct pollfd){.fd = h->conns[i]->fd,
                                         .events = h->conns[i]->writing ? POLLOUT : POLLIN};
        int nfds = h->nconns + 2;
        if (poll(pfd, (nfds_t)nfds, (int)wait) < 0) {
            if (errno == EINTR)
                continue;
            dm_log("datamem: stats: poll: %s; endpoint stopped", strerror(errno));
            break;
        }
        if (pfd[0].revents)
            break;
        /* Connections first (their slots may move as others close), then accept. */
        for (int i = nfds - 3; i >= 0; i--) {
            if (!pfd[i + 2].revents)
                continue;
            conn_t *c = h->conns[i];
            if (c->pending) { /* below, once this pass no longer uses indices */
                c->readable = true;
                continue;
            }
            bool keep = c->writing ? conn_write(c) : conn_read(h, c);
            if (keep && c->writing && !c->out)
                keep = false;
            if (keep && c->writing && (pfd[i + 2].revents & POLLIN))
                keep = conn_write(c); /* a response just built: try sending now */
            if (!keep)
                conn_close(h, i);
        }
        promote_readable(h);
        if (pfd[1].revents)
            accept_some(h);
    }
    while (h->nconns)
        conn_close(h, h->nconns - 1);
    return NULL;
}

/* ---- sockets ---------------------------------------------------------------------- */

/* "127.0.0.1:9100", "[::1]:0", "localhost:9100" -> host and port strings; the
 * port must be a decimal number 0-65535 (nothing wraps: 99999 is refused). */
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
    const char *ps = colon + 1;
    size_t pl = strlen(ps);
    long v = 0;
    for (size_t i = 0; i < pl; i++) {
        if (ps[i] < '0' || ps[i] > '9' || pl > 5)
            return DM_ERANGE;
        v = v * 10 + (ps[i] - '0');
    }
    if (v > 65535 || hl >= hcap || pl >= pcap)
        return DM_ERANGE;
    memcpy(host, h, hl);
    host[hl] = 0;
    snprintf(port, pcap, "%s", ps);
    return 0;
}

static bool addr_loopback(const struct sockaddr *sa) {
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a))
            return true;
        if (IN6_IS_ADDR_V4MAPPED(a))
            return a->s6_addr[12] == 127;
    }
    return false;
}

int dm__http_check_address(const char *hostport, bool *loopback) {
    char host[128], port[16];
    if (split_hostport(hostport, host, sizeof(host), port, sizeof(port)) != 0)
        return DM_ERANGE;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0)
        return DM_ESYS;
    bool all = res != NULL;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next)
        all = all && addr_loopback(ai->ai_addr);
    freeaddrinfo(res);
    *loopback = all;
    return 0;
}

static int listen_tcp(const char *hostport, char *url, size_t cap) {
    char host[128], port[16];
    if (split_hostport(hostport, host, sizeof(host), port, sizeof(port)) != 0) {
        dm_log("datamem: stats: cannot listen on \"%s\": expected host:port with a port "
                "from 0 to 65535", hostport);
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0) {
        dm_log("datamem: stats: cannot listen on %s: %s", hostport, gai_strerror(gai));
        return -1;
    }
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                    ai->ai_protocol);
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
            continue;
        }
        /* A connection reaches accept() only once its first bytes have arrived
         * (or after the request deadline): a client takes a slot when it starts
         * talking, so a flood cannot evict a scraper between its handshake and
         * its request (tests/python/stats/test_http.py). */
        int defer = HTTP_REQUEST_DEADLINE_MS / 1000;
        if (setsockopt(fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &defer, sizeof(defer)) != 0)
            dm_log("datamem: stats: TCP_DEFER_ACCEPT: %s (a flood of connections from the "
                    "scraper's own address can drop a scrape)", strerror(errno));
    }
    freeaddrinfo(res);
    if (fd < 0) {
        dm_log("datamem: stats: cannot listen on %s: %s%s", hostport, strerror(err),
                err == EADDRINUSE ? " (another process has it: use port 0 and "
                                    "`python -m datamem ls` for multi-process jobs)"
                                  : "");
        return -1;
    }
    /* The URL names the address actually bound, a wildcard included: a reader of
     * the discovery file or stats_url() must see that every interface listens. */
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char num[INET6_ADDRSTRLEN + 2] = "", serv[16] = "";
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    getnameinfo((struct sockaddr *)&ss, sl, num, sizeof(num), serv, sizeof(serv),
                NI_NUMERICHOST | NI_NUMERICSERV);
    bool v6 = ss.ss_family == AF_INET6;
    snprintf(url, cap, v6 ? "http://[%s]:%s/metrics" : "http://%s:%s/metrics", num, serv);
    if (!addr_loopback((struct sockaddr *)&ss))
        dm_log("datamem: stats: WARNING: the stats endpoint listens on %s:%s, reachable from "
                "other machines: anyone who can connect reads this job's metrics (command "
                "line, policy path). Put a firewall or a loopback address in front of it.",
                num, serv);
    return fd;
}

/* ---- servers -------------------------------------------------------------------- */

static int start(int fd, const char *unix_path, dev_t dev, ino_t ino, dm_http_render_t render,
                 dm_http_t **out) {
    dm_http_t *h = calloc(1, sizeof(*h));
    if (!h) {
        close(fd);
        if (unix_path)
            dm__sock_remove(unix_path, dev, ino);
        return DM_ENOMEM;
    }
    h->unix_dev = dev, h->unix_ino = ino;
    h->fd = fd;
    h->pid = getpid();
    h->render = render;
    h->is_unix = unix_path != NULL;
    snprintf(h->unix_path, sizeof(h->unix_path), "%s", unix_path ? unix_path : "");
    h->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    /* Our thread takes no signals: they belong to the job's main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = h->wake < 0 ? errno : pthread_create(&h->thread, NULL, serve, h);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        dm_log("datamem: stats: cannot start the endpoint's thread: %s", strerror(rc));
        if (h->wake >= 0)
            close(h->wake);
        close(fd);
        if (h->unix_path[0])
            dm__sock_remove(h->unix_path, h->unix_dev, h->unix_ino);
        free(h);
        return DM_ESYS;
    }
    *out = h;
    return 0;
}

int dm__http_start_tcp(const char *hostport, dm_http_render_t render, dm_http_t **out,
                       char *url, size_t cap) {
    int fd = listen_tcp(hostport, url, cap);
    return fd < 0 ? DM_ESYS : start(fd, NULL, 0, 0, render, out);
}

int dm__http_start_unix(const char *path, dm_http_render_t render, dm_http_t **out) {
    dev_t dev = 0;
    ino_t ino = 0;
    int fd = dm__sock_listen(path, HTTP_BACKLOG, &dev, &ino);
    return fd < 0 ? DM_ESYS : start(fd, path, dev, ino, render, out);
}

void dm__http_stop(dm_http_t *h) {
    if (!h)
        return;
    uint64_t one = 1;
    if (write(h->wake, &one, sizeof(one)) != sizeof(one))
        dm_log("datamem: stats: cannot wake the endpoint's thread: %s", strerror(errno));
    pthread_join(h->thread, NULL);
    close(h->wake);
    close(h->fd);
    if (h->unix_path[0] && h->pid == getpid()) /* still ours: never another's file */
        dm__sock_remove(h->unix_path, h->unix_dev, h->unix_ino);
    free(h);
}

/* The server thread may have been changing its connection list when the fork
 * happened: the child never reads it (those fds leak, once per fork; the parent
 * shuts each socket down when it is done, so clients are not kept waiting). */
void dm__http_forget_in_child(dm_http_t *h) {
    close(h->wake);
    close(h->fd);
    free(h);
}
