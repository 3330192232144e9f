/*
 * export.c: where stats go — which endpoint runs (policy or override), the
 * node_exporter textfile thread, the discovery file, fork and exit.
 *
 * What runs: the policy's `stats:` section applies on every install; an
 * override from dm_stats_serve (Python: DATAMEM_STATS_HTTP, serve_stats())
 * replaces its http / unix_socket. An endpoint is (re)started only when its
 * configured string changes, so a reload that keeps the section keeps the
 * socket (and its port, for port 0). A failure to listen is logged and
 * remembered: the same setting is not retried on every reload.
 *
 * Discovery: while an endpoint runs, $DATAMEM_STATS_DIR/<pid>.json (default
 * /tmp/datamem-<uid>/, mode 0700) names it, so the processes of a
 * multi-process job can be listed (`python -m datamem ls`). The directory is
 * used only through a descriptor checked by dm__dir_open_owned (files.h: ours,
 * not writable by others; otherwise the process is not listed and runs on).
 * Each file begins `{"datamem": 1, "pid": <pid>, ` (DISCOVERY_MARK): when a
 * server starts it prunes the files of dead processes, and only those files —
 * named <digits>.json, regular, owned by this user, beginning with the mark
 * and their own pid — so a directory shared with other files loses none of
 * them (issue 24). `ls` applies the same test.
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
 * Thread safety: `mu` guards the state below and serialises start/stop. The
 * serving and textfile threads never take it, and nothing done under it takes
 * dm__mu or calls jemalloc: stopping a daemon or joining a thread (which may be
 * inside dm_stats_snapshot) waits until it is released (retired_t). So the
 * atfork prepare handler can take it whatever order the handlers of the
 * runtime and of jemalloc run in.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "service/export.h"
#include "service/files.h"

/* How every discovery file begins; `ls` (python/datamem/_stats_cli.py) checks
 * the same: a JSON object whose "datamem" is 1 and "pid" its file's number. */
#define DISCOVERY_MARK "{\"datamem\": 1, \"pid\": "

typedef struct cfg {
    char http[128];
    char unix_socket[256];
    char textfile[256];
    int64_t interval_ms;
} cfg_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static cfg_t policy_cfg;             /* from the last install */
static uint64_t policy_seq;          /* its install sequence number */
static bool ovr_http_set, ovr_unix_set;
static char ovr_http[128], ovr_unix[256];
static cfg_t running;                /* the settings the endpoints were started for */
static dm_http_t *tcp, *unx;
static char url[200], unix_path[256];
static pid_t owner;                  /* process whose endpoint/files these are */
static bool forked_serving;          /* in a fork child: the parent was serving */
static char discovery_dir[PATH_MAX];      /* its directory */
static char discovery[PATH_MAX + 32];     /* our discovery file, for messages; "" = none */
static double started;

/* A textfile thread and what it reads; one per start, so a retired thread
 * still finishing never sees its successor's settings. Freed after its join. */
typedef struct textfile {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    char path[256];
    int64_t interval_ms;
} textfile_t;

static textfile_t *tf;               /* the running one, or NULL */

/* Work that must wait until `mu` is released: stopping a daemon or joining a
 * thread waits for it, and it may be inside dm_stats_snapshot (dm__mu and
 * jemalloc's locks, which a concurrent fork's prepare handlers take). */
typedef struct retired {
    dm_http_t *http[2];
    textfile_t *tf;
    bool final_write;
} retired_t;

static double now_unix(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void copy(char *dst, size_t cap, const char *src) { snprintf(dst, cap, "%s", src); }

/* "{pid}" in a path becomes the process id. */
static void expand_pid(char *dst, size_t cap, const char *src) {
    const char *at = strstr(src, "{pid}");
    if (!at)
        copy(dst, cap, src);
    else
        snprintf(dst, cap, "%.*s%d%s", (int)(at - src), src, (int)getpid(), at + 5);
}

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
         * (top once showed hugepage 268 MiB above resident 264 MiB). */
        if (s->arenas[i].resident < hp_cache[i])
            s->arenas[i].resident = hp_cache[i];
    }
    pthread_mutex_unlock(&hp_mu);
    return rc;
}

