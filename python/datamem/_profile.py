"""Allocation profiles (issue 13): recording and reading.

Recording: DATAMEM_PROFILE=DIR (set by `python -m datamem profile`, or by hand)
makes the start-up hook record every process's NumPy allocations into
DIR/<pid>.dmprof through datamem's recording handler (pyext/datamem_ext.c) and
writer (service/profile.c). Settings, read once at start-up:

  DATAMEM_PROFILE          the directory (created if missing)
  DATAMEM_PROFILE_SAMPLE   mean bytes between samples (default 512KiB), or "full"
  DATAMEM_PROFILE_STACKS   1: record whole Python stacks (default: in full mode)

Without DATAMEM_CONFIG the job runs under a built-in pass-through policy (one
arena, `default`, for everything), written to DIR/passthrough.yaml.

Reading: load(DIR) streams every file (format in service/datamem_profile.h),
pairs frees with allocations, and returns one Profile holding sums per call
site, label, size and lifetime class, the peak of live bytes and a small
random sample of records; _report.py and _suggest.py work from it. A file cut
short (a process killed) is used up to its last whole record, one cut before
its header is skipped; either way with a warning (Profile.warnings).
"""
import glob
import json
import os
import stat
import struct
import sys

import numpy as np

from . import _text

DEFAULT_SAMPLE = 512 * 1024

# The call site of an allocation is the innermost Python frame outside these
# packages (pyext/datamem_ext.c, internal_packages): what a user means by "my
# code" when NumPy, pandas, SciPy or scikit-learn made the array for them.
INTERNAL_PACKAGES = ("numpy", "pandas", "scipy", "sklearn", "datamem")

PASSTHROUGH_POLICY = """\
# Written by datamem's profiler: DATAMEM_CONFIG was not set, so the profiled job
# ran with one arena for every array (datamem's defaults, NumPy's 16-byte
# alignment). `python -m datamem suggest DIR` proposes a real policy.
version: 1
default: default
arenas:
  default: {alignment: 16}
"""

FLAG_CALLOC, FLAG_REALLOC, FLAG_NOGIL = 1, 2, 4


# ---- recording ---------------------------------------------------------------

def parse_sample(text):
    """'full' -> 0, else a size in bytes (units as in policies: 512KiB, 1MiB)."""
    text = str(text).strip()
    if text.lower() == "full":
        return 0
    n = _text.parse_size(text)
    if n < 1:
        raise ValueError("sample interval must be at least 1 byte")
    return n


def parse_max(text):
    """DATAMEM_PROFILE_MAX / --max-size: a size (0 = the default, 256 MiB)."""
    try:
        return _text.parse_size(str(text))
    except Exception as e:
        raise ValueError("DATAMEM_PROFILE_MAX: %s" % e) from None


def _cmdline():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(sys.argv)


def start(directory, sample=DEFAULT_SAMPLE, stacks=None, policy=None, max_bytes=0):
    """Starts recording this process into DIRECTORY/<pid>.dmprof (sample=0: full
    mode; max_bytes: each process's file stops there, 0 = the writer's default,
    256 MiB). Must run before datamem.install() so that every handler records."""
    from . import _ext
    import numpy
    full = sample == 0
    if stacks is None:
        stacks = full
    meta = {"argv": _cmdline(), "python": sys.version.split()[0], "numpy": numpy.__version__,
            "datamem": _ext.VERSION, "policy": os.path.abspath(policy) if policy else ""}
    path = _ext.profile_start(os.fspath(directory), int(sample or 1), bool(full), bool(stacks),
                              json.dumps(meta)[1:-1], int(max_bytes))
    import atexit
    # Registered first, so it runs last: arrays freed after this lived to the end.
    atexit.register(_ext.profile_mark_exit)
    _patch_exit()
    return path


def _patch_exit():
    """multiprocessing's fork children end with os._exit, which skips atexit:
    flush the profile first."""
    from . import _ext
    real = os._exit
    if getattr(real, "_datamem_flush", False):
        return

    def _exit(code):
        try:
            _ext.profile_mark_exit()
            _ext.profile_stop()
        finally:
            real(code)
    _exit._datamem_flush = True
    os._exit = _exit


def passthrough_policy(directory):
    """The pass-through policy's path in DIRECTORY, which is created (mode 0700)
    or must be owned by this user and not writable by others (issue 24: whoever
    owns the directory would otherwise choose the job's policy). The file there
    always holds our own text: an existing one is replaced through a temporary
    file and os.replace (never written through a planted link), unless it is
    already exactly our bytes, ours, and not writable by others."""
    from ._files import owned_dir, write_if_changed
    directory = os.fspath(directory)
    fd = owned_dir(directory, create=True)
    try:
        write_if_changed(fd, "passthrough.yaml", PASSTHROUGH_POLICY.encode(), mode=0o644)
    finally:
        os.close(fd)
    return os.path.join(directory, "passthrough.yaml")


def activate_from_env():
    """Called by the start-up hook when DATAMEM_PROFILE is set: starts recording,
    then installs DATAMEM_CONFIG or the pass-through policy. Returns the policy."""
    import datamem
    directory = os.environ["DATAMEM_PROFILE"]
    sample = parse_sample(os.environ.get("DATAMEM_PROFILE_SAMPLE") or DEFAULT_SAMPLE)
    stacks_env = os.environ.get("DATAMEM_PROFILE_STACKS", "")
    stacks = None if stacks_env == "" else stacks_env not in ("0", "false", "no")
    max_bytes = parse_max(os.environ.get("DATAMEM_PROFILE_MAX") or "0")
    # The directory is checked here, whatever the policy: one that cannot be
    # trusted stops the job at start-up with one line, as a bad policy does.
    from ._files import owned_dir
    os.close(owned_dir(directory, create=True))
    policy = os.environ.get("DATAMEM_CONFIG") or passthrough_policy(directory)
    start(directory, sample, stacks, policy, max_bytes)
    datamem.install(policy)
    return policy


