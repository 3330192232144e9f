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

/* The rule itself is the engine's (runtime/os.c): spill files live under it too. */
int dm__files_dir_open_owned(const char *path, bool create, mode_t mode, char *why, size_t cap) {
    return dm_dir_open_owned(path, create, (unsigned)mode, why, cap);
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
