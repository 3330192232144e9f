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

Reading: load(DIR) parses every file (format in service/datamem_profile.h),
pairs frees with allocations, and returns one Profile whose per-allocation
columns are NumPy arrays; _report.py and _suggest.py work from it.
"""
import glob
import json
import os
import struct
import sys

import numpy as np

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
    from .__main__ import parse_size
    n = parse_size(text)
    if n < 1:
        raise ValueError("sample interval must be at least 1 byte")
    return n


def _cmdline():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(sys.argv)


def start(directory, sample=DEFAULT_SAMPLE, stacks=None, policy=None):
    """Starts recording this process into DIRECTORY/<pid>.dmprof (sample=0: full
    mode). Must run before datamem.install() so that every handler records."""
    from . import _ext
    import numpy
    full = sample == 0
    if stacks is None:
        stacks = full
    meta = {"argv": _cmdline(), "python": sys.version.split()[0], "numpy": numpy.__version__,
            "datamem": _ext.VERSION, "policy": os.path.abspath(policy) if policy else ""}
    path = _ext.profile_start(os.fspath(directory), int(sample or 1), bool(full), bool(stacks),
                              json.dumps(meta)[1:-1])
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
    """The pass-through policy's path in DIRECTORY (written atomically once)."""
    path = os.path.join(os.fspath(directory), "passthrough.yaml")
    if not os.path.exists(path):
        os.makedirs(os.fspath(directory), exist_ok=True)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "w") as f:
            f.write(PASSTHROUGH_POLICY)
        os.replace(tmp, path)
    return path


def activate_from_env():
    """Called by the start-up hook when DATAMEM_PROFILE is set: starts recording,
    then installs DATAMEM_CONFIG or the pass-through policy. Returns the policy."""
    import datamem
    directory = os.environ["DATAMEM_PROFILE"]
    sample = parse_sample(os.environ.get("DATAMEM_PROFILE_SAMPLE") or DEFAULT_SAMPLE)
    stacks_env = os.environ.get("DATAMEM_PROFILE_STACKS", "")
    stacks = None if stacks_env == "" else stacks_env not in ("0", "false", "no")
    policy = os.environ.get("DATAMEM_CONFIG") or passthrough_policy(directory)
    start(directory, sample, stacks, policy)
    datamem.install(policy)
    return policy


def run(argv, out, sample=DEFAULT_SAMPLE, stacks=None, policy=None):
    """`python -m datamem profile`: runs argv with DATAMEM_PROFILE=out; returns
    its exit status."""
    import subprocess
    env = dict(os.environ)
    env["DATAMEM_PROFILE"] = os.path.abspath(out)
    env["DATAMEM_PROFILE_SAMPLE"] = "full" if sample == 0 else str(sample)
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

_A = struct.Struct("<QQQdIIIIIIBB")
_F = struct.Struct("<QQ")
_P = struct.Struct("<QQQ")
_C = struct.Struct("<IIIII")
_II = struct.Struct("<II")


class ProfileError(ValueError):
    pass