def run(argv, out, sample=DEFAULT_SAMPLE, stacks=None, policy=None, max_bytes=None):
    """`python -m datamem profile`: runs argv with DATAMEM_PROFILE=out; returns
    its exit status."""
    import subprocess
    env = dict(os.environ)
    env["DATAMEM_PROFILE"] = os.path.abspath(out)
    env["DATAMEM_PROFILE_SAMPLE"] = "full" if sample == 0 else str(sample)
    if max_bytes is not None:
        env["DATAMEM_PROFILE_MAX"] = str(max_bytes)
    if stacks is not None:
        env["DATAMEM_PROFILE_STACKS"] = "1" if stacks else "0"
    if policy:
        env["DATAMEM_CONFIG"] = os.path.abspath(policy)
    else:
        env.pop("DATAMEM_CONFIG", None)
    try:
        return subprocess.call(argv, env=env)
    except OSError as e:
        sys.stderr.write("datamem: cannot run %s: %s\n" % (argv[0], e.strerror))
        return 127


# ---- reading -------------------------------------------------------------------
#
# A profile directory is read as a stream, one block of each file at a time, and
# summed up as it goes (issue 24: reading whole files as Python rows took ~9x
# the profile's size in memory). What stays in memory: the distinct strings,
# call sites and labels; the arrays live at once (until their free is read);
# a fixed-size histogram per call site for its medians; and, for the peak of
# big temporaries, those freed in the last few seconds (at most TEMP_EVENTS_MAX).

SHORT = 0.1           # seconds: freed this soon = a temporary of an expression
LONG = 1.0            # seconds: freed this late, or never = long-lived
BIG = 4 << 20         # suggest's "big" arrays (see _suggest.py)
TINY = 1024           # suggest's tiny arrays
SIZE_EDGES = [0, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
              256 << 20, 1 << 30]
LIFE_EDGES = [0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0]

MAGIC = b"DMPROF1\n"
BLOCK = 1 << 18            # bytes read from a file at a time
HEADER_MAX = 1 << 20       # the writer's header is at most 8 KiB
STRING_MAX = 1 << 16       # the writer cuts strings at 1 KiB
STACK_MAX = 4096           # the writer records at most 64 frames
SAMPLE_MAX = 4000          # records kept at random for report --html's scatter plot
TEMP_EVENTS_MAX = 1 << 18  # see _Stream.temp_window

_A = np.dtype([("t", "<u8"), ("ptr", "<u8"), ("size", "<u8"), ("w", "<f8"), ("th", "<u4"),
               ("tg", "<u4"), ("ru", "<u4"), ("ar", "<u4"), ("site", "<u4"), ("stack", "<u4"),
               ("dt", "u1"), ("fl", "u1")])
_F = np.dtype([("t", "<u8"), ("ptr", "<u8")])
# An allocation whose free has not been read yet.
_OPEN = np.dtype([("t0", "<f8"), ("ptr", "<u8"), ("size", "<f8"), ("w", "<f8"), ("site", "<i8"),
                  ("th", "<i8"), ("tg", "<i8"), ("ru", "<i8"), ("ar", "<i8"), ("dt", "u1"),
                  ("fl", "u1")])
_II = struct.Struct("<II")
_C = struct.Struct("<IIIII")
_Q = struct.Struct("<Q")
_QQQ = struct.Struct("<QQQ")
_I = struct.Struct("<I")

assert _A.itemsize == 58 and _F.itemsize == 16


class ProfileError(ValueError):
    """A profile that cannot be read; its text is one line."""


def _header(raw, path):
    """The 'H' record's JSON -> its fields, checked once here (a hostile or
    damaged file gets one line naming what is wrong, never a traceback)."""
    try:
        h = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).split("\n")[0]
        raise ProfileError("%s: header is not valid JSON (%s)" % (path, reason))
    if not isinstance(h, dict):
        raise ProfileError("%s: header is a JSON %s, not an object" % (path, type(h).__name__))

    def field(key, kinds, default, ok=lambda v: True, want="", required=False):
        if key not in h:
            if required:
                raise ProfileError("%s: header has no %r" % (path, key))
            return default
        v = h[key]
        if v is None and default is None:
            return None
        if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds) or not ok(v):
            raise ProfileError("%s: header field %r is %s; it must be %s"
                               % (path, key, json.dumps(v)[:40], want))
        return v
    field("format", (int,), 1, lambda v: v == 1, "1 (this datamem reads format 1)")
    u64 = (lambda v: 0 <= v < 1 << 64)
    out = {
        "pid": field("pid", (int,), 0, lambda v: 0 < v < 1 << 31, "a process id", True),
        "ppid": field("ppid", (int,), None, lambda v: 0 <= v < 1 << 31, "a process id"),
        "t0_ns": field("t0_ns", (int,), None, u64, "an integer of nanoseconds"),
        "sample_bytes": field("sample_bytes", (int,), 0, u64, "an integer >= 0"),
        "full": field("full", (bool,), False, want="true or false"),
        "stacks": field("stacks", (bool,), False, want="true or false"),
        "argv": field("argv", (list,), [], lambda v: all(isinstance(a, str) for a in v),
                      "a list of strings"),
        "policy": field("policy", (str,), "", want="a string"),
        "truncated": field("truncated", (bool,), False, want="true or false"),
    }
    return out