int dm__export_render(int format, const char *const_labels, char **out, size_t *len) {
    dm_stats_t *s = malloc(sizeof(*s));
    if (!s)
        return DM_ENOMEM;
    int rc = dm_stats_snapshot(s);
    if (rc == 0) {
        dm_stats_hugepages(s);
        dm_buf_t b = {0};
        dm_svc_stats_t svc;
        dm__svc_stats(&svc);
        dm_stats_process(s, &svc.process);
        if (format == DM_STATS_JSON) {
            dm__metrics_json(s, &svc, &b);
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

/* ---- threads not covered (told by the Python layer) ----------------------- */

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

void dm__svc_stats(dm_svc_stats_t *out) {
    dm__http_counters(&out->http);
    pthread_mutex_lock(&uncovered_mu);
    out->threads_not_covered = uncovered_n;
    memcpy(out->uncovered_names, uncovered_names, sizeof(uncovered_names));
    pthread_mutex_unlock(&uncovered_mu);
}

int dm_stats_render_current(int format, char **out, size_t *len) {
    if (format != DM_STATS_JSON && format != DM_STATS_PROMETHEUS)
        return DM_ERANGE;
    return dm__export_render(format, NULL, out, len);
}

/* ---- files ------------------------------------------------------------------ */

/* Writes `data` to `path` through a temporary file in the same directory and a
 * rename, so a reader sees the old file or the new one, never half of one.
 *
 * The temporary name is unpredictable and created with O_EXCL (mkostemp), so
 * whoever else can write to the directory cannot plant a symlink there and make
 * us write through it (a predictable "<path>.tmp.<pid>" opened without O_EXCL
 * let any user turn a root job's textfile into an overwrite of any file:
 * issue 11). rename() replaces the directory entry, never a symlink's target. */
static int write_atomic(const char *path, const char *data, size_t len, mode_t mode) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.XXXXXX", path) >= (int)sizeof(tmp))
        return DM_ERANGE;
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0)
        return DM_ESYS;
    bool ok = fchmod(fd, mode) == 0 /* mkostemp creates 0600 */ &&
              dm__file_write_all(fd, data, len);
    if (close(fd) != 0 || !ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return DM_ESYS;
    }
    return 0;
}

static int textfile_write(const char *tmpl) {
    char path[256], labels[32] = "";
    expand_pid(path, sizeof(path), tmpl);
    /* Several processes writing "{pid}" files into one textfile directory would
     * otherwise export identical series, which node_exporter rejects. */
    if (strstr(tmpl, "{pid}"))
        snprintf(labels, sizeof(labels), "pid=\"%d\"", (int)getpid());
    char *text = NULL;
    size_t len = 0;
    int rc = dm__export_render(DM_STATS_PROMETHEUS, labels, &text, &len);
    if (rc == 0)
        rc = write_atomic(path, text, len, 0644);
    free(text);
    return rc;
}

int dm_stats_textfile_write(const char *path) { return textfile_write(path); }

/* A "{pid}" textfile is one process's: it goes when the process stops serving
 * (exit included), so node_exporter never serves a dead worker's numbers. */
static void textfile_remove_own(const char *tmpl) {
    char path[256];
    expand_pid(path, sizeof(path), tmpl);
    if (unlink(path) != 0 && errno != ENOENT)
        dm_log("datamem: stats: cannot remove textfile %s: %s", path, strerror(errno));
}

static int64_t age_ms(const struct timespec *now, const struct timespec *then) {
    return ((int64_t)now->tv_sec - (int64_t)then->tv_sec) * 1000 +
           ((int64_t)now->tv_nsec - (int64_t)then->tv_nsec) / 1000000;
}

int dm_stats_textfile_sweep(const char *tmpl, int64_t min_age_ms) {
    const char *at = strstr(tmpl, "{pid}");
    const char *slash = strrchr(tmpl, '/');
    if (!at || (slash && slash > at) || strstr(at + 5, "{pid}"))
        return DM_ERANGE; /* "{pid}" must be in the file name, once */
    char dir[PATH_MAX], prefix[256], suffix[256];
    if (slash)
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - tmpl), tmpl);
    else
        copy(dir, sizeof(dir), ".");
    const char *name = slash ? slash + 1 : tmpl;
    snprintf(prefix, sizeof(prefix), "%.*s", (int)(at - name), name);
    copy(suffix, sizeof(suffix), at + 5);
    size_t pl = strlen(prefix), sl = strlen(suffix);
    DIR *d = opendir(dir[0] ? dir : "/");
    if (!d)
        return DM_ESYS;
    int removed = 0;
    /* Fine-grained: time() reads the clock as of the last tick, and a file
     * written since can carry a later (multigrain) mtime, which made a file
     * written a moment ago look younger than min_age 0 (a flaky test). */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t nl = strlen(e->d_name);
        if (nl <= pl + sl || strncmp(e->d_name, prefix, pl) != 0 ||
            strcmp(e->d_name + nl - sl, suffix) != 0)
            continue;
        long pid = 0;
        size_t i = pl;
        for (; i < nl - sl && e->d_name[i] >= '0' && e->d_name[i] <= '9' && pid < (1L << 30); i++)
            pid = pid * 10 + (e->d_name[i] - '0');
        if (i != nl - sl || pid <= 0 || pid == getpid())
            continue;
        /* Dead here, and not rewritten lately: a live writer in another pid
         * namespace sharing the directory keeps its file fresh. */
        struct stat st;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH ||
            fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
            age_ms(&now, &st.st_mtim) < min_age_ms)
            continue;
        removed += unlinkat(dirfd(d), e->d_name, 0) == 0;
    }
    closedir(d);
    return removed;
}

