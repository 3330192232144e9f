/*
 * files.h: the services' file rules, the ones
 * python/datamem/_files.py holds for the Python side. Internal: never installed.
 *
 * - A directory is used through a descriptor opened with O_DIRECTORY|O_NOFOLLOW,
 *   and only if that descriptor is a directory owned by this user (the effective
 *   uid) and not writable by group or others: whoever else could write there
 *   could plant a symbolic link, or a file we would then trust. The path to it
 *   is resolved on descriptors under the policy's rule (policy/trust.c): every
 *   directory on the way owned by this user or root and not writable by others
 *   (a sticky one, /tmp, only for names of this user's or root's), links
 *   followed only from such directories, so no other user can steer it.
 * - Files are created relative to that descriptor with O_CREAT|O_EXCL|O_NOFOLLOW.
 *
 * Thread safety: none needed (no state).
 */
#ifndef DM_SERVICE_FILES_H
#define DM_SERVICE_FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* A descriptor (O_RDONLY|O_DIRECTORY|O_NOFOLLOW, close-on-exec) on directory
 * `path`, made first with `mode` when `create` and it is absent. Returns the fd,
 * or DM_EIO (cannot create or open it) or DM_EUNSAFE (a symbolic link, owned by
 * another user, writable by others), with one line in `why` naming the path and
 * what is wrong with it. */
int dm__files_dir_open_owned(const char *path, bool create, mode_t mode, char *why, size_t cap);

/* Opens a new file `name` in directory `dirfd` for writing
 * (O_CREAT|O_EXCL|O_NOFOLLOW, close-on-exec): fails with EEXIST when anything,
 * a symbolic link included, is already there. -1 and errno on failure. */
int dm__files_create(int dirfd, const char *name, mode_t mode);

/* Makes `name` in directory `dirfd` hold `data` with `mode`: a new file of an
 * unpredictable name there (dm__files_create), then renameat over `name`, so
 * a planted link is replaced, never written through, and a reader sees the
 * old file or the new one. 0, or DM_ESYS / DM_ERANGE with errno set. */
int dm__files_write_atomic(int dirfd, const char *name, const char *data, size_t len,
                           mode_t mode);

/* The directory of file `path` opened under the rule above
 * (dm__files_dir_open_owned, never created), with the file's own name copied
 * to `name`: what writes, renames and removals of that file go through.
 * Returns the descriptor, or DM_EIO / DM_EUNSAFE with one line in `why`. */
int dm__files_parent_open(const char *path, char *name, size_t ncap, char *why, size_t cap);

/* Writes all `len` bytes to `fd` (retrying short writes and EINTR): true when
 * every byte went out. */
bool dm__files_write_all(int fd, const char *data, size_t len);

/* `src` with its first "{pid}" replaced by the process id, into `dst` (cut at
 * `cap`): the textfile and Unix socket paths of a job's workers. */
void dm__files_expand_pid(char *dst, size_t cap, const char *src);

#endif /* DM_SERVICE_FILES_H */
