"""Reading a profile directory: load(DIR) streams every file
(format and per-file reader in dmprof.py), pairs frees with
allocations, and returns one Profile holding sums per call site, label, size
and lifetime class, the peak of live bytes and a small random sample of
records; report.py and suggest.py work from it. A file cut short (a process
killed) is used up to its last whole record, one cut before its header is
skipped; either way with a warning (Profile.warnings).
"""
import glob
import os
import re

import numpy as np

from .dmprof import (
    BIG, FLAG_NOGIL, FLAG_REALLOC, LIFE_EDGES, LONG, SAMPLE_MAX, SHORT, SIZE_EDGES,
    TEMP_EVENTS_MAX, TINY, ProfileError, _File)
from .._text import printable, shell_command


# ---- reading -------------------------------------------------------------------
#
# A profile directory is read as a stream, one block of each file at a time, and
# summed up as it goes (reading whole files as Python rows took ~9x
# the profile's size in memory). What stays in memory: the distinct strings,
# call sites and labels; the arrays live at once (until their free is read);
# a fixed-size histogram per call site for its medians; and, for the peak of
# big temporaries, those freed in the last few seconds (at most TEMP_EVENTS_MAX).


class _Stream:
    """Merges the files' live-bytes events into one time order (each file's own
    order is kept: the writer appends under one lock, so it is a valid order of
    that process's allocations and frees) and follows the sum: its peak, and
    what each call site held at that peak; with `grid`, each layer's live bytes
    at the grid's times (report --html); with `select` (a boolean per site
    index + 1, and a size), the highest live bytes of the arrays of at least
    that size from the selected sites (suggest --memory's replay)."""

    def __init__(self, prof, grid=None, layers=None, select=None):
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
        self.select = select
        self.sel_live = self.sel_peak = 0.0

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
        if self.select is not None:
            lut, min_size = self.select
            # an event is one array, or a sample of |dw| arrays of one size
            m = lut[np.minimum(site, len(lut) - 1)] & (np.abs(db) >= min_size * np.abs(dw))
            c = self.sel_live + np.cumsum(np.where(m, db, 0.0))
            self.sel_peak = max(self.sel_peak, float(c.max()))
            self.sel_live = float(c[-1])
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


# ---- whose code a frame is ---------------------------------------------------------
#
# A frame is a library's when its module is one of the packages whose frames
# the recorder never takes for the call site (numpy, pandas, scipy, sklearn,
# datamem: pyext/site.c), its file is in a site-packages or dist-packages
# directory (anything pip installed: joblib, dask...), in the standard library
# (.../lib/python3.X/), or frozen (<frozen importlib._bootstrap>). Every other
# frame is the user's: their scripts and modules, wherever they are.
INTERNAL_PACKAGES = ("numpy", "pandas", "scipy", "sklearn", "datamem")
_LIBRARY_FILE = re.compile(r"([/\\](site|dist)-packages[/\\])|([/\\]lib[/\\]python\d+\.\d+t?[/\\])"
                           r"|^<frozen ")


def is_library(site):
    """site: (module, function, file, line) -> whether the frame is a library's."""
    mod, _fn, file, _line = site
    if any(mod == p or mod.startswith(p + ".") for p in INTERNAL_PACKAGES):
        return True
    return bool(_LIBRARY_FILE.search(file))


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

    def __init__(self, directory, paths, user_sites=False):
        from .. import _ext
        self.directory = directory
        self.paths = paths
        # user_sites: a record's site is the innermost frame of its stack that is
        # the user's (is_library), when it has one (report); else the recorded
        # site, the innermost frame outside INTERNAL_PACKAGES, which call-site
        # rules match (suggest)
        self.user_sites = user_sites
        self.stacks, self._stack_index = [], {}  # tuples of site indexes, innermost first
        self.stack_site = []                     # per stack: its user site (or -1)
        self.stack_sums = np.zeros((64, 2))      # per stack + 1: allocations, bytes
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

    def _stack(self, frames):
        i = self._stack_index.get(frames)
        if i is None:
            i = self._stack_index[frames] = len(self.stacks)
            self.stacks.append(frames)
            user = [f for f in frames if not is_library(self.sites[f])]
            self.stack_site.append(user[0] if user else frames[0] if frames else -1)
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
        st = r["stack"] + 1
        if len(self.stack_sums) < len(self.stacks) + 1:
            grow = max(len(self.stacks) + 1, 2 * len(self.stack_sums)) - len(self.stack_sums)
            self.stack_sums = np.concatenate([self.stack_sums, np.zeros((grow, 2))])
        u, inv = np.unique(st, return_inverse=True)
        self.stack_sums[u, 0] += np.bincount(inv, w, len(u))
        self.stack_sums[u, 1] += np.bincount(inv, b, len(u))
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
        self.stack_sums = self.stack_sums[:len(self.stacks) + 1]
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
        grid_ns = np.asarray(grid, np.float64) * 1e9 + self.t_origin_ns
        return self._again(lambda again: _Stream(again, grid_ns, lut)).grid_vals

    def peak_of(self, site_indexes, min_size):
        """The highest live bytes, at any time, of the arrays of at least
        `min_size` bytes from the sites in `site_indexes` (all processes
        together): a second pass over the files (suggest --memory)."""
        lut = np.zeros(len(self.sites) + 2, bool)
        lut[[i + 1 for i in site_indexes]] = True
        return self._again(lambda again: _Stream(again, select=(lut, min_size))).sel_peak

    def _again(self, make_stream):
        """Reads the files again into the _Stream that make_stream(profile) makes,
        with this profile's strings and sites and no sums; returns the stream."""
        again = Profile.__new__(Profile)
        again.__dict__.update({k: v for k, v in self.__dict__.items()
                               if k in ("directory", "paths", "sites", "_site_index", "labels",
                                        "_label_index", "dtype_names", "user_sites", "stacks",
                                        "_stack_index", "stack_site")})
        again.warnings = []
        again._add = lambda *a: None
        again.stream = make_stream(again)
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
        return again.stream


def load(directory, user_sites=False):
    """Reads every DIR/*.dmprof (one per process) into one Profile (user_sites:
    see Profile)."""
    directory = os.fspath(directory)
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "*.dmprof")))
    if not paths:
        raise ProfileError("%s: no profile files (*.dmprof); record one with: %s"
                           % (printable(directory),
                              shell_command("python", "-m", "datamem", "profile", "--out",
                                            directory, "--", "python", "job.py")))
    return Profile(directory, paths, user_sites)