static const char *stats_dir(char *buf, size_t cap) {
    const char *d = getenv("DATAMEM_STATS_DIR"); /* once per server start, never hot */
    if (d && *d)
        copy(buf, cap, d);
    else
        snprintf(buf, cap, "/tmp/datamem-%u", (unsigned)getuid());
    return buf;
}

/* The discovery directory, created 0700 if missing: a descriptor on it, or -1
 * (logged) when it cannot be made or is not safe to use (a symbolic link,
 * another user's, writable by others: it sits in /tmp by default). */
static int stats_dir_open(const char *dir, bool create) {
    char why[PATH_MAX + 128];
    int fd = dm__dir_open_owned(dir, create, 0700, why, sizeof(why));
    if (fd < 0)
        dm_log("datamem: stats: %s; set DATAMEM_STATS_DIR to a directory of this user's "
               "(process not listed)", why);
    return fd;
}

/* `name` as the pid of a discovery file ("<digits>.json"), or 0. */
static long discovery_pid(const char *name) {
    long pid = 0;
    const char *c = name;
    for (; *c >= '0' && *c <= '9' && pid < (1L << 30); c++)
        pid = pid * 10 + (*c - '0');
    return c > name && name[0] != '0' && strcmp(c, ".json") == 0 ? pid : 0;
}

/* Whether `name` in `dirfd` is a discovery file datamem wrote for process
 * `pid`: a regular file (a symbolic link is not followed), owned by this user,
 * beginning with DISCOVERY_MARK and that pid. */
static bool discovery_is_ours(int dirfd, const char *name, long pid) {
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid())
        return false;
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return false;
    char want[64], head[64];
    int wn = snprintf(want, sizeof(want), DISCOVERY_MARK "%ld,", pid);
    ssize_t n = 0;
    bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
              (n = pread(fd, head, sizeof(head), 0)) >= wn &&
              memcmp(head, want, (size_t)wn) == 0;
    close(fd);
    return ok;
}

/* Removes the discovery files of processes that no longer exist; nothing else. */
static void prune_dead(int dirfd) {
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0)
            close(fd);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        long pid = discovery_pid(e->d_name);
        if (pid <= 0 || pid == getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        if (discovery_is_ours(dirfd, e->d_name, pid))
            unlinkat(dirfd, e->d_name, 0);
    }
    closedir(d);
}

/* Writes `name` in `dirfd` through a new file of an unpredictable name there
 * (O_CREAT|O_EXCL|O_NOFOLLOW) and a rename: no planted link is written through,
 * and a reader sees the old file or the new one. */
static int write_atomic_at(int dirfd, const char *name, const char *data, size_t len,
                           mode_t mode) {
    char tmp[NAME_MAX + 1];
    int fd = -1;
    for (int i = 0; i < 16 && fd < 0; i++) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        unsigned r = (unsigned)ts.tv_nsec * 2654435761u ^ (unsigned)getpid() ^ (unsigned)i << 24;
        if (snprintf(tmp, sizeof(tmp), "%s.tmp.%08x", name, r) >= (int)sizeof(tmp))
            return DM_ERANGE;
        fd = dm__file_create(dirfd, tmp, mode);
        if (fd < 0 && errno != EEXIST)
            return DM_ESYS;
    }
    if (fd < 0)
        return DM_ESYS;
    bool ok = dm__file_write_all(fd, data, len);
    if (close(fd) != 0 || !ok || renameat(dirfd, tmp, dirfd, name) != 0) {
        int e = errno;
        unlinkat(dirfd, tmp, 0);
        errno = e;
        return DM_ESYS;
    }
    return 0;
}

