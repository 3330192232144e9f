/*
 * watch.c: reloads the policy when its file changes (inotify), from a C thread.
 *
 * We watch the file's *directory*, not the file: editors replace files by
 * rename, `mv` swaps the inode, and Kubernetes ConfigMaps update by swapping a
 * `..data` symlink in the directory; a watch on the file itself sees only
 * IN_DELETE_SELF and dies. Any create / modify / close-after-write / moved-to /
 * delete / attribute event naming the file or `..data` (re)starts a debounce
 * timer (editors write in bursts). Modify counts, truncation included, so a file
 * written in place is read only once its writer has paused for the debounce, not
 * when a timer from an earlier event runs out half-way through the write; the
 * kernel merges a burst of identical events still unread into one. When the
 * timer expires the file is read and its content hash is compared with the
 * policy the thread watches for, so no-op writes and touches do not reload.
 * A file that is missing or broken keeps the last good policy: the diagnostics go
 * to the log and the failure is counted. If the directory itself goes away the
 * watch is re-armed every half second until it is back.
 *
 * The thread starts the first time a policy with `reload.watch: true` is
 * installed and then lives for the process, idle (blocked in poll) while no
 * policy asks for watching: off costs nothing, and switching costs no thread
 * churn. Configuration changes wake it through an eventfd. After fork the child
 * has no watcher thread, and closes the parent's eventfd and inotify descriptor:
 * a child's watcher on a shared eventfd could read the parent's wake-ups away.
 * The child watches as its parent did (dm__watch_on_fork_child) with its own.
 *
 * The engine tells us of installs in install order (dm_install_hook_t), so
 * the watcher follows the file of the policy in force. The thread acts on a
 * snapshot: the settings of one installed policy and that policy's hash. Its
 * reload goes through dm_runtime_reload over that hash, so it lands only while
 * the policy it took its settings from is still in force: an install that came
 * first wins (DM_ESUPERSEDED), and the thread retries with the new settings
 * once that install has told it of them. The hash is what keeps a watcher woken
 * by a write just before `datamem.reload()` from putting a later write in force
 * under the settings of the policy that reload replaced.
 *
 * Thread safety: cfg is guarded by watch_mu.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/watch.h"

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    bool started;        /* the thread exists (in this process) */
    bool enabled;
    char path[PATH_MAX]; /* policy file to watch */
    int64_t debounce_ms;
    uint64_t over;       /* the hash of the policy these settings came from */
    unsigned gen;        /* bumped on every change, so the thread takes a new snapshot */
    int wake_fd;         /* eventfd */
    int inotify_fd;      /* the thread's; closed in a fork child */
} cfg = {.wake_fd = -1, .inotify_fd = -1};

static _Atomic uint64_t watch_reloads, watch_skipped;
/* DATAMEM_QUIET=1: a reload's warnings are not logged (its errors are).
 * Written once by the constructor (dm__watch_init), before any thread. */
static bool quiet;
/* A hash of the policy warnings last reported in this process (0: none); see
 * dm_watch_warnings_changed. A fork child keeps it: its parent reported them
 * on the same stderr. */
static _Atomic uint64_t warnings_reported;

bool dm_watch_warnings_changed(const char *text) {
    uint64_t h = 0;
    if (text && text[0]) {
        h = 0xcbf29ce484222325ull; /* FNV-1a */
        for (const unsigned char *c = (const unsigned char *)text; *c; c++)
            h = (h ^ *c) * 0x100000001b3ull;
        h |= h == 0;
    }
    return atomic_exchange(&warnings_reported, h) != h && h != 0;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Copies at most n bytes of src, truncating to fit and always terminating. */
static void copy_str(char *dst, size_t cap, const char *src, size_t n) {
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = 0;
}

static void split_path(const char *path, char *dir, size_t dcap, char *base, size_t bcap) {
    const char *slash = strrchr(path, '/');
    if (!slash) {
        copy_str(dir, dcap, ".", 1);
        copy_str(base, bcap, path, strlen(path));
    } else {
        copy_str(dir, dcap, path, slash == path ? 1 : (size_t)(slash - path));
        copy_str(base, bcap, slash + 1, strlen(slash + 1));
    }
}

/* Reads the file and returns its hash; false, with the reason in `why`, if it
 * cannot be read now. dm_policy_open applies the policy's rule (a file or
 * directory swapped for one of another user's is refused before it is read)
 * and never blocks on a FIFO. */
static bool file_hash(const char *path, uint64_t *h, char *why, size_t wcap) {
    int fd = dm_policy_open(path, why, wcap), err = 0;
    if (fd < 0)
        return false;
    size_t cap = DM_POLICY_FILE_MAX + 1, n = 0;
    char *buf = malloc(cap);
    bool ok = buf != NULL;
    while (ok && n < cap) {
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            ok = r == 0;
            err = errno;
            break;
        }
        n += (size_t)r;
    }
    close(fd);
    if (ok)
        *h = dm_policy_hash(buf, n);
    else
        snprintf(why, wcap, "cannot read the policy: %s", buf ? strerror(err) : "out of memory");
    free(buf);
    return ok;
}