class _File:
    """One .dmprof, read a block at a time: definitions are kept, allocations
    wait in `open` for their free, and each block hands completed records to
    the Profile (sums) and its live-bytes events to the _Stream (peaks)."""

    def __init__(self, path, prof):
        self.path, self.prof = path, prof
        self.fd = None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise ProfileError("%s: cannot open: %s" % (path, e.strerror or e))
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        if self.skip:
            self.close()

    def _open(self):
        path, fd = self.path, self.fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProfileError("%s: not a regular file" % path)
        self.size = st.st_size
        head = os.pread(fd, 8 + 5 + HEADER_MAX, 0)
        self.skip = None  # why the file is skipped (a warning), or None
        if not head.startswith(MAGIC):
            if MAGIC.startswith(head):  # empty, or cut inside the magic
                self.skip = ("%s: skipped: %s (its process was killed before the first flush?)"
                             % (path, "empty" if not head else "cut short at %d bytes" % len(head)))
                return
            raise ProfileError("%s: not a datamem profile" % path)
        if len(head) < 13 or head[8] != 0x48:
            if len(head) < 13:
                self.skip = ("%s: skipped: cut short inside its header (%d bytes)"
                             % (path, len(head)))
                return
            raise ProfileError("%s: no header record after the magic" % path)
        (ln,) = _I.unpack_from(head, 9)
        if ln > HEADER_MAX:
            raise ProfileError("%s: header of %d bytes (at most %d)" % (path, ln, HEADER_MAX))
        if len(head) < 13 + ln:
            self.skip = "%s: skipped: cut short inside its header (%d bytes)" % (path, len(head))
            return
        self.header = _header(head[13:13 + ln], path)
        self.pos = 13 + ln
        self.rest = b""
        self.eof = False
        self.strings = {0: ""}
        self.sites = {}    # local id -> global site index
        self.labels = {}   # (kind, local id) -> global label id
        self.open = np.zeros(0, _OPEN)
        self.orphans = []  # allocations whose address was allocated again, unfreed
        self.exit_t = None
        self.limit = None  # (t, limit bytes, records) from a 'T' record
        self.t_max = float(self.header["t0_ns"] or 0)
        self.t_first = None
        self.key = -np.inf
        self.records = 0
        self.unmatched_frees = 0
        self.max_rss = 0
        self.cut_at = None
        self.pending = []  # live-bytes events not yet merged: (key, bytes, weight, site)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- records ------------------------------------------------------------------

    def _bad(self, what, at):
        raise ProfileError("%s: %s at byte %d" % (self.path, what, at))

    def _scan(self, data, base):
        """Walks the records of `data` (file offset `base`): definitions are taken
        in, allocations and frees listed by offset. Returns (a offsets, f offsets,
        bytes used)."""
        a_pos, f_pos = [], []
        ap, fp = a_pos.append, f_pos.append
        pos, n = 0, len(data)
        strings, prof = self.strings, self.prof
        while pos < n:
            k = data[pos]
            if k == 0x41:  # 'A'
                if pos + 59 > n:
                    break
                ap(pos)
                pos += 59
            elif k == 0x46:  # 'F'
                if pos + 17 > n:
                    break
                fp(pos)
                pos += 17
            elif k == 0x53:  # 'S'
                if pos + 9 > n:
                    break
                sid, ln = _II.unpack_from(data, pos + 1)
                if ln > STRING_MAX:
                    self._bad("a string of %d bytes (at most %d)" % (ln, STRING_MAX), base + pos)
                if pos + 9 + ln > n:
                    break
                strings[sid] = data[pos + 9:pos + 9 + ln].decode("utf-8", "replace")
                pos += 9 + ln
            elif k == 0x43:  # 'C'
                if pos + 21 > n:
                    break
                sid, mod, fn, fi, line = _C.unpack_from(data, pos + 1)
                self.sites[sid] = prof._site((strings.get(mod, "?"), strings.get(fn, "?"),
                                              strings.get(fi, "?"), line))
                pos += 21
            elif k == 0x4B:  # 'K': stacks are recorded, not summarized
                if pos + 9 > n:
                    break
                _kid, cnt = _II.unpack_from(data, pos + 1)
                if cnt > STACK_MAX:
                    self._bad("a stack of %d frames (at most %d)" % (cnt, STACK_MAX), base + pos)
                if pos + 9 + 4 * cnt > n:
                    break
                pos += 9 + 4 * cnt
            elif k == 0x50:  # 'P'
                if pos + 25 > n:
                    break
                t, maxrss, _samples = _QQQ.unpack_from(data, pos + 1)
                self.max_rss = max(self.max_rss, maxrss)
                self.t_max = max(self.t_max, float(t))
                pos += 25
            elif k == 0x58:  # 'X'
                if pos + 9 > n:
                    break
                (t,) = _Q.unpack_from(data, pos + 1)
                self.exit_t = float(t)
                pos += 9
            elif k == 0x54:  # 'T': the writer's size limit
                if pos + 25 > n:
                    break
                t, limit, recs = _QQQ.unpack_from(data, pos + 1)
                self.limit = (float(t), limit, recs)
                self.t_max = max(self.t_max, float(t))
                pos += 25
            elif k == 0x48:
                self._bad("a second header", base + pos)
            else:
                self._bad("bad record type 0x%02x" % k, base + pos)
        return a_pos, f_pos, pos

    def _label(self, kind, ids):
        """Local string ids -> global label ids of `kind` (thread, tags, ...)."""
        u, inv = np.unique(ids, return_inverse=True)
        g = np.empty(len(u), np.int64)
        for i, x in enumerate(u.tolist()):
            key = (kind, x)
            v = self.labels.get(key)
            if v is None:
                text = self.strings.get(x, "")
                if kind != "tags":
                    text = text or "?"
                v = self.labels[key] = self.prof._label(kind, text)
            g[i] = v
        return g[inv]

    def step(self):
        """Reads and digests one block; sets eof at the end of the file."""
        # A block at least as big as the allocations still open (each is matched
        # against every block), so that matching costs O(records log records).
        want = max(BLOCK, 64 * len(self.open))
        chunk = os.pread(self.fd, want, self.pos)
        data = self.rest + chunk
        base = self.pos - len(self.rest)
        self.pos += len(chunk)
        at_end = len(chunk) < want
        a_pos, f_pos, used = self._scan(data, base)
        self.rest = data[used:]
        # each record's bytes as a row of a strided view (no copy), then the rows wanted
        raw = np.frombuffer(data, np.uint8)

        def rows(width):
            return np.lib.stride_tricks.as_strided(raw, (max(len(data) - width + 1, 0), width),
                                                   (1, 1), writeable=False)
        if a_pos:
            off = np.asarray(a_pos, np.int64)
            a = np.ascontiguousarray(rows(59)[off, 1:]).view(_A).ravel()
            w = a["w"]
            bad = ~np.isfinite(w) | (w < 0)
            if bad.any():
                i = int(np.argmax(bad))
                self._bad("allocation record with weight %r (it must be a finite number >= 0)"
                          % float(w[i]), base + a_pos[i])
        else:
            off, a = np.zeros(0, np.int64), np.zeros(0, _A)
        if f_pos:
            foff = np.asarray(f_pos, np.int64)
            f = np.ascontiguousarray(rows(17)[foff, 1:]).view(_F).ravel()
        else:
            foff, f = np.zeros(0, np.int64), np.zeros(0, _F)
        self._digest(a, off, f, foff)
        if at_end:
            self.eof = True
            self.size = self.pos
            if self.rest:
                self.cut_at = base + used
            self._finish()
            self.close()

    def _digest(self, a, a_off, f, f_off):
        new = np.zeros(len(a), _OPEN)
        if len(a):
            new["t0"] = a["t"]
            new["ptr"] = a["ptr"]
            new["size"] = a["size"]
            new["w"] = a["w"]
            new["site"] = self._site_ids(a["site"])
            for k, kind in (("th", "thread"), ("tg", "tags"), ("ru", "rule"), ("ar", "arena")):
                new[k] = self._label(kind, a[k])
            new["dt"] = a["dt"]
            new["fl"] = a["fl"]
            self.records += len(a)
            if self.t_first is None:
                self.t_first = float(a["t"][0])
        ft = f["t"].astype(np.float64)
        times = np.concatenate([new["t0"], ft])
        if len(times):
            self.t_max = max(self.t_max, float(times.max()))
        # Pair each free with the last allocation of its address before it (file
        # order); an allocation of an address still open leaves the first one
        # open for good (an orphan), as a free of nothing is counted and dropped.
        allocs = np.concatenate([self.open, new])
        na, nf = len(allocs), len(f)
        ptr = np.concatenate([allocs["ptr"], f["ptr"]])
        seq = np.concatenate([np.full(len(self.open), -1, np.int64), a_off, f_off])
        order = np.lexsort((seq, ptr))
        is_a = order < na
        same = ptr[order][1:] == ptr[order][:-1]
        pair = same & is_a[:-1] & ~is_a[1:]
        ai, fi = order[:-1][pair], order[1:][pair] - na
        orphan = same & is_a[:-1] & is_a[1:]
        self.unmatched_frees += nf - len(fi)
        last = np.ones(len(order), bool)
        last[:-1] = ~same
        keep = order[is_a & last]
        if orphan.any():
            self.orphans.append(allocs[order[:-1][orphan]])
        self.open = allocs[np.sort(keep)]
        done, t1 = allocs[ai], ft[fi]
        after_exit = t1 >= self.exit_t if self.exit_t is not None else np.zeros(len(fi), bool)
        life = np.where(after_exit, (self.exit_t or 0.0) - done["t0"], t1 - done["t0"]) / 1e9
        self.prof._add(done, life, after_exit)
        # live bytes in file order: + at each allocation, - at each free read
        # (a free after exit does not count: the array lived to the end)
        fr = ~after_exit
        fb = done["w"][fr] * done["size"][fr]
        ev_off = np.concatenate([a_off, f_off[fi[fr]]])
        ev_t = np.concatenate([new["t0"], t1[fr]])
        o = np.argsort(ev_off, kind="stable")
        key = np.maximum.accumulate(np.concatenate([[self.key], ev_t[o]]))[1:]
        if len(key):
            self.key = float(key[-1])
            self.pending.append((key, np.concatenate([new["w"] * new["size"], -fb])[o],
                                 np.concatenate([new["w"], -done["w"][fr]])[o],
                                 np.concatenate([new["site"], done["site"][fr]])[o]))
        temp = fr & (done["size"] >= BIG) & (life < LONG)
        if temp.any():
            tb = done["w"][temp] * done["size"][temp]
            self.prof.stream.add_temps(done["t0"][temp], t1[temp], tb)

    def _site_ids(self, ids):
        u, inv = np.unique(ids, return_inverse=True)
        g = np.array([self.sites.get(x, -1) for x in u.tolist()], np.int64)
        return g[inv]

    def _finish(self):
        """End of file: what is still open lived to the end of the process."""
        end = self.exit_t if self.exit_t is not None else self.t_max
        self.end = end
        rest = np.concatenate([self.open] + self.orphans)
        self.open, self.orphans = np.zeros(0, _OPEN), []
        self.prof._add(rest, (end - rest["t0"]) / 1e9, np.ones(len(rest), bool))

    # -- the merge's side -----------------------------------------------------------

    def pending_len(self):
        return sum(len(p[0]) for p in self.pending)

    def take(self, upto):
        """The pending events with key <= upto."""
        if not self.pending:
            return None
        ev = [np.concatenate(c) for c in zip(*self.pending)] if len(self.pending) > 1 \
            else list(self.pending[0])
        n = int(np.searchsorted(ev[0], upto, side="right"))
        self.pending = [tuple(c[n:] for c in ev)] if n < len(ev[0]) else []
        return tuple(c[:n] for c in ev)


