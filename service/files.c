/*
 * files.c: the services' file rules (files.h): owned directories, files
 * created with O_EXCL|O_NOFOLLOW, "{pid}" in a path. Used by the profile
 * writer (profile.c), the discovery files (discovery.c), the textfile
 * (textfile.c) and the Unix socket endpoint (export.c). No state.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/files.h"

int dm__files_dir_open_owned(const char *path, bool create, mode_t mode, char *why, size_t cap) {
    if (create && mkdir(path, mode) != 0 && errno != EEXIST) {
        snprintf(why, cap, "%s: cannot create: %s", path, strerror(errno));
        return DM_EIO;
    }
    struct stat st;
    if (lstat(path, &st) != 0) {
        snprintf(why, cap, "%s: %s", path, strerror(errno));
        return DM_EIO;
    }
    if (S_ISLNK(st.st_mode)) {
        snprintf(why, cap, "%s: a symbolic link, not a directory", path);
        return DM_EUNSAFE;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(why, cap, "%s: not a directory", path);
        return DM_EIO;
    }
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP || e == ENOTDIR) /* swapped since the lstat */
            snprintf(why, cap, "%s: replaced while being checked", path);
        else
            snprintf(why, cap, "%s: %s", path, strerror(e));
        return e == ELOOP || e == ENOTDIR ? DM_EUNSAFE : DM_EIO;
    }
    /* The descriptor is what we use from now on: check it, not the path. */
    struct stat fst;
    int rc = 0;
    uid_t euid = geteuid();
    if (fstat(fd, &fst) != 0) {
        snprintf(why, cap, "%s: %s", path, strerror(errno));
        rc = DM_EIO;
    } else if (fst.st_dev != st.st_dev || fst.st_ino != st.st_ino) {
        snprintf(why, cap, "%s: replaced while being checked", path);
        rc = DM_EUNSAFE;
    } else if (fst.st_uid != euid) {
        snprintf(why, cap, "%s: directory owned by uid %u, not by this user (uid %u)", path,
                 (unsigned)fst.st_uid, (unsigned)euid);
        rc = DM_EUNSAFE;
    } else if (fst.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, cap, "%s: directory writable by other users (mode %04o)", path,
                 (unsigned)(fst.st_mode & 07777));
        rc = DM_EUNSAFE;
    }
    if (rc) {
        close(fd);
        return rc;
    }
    return fd;
}

int dm__files_create(int dirfd, const char *name, mode_t mode) {
    return openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
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
