/*
 * export.c: where stats go — which endpoint runs (policy or override), which
 * textfile thread runs, the discovery file, fork and exit. The pieces are
 * their own modules; this file decides when each starts and stops:
 *
 *   export.c -> http.c       (the servers, handed render_for_http)
 *            -> textfile.c   (the textfile thread)
 *            -> discovery.c  (this process's <pid>.json)
 *            -> render.c     (a snapshot rendered: what the servers and the
 *                             textfile serve)
 *            -> svc_stats.c  (only to reset its lock in a fork child)
 *
 * Dependencies run one way: http.c knows nothing of this file or of render.c
 * (it calls the render function it was started with), so nothing below calls
 * back up here.
 *
 * What runs: the policy's `stats:` section applies on every install; an
 * override from dm_stats_serve (Python: DATAMEM_STATS_HTTP, serve_stats())
 * replaces its http / unix_socket. An endpoint is (re)started only when its
 * configured string changes, so a reload that keeps the section keeps the
 * socket (and its port, for port 0). A failure to listen is logged and
 * remembered: the same setting is not retried on every reload.
 *
 * Fork: the child has none of the parent's threads. The atfork child handler
 * marks everything stopped and closes the inherited listening sockets (only the
 * parent answers on them). dm__export_restart_in_child (from
 * dm_runtime_after_fork_child, which Python calls through os.register_at_fork)
 * then starts the child's own endpoint on the same host with port 0 and, for a
 * Unix socket, "<path>.<pid>" unless the path has "{pid}" — so every worker of
 * a fork-based pool is reachable and listed. The textfile stays with the
 * process that started it.
 *
 * Exit: an atexit handler in the process that started serving writes the
 * textfile once more and removes the discovery file and Unix socket.
 *
 * SIGTERM: its default action skips atexit, which left the socket, the
 * discovery file and a "{pid}" textfile behind. While this process serves,
 * the services' SIGTERM handler (service/term.h) first removes those files,
 * the paths published in `term` (each only if it is still a socket or regular
 * file of this user's), with async-signal-safe calls only (fstatat, unlink).
 * A shared textfile stays (rendering it is not signal-safe).
 *
 * Thread safety: `mu` guards the state below and serialises start/stop. The
 * serving and textfile threads never take it, and nothing done under it takes
 * dm__mem_mu or calls jemalloc: stopping a daemon or joining a thread
 * (which may be inside dm_stats_snapshot) waits until it is released
 * (retired_t). So the atfork prepare handler can take it whatever order the
 * handlers of the runtime and of jemalloc run in.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/discovery.h"
#include "service/export.h"
#include "service/files.h"
#include "service/http.h"
#include "service/render.h"
#include "service/svc_stats.h"
#include "service/term.h"
#include "service/textfile.h"

typedef struct cfg {
    char http[128];
    char unix_socket[256];
    char textfile[256];
    int64_t interval_ms;
} cfg_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static cfg_t policy_cfg;             /* from the last install */
static bool ovr_http_set, ovr_unix_set;
static char ovr_http[128], ovr_unix[256];
static cfg_t running;                /* the settings the endpoints were started for */
static dm_http_t *tcp, *unx;
static char url[200], unix_path[256];
static pid_t owner;                  /* process whose endpoint/files these are */
static bool forked_serving;          /* in a fork child: the parent was serving */
static double started;

static dm_textfile_t *tf;               /* the running one, or NULL */

/* Work that must wait until `mu` is released: stopping a daemon or joining a
 * thread waits for it, and it may be inside dm_stats_snapshot (dm__mem_mu
 * and jemalloc's locks, which a concurrent fork's prepare handlers take). */
typedef struct retired {
    dm_http_t *http[2];
    dm_textfile_t *tf;
    bool final_write;
} retired_t;

