/*
 * trust.c: the one rule for the paths datamem reads its policy from and
 * writes into, in the manner of OpenSSH's StrictModes and sudo's checks of
 * their own configuration: whoever can change a file, or any directory on
 * the way to it, must be someone the job already trusts.
 *
 * The path is resolved here, not by the kernel: each directory is opened
 * (O_PATH|O_NOFOLLOW) relative to the one before it and checked on that
 * descriptor before any name is looked up in it, so nothing can be swapped
 * between a check and its use. The rule, for the user running the job (the
 * effective uid):
 *
 *  - A directory on the way is trusted when it is owned by the user or root
 *    and not writable by group or others. A directory others may write that
 *    has the sticky bit (/tmp) is trusted only for the names in it that
 *    belong to the user or root: there, only a name's owner, the directory's
 *    owner or root can rename or remove it (the kernel's protected_symlinks
 *    reasons the same way). Group-writable without the sticky bit is refused:
 *    a group member could rename anything there.
 *  - A symbolic link is followed only from a trusted directory, so it says
 *    what its directory's owner meant: Kubernetes ConfigMap mounts
 *    (policy.yaml -> ..data/policy.yaml, ..data -> ..2026_11_27_..., every
 *    one root's) resolve, a link planted by another user does not.
 *  - A policy (DM__TRUST_FILE) is a regular file owned by the user or root,
 *    writable by no one else; in a sticky shared directory it must also be
 *    the inode's only link (another user cannot plant a hard link to a file
 *    of root's under the name the job reads).
 *  - A directory to write into (DM__TRUST_DIR) is owned by the user (root's
 *    does not do: a job that is not root could not write there anyway) and
 *    not writable by group or others, sticky or not, and its own name is
 *    never a symbolic link: files.c's rule for the services' directories.
 *
 * Reentrant: no state.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "policy/diag.h"
#include "policy/trust.h"

#define MAX_LINKS 40 /* symbolic links in one resolution, as the kernel's ELOOP */
#define SHARED (S_IWGRP | S_IWOTH)

typedef struct walk {
    int dirfd;          /* the directory reached (O_PATH), already checked */
    struct stat dst;    /* its stat */
    char at[PATH_MAX];  /* its resolved path, for messages ("" is the root) */
    uid_t euid;
    char *why;
    size_t cap;
} walk_t;

static int fail(walk_t *w, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(walk_t *w, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->why, w->cap, fmt, ap);
    va_end(ap);
    return rc;
}

static int fail_errno(walk_t *w, const char *name) {
    int e = errno;
    fail(w, DM_EIO, "%s/%s: %s", w->at, name, strerror(e));
    errno = e;
    return DM_EIO;
}

static bool owner_ok(const walk_t *w, uid_t uid) { return uid == w->euid || uid == 0; }

/* A directory passed through (at `path`): 0, or DM_EUNSAFE with why. */
static int check_dir(walk_t *w, const struct stat *st, const char *path) {
    if (!owner_ok(w, st->st_uid))
        return fail(w, DM_EUNSAFE, "%s: directory owned by uid %u, not by this user (uid %u) "
                    "or root", path[0] ? path : "/", (unsigned)st->st_uid, (unsigned)w->euid);
    if ((st->st_mode & SHARED) && !(st->st_mode & S_ISVTX))
        return fail(w, DM_EUNSAFE, "%s: directory writable by other users (mode %04o)",
                    path[0] ? path : "/", (unsigned)(st->st_mode & 07777));
    return 0;
}

/* A name found in the current directory: in a sticky shared one, only the
 * user's or root's names are stable. */
static int check_name(walk_t *w, const struct stat *st, const char *name) {
    if ((w->dst.st_mode & SHARED) && !owner_ok(w, st->st_uid))
        return fail(w, DM_EUNSAFE, "%s/%s: owned by uid %u, in a directory other users can "
                    "write (mode %04o)", w->at, name, (unsigned)st->st_uid,
                    (unsigned)(w->dst.st_mode & 07777));
    return 0;
}

/* Moves the walk into directory fd (its stat st, its path `path`). */
static void enter(walk_t *w, int fd, const struct stat *st, const char *path) {
    close(w->dirfd);
    w->dirfd = fd;
    w->dst = *st;
    if (path != w->at)
        snprintf(w->at, sizeof w->at, "%s", path);
}

/* Opens `name` in the current directory without following a link and checks
 * that it is the inode fstatat saw (`st`). */
