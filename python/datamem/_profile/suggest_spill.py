"""`suggest --memory SIZE`: a spill rule for a job whose arrays outgrow RAM.

When the profile's peak of live arrays passes SHARE (70%) of the memory the job
will have (the rest is room for Python objects, pandas' hash tables, Arrow
buffers: docs/spill-and-limits.md, `worker_limit`), the policy gets a file-backed
arena (docs/spill-and-limits.md, "When arrays outgrow RAM") and one of two ways into it:

- a rule for the call sites that held the peak, when at most three of them,
  each mostly long-lived arrays of BIG or more, hold the bytes past the limit:
  those arrays always live on disk and everything else in RAM; a call-site rule
  adds about 240 instructions to a small create+free (docs/find-your-policy.md),
  live-byte counting about 550 (it takes every allocation off the fast path:
  docs/spill-and-limits.md);
- else `worker_limit` with `worker_spill`: whatever passes the limit, from any
  call site, is served from the file instead of raising MemoryError.
The other one is offered in a comment. `backing.max` is twice the most the
arena will hold (so a job that grows still fits, and a runaway cannot fill the
disk), replayed from the profile before it is printed: for a call-site rule,
the highest its sites' arrays of BIG or more reach at any time, from a second
pass over the profile (every array of theirs lives on disk, not only the bytes
past the limit; and a site can hold more before the peak of all live arrays
than at it: a rule sized by what its site held at that peak got 64 MiB for
arrays that reached 200 MiB earlier, and the job died of MemoryError, issue
44); for worker_limit, the bytes past a process's limit (its arrays and what it
holds beside them, from its peak RSS: _beside) plus the largest array
(an array that would pass the limit goes to disk whole: a 2 MiB file for the
0.8 MiB past it could not take the first 8 MiB array; the arena never holds
more than that, since the bytes in RAM stay above the limit less the array
that spilled last), and never more than the peak of live arrays.
`datamem tune --candidates policy.yaml -- CMD` runs the policy itself.
`resident_max` 128 MiB as configs/spill.yaml, at most 1/16 of the memory.

The directory is the user's to make (a comment says how: the command quotes
it, _text.shell_arg, so a space, `;` or `$(...)` in DIR stays part of the name;
and the policy names it as a YAML double-quoted string, yaml_str, so a `"`, `}`
or `#` in it cannot end the value and add keys).

Call-site names go into the rule's `function` globs only when they are plain
dotted identifiers (letters, digits, `_`, `.`, `<>` as in `<lambda>`) of at most
63 bytes: nothing a glob or YAML would read as anything but the name; a site
with another name is never chosen (its bytes count as not covered). Nor is a
module's top level (`__main__.<module>`, and a comprehension or lambda there,
`__main__.<listcomp>`): every array a script makes outside a function matches
the first, so such a rule would spill the whole job; `f.<locals>.<listcomp>`
is f's and stays a site.
"""
import json
import re

from .dmprof import BIG
from .read import SITE_COLUMNS
from .report import fmt_time
from .._text import human_bytes, printable, shell_command

SHARE = 70                       # worker_limit, in percent of the memory limit (spill.yaml's)
DEFAULT_DIR = "/var/tmp/datamem-spill"
SITES_MAX = 3                    # call sites in a spill rule
RESIDENT_MAX = 128 << 20         # configs/spill.yaml's
_PLAIN_NAME = re.compile(r"[A-Za-z_<][A-Za-z0-9_.<>]{0,62}")


def check_dir(path):
    """The spill directory as the policy will name it; ValueError saying why not."""
    if not path.startswith("/"):
        raise ValueError("%s: not an absolute path" % printable(path))
    if printable(path) != path or len(path.encode()) > 255:
        raise ValueError("%s: a control character in it, or longer than 255 bytes"
                         % printable(path))
    return path


def yaml_str(text):
    """`text` as a YAML double-quoted scalar: JSON's escapes (`\\"`, `\\\\`) are
    YAML's; non-ASCII left as it is (a \\u escape of a surrogate pair, as
    JSON writes a character past U+FFFF, is an error to libyaml)."""
    return json.dumps(text, ensure_ascii=False)