/* A test's seam (watch_test): called with true once a reload is decided, before
 * the file is read, and with false after the attempt. NULL in the product. */
void (*dm__watch_seam)(bool before);

/* Reloads `path` over the policy whose hash is `over`; false if another install
 * came first (the caller retries with the settings that install brings). */
static bool reload_now(const char *path, uint64_t over) {
    uint64_t h;
    char why[512];
    if (!file_hash(path, &h, why, sizeof why)) {
        static const char plain[] = "cannot read the policy: "; /* said already */
        const char *w = strncmp(why, plain, sizeof plain - 1) == 0 ? why + sizeof plain - 1 : why;
        dm_log("datamem: policy %s cannot be read (%s); keeping the last good policy", path, w);
        dm_runtime_note_reload_failure(); /* after the log: a reader of the count sees both */
        return true;
    }
    if (h == over) { /* the bytes of the policy this thread watches for */
        atomic_fetch_add(&watch_skipped, 1);
        return true;
    }
    dm_diags_t *d = malloc(sizeof(*d));
    if (!d)
        return true;
    dm_diags_init(d, path);
    int rc = dm_runtime_reload(path, over, d); /* never over another install */
    if (rc == DM_ESUPERSEDED) {
        free(d);
        return false;
    }
    if (rc) {
        char *msg = malloc(16384);
        if (msg) {
            dm_diags_format_all(d, msg, 16384);
            dm_log("datamem: reload of %s failed; keeping the last good policy:\n%s", path, msg);
            free(msg);
        }
    } else {
        atomic_fetch_add(&watch_reloads, 1);
        char msg[4096] = "";
        if (d->nwarnings)
            dm_diags_format_all(d, msg, sizeof(msg));
        if (!quiet && dm_watch_warnings_changed(msg)) /* a set already reported stays quiet */
            dm_log("datamem: reloaded %s with warnings:\n%s", path, msg);
    }
    free(d);
    return true;
}

static bool event_names_us(const struct inotify_event *ev, const char *base) {
    if (ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_Q_OVERFLOW))
        return true;
    return ev->len && (strcmp(ev->name, base) == 0 || strcmp(ev->name, "..data") == 0);
}