/* argv[0] and the command line (arguments joined by spaces), from /proc. */
static void cmdline(char *argv0, size_t cap0, char *all, size_t cap) {
    argv0[0] = all[0] = 0;
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, all, cap - 1);
    close(fd);
    if (n <= 0)
        return;
    all[n] = 0;
    copy(argv0, cap0, all);
    for (ssize_t i = 0; i < n - 1; i++)
        if (!all[i])
            all[i] = ' ';
}

/* Called with mu held. */
static void discovery_update(void) {
    char name[32];
    snprintf(name, sizeof(name), "%d.json", (int)getpid());
    if (discovery[0] && !tcp && !unx) {
        int dirfd = stats_dir_open(discovery_dir, false);
        if (dirfd >= 0) {
            unlinkat(dirfd, name, 0);
            close(dirfd);
        }
        discovery[0] = 0;
        return;
    }
    if (!tcp && !unx)
        return;
    bool fresh = !discovery[0];
    if (fresh)
        stats_dir(discovery_dir, sizeof(discovery_dir));
    int dirfd = stats_dir_open(discovery_dir, fresh);
    if (dirfd < 0) {
        discovery[0] = 0;
        return;
    }
    if (fresh)
        prune_dead(dirfd);
    snprintf(discovery, sizeof(discovery), "%s/%s", discovery_dir, name);
    char argv0[256], all[1024];
    cmdline(argv0, sizeof(argv0), all, sizeof(all));
    dm_buf_t b = {0};
    dm__buf_printf(&b, DISCOVERY_MARK "%d, \"url\": ", (int)getpid());
    if (tcp)
        dm__buf_json_str(&b, url);
    else
        dm__buf_puts(&b, "null");
    dm__buf_puts(&b, ", \"unix_socket\": ");
    if (unx)
        dm__buf_json_str(&b, unix_path);
    else
        dm__buf_puts(&b, "null");
    dm__buf_puts(&b, ", \"argv0\": ");
    dm__buf_json_str(&b, argv0);
    dm__buf_puts(&b, ", \"cmdline\": ");
    dm__buf_json_str(&b, all);
    dm__buf_printf(&b, ", \"started\": %.3f, \"version\": \"%s\"}\n", started,
                   DM_VERSION_STRING);
    char *text = NULL;
    size_t len = 0;
    if (dm__buf_finish(&b, &text, &len) != 0 ||
        write_atomic_at(dirfd, name, text, len, 0600) != 0)
        dm_log("datamem: stats: cannot write %s: %s", discovery, strerror(errno));
    free(text);
    close(dirfd);
}

/* ---- the textfile thread --------------------------------------------------------- */

static void *tf_main(void *arg) {
    textfile_t *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        char path[256];
        copy(path, sizeof(path), t->path);
        pthread_mutex_unlock(&t->mu);
        if (textfile_write(path) != 0)
            dm_log("datamem: stats: cannot write textfile %s: %s", path, strerror(errno));
        if (strstr(path, "{pid}")) /* files of dead workers, unchanged for 3 periods */
            dm_stats_textfile_sweep(path, 3 * (t->interval_ms > 10000 ? t->interval_ms : 10000));
        pthread_mutex_lock(&t->mu);
        struct timespec next;
        clock_gettime(CLOCK_MONOTONIC, &next);
        int64_t ms = t->interval_ms > 0 ? t->interval_ms : 10000;
        next.tv_sec += ms / 1000;
        next.tv_nsec += (ms % 1000) * 1000000;
        if (next.tv_nsec >= 1000000000) {
            next.tv_sec++;
            next.tv_nsec -= 1000000000;
        }
        int rc = 0;
        int64_t armed = t->interval_ms;
        while (!t->stop && rc != ETIMEDOUT && armed == t->interval_ms)
            rc = pthread_cond_timedwait(&t->cv, &t->mu, &next);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Our threads take no signals: they belong to the job's main thread (Python
 * runs its handlers there). */