static int open_same(walk_t *w, const char *name, int flags, const struct stat *st) {
    int fd = openat(w->dirfd, name, flags | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return fail_errno(w, name);
    struct stat fst;
    if (fstat(fd, &fst) != 0 || fst.st_dev != st->st_dev || fst.st_ino != st->st_ino) {
        close(fd);
        return fail(w, DM_EUNSAFE, "%s/%s: replaced while being checked", w->at, name);
    }
    return fd;
}

static const char *kind_of(mode_t mode) {
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "not a regular file";
}

/* The last name, a regular file to read. */
static int final_file(walk_t *w, const char *name, const struct stat *st) {
    if (!S_ISREG(st->st_mode)) {
        errno = S_ISDIR(st->st_mode) ? EISDIR : EINVAL;
        return fail(w, DM_EINVALID, "%s", kind_of(st->st_mode));
    }
    /* O_NONBLOCK: a FIFO swapped in after the fstatat must not block open. */
    int fd = open_same(w, name, O_RDONLY | O_NONBLOCK | O_NOCTTY, st);
    if (fd < 0)
        return fd;
    int rc = 0, fl;
    if (!owner_ok(w, st->st_uid))
        rc = fail(w, DM_EUNSAFE, "%s/%s: owned by uid %u, not by this user (uid %u) or root",
                  w->at, name, (unsigned)st->st_uid, (unsigned)w->euid);
    else if (st->st_mode & SHARED)
        rc = fail(w, DM_EUNSAFE, "%s/%s: writable by other users (mode %04o)", w->at, name,
                  (unsigned)(st->st_mode & 07777));
    else if ((w->dst.st_mode & SHARED) && st->st_nlink != 1)
        rc = fail(w, DM_EUNSAFE, "%s/%s: %u hard links to it, in a directory other users "
                  "can write (mode %04o)", w->at, name, (unsigned)st->st_nlink,
                  (unsigned)(w->dst.st_mode & 07777));
    else if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
        rc = fail_errno(w, name);
    if (rc) {
        int e = errno;
        close(fd);
        errno = e;
        return rc;
    }
    return fd;
}

/* The directory the walk ended in (name "" when the path ended with "/" or
 * "."), to write into. */
static int final_dir(walk_t *w, const char *name, const struct stat *st, const char *path) {
    if (!S_ISDIR(st->st_mode)) {
        errno = ENOTDIR;
        return fail(w, DM_EINVALID, "%s: not a directory", path);
    }
    if (st->st_uid != w->euid)
        return fail(w, DM_EUNSAFE, "%s: directory owned by uid %u, not by this user (uid %u)",
                    path, (unsigned)st->st_uid, (unsigned)w->euid);
    if (st->st_mode & SHARED)
        return fail(w, DM_EUNSAFE, "%s: directory writable by other users (mode %04o)", path,
                    (unsigned)(st->st_mode & 07777));
    return open_same(w, name[0] ? name : ".", O_RDONLY | O_DIRECTORY, st);
}

/* Puts the link's target in front of the unresolved rest of the path
 * (`rest`); an absolute target restarts the walk at "/". */
static int follow(walk_t *w, const char *name, char *rest, size_t cap) {
    char target[PATH_MAX], joined[2 * PATH_MAX];
    ssize_t n = readlinkat(w->dirfd, name, target, sizeof target - 1);
    if (n < 0)
        return fail_errno(w, name);
    target[n] = 0;
    if (snprintf(joined, sizeof joined, "%s/%s", target, rest) >= (int)cap) {
        errno = ENAMETOOLONG;
        return fail_errno(w, name);
    }
    memcpy(rest, joined, strlen(joined) + 1);
    if (target[0] == '/') {
        int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            if (fd >= 0)
                close(fd);
            return fail_errno(w, name);
        }
        enter(w, fd, &st, "");
        return check_dir(w, &st, "");
    }
    return 0;
}

/* The parent of the current directory (the root's is the root). */
static int up(walk_t *w) {
    struct stat st;
    int fd = openat(w->dirfd, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0)
            close(fd);
        return fail_errno(w, "..");
    }
    char *slash = strrchr(w->at, '/');
    if (slash)
        *slash = 0;
    enter(w, fd, &st, w->at);
    return check_dir(w, &st, w->at);
}

/* Looks `name` up in the current directory (made there first when it is the
 * last name, absent and wanted made). */
static int lookup(walk_t *w, const char *name, bool last, dm__trust_want_t want, mode_t mode,
                  const char *path, struct stat *st) {
    if (fstatat(w->dirfd, name, st, AT_SYMLINK_NOFOLLOW) == 0)
        return 0;
    if (errno != ENOENT || !last || want != DM__TRUST_DIR_CREATE)
        return fail_errno(w, name);
    if (mkdirat(w->dirfd, name, mode) != 0 && errno != EEXIST) {
        int e = errno;
        fail(w, DM_EIO, "%s: cannot create: %s", path, strerror(e));
        errno = e;
        return DM_EIO;
    }
    return fstatat(w->dirfd, name, st, AT_SYMLINK_NOFOLLOW) == 0 ? 0 : fail_errno(w, name);
}