def read_file(path):
    """One .dmprof file -> dict of header, strings, sites, stacks, allocation
    rows (t0, t1, size, weight, thread, tags, rule, arena, site, stack, dtype,
    flags; t1 = None: live at exit, including arrays freed once the interpreter
    began to exit) and process samples (t, maxrss)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(b"DMPROF1\n"):
        raise ProfileError("%s: not a datamem profile" % path)
    pos, n = 8, len(data)
    header, strings, sites, stacks = {}, {0: ""}, {}, {}
    rows, open_by_ptr, rss = [], {}, []
    exit_t = None
    unmatched_frees = 0
    unpack_a, unpack_f = _A.unpack_from, _F.unpack_from
    while pos < n:
        kind = data[pos]
        pos += 1
        try:
            if kind == 0x41:  # 'A'
                t, ptr, size, w, th, tg, ru, ar, site, stack, dt, fl = unpack_a(data, pos)
                pos += 58
                row = [t, None, size, w, th, tg, ru, ar, site, stack, dt, fl]
                open_by_ptr[ptr] = row
                rows.append(row)
            elif kind == 0x46:  # 'F'
                t, ptr = unpack_f(data, pos)
                pos += 16
                row = open_by_ptr.pop(ptr, None)
                if row is None:
                    unmatched_frees += 1
                else:
                    row[1] = t
            elif kind == 0x53:  # 'S'
                sid, ln = _II.unpack_from(data, pos)
                pos += 8
                if pos + ln > n:
                    break
                strings[sid] = data[pos:pos + ln].decode("utf-8", "replace")
                pos += ln
            elif kind == 0x43:  # 'C'
                sid, mod, fn, fi, line = _C.unpack_from(data, pos)
                pos += 20
                sites[sid] = (mod, fn, fi, line)
            elif kind == 0x4B:  # 'K'
                kid, cnt = _II.unpack_from(data, pos)
                pos += 8
                stacks[kid] = struct.unpack_from("<%dI" % cnt, data, pos)
                pos += 4 * cnt
            elif kind == 0x50:  # 'P'
                t, maxrss, _samples = _P.unpack_from(data, pos)
                pos += 24
                rss.append((t, maxrss))
            elif kind == 0x58:  # 'X'
                (exit_t,) = struct.unpack_from("<Q", data, pos)
                pos += 8
            elif kind == 0x48:  # 'H'
                (ln,) = struct.unpack_from("<I", data, pos)
                pos += 4
                header = json.loads(data[pos:pos + ln].decode("utf-8", "replace"))
                pos += ln
            else:
                raise ProfileError("%s: bad record type %r at byte %d" % (path, kind, pos - 1))
        except struct.error:
            break  # a file cut short (killed process): keep what is complete
    if exit_t is not None:  # freed while the interpreter exited: lived to the end
        for row in rows:
            if row[1] is not None and row[1] >= exit_t:
                row[1] = None
    return {"path": path, "header": header, "strings": strings, "sites": sites,
            "stacks": stacks, "rows": rows, "rss": rss, "unmatched_frees": unmatched_frees,
            "size": n, "exit": exit_t}


class Profile:
    """Every allocation record of a profile directory, as columns.

    t0, t1 (seconds from the earliest process start; t1 = nan: live at the end),
    end (the end of the record's process), size, weight (allocations the record
    stands for), pid, thread, tags, rule, arena, site (index into `sites`,
    -1 unknown), stack (tuple of site indexes, innermost first, or ()),
    dtype (name), flags. `sites` is a list of (module, function, file, line).
    """

    def __init__(self, directory, files):
        from . import _ext
        self.directory = directory
        self.files = files
        self.processes = []
        dtypes = list(_ext.DTYPES)
        t_origin = min((f["header"].get("t0_ns", 0) for f in files), default=0)
        self.t_origin_ns = t_origin
        site_index, self.sites = {}, []
        labels = {"thread": {}, "tags": {}, "rule": {}, "arena": {}}
        self.labels = {k: [] for k in labels}
        cols = {k: [] for k in ("t0", "t1", "size", "weight", "pid", "thread", "tags", "rule",
                                "arena", "site", "dtype", "flags", "end")}
        stacks = []

        def label(kind, text):
            d = labels[kind]
            if text not in d:
                d[text] = len(d)
                self.labels[kind].append(text)
            return d[text]

        for f in files:
            h, s = f["header"], f["strings"]
            pid = int(h.get("pid", 0))
            local_site = {}
            for sid, (mod, fn, fi, line) in f["sites"].items():
                key = (s.get(mod, "?"), s.get(fn, "?"), s.get(fi, "?"), line)
                if key not in site_index:
                    site_index[key] = len(self.sites)
                    self.sites.append(key)
                local_site[sid] = site_index[key]
            t_end = f["exit"] or max([r[0] for r in f["rss"]] + [r[0] for r in f["rows"]] +
                                     [r[1] for r in f["rows"] if r[1] is not None] +
                                     [h.get("t0_ns", 0)])
            self.processes.append({
                "pid": pid, "ppid": h.get("ppid"), "argv": h.get("argv", []),
                "file": f["path"], "file_bytes": f["size"], "records": len(f["rows"]),
                "full": bool(h.get("full")), "sample_bytes": h.get("sample_bytes"),
                "stacks": bool(h.get("stacks")), "policy": h.get("policy", ""),
                "start": (h.get("t0_ns", t_origin) - t_origin) / 1e9,
                "end": (t_end - t_origin) / 1e9,
                "max_rss": max([r[1] for r in f["rss"]], default=0),
                "unmatched_frees": f["unmatched_frees"]})
            for (t0, t1, size, w, th, tg, ru, ar, site, stack, dt, fl) in f["rows"]:
                cols["t0"].append((t0 - t_origin) / 1e9)
                cols["t1"].append((t1 - t_origin) / 1e9 if t1 is not None else np.nan)
                cols["size"].append(size)
                cols["weight"].append(w)
                cols["pid"].append(pid)
                cols["thread"].append(label("thread", s.get(th, "") or "?"))
                cols["tags"].append(label("tags", s.get(tg, "")))
                cols["rule"].append(label("rule", s.get(ru, "") or "?"))
                cols["arena"].append(label("arena", s.get(ar, "") or "?"))
                cols["site"].append(local_site.get(site, -1))
                cols["dtype"].append(dt)
                cols["flags"].append(fl)
                cols["end"].append((t_end - t_origin) / 1e9)
                stacks.append(tuple(local_site.get(x, -1) for x in f["stacks"].get(stack, ())))
        for k in ("t0", "t1", "weight", "end"):
            setattr(self, k, np.asarray(cols[k], dtype=np.float64))
        self.size = np.asarray(cols["size"], dtype=np.float64)
        for k in ("pid", "thread", "tags", "rule", "arena", "site", "dtype", "flags"):
            setattr(self, k, np.asarray(cols[k], dtype=np.int64))
        self.dtype_names = [dtypes[i] if 0 <= i < len(dtypes) else "?" for i in range(256)]
        self.stacks = stacks
        self.full = all(p["full"] for p in self.processes)
        self.sample_bytes = max((p["sample_bytes"] or 0 for p in self.processes if not p["full"]),
                                default=0)

    def __len__(self):
        return len(self.size)

    @property
    def live_at_end(self):
        return np.isnan(self.t1)

    @property
    def lifetime(self):
        """Seconds from allocation to free; for blocks live at the end, to the
        end of their process (a lower bound)."""
        return np.where(self.live_at_end, self.end, self.t1) - self.t0

    def site_label(self, i, short=False):
        if i < 0:
            return "(unknown: no Python frame, e.g. realloc without the GIL)"
        mod, fn, fi, line = self.sites[i]
        return "%s:%d" % (fn, line) if short else "%s (%s:%d)" % (fn, fi, line)


def load(directory):
    """Reads every DIR/*.dmprof (one per process) into one Profile."""
    directory = os.fspath(directory)
    paths = sorted(glob.glob(os.path.join(directory, "*.dmprof")))
    if not paths:
        raise ProfileError("%s: no profile files (*.dmprof); record one with "
                           "`python -m datamem profile --out %s -- python job.py`"
                           % (directory, directory))
    return Profile(directory, [read_file(p) for p in paths])