static void *watch_main(void *arg) {
    int in = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    pthread_mutex_lock(&watch_mu);
    cfg.inotify_fd = in;
    pthread_mutex_unlock(&watch_mu);
    int wd = -1;
    unsigned seen_gen = ~0u;
    char path[PATH_MAX] = "", dir[PATH_MAX], base[NAME_MAX + 1];
    bool enabled = false;
    uint64_t over = 0;
    int64_t debounce = 50, due = -1; /* due: when to reload, -1 = nothing pending */
    char evbuf[16 * (sizeof(struct inotify_event) + NAME_MAX + 1)]
        __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        pthread_mutex_lock(&watch_mu);
        int wake = cfg.wake_fd;
        if (cfg.gen != seen_gen) {
            seen_gen = cfg.gen;
            over = cfg.over;
            if (enabled != cfg.enabled || debounce != cfg.debounce_ms ||
                strcmp(path, cfg.path) != 0) { /* not a new hash alone: re-arm */
                enabled = cfg.enabled;
                debounce = cfg.debounce_ms;
                copy_str(path, sizeof(path), cfg.path, strlen(cfg.path));
                split_path(path, dir, sizeof(dir), base, sizeof(base));
                if (wd >= 0)
                    inotify_rm_watch(in, wd);
                wd = -1;
                due = -1;
            }
        }
        pthread_mutex_unlock(&watch_mu);
        if (enabled && wd < 0 && in >= 0) {
            wd = inotify_add_watch(in, dir, IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE |
                                            IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE |
                                            IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF |
                                            IN_ONLYDIR);
            if (wd >= 0 && due < 0)
                due = now_ms() + debounce; /* re-armed: catch what changed meanwhile */
        }
        int timeout = !enabled ? -1 : wd < 0 ? 500 : due >= 0 ? (int)(due - now_ms()) : -1;
        if (timeout < -1 || (due >= 0 && timeout < 0))
            timeout = 0;
        struct pollfd fds[2] = {{wake, POLLIN, 0}, {in, POLLIN, 0}};
        int n = poll(fds, 2, timeout);
        if (n > 0 && (fds[0].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(wake, &v, sizeof(v));
            (void)r;
        }
        if (n > 0 && (fds[1].revents & POLLIN)) {
            ssize_t len;
            while ((len = read(in, evbuf, sizeof(evbuf))) > 0) {
                for (char *p = evbuf; p < evbuf + len;) {
                    const struct inotify_event *ev = (const struct inotify_event *)p;
                    if ((ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF)) &&
                        ev->wd == wd)
                        wd = -1; /* the directory went away: re-arm */
                    if (enabled && event_names_us(ev, base))
                        due = now_ms() + debounce;
                    p += sizeof(struct inotify_event) + ev->len;
                }
            }
        }
        if (enabled && due >= 0 && now_ms() >= due) {
            due = -1;
            if (dm__watch_seam)
                dm__watch_seam(true);
            if (!reload_now(path, over)) /* the newer install's settings come next */
                due = now_ms() + (debounce > 10 ? debounce : 10);
            if (dm__watch_seam)
                dm__watch_seam(false);
        }
    }
    return arg;
}

static void watch_configure(const char *path, bool enabled, int64_t debounce_ms,
                            uint64_t over) {
    pthread_mutex_lock(&watch_mu);
    bool changed = cfg.enabled != enabled || strcmp(cfg.path, path) != 0 ||
                   cfg.debounce_ms != debounce_ms || cfg.over != over;
    if (changed) {
        cfg.enabled = enabled;
        copy_str(cfg.path, sizeof(cfg.path), path, strlen(path));
        cfg.debounce_ms = debounce_ms;
        cfg.over = over;
        cfg.gen++;
    }
    if (enabled && !cfg.started) {
        if (cfg.wake_fd < 0)
            cfg.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (cfg.wake_fd >= 0 && pthread_create(&th, &attr, watch_main, NULL) == 0)
            cfg.started = true;
        else
            dm_log("datamem: cannot start the policy watcher; reload with datamem.reload()");
        pthread_attr_destroy(&attr);
    } else if (changed && cfg.started) {
        uint64_t one = 1;
        ssize_t r = write(cfg.wake_fd, &one, sizeof(one));
        (void)r;
    }
    pthread_mutex_unlock(&watch_mu);
}

/* pthread_atfork child handler: the thread did not survive the fork; its
 * descriptors are the parent's and go (the next install makes our own). */
static void watch_atfork_child(void) {
    pthread_mutex_init(&watch_mu, NULL);
    cfg.started = false;
    cfg.gen++;
    if (cfg.wake_fd >= 0)
        close(cfg.wake_fd);
    if (cfg.inotify_fd >= 0)
        close(cfg.inotify_fd);
    cfg.wake_fd = cfg.inotify_fd = -1;
}

/* After every install (the engine's observer), with the policy it published. */
void dm__watch_on_install(const dm_policy_t *p) {
    if (p->path[0])
        watch_configure(p->path, p->reload.watch, p->reload.debounce_ms, p->hash);
}

/* dm_runtime_after_fork_child: the child watches as its parent did. */
void dm__watch_on_fork_child(void) {
    dm_policy_t *p = dm_runtime_policy_copy();
    if (p)
        dm__watch_on_install(p);
    dm_policy_free(p);
}

void dm__watch_init(void) {
    const char *q = getenv("DATAMEM_QUIET"); /* the library's load: one thread */
    quiet = q && strcmp(q, "1") == 0;
    pthread_atfork(NULL, NULL, watch_atfork_child);
}

void dm_watch_counts(uint64_t *reloads, uint64_t *skipped) {
    *reloads = atomic_load(&watch_reloads);
    *skipped = atomic_load(&watch_skipped);
}