class _Stream:
    """Merges the files' live-bytes events into one time order (each file's own
    order is kept: the writer appends under one lock, so it is a valid order of
    that process's allocations and frees) and follows the sum: its peak, and
    what each call site held at that peak; with `grid`, each layer's live bytes
    at the grid's times (report --html)."""

    def __init__(self, prof, grid=None, layers=None):
        self.prof = prof
        self.live = 0.0
        self.peak = (0.0, None)  # (bytes, key)
        self.site_b = np.zeros(0)  # live bytes and arrays by site index + 1
        self.site_w = np.zeros(0)
        self.peak_b = self.peak_w = np.zeros(0)
        self.temps = []          # (t, bytes) of big temporaries not yet in temp_peak
        self.temps_n = 0
        self.temp_live = 0.0
        self.temp_peak = 0.0
        self.horizon = -np.inf   # temporaries before this time are summed
        self.grid, self.layers = grid, layers
        if grid is not None:
            self.grid_vals = np.zeros((int(layers.max()) + 1, len(grid)))
            self.layer_live = np.zeros(int(layers.max()) + 1)
            self.gi = 0

    def _grow(self, n):
        if len(self.site_b) < n:
            m = max(n, 2 * len(self.site_b), 64)
            self.site_b = np.concatenate([self.site_b, np.zeros(m - len(self.site_b))])
            self.site_w = np.concatenate([self.site_w, np.zeros(m - len(self.site_w))])

    def add_temps(self, t0, t1, b):
        self.temps.append((np.concatenate([t0, t1]), np.concatenate([b, -b])))
        self.temps_n += 2 * len(b)

    def temp_window(self, now):
        """Sums the temporaries' events up to time `upto`. A temporary's
        allocation is known only at its free (< LONG later), so events are held
        until every file is 2 x LONG past them; past TEMP_EVENTS_MAX held, they
        are summed up to the merge's time and a later one is counted at that
        time (a lower bound of the peak, for more than a million big
        temporaries freed within 2 s)."""
        if not self.temps:
            return
        upto = now if self.temps_n > TEMP_EVENTS_MAX else now - 2 * LONG * 1e9
        if upto <= self.horizon:
            return
        t = np.concatenate([x[0] for x in self.temps])
        b = np.concatenate([x[1] for x in self.temps])
        t = np.maximum(t, self.horizon)
        o = np.lexsort((b < 0, t))  # at one time: allocations first
        t, b = t[o], b[o]
        n = int(np.searchsorted(t, upto, side="right"))
        if n:
            c = self.temp_live + np.cumsum(b[:n])
            self.temp_peak = max(self.temp_peak, float(c.max()))
            self.temp_live = float(c[-1])
            self.horizon = max(self.horizon, upto)
        self.temps = [(t[n:], b[n:])] if n < len(t) else []
        self.temps_n = len(t) - n

    def window(self, key, db, dw, site):
        if not len(key):
            return
        o = np.argsort(key, kind="stable")
        key, db, dw, site = key[o], db[o], dw[o], site[o] + 1
        self._grow(len(self.prof.sites) + 1)
        live = self.live + np.cumsum(db)
        k = int(np.argmax(live))
        if live[k] > self.peak[0] or self.peak[1] is None:
            self.peak = (float(live[k]), float(key[k]))
            self.peak_b = self.site_b.copy()
            self.peak_w = self.site_w.copy()
            u, inv = np.unique(site[:k + 1], return_inverse=True)
            self.peak_b[u] += np.bincount(inv, db[:k + 1], len(u))
            self.peak_w[u] += np.bincount(inv, dw[:k + 1], len(u))
        u, inv = np.unique(site, return_inverse=True)
        self.site_b[u] += np.bincount(inv, db, len(u))
        self.site_w[u] += np.bincount(inv, dw, len(u))
        if self.grid is not None:
            self._sample(key, db, site)
        self.live = float(live[-1])

    def _sample(self, key, db, site):
        """Each layer's live bytes at the grid times in this window's span."""
        g = self.grid
        j = int(np.searchsorted(g, key[-1], side="left"))  # grid times before the last key
        lut = self.layers
        layer = lut[np.minimum(site, len(lut) - 1)]
        for li in range(len(self.layer_live)):
            m = layer == li
            c = self.layer_live[li] + np.cumsum(np.where(m, db, 0.0))
            if j > self.gi:
                idx = np.searchsorted(key, g[self.gi:j], side="right") - 1
                self.grid_vals[li, self.gi:j] = np.where(idx >= 0, c[np.maximum(idx, 0)],
                                                         self.layer_live[li])
            self.layer_live[li] = c[-1]
        self.gi = max(self.gi, j)

    def run(self, files):
        """Reads every file to its end, merging as it goes."""
        files = list(files)
        while files:
            for f in files:
                while not f.eof and not f.pending:
                    f.step()
            ahead = [f.key for f in files if not f.eof]
            upto = min(ahead) if ahead else np.inf
            parts = [p for p in (f.take(upto) for f in files) if p is not None and len(p[0])]
            if parts:
                self.window(*(np.concatenate(c) for c in zip(*parts)))
            self.temp_window(upto)
            files = [f for f in files if not f.eof or f.pending]
        self.temp_window(np.inf)
        if self.grid is not None:
            self.grid_vals[:, self.gi:] = self.layer_live[:, None]