static int thread_start(pthread_t *t, void *(*fn)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

static textfile_t *tf_start(const char *path, int64_t interval_ms) {
    textfile_t *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    copy(t->path, sizeof(t->path), path);
    t->interval_ms = interval_ms;
    if (thread_start(&t->thread, tf_main, t) != 0) {
        dm_log("datamem: stats: cannot start the textfile thread");
        free(t);
        return NULL;
    }
    return t;
}

static void tf_signal_stop(textfile_t *t) {
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

/* Called without mu. */
static void retired_run(retired_t *r) {
    for (int i = 0; i < 2; i++)
        if (r->http[i])
            dm__http_stop(r->http[i]);
    if (r->tf) {
        pthread_join(r->tf->thread, NULL);
        if (strstr(r->tf->path, "{pid}"))
            textfile_remove_own(r->tf->path);
        else if (r->final_write && textfile_write(r->tf->path) != 0)
            dm_log("datamem: stats: cannot write textfile %s: %s", r->tf->path, strerror(errno));
        pthread_mutex_destroy(&r->tf->mu);
        pthread_cond_destroy(&r->tf->cv);
        free(r->tf);
    }
}

/* ---- endpoints ------------------------------------------------------------------------ */

static int tcp_start(const char *hostport) {
    int rc = dm__http_start_tcp(hostport, &tcp, url, sizeof(url));
    if (rc != 0) {
        tcp = NULL;
        url[0] = 0;
    }
    return rc;
}

static int unx_start(const char *tmpl, bool child) {
    char path[256];
    expand_pid(path, sizeof(path), tmpl);
    if (child && !strstr(tmpl, "{pid}"))
        snprintf(path, sizeof(path), "%.200s.%d", tmpl, (int)getpid());
    int rc = dm__http_start_unix(path, &unx);
    if (rc == 0)
        copy(unix_path, sizeof(unix_path), path);
    else
        unx = NULL;
    return rc;
}

static void atfork_prepare(void) { pthread_mutex_lock(&mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&mu); }

/* The child: none of the parent's threads exist here. Their handles are
 * dropped (a textfile_t and a daemon's memory leak, once per fork). */
static void atfork_child(void) {
    forked_serving = tcp || unx;
    if (tcp)
        dm__http_forget_in_child(tcp);
    if (unx)
        dm__http_forget_in_child(unx);
    tcp = unx = NULL;
    tf = NULL;
    url[0] = unix_path[0] = 0;
    discovery[0] = 0;
    owner = 0;
    pthread_mutex_init(&hp_mu, NULL);
    pthread_mutex_init(&uncovered_mu, NULL); /* a scrape may have held it */
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
            tf_signal_stop(tf);
        r->tf = tf;
        tf = want.textfile[0] ? tf_start(want.textfile, want.interval_ms) : NULL;
        copy(running.textfile, sizeof(running.textfile), want.textfile);
        changed = true;
    } else if (tf && want.interval_ms != running.interval_ms) {
        pthread_mutex_lock(&tf->mu);
        tf->interval_ms = want.interval_ms;
        pthread_cond_signal(&tf->cv); /* re-arms with the new period */
        pthread_mutex_unlock(&tf->mu);
    }
    running.interval_ms = want.interval_ms;
    if (changed) {
        if ((tcp || unx || tf) && owner != getpid()) {
            owner = getpid();
            started = now_unix();
        }
        discovery_update();
    }
    return rc;
}

/* From dm_runtime_install, outside dm__mu: the policy's `stats:` section.
 * `seq` orders concurrent installs (an older one never undoes a newer one). */
void dm__export_configure(const dm_stats_spec_t *spec, uint64_t seq) {
    bool any = spec->http[0] || spec->unix_socket[0] || spec->textfile[0];
    pthread_mutex_lock(&mu);
    bool idle = !any && !running.http[0] && !running.unix_socket[0] && !running.textfile[0];
    if (seq >= policy_seq && idle) /* nothing runs or will: start no machinery */
        policy_seq = seq;
    pthread_mutex_unlock(&mu);
    if (idle)
        return;
    pthread_once(&once, init_once);
    retired_t r = {0};
    pthread_mutex_lock(&mu);
    if (seq >= policy_seq) {
        policy_seq = seq;
        copy(policy_cfg.http, sizeof(policy_cfg.http), spec->http);
        copy(policy_cfg.unix_socket, sizeof(policy_cfg.unix_socket), spec->unix_socket);
        copy(policy_cfg.textfile, sizeof(policy_cfg.textfile), spec->textfile);
        policy_cfg.interval_ms = spec->interval_ms;
        apply(&r);
    }
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
        tf_signal_stop(tf);
    tcp = unx = NULL;
    tf = NULL;
    url[0] = unix_path[0] = 0;
    discovery_update();
    owner = 0; /* stays stopped: the same settings on a later install do not restart */
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
    }
    pthread_mutex_unlock(&mu);
}