def _size_text(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= k and n % k == 0:
            return "%d%s" % (n // k, unit)
    return str(int(n))


def _pow2(n, up):
    p = 1 << 20
    while p < n if up else p * 2 <= n:
        p <<= 1
    return p


def _worker_size(limit, nproc):
    """worker_limit for each of nproc processes sharing `limit`: whole MiB."""
    return max(1 << 20, (limit // nproc) >> 20 << 20)


def _top_level(fn):
    """Whether call site `fn` (module.qualname) is a module's top level: its
    `<module>`, or a `<listcomp>`/`<lambda>`... not inside a function's `<locals>`."""
    parts = fn.split(".")
    return parts[-1].startswith("<") and (len(parts) < 2 or parts[-2] != "<locals>")


def _sites(p, excess):
    """Up to SITES_MAX call sites, most bytes at the peak first, each mostly
    long-lived big arrays and with a plain name, that held `excess` bytes at the
    peak together: [(function, bytes at the peak)], or None if no such few do."""
    held = p.peak["site_bytes"]
    col = {c: SITE_COLUMNS.index(c) for c in ("bytes", "resident_bytes")}
    chosen, covered = [], 0.0
    for r in sorted(range(1, len(held)), key=lambda r: -held[r]):
        if held[r] <= 0 or len(chosen) == SITES_MAX:
            break
        fn = p.sites[r - 1][1]
        sums = p.site_sums[r]
        if (not _PLAIN_NAME.fullmatch(fn) or _top_level(fn)
                or sums[col["resident_bytes"]] < 0.5 * sums[col["bytes"]]):
            continue
        chosen.append((fn, float(held[r])))
        covered += held[r]
        if covered >= excess:
            return chosen
    return None


def _arena_most(p, sites, peak, limit, nproc):
    """The most the spill arena holds at once: for a rule on `sites`, the highest
    their arrays of BIG or more reach at any time (replayed from the profile);
    for worker_limit, what passes a process's limit and the array that crossed it."""
    if sites:
        names = {fn for fn, _ in sites}
        return p.peak_of([i for i, s in enumerate(p.sites) if s[1] in names], BIG)
    own = limit if nproc == 1 else _worker_size(limit, nproc)
    return min(peak, peak - max(0.0, own - _beside(p, peak, nproc)) + float(p.totals["max_size"]))


def _beside(p, peak, nproc):
    """What a process held beside its arrays, which the runtime counts against
    worker_limit too (docs/spill-and-limits.md, "What `worker_limit` counts"): its
    largest peak RSS less its share of the peak of live arrays. The profile
    has no finer figure; a high one sizes the spill arena up, never down."""
    rss = max([float(q["max_rss"] or 0) for q in p.processes] + [0.0])
    return max(0.0, rss - peak / nproc)


def spill(p, memory, spill_dir):
    """The spill part of a suggested policy for a job with `memory` bytes:
    {"arenas": lines, "rules": lines, "tail": lines, "estimate": lines} (empty
    lists but for the estimate when the peak fits)."""
    peak, at = float(p.peak["bytes"]), float(p.peak["time"])
    limit = memory * SHARE // 100
    nproc = len(p.processes)
    out = {"arenas": [], "rules": [], "tail": [], "estimate": []}
    procs = "" if nproc == 1 else " (%d processes together)" % nproc
    if peak <= limit:
        out["estimate"].append("#   --memory %s: the peak of live arrays%s, %s at %s, is within "
                               "%d%% of it: nothing to spill" % (human_bytes(memory), procs,
                                                                 human_bytes(peak), fmt_time(at),
                                                                 SHARE))
        return out
    excess = peak - limit
    sites = _sites(p, excess)
    held = _arena_most(p, sites, peak, limit, nproc)
    disk_max = _pow2(2 * held, up=True)
    resident_max = min(RESIDENT_MAX, _pow2(memory // 16, up=False))
    out["arenas"] = [
        "  # --memory %s: the peak of live arrays%s, %s at %s, passes %d%% of it"
        % (human_bytes(memory), procs, human_bytes(peak), fmt_time(at), SHARE),
        "  # (%s; the rest is room for Python objects, pandas, Arrow...) by %s."
        % (human_bytes(limit), human_bytes(excess)),
        "  # -> a file-backed arena for what does not fit. Make its directory once, on local",
        "  #    disk (not tmpfs or a network filesystem), yours and not writable by others:",
        "  #      " + shell_command("mkdir", "-m", "700", "-p", spill_dir),
        ("  #    max: twice the most its rule's arrays hold at once in the profile (%s);"
         % human_bytes(held)) if sites else
        ("  #    max: twice the bytes past the limit and the largest array (%s);"
         % human_bytes(held)),
        "  #    resident_max: its pages kept in memory (a datamem thread pages out the rest;",
        "  #    docs/spill-and-limits.md)",
        "  spill: {alignment: 64, decay: {dirty: 1s}, backing: {dir: %s, max: %s, resident_max: %s}}"
        % (yaml_str(spill_dir), _size_text(disk_max), _size_text(resident_max))]
    if nproc == 1:
        worker = "%d%%" % SHARE
        where = ["%d%% of the memory limit (DATAMEM_MEMORY_LIMIT, else the cgroup's," % SHARE,
                 "else RAM: %s where the job runs)" % human_bytes(memory)]
    else:  # worker_limit counts each process alone; the profile's peak is their sum
        worker = _size_text(_worker_size(limit, nproc))
        where = ["%s in each of the %d processes" % (worker, nproc),
                 "(%d%% of %s shared among them)" % (SHARE, human_bytes(memory))]
    limit_lines = ["worker_limit: %s" % worker, "worker_spill: spill"]
    if sites:
        names = ", ".join("%s (%s)" % (fn, human_bytes(b)) for fn, b in sites)
        out["rules"] = [
            "  # what held the peak: %s;" % names,
            "  # together at least the %s past the limit" % human_bytes(excess),
            "  # -> their arrays >= %s live on disk, everything else in RAM (a call-site"
            % human_bytes(BIG),
            "  #    rule costs each allocation less than counting live bytes would)",
            "  - name: spill",
            "    match: {function: [%s], size: {min: %s}}"
            % (", ".join(json.dumps(fn) for fn, _ in sites),
               _size_text(BIG)),
            "    arena: spill"]
        out["tail"] = ["# Or spill, from any call site, whatever passes " + where[0],
                       "# " + where[1] + " (counting live bytes takes every allocation",
                       "# off the fast path):"] + ["# " + line for line in limit_lines]
        out["estimate"].append("#   spill: %s at the peak from %d call site%s in a file in %s "
                               "(disk speed, not RAM's)" % (human_bytes(sum(b for _, b in sites)),
                                                            len(sites),
                                                            "" if len(sites) == 1 else "s",
                                                            spill_dir))
        return out
    out["tail"] = ["# Every array past " + where[0],
                   "# " + where[1] + " is served from the spill arena instead of RAM.",
                   "# No %d call sites of long-lived big arrays hold the %s past it, for a rule"
                   % (SITES_MAX, human_bytes(excess)),
                   "# (counting live bytes takes every allocation off the fast path)."] + limit_lines
    out["estimate"].append("#   spill: about %s at the peak, whichever arrays pass the limit, in "
                           "a file in %s (disk speed, not RAM's)" % (human_bytes(excess), spill_dir))
    return out
