/*
 * textfile.c: the node_exporter textfile. dm_stats_textfile_write writes the
 * Prometheus text of a fresh snapshot through a temporary file and a rename;
 * a "{pid}" in the path becomes the process id and adds a pid="<pid>" label to
 * every sample, so the workers of a job can write side by side. A textfile
 * thread (one per start, dm_textfile_t) rewrites it every interval and, for a
 * "{pid}" template, sweeps the files of dead workers; stopping removes a
 * "{pid}" file (it is this process's alone) or writes a shared one a last time.
 *
 * Thread safety: a dm_textfile_t's settings are guarded by its own `mu`, read
 * by its thread and written by its owner (export.c); the thread takes no other
 * lock of ours and calls dm_stats_snapshot, so its owner joins it only after
 * releasing every lock a snapshot could wait behind.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/files.h"
#include "service/render.h"
#include "service/textfile.h"

/* A textfile thread and what it reads; one per start, so a retired thread
 * still finishing never sees its successor's settings. Freed after its join. */
struct dm_textfile {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    char path[256];
    int64_t interval_ms;
};

/* ---- writing and sweeping ---------------------------------------------------- */

/* The textfile's directory follows the one directory rule (files.h): opened on
 * a descriptor and used only if it is this user's and nobody else can write
 * there, every directory on the way trusted too; the file is then written
 * through an unpredictable O_EXCL temporary name and renamed, both relative to
 * that descriptor (dm__files_write_atomic), so neither a planted link at the
 * name nor a directory swapped for a link after the check can send the write
 * anywhere else. `why` gets the reason of a failure, in one line. */
static int textfile_write(const char *tmpl, char *why, size_t cap) {
    char path[256], labels[32] = "", name[NAME_MAX + 1];
    dm__files_expand_pid(path, sizeof(path), tmpl);
    int dirfd = dm__files_parent_open(path, name, sizeof(name), why, cap);
    if (dirfd < 0)
        return dirfd == DM_EUNSAFE ? DM_EUNSAFE : DM_ESYS;
    /* Several processes writing "{pid}" files into one textfile directory would
     * otherwise export identical series, which node_exporter rejects. */
    if (strstr(tmpl, "{pid}"))
        snprintf(labels, sizeof(labels), "pid=\"%d\"", (int)getpid());
    char *text = NULL;
    size_t len = 0;
    int rc = dm__render_current(DM_STATS_PROMETHEUS, labels, &text, &len);
    if (rc == 0 && (rc = dm__files_write_atomic(dirfd, name, text, len, 0644)) != 0)
        snprintf(why, cap, "%s: %s", path, strerror(errno));
    else if (rc)
        snprintf(why, cap, "%s: %s", path, dm_strerror(rc));
    free(text);
    close(dirfd);
    return rc;
}

int dm_stats_textfile_write(const char *path) {
    char why[PATH_MAX + 128];
    int rc = textfile_write(path, why, sizeof(why));
    if (rc)
        dm_log("datamem: stats: cannot write textfile: %s", why);
    return rc;
}

/* A "{pid}" textfile is one process's: it goes when the process stops serving
 * (exit included), so node_exporter never serves a dead worker's numbers.
 * Removed relative to the checked directory, and only when it is a regular
 * file of this user's (the file this process wrote, not whatever replaced it). */
static void textfile_remove_own(const char *tmpl) {
    char path[256], name[NAME_MAX + 1], why[PATH_MAX + 128];
    dm__files_expand_pid(path, sizeof(path), tmpl);
    int dirfd = dm__files_parent_open(path, name, sizeof(name), why, sizeof(why));
    struct stat st;
    if (dirfd < 0)
        dm_log("datamem: stats: cannot remove textfile: %s", why);
    else if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
             st.st_uid == geteuid() && unlinkat(dirfd, name, 0) != 0 && errno != ENOENT)
        dm_log("datamem: stats: cannot remove textfile %s: %s", path, strerror(errno));
    if (dirfd >= 0)
        close(dirfd);
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
    char prefix[256], suffix[256], name[NAME_MAX + 1], why[PATH_MAX + 128];
    const char *base = slash ? slash + 1 : tmpl;
    snprintf(prefix, sizeof(prefix), "%.*s", (int)(at - base), base);
    snprintf(suffix, sizeof(suffix), "%s", at + 5);
    size_t pl = strlen(prefix), sl = strlen(suffix);
    /* The directory's rule, as for writing: only a directory nobody else can
     * write is swept (the names in it are then ours to judge). */
    int dfd = dm__files_parent_open(tmpl, name, sizeof(name), why, sizeof(why));
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0)
            close(dfd);
        else
            dm_log("datamem: stats: cannot sweep textfiles: %s", why);
        return dfd == DM_EUNSAFE ? DM_EUNSAFE : DM_ESYS;
    }
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

/* ---- the textfile thread ------------------------------------------------------ */

static void *tf_main(void *arg) {
    dm_textfile_t *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        char path[256];
        snprintf(path, sizeof(path), "%s", t->path);
        pthread_mutex_unlock(&t->mu);
        char why[PATH_MAX + 128];
        if (textfile_write(path, why, sizeof(why)) != 0)
            dm_log("datamem: stats: cannot write textfile: %s", why);
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

dm_textfile_t *dm__textfile_start(const char *path, int64_t interval_ms) {
    dm_textfile_t *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    snprintf(t->path, sizeof(t->path), "%s", path);
    t->interval_ms = interval_ms;
    if (thread_start(&t->thread, tf_main, t) != 0) {
        dm_log("datamem: stats: cannot start the textfile thread");
        free(t);
        return NULL;
    }
    return t;
}

void dm__textfile_signal_stop(dm_textfile_t *t) {
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

void dm__textfile_set_interval(dm_textfile_t *t, int64_t interval_ms) {
    pthread_mutex_lock(&t->mu);
    t->interval_ms = interval_ms;
    pthread_cond_signal(&t->cv); /* re-arms with the new period */
    pthread_mutex_unlock(&t->mu);
}

void dm__textfile_join(dm_textfile_t *t, bool final_write) {
    pthread_join(t->thread, NULL);
    if (strstr(t->path, "{pid}"))
        textfile_remove_own(t->path);
    else if (final_write)
        dm_stats_textfile_write(t->path);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}