class _Medians:
    """Per group, the median of a value weighted by bytes (half of a group's
    bytes are in records with at most this value), from a histogram with 256
    bins per octave: each bin keeps its smallest and largest value, so the
    median is exact when its bin holds one value (a line's arrays of one size)
    and within 0.3% otherwise. Memory: the bins in use (one per distinct value
    at most; 256 per octave the values span)."""

    SHIFT = 21

    def __init__(self):
        self.keys = np.zeros(0, np.int64)
        self.wt = self.lo = self.hi = self.wv = np.zeros(0)
        self.new = []
        self.new_n = 0

    @staticmethod
    def _bin(v):
        v = np.nan_to_num(v, nan=0.0, posinf=1e300, neginf=-1e300)
        m, e = np.frexp(np.abs(v))
        q = np.where(v == 0, 0, (e.astype(np.int64) + 1100) * 256 +
                     np.floor((m - 0.5) * 512).astype(np.int64) + 1)
        return (1 << 20) + np.sign(v).astype(np.int64) * q

    def add(self, group, value, weight):
        if len(value):
            self.new.append((group.astype(np.int64) << self.SHIFT | self._bin(value),
                             value.astype(np.float64), weight.astype(np.float64)))
            self.new_n += len(value)
            if self.new_n > max(1 << 16, len(self.keys)):
                self._merge()

    def _merge(self):
        if not self.new:
            return
        k = np.concatenate([self.keys] + [x[0] for x in self.new])
        v = [np.concatenate([a] + [x[1] for x in self.new]) for a in (self.lo, self.hi)]
        w = np.concatenate([self.wt] + [x[2] for x in self.new])
        wv = np.concatenate([self.wv] + [x[2] * x[1] for x in self.new])
        self.new, self.new_n = [], 0
        o = np.argsort(k, kind="stable")
        k = k[o]
        starts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
        self.keys = k[starts]
        self.wt = np.add.reduceat(w[o], starts)
        self.wv = np.add.reduceat(wv[o], starts)
        self.lo = np.minimum.reduceat(v[0][o], starts)
        self.hi = np.maximum.reduceat(v[1][o], starts)

    def median(self, group):
        self._merge()
        i0 = int(np.searchsorted(self.keys, group << self.SHIFT))
        i1 = int(np.searchsorted(self.keys, (group + 1) << self.SHIFT))
        if i0 == i1:
            return float("nan")
        cw = np.cumsum(self.wt[i0:i1])
        j = i0 + min(int(np.searchsorted(cw, cw[-1] / 2.0)), i1 - i0 - 1)
        if self.lo[j] == self.hi[j] or self.wt[j] <= 0:
            return float(self.lo[j])
        return float(self.wv[j] / self.wt[j])


