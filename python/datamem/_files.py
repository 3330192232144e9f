"""The file rules of the Python side, in one place (the C side
holds the same ones in service/files.h).

- A directory the package did not create itself is used only if it is a real
  directory (not a symbolic link), owned by this user (the effective uid) and
  not writable by group or others, and every directory on the way to it is
  trusted (this user's or root's, writable by no one else, or sticky like /tmp
  for names of this user's or root's): owned_dir() has the C side's
  policy/trust.c resolve the path on descriptors and check each one, and
  callers then work relative to the descriptor it returns, never through the
  path again. read_policy() reads a policy file under the same rule.
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
import hashlib
import os
import secrets
import stat
import tempfile

__all__ = ["UnsafeError", "TooLargeError", "check_owned", "owned_dir", "read_policy",
           "write_atomic", "open_append", "read_bounded", "read_owned", "write_if_changed",
           "policy_file"]

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


POLICY_MAX = 1 << 20  # bytes in a policy: policy/policy.h's DM_POLICY_FILE_MAX
_TRUST_FILE, _TRUST_DIR, _TRUST_DIR_CREATE = 0, 1, 2
_DM_EUNSAFE, _DM_EINVALID = -11, -5


def _trust_open(path, want, mode=0):
    """policy/trust.c's dm__trust_open: an fd, or UnsafeError / OSError."""
    from . import _ext
    fd, code, why, err = _ext.trust_open(os.fspath(path), want, mode)
    if code == 0:
        return fd
    if code in (_DM_EUNSAFE, _DM_EINVALID):
        raise UnsafeError(why)
    raise OSError(err, why)  # FileNotFoundError for ENOENT


def owned_dir(path, create=False, mode=0o700):
    """An fd (O_DIRECTORY, close-on-exec) on directory `path`, which must be a
    directory (its own name not a symbolic link), owned by this user and not
    writable by group or others, reached through trusted directories only (see
    above). `create`: make it (with `mode`) if it is not there. Raises
    UnsafeError, or FileNotFoundError when it is absent."""
    return _trust_open(path, _TRUST_DIR_CREATE if create else _TRUST_DIR, mode)


def read_policy(path, limit):
    """The bytes of policy file `path`, read under the policy's rule (the C
    side's, for DATAMEM_CONFIG and install): the file and every directory on
    its way owned by this user or root and writable by no one else. Raises
    UnsafeError (TooLargeError) or OSError."""
    fd = _trust_open(path, _TRUST_FILE)
    try:
        return read_bounded(fd, limit, os.fsdecode(os.fspath(path)))
    finally:
        os.close(fd)


def write_atomic(path, data, dir_fd=None, mode=0o600):
    """Writes `data` (bytes or str, UTF-8) to `path`: a new file with an
    unpredictable name next to it (O_CREAT|O_EXCL|O_NOFOLLOW), fsync, then
    os.replace() over `path`, so a planted symbolic link is replaced, never
    written through, and a reader never sees half a file. With `dir_fd`, `path`
    is a name in that directory (from owned_dir()); without it, `path`'s
    directory must pass owned_dir(). The file gets `mode`."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    path = os.fspath(path)
    own_fd = dir_fd is None
    if own_fd:  # the directory the caller named, under the rule; all below is relative to it
        parent, name = os.path.split(path)
        dir_fd = owned_dir(parent or ".")
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


def write_new_file(path, data, mode=0o600):
    """write_atomic(), refusing a destination that is a symbolic link (the
    user named a file, not where a link planted there points)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "%s is a symbolic link: not writing there"
                          % os.fspath(path))
    write_atomic(path, data, mode=mode)


def open_append(path, mode=0o644):
    """A binary file object appending to `path` (created with `mode` when
    absent): its directory must pass owned_dir(), the name is opened without
    following a symbolic link, and an existing file must be a regular file of
    this user's, not writable by others, its inode's only link. Raises
    UnsafeError or OSError."""
    path = os.fspath(path)
    parent, name = os.path.split(path)
    dir_fd = owned_dir(parent or ".")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeError("%s: a symbolic link, not a file" % path)
        raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeError("%s: not a regular file" % path)
        check_owned(st, path, "file")
        if st.st_nlink != 1:  # a hard link to a file of someone else's trust
            raise UnsafeError("%s: %d hard links to it" % (path, st.st_nlink))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


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


def policy_file(text):
    """Writes policy `text` (bytes) to a file named after its SHA-256 in this
    user's directory under the temp dir (`datamem-dask-<euid>`) and returns the
    path. A file with the same name that this user wrote and that holds the same
    bytes is left alone (never rewritten under a running process); anything
    else there is replaced.

    The directory is checked the way the C side checks its own: a real
    directory, not a symbolic link, owned by this user and writable by no one
    else, checked on the descriptor that the file is then written through
    (owned_dir). Its name is predictable, so another user may have made it
    first, or a symbolic link there: both are refused (PermissionError), since
    whoever can change the directory or swap the link chooses the policy a
    worker loads."""
    d = os.path.join(tempfile.gettempdir(), "datamem-dask-%d" % os.geteuid())
    try:
        fd = owned_dir(d, create=True)
    except UnsafeError as e:
        raise PermissionError("datamem: %s; remove it or set TMPDIR" % e) from None
    try:
        name = "policy-%s.yaml" % hashlib.sha256(text).hexdigest()[:20]
        write_if_changed(fd, name, text)
    finally:
        os.close(fd)
    return os.path.join(d, name)