static double now_unix(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void copy(char *dst, size_t cap, const char *src) { snprintf(dst, cap, "%s", src); }

/* Called without mu. */
static void retired_run(retired_t *r) {
    for (int i = 0; i < 2; i++)
        if (r->http[i])
            dm__http_stop(r->http[i]);
    if (r->tf)
        dm__textfile_join(r->tf, r->final_write);
}

/* ---- endpoints ------------------------------------------------------------------------ */

/* What the servers serve: a fresh snapshot, without constant labels. */
static int render_for_http(int format, char **out, size_t *len) {
    return dm__render_current(format, NULL, out, len);
}

/* Called with mu held, as everything that writes the discovery file: it names
 * the endpoints running now, or goes with the last of them. */
static void discovery_update(void) {
    if (tcp || unx)
        dm__discovery_write(tcp ? url : NULL, unx ? unix_path : NULL, started);
    else
        dm__discovery_remove();
}

static int tcp_start(const char *hostport) {
    int rc = dm__http_start_tcp(hostport, render_for_http, &tcp, url, sizeof(url));
    if (rc != 0) {
        tcp = NULL;
        url[0] = 0;
    }
    return rc;
}

static int unx_start(const char *tmpl, bool child) {
    char path[256];
    dm__files_expand_pid(path, sizeof(path), tmpl);
    if (child && !strstr(tmpl, "{pid}"))
        snprintf(path, sizeof(path), "%.200s.%d", tmpl, (int)getpid());
    int rc = dm__http_start_unix(path, render_for_http, &unx);
    if (rc == 0)
        copy(unix_path, sizeof(unix_path), path);
    else
        unx = NULL;
    return rc;
}

/* ---- SIGTERM: the files this process made go with it ----------------------------------- */

#define TERM_FILES 3 /* the Unix socket, the discovery file, a "{pid}" textfile */
typedef struct term_files {
    char path[TERM_FILES][PATH_MAX];
    _Atomic int n;         /* paths valid: zeroed before they change, set after */
    _Atomic pid_t pid;     /* the process they are for (a fork child's handler skips them) */
} term_files_t;
static term_files_t term;

/* The SIGTERM function (service/term.h). */
static void on_sigterm(bool dies) {
    (void)dies; /* a program's handler after this one ends the process its own way */
    int saved = errno;
    if (atomic_load_explicit(&term.pid, memory_order_acquire) == getpid()) {
        int n = atomic_load_explicit(&term.n, memory_order_acquire);
        for (int i = 0; i < n && i < TERM_FILES; i++) {
            struct stat st; /* only a file of ours, and never through a link */
            if (fstatat(AT_FDCWD, term.path[i], &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                st.st_uid == geteuid() && (S_ISSOCK(st.st_mode) || S_ISREG(st.st_mode)))
                unlink(term.path[i]);
        }
    }
    errno = saved;
}

/* Called with mu held after the endpoints change: publishes the files this
 * process made, and installs the handler the first time there are some. */
static void term_publish(void) {
    atomic_store_explicit(&term.n, 0, memory_order_release);
    if (owner != getpid() || !(tcp || unx || tf))
        return;
    int n = 0;
    if (unx && unix_path[0])
        copy(term.path[n++], PATH_MAX, unix_path);
    if (dm__discovery_path()[0])
        copy(term.path[n++], PATH_MAX, dm__discovery_path());
    if (tf && strstr(running.textfile, "{pid}"))
        dm__files_expand_pid(term.path[n++], PATH_MAX, running.textfile);
    atomic_store_explicit(&term.pid, getpid(), memory_order_release);
    atomic_store_explicit(&term.n, n, memory_order_release);
    if (n)
        dm__term_on(on_sigterm); /* once; fails only where SIGTERM is ignored */
}

static void atfork_prepare(void) { pthread_mutex_lock(&mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&mu); }

/* The child: none of the parent's threads exist here. Their handles are
 * dropped (a dm_textfile_t and a daemon's memory leak, once per fork). */
static void atfork_child(void) {
    forked_serving = tcp || unx;
    if (tcp)
        dm__http_forget_in_child(tcp);
    if (unx)
        dm__http_forget_in_child(unx);
    tcp = unx = NULL;
    tf = NULL;
    url[0] = unix_path[0] = 0;
    dm__discovery_forget_in_child();
    owner = 0;
    dm__render_atfork_child(); /* a scrape may have held their locks */
    dm__svc_stats_atfork_child();
    dm__http_atfork_child();
    pthread_mutex_unlock(&mu);
}

static void at_exit(void) {
    pthread_mutex_lock(&mu);
    bool mine = owner == getpid();
    pthread_mutex_unlock(&mu);
    if (mine)
        dm_stats_export_stop();
}

static void init_once(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    atexit(at_exit);
}

static void effective(cfg_t *e) {
    *e = policy_cfg;
    if (ovr_http_set)
        copy(e->http, sizeof(e->http), ovr_http);
    if (ovr_unix_set)
        copy(e->unix_socket, sizeof(e->unix_socket), ovr_unix);
}

/* Called with mu held: brings the endpoints and the textfile in line with the
 * effective settings; what must stop goes to `r`. Returns the first start
 * failure (0 if none). */
static int apply(retired_t *r) {
    cfg_t want;
    effective(&want);
    int rc = 0;
    bool changed = false;
    if (strcmp(want.http, running.http) != 0) {
        r->http[0] = tcp;
        tcp = NULL;
        url[0] = 0;
        if (want.http[0] && (rc = tcp_start(want.http)) != 0)
            dm_log("datamem: stats: endpoint off (http: \"%s\"); the job runs on", want.http);
        copy(running.http, sizeof(running.http), want.http);
        changed = true;
    }
    if (strcmp(want.unix_socket, running.unix_socket) != 0) {
        r->http[1] = unx;
        unx = NULL;
        unix_path[0] = 0;
        int urc = 0;
        if (want.unix_socket[0] && (urc = unx_start(want.unix_socket, false)) != 0)
            dm_log("datamem: stats: endpoint off (unix_socket: \"%s\"); the job runs on",
                    want.unix_socket);
        if (!rc)
            rc = urc;
        copy(running.unix_socket, sizeof(running.unix_socket), want.unix_socket);
        changed = true;
    }
    if (strcmp(want.textfile, running.textfile) != 0) {
        if (tf)
            dm__textfile_signal_stop(tf);
        r->tf = tf;
        tf = want.textfile[0] ? dm__textfile_start(want.textfile, want.interval_ms) : NULL;
        copy(running.textfile, sizeof(running.textfile), want.textfile);
        changed = true;
    } else if (tf && want.interval_ms != running.interval_ms) {
        dm__textfile_set_interval(tf, want.interval_ms);
    }
    running.interval_ms = want.interval_ms;
    if (changed) {
        if ((tcp || unx || tf) && owner != getpid()) {
            owner = getpid();
            started = now_unix();
        }
        discovery_update();
        term_publish();
    }
    return rc;
}

/* From dm_runtime_install, outside dm__mem_mu (service.c's observer; the
 * engine calls it in install order). */
void dm__export_configure(const dm_stats_spec_t *spec) {
    bool any = spec->http[0] || spec->unix_socket[0] || spec->textfile[0];
    pthread_mutex_lock(&mu);
    bool idle = !any && !running.http[0] && !running.unix_socket[0] && !running.textfile[0];
    pthread_mutex_unlock(&mu);
    if (idle) /* nothing runs or will: start no machinery */
        return;
    pthread_once(&once, init_once);
    retired_t r = {0};
    pthread_mutex_lock(&mu);
    copy(policy_cfg.http, sizeof(policy_cfg.http), spec->http);
    copy(policy_cfg.unix_socket, sizeof(policy_cfg.unix_socket), spec->unix_socket);
    copy(policy_cfg.textfile, sizeof(policy_cfg.textfile), spec->textfile);
    policy_cfg.interval_ms = spec->interval_ms;
    apply(&r);
    pthread_mutex_unlock(&mu);
    retired_run(&r);
}

int dm_stats_serve(const char *http, const char *unix_socket) {
    dm_runtime_init();
    if (http && *http) {
        /* From the environment or serve_stats(): loopback only. Exposing a job's
         * metrics to the network is a decision written in the policy. */
        bool loopback = false;
        int rc = dm__http_check_address(http, &loopback);
        if (rc == DM_ERANGE) {
            dm_log("datamem: stats: cannot listen on \"%s\": expected host:port with a port "
                    "from 0 to 65535", http);
            return DM_ERANGE;
        }
        if (rc != 0 || !loopback) {
            dm_log("datamem: stats: refusing to listen on %s: %s; from DATAMEM_STATS_HTTP or "
                    "serve_stats() only loopback addresses are served (127.0.0.1, [::1], "
                    "localhost). To expose metrics beyond this machine, write the address in "
                    "the policy (stats.http)", http,
                    rc != 0 ? "the host does not resolve" : "not a loopback address");
            return DM_EDENIED;
        }
    }
    pthread_once(&once, init_once);
    retired_t r = {0};
    pthread_mutex_lock(&mu);
    if (http) {
        ovr_http_set = true;
        copy(ovr_http, sizeof(ovr_http), http);
    }
    if (unix_socket) {
        ovr_unix_set = true;
        copy(ovr_unix, sizeof(ovr_unix), unix_socket);
    }
    int rc = apply(&r);
    pthread_mutex_unlock(&mu);
    retired_run(&r);
    return rc;
}

void dm_stats_endpoint(char *u, size_t ucap, char *upath, size_t pcap) {
    pthread_mutex_lock(&mu);
    if (u && ucap)
        copy(u, ucap, url);
    if (upath && pcap)
        copy(upath, pcap, unix_path);
    pthread_mutex_unlock(&mu);
}

void dm_stats_export_stop(void) {
    retired_t r = {.final_write = true};
    pthread_mutex_lock(&mu);
    r.http[0] = tcp;
    r.http[1] = unx;
    r.tf = tf;
    if (tf)
        dm__textfile_signal_stop(tf);
    tcp = unx = NULL;
    tf = NULL;
    url[0] = unix_path[0] = 0;
    discovery_update();
    owner = 0; /* stays stopped: the same settings on a later install do not restart */
    term_publish();
    pthread_mutex_unlock(&mu);
    retired_run(&r);
}

/* From dm_runtime_after_fork_child (Python: os.register_at_fork): the child's
 * own endpoint, same host, port 0; a Unix socket gets ".<pid>" unless its path
 * has "{pid}". `running` keeps the parent's strings, so a reload in the child
 * with unchanged settings changes nothing (and never rebinds the parent's fixed
 * port). The textfile stays the parent's. */
void dm__export_restart_in_child(void) {
    pthread_mutex_lock(&mu);
    if (!forked_serving || tcp || unx) { /* the parent was not serving, or done */
        pthread_mutex_unlock(&mu);
        return;
    }
    forked_serving = false;
    if (running.http[0]) {
        char hp[128];
        const char *colon = strrchr(running.http, ':');
        int hostlen = colon ? (int)(colon - running.http) : (int)strlen(running.http);
        snprintf(hp, sizeof(hp), "%.*s:0", hostlen, running.http);
        if (tcp_start(hp) != 0)
            dm_log("datamem: stats: endpoint off in child %d; the job runs on", (int)getpid());
    }
    if (running.unix_socket[0] && unx_start(running.unix_socket, true) != 0)
        dm_log("datamem: stats: Unix socket endpoint off in child %d; the job runs on",
                (int)getpid());
    if (tcp || unx) {
        owner = getpid();
        started = now_unix();
        discovery_update();
        term_publish();
    }
    pthread_mutex_unlock(&mu);
}