# Sums kept per call site (columns of Profile.site_sums).
SITE_COLUMNS = ("allocations", "bytes", "records", "max_size", "short_bytes", "long_bytes",
                "live_at_end_bytes", "temp_allocations", "temp_bytes", "temp_short_bytes",
                "resident_allocations", "resident_bytes", "tiny_allocations", "tiny_bytes")
TOTAL_COLUMNS = SITE_COLUMNS + ("no_gil_records", "realloc_records", "big_bytes")


class Profile:
    """The sums of a profile directory, read in one streaming pass (load()).

    Every count and byte figure is a sum of record weights (allocations a
    sample stands for). `sites` lists (module, function, file, line); per-site
    figures are indexed by site index + 1 (0: no Python frame). Lifetimes of
    arrays live at the end of their process run to that end (a lower bound)."""

    def __init__(self, directory, paths):
        from . import _ext
        self.directory = directory
        self.paths = paths
        self.warnings = []
        self.sites, self._site_index = [], {}
        self.labels = {k: [] for k in ("thread", "tags", "rule", "arena")}
        self._label_index = {k: {} for k in self.labels}
        dtypes = list(_ext.DTYPES)
        self.dtype_names = [dtypes[i] if 0 <= i < len(dtypes) else "?" for i in range(256)]
        self.totals = dict.fromkeys(TOTAL_COLUMNS, 0.0)
        self.site_sums = np.zeros((64, len(SITE_COLUMNS)))
        self.site_pairs = {k: np.zeros(0, np.int64) for k in ("thread", "dtype", "arena", "rule")}
        self.groups = {k: np.zeros((0, 2)) for k in ("thread", "tags", "arena", "rule", "dtype")}
        self.size_hist = np.zeros((len(SIZE_EDGES), 3))  # allocations, bytes, records
        self.life_hist = np.zeros((len(LIFE_EDGES), 3))  # of arrays freed before the end
        self.live_end_hist = np.zeros(3)
        self.log2_bytes = np.zeros((2, 66))  # [resident, temp] bytes by floor(log2(size))
        self.median_size = _Medians()     # by site
        self.median_life = _Medians()     # by site
        self.median_life_size = _Medians()  # by size bucket
        self.median_life_temp = _Medians()  # one group: big temporaries
        self.sample = None
        self._rng = np.random.default_rng(0)

        files = []
        try:
            for path in paths:
                f = _File(path, self)
                if f.skip:
                    self.warnings.append(f.skip)
                else:
                    files.append(f)
            if not files:
                raise ProfileError("%s: no usable profile file (%s)" % (
                    directory, "; ".join(w.split(": skipped: ", 1)[-1] for w in self.warnings)))
            self.stream = _Stream(self)
            self.stream.run(files)
        finally:
            for f in files:
                f.close()
        self._finish(files)

    # -- interning (called by _File) --------------------------------------------------

    def _site(self, key):
        i = self._site_index.get(key)
        if i is None:
            i = self._site_index[key] = len(self.sites)
            self.sites.append(key)
        return i

    def _label(self, kind, text):
        d = self._label_index[kind]
        i = d.get(text)
        if i is None:
            i = d[text] = len(self.labels[kind])
            self.labels[kind].append(text)
        return i

    # -- sums ---------------------------------------------------------------------------

    def _add(self, r, life, live_end):
        """Adds completed records (an _OPEN array), their lifetimes (seconds) and
        whether they were live at the end."""
        if not len(r):
            return
        w, size = r["w"], r["size"]
        b = w * size
        short = ~live_end & (life < SHORT)
        long_ = live_end | (life >= LONG)
        big = size >= BIG
        temp, res, tiny = big & ~long_, big & long_, size <= TINY
        cols = [w, b, np.ones(len(r)), None, b * short, b * long_, b * live_end, w * temp,
                b * temp, b * (temp & short), w * res, b * res, w * tiny, b * tiny]
        site = r["site"] + 1
        if len(self.site_sums) < len(self.sites) + 1:
            grow = max(len(self.sites) + 1, 2 * len(self.site_sums)) - len(self.site_sums)
            self.site_sums = np.concatenate([self.site_sums,
                                             np.zeros((grow, len(SITE_COLUMNS)))])
        u, inv = np.unique(site, return_inverse=True)
        for i, c in enumerate(cols):
            if c is None:  # max_size
                mx = np.zeros(len(u))
                np.maximum.at(mx, inv, size)
                self.site_sums[u, i] = np.maximum(self.site_sums[u, i], mx)
                self.totals["max_size"] = max(self.totals["max_size"], float(size.max()))
            else:
                self.site_sums[u, i] += np.bincount(inv, c, len(u))
                self.totals[SITE_COLUMNS[i]] += float(c.sum())
        self.totals["no_gil_records"] += int(((r["fl"] & FLAG_NOGIL) != 0).sum())
        self.totals["realloc_records"] += int(((r["fl"] & FLAG_REALLOC) != 0).sum())
        self.totals["big_bytes"] += float(b[big].sum())
        for kind, col in (("thread", r["th"]), ("dtype", r["dt"].astype(np.int64)),
                          ("arena", r["ar"]), ("rule", r["ru"])):
            self.site_pairs[kind] = np.union1d(self.site_pairs[kind], site << 32 | col)
        for kind, col in (("thread", r["th"]), ("tags", r["tg"]), ("arena", r["ar"]),
                          ("rule", r["ru"]), ("dtype", r["dt"].astype(np.int64))):
            g = self.groups[kind]
            n = max(len(g), int(col.max()) + 1)
            add = np.stack([np.bincount(col, w, n), np.bincount(col, b, n)], axis=1)
            if len(g) < n:
                g = np.concatenate([g, np.zeros((n - len(g), 2))])
            self.groups[kind] = g + add
        sb = np.searchsorted(SIZE_EDGES, size, side="right") - 1
        self.size_hist += np.stack([np.bincount(sb, w, len(SIZE_EDGES)),
                                    np.bincount(sb, b, len(SIZE_EDGES)),
                                    np.bincount(sb, None, len(SIZE_EDGES))], axis=1)
        fr = ~live_end & (life >= 0)
        lb = np.searchsorted(LIFE_EDGES, life[fr], side="right") - 1
        self.life_hist += np.stack([np.bincount(lb, w[fr], len(LIFE_EDGES)),
                                    np.bincount(lb, b[fr], len(LIFE_EDGES)),
                                    np.bincount(lb, None, len(LIFE_EDGES))], axis=1)
        self.live_end_hist += [w[live_end].sum(), b[live_end].sum(), live_end.sum()]
        e = np.frexp(np.maximum(size, 1))[1] - 1  # floor(log2(size))
        for i, m in enumerate((res, temp)):
            if m.any():
                self.log2_bytes[i] += np.bincount(e[m], b[m], 66)[:66]
        self.median_size.add(site, size, b)
        self.median_life.add(site, life, b)
        self.median_life_size.add(sb, life, b)
        if temp.any():
            self.median_life_temp.add(np.zeros(int(temp.sum()), np.int64), life[temp], b[temp])
        # a uniform random sample of records (the smallest random keys)
        prio = self._rng.random(len(r))
        smp = (prio, life, size, r["site"])
        if self.sample is not None:
            smp = tuple(np.concatenate([a, c]) for a, c in zip(self.sample, smp))
        if len(smp[0]) > SAMPLE_MAX:
            keep = np.argpartition(smp[0], SAMPLE_MAX)[:SAMPLE_MAX]
            smp = tuple(c[keep] for c in smp)
        self.sample = smp

    def _finish(self, files):
        known = [f.header["t0_ns"] for f in files if f.header["t0_ns"] is not None]
        known += [f.t_first for f in files if f.header["t0_ns"] is None and f.t_first is not None]
        self.t_origin_ns = origin = float(min(known, default=0))
        self.processes = []
        for f in files:
            h = f.header
            t0 = h["t0_ns"] if h["t0_ns"] is not None else (f.t_first or origin)
            self.processes.append({
                "pid": h["pid"], "ppid": h["ppid"], "argv": h["argv"], "file": f.path,
                "file_bytes": f.size, "records": f.records, "full": h["full"],
                "sample_bytes": h["sample_bytes"], "stacks": h["stacks"], "policy": h["policy"],
                "start": (t0 - origin) / 1e9, "end": (f.end - origin) / 1e9,
                "max_rss": f.max_rss, "unmatched_frees": f.unmatched_frees,
                "limit": None if f.limit is None else
                {"time": (f.limit[0] - origin) / 1e9, "bytes": f.limit[1], "records": f.limit[2]}})
            if f.limit is not None:
                self.warnings.append(
                    "%s: profile truncated at %d bytes (cap), after %d records at %.3f s: "
                    "process %d's later allocations are not in it (DATAMEM_PROFILE_MAX raises "
                    "the cap)" % (f.path, f.limit[1], f.limit[2], (f.limit[0] - origin) / 1e9,
                                  h["pid"]))
            if f.cut_at is not None:
                self.warnings.append("%s: cut short at byte %d (its process was killed?); "
                                     "using the %d records before it" % (f.path, f.cut_at,
                                                                         f.records))
        self.records = int(self.totals["records"])
        self.full = all(p["full"] for p in self.processes)
        self.sample_bytes = max((p["sample_bytes"] for p in self.processes if not p["full"]),
                                default=0)
        self.end = max([p["end"] for p in self.processes] + [0.0])
        n = len(self.sites) + 1
        self.site_sums = self.site_sums[:n]
        s = self.stream

        def fit(a):
            return np.concatenate([a, np.zeros(max(0, n - len(a)))])[:n]
        self.peak = {"bytes": s.peak[0],
                     "time": 0.0 if s.peak[1] is None else (s.peak[1] - origin) / 1e9,
                     "site_bytes": fit(s.peak_b), "site_allocations": fit(s.peak_w)}
        self.temp_peak = s.temp_peak
        del self.stream

    def __len__(self):
        return self.records

    def site_label(self, i, short=False):
        if i < 0:
            return "(unknown: no Python frame, e.g. realloc without the GIL)"
        mod, fn, fi, line = self.sites[i]
        return "%s:%d" % (fn, line) if short else "%s (%s:%d)" % (fn, fi, line)

    def site_set(self, kind, i):
        """The labels (thread, dtype, arena or rule) seen at site index i (-1: unknown)."""
        pairs = self.site_pairs[kind]
        lo = int(np.searchsorted(pairs, (i + 1) << 32))
        hi = int(np.searchsorted(pairs, (i + 2) << 32))
        names = self.dtype_names if kind == "dtype" else self.labels[kind]
        return sorted({names[int(x) & 0xFFFFFFFF] for x in pairs[lo:hi]})

    def live_layers(self, site_indexes, grid):
        """Live bytes at the times in `grid` (seconds), one row per site index in
        `site_indexes` and a last row for every other site: a second pass over
        the files (report --html)."""
        site_indexes = list(site_indexes)
        lut = np.full(len(self.sites) + 2, len(site_indexes), np.int64)  # last: sites new since
        for n, i in enumerate(site_indexes):
            lut[i + 1] = n
        again = Profile.__new__(Profile)
        again.__dict__.update({k: v for k, v in self.__dict__.items()
                               if k in ("directory", "paths", "sites", "_site_index", "labels",
                                        "_label_index", "dtype_names")})
        again.warnings = []
        again._add = lambda *a: None
        grid_ns = np.asarray(grid, np.float64) * 1e9 + self.t_origin_ns
        again.stream = _Stream(again, grid_ns, lut)
        files = []
        try:
            for path in self.paths:
                f = _File(path, again)
                if not f.skip:
                    files.append(f)
            again.stream.run(files)
        finally:
            for f in files:
                f.close()
        return again.stream.grid_vals


def load(directory):
    """Reads every DIR/*.dmprof (one per process) into one Profile."""
    directory = os.fspath(directory)
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "*.dmprof")))
    if not paths:
        raise ProfileError("%s: no profile files (*.dmprof); record one with "
                           "`python -m datamem profile --out %s -- python job.py`"
                           % (directory, directory))
    return Profile(directory, paths)
