/*
 * files.c: the services' file rules (files.h): owned directories (resolved
 * and checked by policy/trust.c, the rule the policy file follows too), files
 * created with O_EXCL|O_NOFOLLOW, "{pid}" in a path. Used by the profile
 * writer (profile.c), the discovery files (discovery.c), the textfile
 * (textfile.c) and the Unix socket endpoint (export.c). No state.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <limits.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "policy/trust.h"
#include "runtime/datamem.h"
#include "service/files.h"

/* The rule itself is the engine's (runtime/os.c): spill files live under it too. */
int dm__files_dir_open_owned(const char *path, bool create, mode_t mode, char *why, size_t cap) {
    return dm_dir_open_owned(path, create, (unsigned)mode, why, cap);
}

int dm__files_create(int dirfd, const char *name, mode_t mode) {
    return openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
}

int dm__files_write_atomic(int dirfd, const char *name, const char *data, size_t len,
                           mode_t mode) {
    char tmp[NAME_MAX + 1];
    int fd = -1;
    for (int i = 0; i < 16 && fd < 0; i++) {
        unsigned r;
        if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            r = (unsigned)ts.tv_nsec * 2654435761u ^ (unsigned)getpid() ^ (unsigned)i << 24;
        }
        if (snprintf(tmp, sizeof(tmp), "%s.tmp.%08x", name, r) >= (int)sizeof(tmp))
            return DM_ERANGE;
        fd = dm__files_create(dirfd, tmp, mode);
        if (fd < 0 && errno != EEXIST)
            return DM_ESYS;
    }
    if (fd < 0)
        return DM_ESYS;
    /* The mode is set on the descriptor: the umask must not narrow it (a
     * textfile is 0644 for node_exporter). */
    bool ok = fchmod(fd, mode) == 0 && dm__files_write_all(fd, data, len);
    if (close(fd) != 0 || !ok || renameat(dirfd, tmp, dirfd, name) != 0) {
        int e = errno;
        unlinkat(dirfd, tmp, 0);
        errno = e;
        return DM_ESYS;
    }
    return 0;
}

int dm__files_parent_open(const char *path, char *name, size_t ncap, char *why, size_t cap) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    char dir[PATH_MAX];
    if (!base[0] || strcmp(base, ".") == 0 || strcmp(base, "..") == 0 ||
        snprintf(name, ncap, "%s", base) >= (int)ncap) {
        snprintf(why, cap, "%s: not a file name", path);
        errno = EINVAL;
        return DM_EIO;
    }
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    return dm__files_dir_open_owned(dir, false, 0, why, cap);
}

bool dm__files_write_all(int fd, const char *data, size_t len) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = write(fd, data + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        done += (size_t)n;
    }
    return true;
}

void dm__files_expand_pid(char *dst, size_t cap, const char *src) {
    const char *at = strstr(src, "{pid}");
    if (!at)
        snprintf(dst, cap, "%s", src);
    else
        snprintf(dst, cap, "%.*s%d%s", (int)(at - src), src, (int)getpid(), at + 5);
}
