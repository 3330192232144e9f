"""The file rules of the Python side, in one place (the C side
holds the same ones in service/files.h).

- A directory the package did not create itself is used only if it is a real
  directory (not a symbolic link), owned by this user (the effective uid) and
  not writable by group or others: owned_dir() checks with lstat, opens it with
  O_DIRECTORY|O_NOFOLLOW and checks the descriptor again (fstat), and callers
  then work relative to that descriptor, never through the path again.
- A file is created with O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name
  and renamed over its target (write_atomic()): nobody can plant a symbolic link
  at a name we are about to open, and a reader sees the old file or the new one.
- An existing file is adopted as input only if it is a regular file owned by
  this user and not writable by others (read_owned(), write_if_changed()).
- Reads are bounded (read_bounded()): a file or a socket cannot make us hold
  more than the caller's limit.

Errors are UnsafeError (an OSError), whose text is one line naming the path and
what is wrong with it.
"""
import errno
import os
import secrets
import stat

__all__ = ["UnsafeError", "TooLargeError", "check_owned", "owned_dir", "write_atomic",
           "read_bounded", "read_owned", "write_if_changed"]

_CHUNK = 1 << 16


class UnsafeError(OSError):
    """A path that breaks the rules above (its text is one line)."""

    def __init__(self, message):
        super().__init__(errno.EPERM, message)

    def __str__(self):
        return self.strerror


class TooLargeError(UnsafeError):
    """More bytes than the caller's limit."""


def check_owned(st, what, kind="directory"):
    """Raises UnsafeError unless stat result `st` (of `what`) is owned by this
    user and not writable by group or others."""
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeError("%s: %s owned by uid %d, not by this user (uid %d)"
                          % (what, kind, st.st_uid, euid))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeError("%s: %s writable by other users (mode %04o)"
                          % (what, kind, stat.S_IMODE(st.st_mode)))


def owned_dir(path, create=False, mode=0o700):
    """An fd (O_DIRECTORY|O_NOFOLLOW, close-on-exec) on directory `path`, which
    must be a directory (not a symbolic link), owned by this user and not
    writable by group or others. `create`: make it (with `mode`) if it is not
    there. Raises UnsafeError, or FileNotFoundError when it is absent."""
    path = os.fspath(path)
    if create:
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeError("%s: a symbolic link, not a directory" % path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeError("%s: not a directory" % path)
    check_owned(st, path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped since the lstat
            raise UnsafeError("%s: replaced while being checked" % path)
        raise
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeError("%s: replaced while being checked" % path)
        check_owned(fst, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(path, data, dir_fd=None, mode=0o600):
    """Writes `data` (bytes or str, UTF-8) to `path`: a new file with an
    unpredictable name next to it (O_CREAT|O_EXCL|O_NOFOLLOW), fsync, then
    os.replace() over `path`, so a planted symbolic link is replaced, never
    written through, and a reader never sees half a file. With `dir_fd`, `path`
    is a name in that directory (from owned_dir()). The file gets `mode`."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    path = os.fspath(path)
    own_fd = dir_fd is None
    if own_fd:  # the directory the caller named; everything below is relative to it
        parent, name = os.path.split(path)
        dir_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        name = path
    try:
        tmp = "%s.tmp.%s" % (name, secrets.token_hex(8))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        if own_fd:
            os.close(dir_fd)


def read_bounded(src, limit, what=None):
    """At most `limit` bytes from `src`: an fd (int), a path, or an object with
    read(n) (a file, an http.client.HTTPResponse). Raises TooLargeError if
    there is more."""
    if isinstance(src, int):
        read = lambda n: os.read(src, n)  # noqa: E731
    elif hasattr(src, "read"):
        read = src.read
    else:
        with open(src, "rb") as f:
            return read_bounded(f, limit, what or os.fspath(src))
    parts, size = [], 0
    while True:
        chunk = read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise TooLargeError("%s: more than %d bytes" % (what or "input", limit))


def read_owned(dir_fd, name, limit, what=None):
    """(bytes, stat) of file `name` in directory `dir_fd`, opened without following
    a symbolic link; it must be a regular file owned by this user and not
    writable by others, and hold at most `limit` bytes. Raises UnsafeError
    (TooLargeError) or OSError (absent, ...)."""
    what = what or name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeError("%s: a symbolic link, not a file" % what)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeError("%s: not a regular file" % what)
        check_owned(st, what, "file")
        return read_bounded(fd, limit, what), st
    finally:
        os.close(fd)


def write_if_changed(dir_fd, name, data, mode=0o600):
    """Makes `name` in directory `dir_fd` hold exactly `data`: an existing file is
    kept only if read_owned() accepts it and it holds those bytes (so a file in
    use is never rewritten); anything else there is replaced (write_atomic())."""
    try:
        have, _ = read_owned(dir_fd, name, len(data))
        if have == data:
            return
    except OSError:  # absent, too big, a link, not ours: replaced below
        pass
    write_atomic(name, data, dir_fd=dir_fd, mode=mode)
