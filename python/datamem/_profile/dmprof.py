"""Allocation profiles: the format of one .dmprof file (service/datamem_profile.h)
and its reader, _File, which yields a file's records a block at a time with
every field checked (a hostile or damaged file gets one line, never a
traceback). The sums over a directory are in read.py.
"""
import json
import os
import stat
import struct

import numpy as np

SHORT = 0.1           # seconds: freed this soon = a temporary of an expression
LONG = 1.0            # seconds: freed this late, or never = long-lived
BIG = 4 << 20         # suggest's "big" arrays (see suggest.py)
TINY = 1024           # suggest's tiny arrays
SIZE_EDGES = [0, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
              256 << 20, 1 << 30]
LIFE_EDGES = [0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0]

FLAG_CALLOC, FLAG_REALLOC, FLAG_NOGIL = 1, 2, 4

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
                  ("stack", "<i8"), ("th", "<i8"), ("tg", "<i8"), ("ru", "<i8"), ("ar", "<i8"), ("dt", "u1"),
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
                self.skip = ("%s: skipped: %s (its process was killed as its profile began?)"
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
        self.stacks = {}   # local id -> global stack index
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
            elif k == 0x4B:  # 'K': a stack, innermost frame first
                if pos + 9 > n:
                    break
                kid, cnt = _II.unpack_from(data, pos + 1)
                if cnt > STACK_MAX:
                    self._bad("a stack of %d frames (at most %d)" % (cnt, STACK_MAX), base + pos)
                if pos + 9 + 4 * cnt > n:
                    break
                ids = struct.unpack_from("<%dI" % cnt, data, pos + 9)
                frames = tuple(self.sites[x] for x in ids if x in self.sites)
                if frames:
                    self.stacks[kid] = prof._stack(frames)
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
            new["stack"] = self._stack_ids(a["stack"], new["site"])
            if self.prof.user_sites:  # report: the innermost frame of the user's code
                new["site"] = np.asarray(self.prof.stack_site, np.int64)[new["stack"]]
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

    def _stack_ids(self, ids, site):
        """Local stack ids -> global stack indexes; a record without a stack
        (sampled without --stacks) gets the one-frame stack of its site (none:
        no Python frame, -1 -> the stack of no frame)."""
        u, inv = np.unique(ids, return_inverse=True)
        g = np.array([self.stacks.get(x, -1) for x in u.tolist()], np.int64)[inv]
        none = g < 0
        if none.any():
            u, inv = np.unique(site[none], return_inverse=True)
            g[none] = np.array([self.prof._stack((x,) if x >= 0 else ()) for x in u.tolist()],
                               np.int64)[inv]
        return g

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
