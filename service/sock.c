/*
 * sock.c: the stats endpoint's Unix socket file (stats.unix_socket).
 *
 * A root job binding in a directory another user can write, then calling
 * chmod(path) by name, chmods whatever that user has swapped in meanwhile (a
 * link to any file). So the name is never looked up again through a path
 * someone else could change:
 *
 *  1. The socket's directory is opened under the one directory rule
 *     (files.h): this user's, writable by no one else, every directory on
 *     the way trusted; everything below is relative to that descriptor.
 *  2. A private directory (mode 0700, unpredictable name) is made in it, and
 *     the socket bound inside it through /proc/self/fd/<its descriptor>/s:
 *     the kernel resolves that to the directory we hold, whatever happens
 *     to any name.
 *  3. Its mode is set to 0600 there (fchmodat relative to the private
 *     directory, which no one else can enter or write), before the socket
 *     has a name anyone else can reach.
 *  4. renameat2(RENAME_NOREPLACE) moves it to its name: one atomic step that
 *     never replaces anything that appeared meanwhile. The private directory
 *     is removed.
 *
 * umask around bind() would set the mode without a name too, but the umask is
 * the whole process's: a file another thread of the job creates meanwhile
 * would get our mask. fchmod() on the socket before bind() changes the
 * socket's own inode, not the file bind() creates.
 *
 * Reentrant: no state.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/files.h"
#include "service/sock.h"

/* Whether a process accepts on the socket at `path` (a connect, which
 * changes nothing, is the only way to know). */
static bool live(const struct sockaddr_un *sa) {
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool up = probe >= 0 && connect(probe, (const struct sockaddr *)sa, sizeof(*sa)) == 0;
    if (probe >= 0)
        close(probe);
    return up;
}

/* What is at `name` now: 0 when nothing (or a stale socket of ours, removed),
 * -1 (logged) when it must be left alone. */
static int clear_name(int dirfd, const char *name, const char *path,
                      const struct sockaddr_un *sa) {
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return 0;
    if (!S_ISSOCK(st.st_mode)) {
        dm_log("datamem: stats: cannot listen on %s: a file that is not a socket is there",
               path);
        return -1;
    }
    if (live(sa)) {
        dm_log("datamem: stats: cannot listen on %s: Address already in use "
               "(another process serves it)", path);
        return -1;
    }
    if (st.st_uid != geteuid()) { /* delete only what this user made */
        dm_log("datamem: stats: cannot listen on %s: a stale socket of uid %u is there",
               path, (unsigned)st.st_uid);
        return -1;
    }
    unlinkat(dirfd, name, 0);
    return 0;
}

/* A private directory (0700, unpredictable name) in dirfd: its descriptor,
 * its name in `priv`; -1 on failure. */
static int private_dir(int dirfd, char *priv, size_t cap) {
    for (int i = 0; i < 16; i++) {
        unsigned r = 0;
        if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r))
            r ^= (unsigned)getpid() * 2654435761u + (unsigned)i;
        snprintf(priv, cap, ".datamem-sock.%08x", r);
        if (mkdirat(dirfd, priv, 0700) == 0)
            return openat(dirfd, priv, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (errno != EEXIST)
            return -1;
    }
    return -1;
}

/* Binds and listens inside the private directory privfd, mode 0600, then
 * moves the socket to `name` in dirfd. The socket's fd, or -1 (errno). */
static int bind_private(int dirfd, int privfd, const char *name, int backlog, dev_t *dev,
                        ino_t *ino) {
    struct sockaddr_un at = {.sun_family = AF_UNIX};
    snprintf(at.sun_path, sizeof(at.sun_path), "/proc/self/fd/%d/s", privfd);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct stat st;
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&at, sizeof(at)) != 0 ||
        fchmodat(privfd, "s", 0600, 0) != 0 || listen(fd, backlog) != 0 ||
        fstatat(privfd, "s", &st, AT_SYMLINK_NOFOLLOW) != 0)
        goto fail;
    if (renameat2(privfd, "s", dirfd, name, RENAME_NOREPLACE) != 0) {
        if (errno != EINVAL && errno != ENOSYS) /* a file system without NOREPLACE */
            goto fail;
        if (faccessat(dirfd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0) {
            errno = EEXIST;
            goto fail;
        }
        if (renameat(privfd, "s", dirfd, name) != 0)
            goto fail;
    }
    *dev = st.st_dev, *ino = st.st_ino;
    return fd;
fail:;
    int e = errno;
    close(fd);
    unlinkat(privfd, "s", 0);
    errno = e;
    return -1;
}

int dm__sock_listen(const char *path, int backlog, dev_t *dev, ino_t *ino) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        dm_log("datamem: stats: Unix socket path too long (at most %zu bytes): %s",
               sizeof(sa.sun_path) - 1, path);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    char name[NAME_MAX + 1], why[PATH_MAX + 128], priv[64];
    int dirfd = dm__files_parent_open(path, name, sizeof(name), why, sizeof(why));
    if (dirfd < 0) {
        dm_log("datamem: stats: cannot listen on %s: %s", path, why);
        return -1;
    }
    int fd = -1, privfd = -1;
    if (clear_name(dirfd, name, path, &sa) == 0) {
        privfd = private_dir(dirfd, priv, sizeof(priv));
        fd = privfd < 0 ? -1 : bind_private(dirfd, privfd, name, backlog, dev, ino);
        if (fd < 0)
            dm_log("datamem: stats: cannot listen on %s: %s", path, strerror(errno));
        if (privfd >= 0) {
            close(privfd);
            unlinkat(dirfd, priv, AT_REMOVEDIR);
        }
    }
    close(dirfd);
    return fd;
}

void dm__sock_remove(const char *path, dev_t dev, ino_t ino) {
    char name[NAME_MAX + 1], why[PATH_MAX + 128];
    int dirfd = dm__files_parent_open(path, name, sizeof(name), why, sizeof(why));
    struct stat st;
    if (dirfd < 0)
        return;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev &&
        st.st_ino == ino)
        unlinkat(dirfd, name, 0);
    close(dirfd);
}