/* One name (not "", "." or ".."), `rest` the path after it. Returns a
 * negative code, 0 to go on with `rest` (rewritten when a link was followed),
 * or 1 with the descriptor of the end in *out. */
static int step(walk_t *w, const char *name, char *rest, size_t cap, dm__trust_want_t want,
                mode_t mode, int *links, int *out) {
    bool last = rest[strspn(rest, "/")] == 0;
    char path[PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof path, "%s/%s", w->at, name) >= (int)sizeof path) {
        errno = ENAMETOOLONG;
        return fail_errno(w, name);
    }
    int rc = lookup(w, name, last, want, mode, path, &st);
    if (rc)
        return rc;
    if (last && want != DM__TRUST_FILE) { /* its own, stricter rule */
        if (S_ISLNK(st.st_mode))
            return fail(w, DM_EUNSAFE, "%s: a symbolic link, not a directory", path);
        *out = final_dir(w, name, &st, path);
        return *out < 0 ? *out : 1;
    }
    if ((rc = check_name(w, &st, name)))
        return rc;
    if (S_ISLNK(st.st_mode)) {
        if (++*links > MAX_LINKS) {
            errno = ELOOP;
            return fail_errno(w, name);
        }
        return follow(w, name, rest, cap);
    }
    if (last) {
        *out = final_file(w, name, &st);
        return *out < 0 ? *out : 1;
    }
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return fail_errno(w, name);
    }
    int fd = open_same(w, name, O_PATH | O_DIRECTORY, &st);
    if (fd < 0)
        return fd;
    enter(w, fd, &st, path);
    return check_dir(w, &st, path);
}

/* Walks `rest` (an absolute path; it holds what is left to resolve). */
static int walk(walk_t *w, char *rest, size_t cap, dm__trust_want_t want, mode_t mode) {
    int links = 0, rc, out = -1;
    w->dirfd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (w->dirfd < 0 || fstat(w->dirfd, &w->dst) != 0)
        return fail_errno(w, "");
    if ((rc = check_dir(w, &w->dst, "")))
        return rc;
    for (;;) {
        const char *p = rest + strspn(rest, "/");
        size_t n = strcspn(p, "/");
        if (n == 0) { /* the path ends at the directory reached ("/", "dir/", "dir/.") */
            if (want != DM__TRUST_FILE)
                return final_dir(w, "", &w->dst, w->at[0] ? w->at : "/");
            errno = EISDIR;
            return fail(w, DM_EINVALID, "a directory");
        }
        char name[NAME_MAX + 1];
        if (n > NAME_MAX) {
            errno = ENAMETOOLONG;
            return fail(w, DM_EIO, "%s/%.*s: %s", w->at, (int)n, p, strerror(ENAMETOOLONG));
        }
        memcpy(name, p, n);
        name[n] = 0;
        memmove(rest, p + n, strlen(p + n) + 1);
        if (strcmp(name, ".") == 0)
            continue;
        rc = strcmp(name, "..") == 0 ? up(w)
                                     : step(w, name, rest, cap, want, mode, &links, &out);
        if (rc < 0)
            return rc;
        if (rc == 1)
            return out;
    }
}

int dm__trust_open(const char *path, dm__trust_want_t want, mode_t mode, char *why, size_t cap) {
    char rest[2 * PATH_MAX], cwd[PATH_MAX];
    walk_t w = {.dirfd = -1, .euid = geteuid(), .why = why, .cap = cap};
    why[0] = 0;
    if (!path[0]) {
        errno = ENOENT;
        return fail(&w, DM_EIO, "%s", strerror(ENOENT));
    }
    if (path[0] != '/' && !getcwd(cwd, sizeof cwd))
        return fail_errno(&w, ".");
    if (snprintf(rest, sizeof rest, "%s%s%s", path[0] == '/' ? "" : cwd,
                 path[0] == '/' ? "" : "/", path) >= (int)sizeof rest) {
        errno = ENAMETOOLONG;
        return fail(&w, DM_EIO, "%s: %s", path, strerror(ENAMETOOLONG));
    }
    int rc = walk(&w, rest, sizeof rest, want, mode);
    int e = errno;
    if (w.dirfd >= 0)
        close(w.dirfd);
    errno = e;
    return rc;
}
