/*
 * discovery.c: this process's discovery file. While an endpoint runs,
 * $DATAMEM_STATS_DIR/<pid>.json (default /tmp/datamem-<uid>/, mode 0700) names
 * it, so the processes of a multi-process job can be listed (`python -m
 * datamem ls`). The directory is used only through a descriptor checked by
 * dm__files_dir_open_owned (files.h: ours, not writable by others; otherwise the
 * process is not listed and runs on). Each file begins `{"datamem": 1, "pid":
 * <pid>, ` (DISCOVERY_MARK): the first write of a process prunes the files of
 * dead processes, and only those files — named <digits>.json, regular, owned
 * by this user, beginning with the mark and their own pid — so a directory
 * shared with other files loses none of them. `ls` applies the same
 * test.
 *
 * Thread safety: the state below is the caller's to serialise (export.c calls
 * every function here under its lock).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/buf.h"
#include "service/discovery.h"
#include "service/files.h"

/* How every discovery file begins; `ls` (python/datamem/_stats/discovery.py)
 * checks the same: a JSON object whose "datamem" is 1 and "pid" its file's
 * number. */
#define DISCOVERY_MARK "{\"datamem\": 1, \"pid\": "

static char discovery_dir[PATH_MAX];      /* its directory */
static char discovery[PATH_MAX + 32];     /* our discovery file, for messages; "" = none */

/* The rule is written twice, here and in python/datamem/_stats/discovery.py
 * (stats_dir): asking this function from Python would take a new wrapper in
 * pyext/ for a one-line rule. tests/python/stats/test_stats_export.py
 * (test_stats_dir_rule_is_the_c_sides) pins the two equal in every branch. */
const char *dm__discovery_dir(char *buf, size_t cap) {
    const char *d = getenv("DATAMEM_STATS_DIR"); /* once per server start, never hot */
    if (d && *d)
        snprintf(buf, cap, "%s", d);
    else
        snprintf(buf, cap, "/tmp/datamem-%u", (unsigned)getuid());
    return buf;
}

/* The discovery directory, created 0700 if missing: a descriptor on it, or -1
 * (logged) when it cannot be made or is not safe to use (a symbolic link,
 * another user's, writable by others: it sits in /tmp by default). */
static int stats_dir_open(const char *dir, bool create) {
    char why[PATH_MAX + 128];
    int fd = dm__files_dir_open_owned(dir, create, 0700, why, sizeof(why));
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
    snprintf(argv0, cap0, "%s", all);
    for (ssize_t i = 0; i < n - 1; i++)
        if (!all[i])
            all[i] = ' ';
}

void dm__discovery_remove(void) {
    if (!discovery[0])
        return;
    char name[32];
    snprintf(name, sizeof(name), "%d.json", (int)getpid());
    int dirfd = stats_dir_open(discovery_dir, false);
    if (dirfd >= 0) {
        unlinkat(dirfd, name, 0);
        close(dirfd);
    }
    discovery[0] = 0;
}

void dm__discovery_forget_in_child(void) { discovery[0] = 0; }

const char *dm__discovery_path(void) { return discovery; }

static void entry_text(dm_buf_t *b, const char *url, const char *unix_path, double started) {
    char argv0[256], all[1024];
    cmdline(argv0, sizeof(argv0), all, sizeof(all));
    dm__buf_printf(b, DISCOVERY_MARK "%d, \"url\": ", (int)getpid());
    if (url)
        dm__buf_json_str(b, url);
    else
        dm__buf_puts(b, "null");
    dm__buf_puts(b, ", \"unix_socket\": ");
    if (unix_path)
        dm__buf_json_str(b, unix_path);
    else
        dm__buf_puts(b, "null");
    dm__buf_puts(b, ", \"argv0\": ");
    dm__buf_json_str(b, argv0);
    dm__buf_puts(b, ", \"cmdline\": ");
    dm__buf_json_str(b, all);
    dm__buf_printf(b, ", \"started\": %.3f, \"version\": \"%s\"}\n", started,
                   DM_VERSION_STRING);
}

void dm__discovery_write(const char *url, const char *unix_path, double started) {
    char name[32];
    snprintf(name, sizeof(name), "%d.json", (int)getpid());
    bool fresh = !discovery[0];
    if (fresh)
        dm__discovery_dir(discovery_dir, sizeof(discovery_dir));
    int dirfd = stats_dir_open(discovery_dir, fresh);
    if (dirfd < 0) {
        discovery[0] = 0;
        return;
    }
    if (fresh)
        prune_dead(dirfd);
    snprintf(discovery, sizeof(discovery), "%s/%s", discovery_dir, name);
    dm_buf_t b = {0};
    entry_text(&b, url, unix_path, started);
    char *text = NULL;
    size_t len = 0;
    if (dm__buf_finish(&b, &text, &len) != 0 ||
        dm__files_write_atomic(dirfd, name, text, len, 0600) != 0)
        dm_log("datamem: stats: cannot write %s: %s", discovery, strerror(errno));
    free(text);
    close(dirfd);
}
