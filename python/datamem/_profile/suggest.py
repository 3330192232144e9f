"""`python -m datamem suggest DIR > policy.yaml`: a policy from a profile.

The proposal follows what the allocator benchmark measured
(docs/performance.md; bench/policies/throughput.yaml, the benchmarks'
three-arena policy), scaled to the job's own numbers:

- Big arrays that are freed soon (temporaries) are where a NEP 49 handler wins
  most: NumPy's default allocator (glibc) gives blocks above its mmap threshold
  back to the kernel and refaults every page on the next iteration (temporaries
  8 MiB: 0.45x the default's time, 64 MiB: 0.73x, zero faults per iteration).
  They get a `reuse` arena: page-aligned, a 30 s decay (freed pages
  kept 30 s; the default `decay.budget` 0 purges them when the arena grows:
  mixed-size runs 1.04x the default's peak RSS, 1.39x without), hugepages as
  NumPy advises them (`hugepages: on` for whole extents held up to 1.08x the
  default's peak RSS on real jobs: a 6.5 MB vector takes four 2 MiB pages).
  `dirty: never` with a budget sized to the job's peak of temporaries is
  offered in a comment only: on fft_image it held 1.34x the default's peak RSS
  for no gain.
- Big arrays that live long (or to the end) share the reuse arena by default:
  on bench/suggest_proof.sh an arena of their own cost peak RSS (stencil_big
  1.09x the default against throughput.yaml's 1.01x: two arenas cannot share
  freed pages). `suggest --resident` gives them their own `resident` arena
  (hugepages for random access: gather 0.92x) when a size bound separates them
  from the temporaries.
- "Big" starts at 4 MiB: 2 MiB temporaries on the
  hugepage arena held more memory (scipy_cg 1.11x the default's peak RSS
  against 1.05x).
- Tiny arrays (<= 1 KiB) go to a 16-byte-aligned arena, everything else to a
  64-byte-aligned default arena.
Every rule is preceded by a comment with the numbers behind it. Names from the
profile (call sites, the directory, policy paths) appear only in comments, with
their control characters escaped (printable()): a line break in a function's
name would otherwise end the comment and add YAML of the profiled job's choosing.
The commands in those comments quote what they name (_text.shell_command).
`--memory SIZE` adds a spill arena when the peak does not fit (suggest_spill.py,
whose rule names call sites only when their names are plain identifiers).
"""
import numpy as np

from . import suggest_spill
from .dmprof import BIG, LONG, SHORT
from .read import SITE_COLUMNS
from .report import fmt_count, fmt_time
from .._text import human_bytes, printable, shell_command

def _pow2_ceil(n):
    p = 1
    while p < n:
        p <<= 1
    return p


def _size_text(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return "%d%s" % (n // k, unit)
    return str(int(n))


def _top_sites(p, column, limit=3):
    """The `limit` call sites with most of `column` (bytes of a class), as
    'function:line (share)', and how many sites have any."""
    rows = list(range(1, len(p.site_sums))) + [0]  # the unknown site last
    sb = p.site_sums[rows, SITE_COLUMNS.index(column)]
    total = sb.sum() or 1.0
    out = []
    for j in np.argsort(-sb, kind="stable")[:limit]:
        if sb[j] > 0:
            out.append("%s (%.0f%%)" % (printable(p.site_label(rows[j] - 1, True)),
                                        100 * sb[j] / total))
    return out, int((sb > 0).sum())


def _below(log2, bound):
    """Bytes of `log2` (bytes by floor(log2(size)): Profile.log2_bytes) in arrays
    smaller than `bound` (a power of two)."""
    return float(log2[:bound.bit_length() - 1].sum())


def _pct(x, total):
    return "%.0f%%" % (100.0 * x / total)


def _tune_hint(p):
    """The command that measures this policy against NumPy's default and the
    presets on the profiled job (tune.py), quoted for a shell."""
    pids = {q["pid"] for q in p.processes}
    argv = next((q["argv"] for q in p.processes if q["argv"] and q["ppid"] not in pids), None)
    if not argv:
        return "python -m datamem tune -- CMD ..."
    return shell_command("python", "-m", "datamem", "tune", "--out", "policy.yaml", "--",
                         *argv)


def _head(p):
    """The comment lines that open the policy: what was recorded."""
    T = p.totals
    est = "" if p.full else " (estimated from samples)"
    return ["# Suggested by: " + shell_command("python", "-m", "datamem", "suggest", p.directory),
            "# from %s%s: %s allocated in %s arrays over %.2f s, %d process%s."
            % ("every allocation" if p.full else
               "%s samples (one per %s allocated)" % (fmt_count(len(p)), human_bytes(p.sample_bytes)),
               est, human_bytes(T["bytes"]), fmt_count(T["allocations"]),
               p.end, len(p.processes),
               "" if len(p.processes) == 1 else "es"),
            "# Check it: python -m datamem check policy.yaml; see where an array goes:",
            "# python -m datamem explain policy.yaml --size 8MiB"]


def _misplaced(p, sep):
    """Big bytes on the wrong side of size bound `sep` ("size_min" or
    "size_max_below", bound): temporaries with the long-lived or the reverse."""
    res_log2, temp_log2 = p.log2_bytes
    res_b, temp_b = p.totals["resident_bytes"], p.totals["temp_bytes"]
    kind, bound = sep
    if kind == "size_min":
        return _below(res_log2, bound) + (temp_b - _below(temp_log2, bound))
    return (res_b - _below(res_log2, bound)) + _below(temp_log2, bound)


def _separating_bound(p):
    """("size_min" or "size_max_below", bound): the power of two from BIG up that
    separates long-lived big arrays from the temporaries, misplacing the fewest
    bytes and at most 10% of the big ones; None if there is none."""
    best = None
    for e in range(int(np.log2(BIG)), 41):
        bound = 1 << e
        for cand in ((_misplaced(p, ("size_min", bound)), "size_min", bound),
                     (_misplaced(p, ("size_max_below", bound)), "size_max_below", bound)):
            if (cand[2] > BIG or cand[1] == "size_min") and (best is None or cand[0] < best[0]):
                best = cand
    if best and best[0] <= 0.1 * p.totals["big_bytes"]:
        return best[1:]
    return None


def _resident(p, call_site_rules, resident_arena, arenas, rules, estimate):
    """Long-lived big arrays: their own arena with `resident_arena`, if a size
    bound separates them from the temporaries (a power of two, misplacing at
    most 10% of their bytes); else a comment saying why they share reuse."""
    T = p.totals
    res_b, big_b = T["resident_bytes"], T["big_bytes"]
    sep = _separating_bound(p)
    sites, nsites = _top_sites(p, "resident_bytes")
    comment = ["  # long-lived big arrays: sizes >= %s freed after %s or never: %s (%s of bytes),"
               % (human_bytes(BIG), fmt_time(LONG), human_bytes(res_b), _pct(res_b, T["bytes"] or 1.0)),
               "  # %s arrays, from %d site%s: %s"
               % (fmt_count(T["resident_allocations"]), nsites, "" if nsites == 1 else "s",
                  ", ".join(sites))]
    if sep is None or not resident_arena:
        shared = ("the reuse arena" if T["temp_bytes"] > 0 else
                  "the default arena (this policy has no reuse arena)")
        if sep is None:
            rules_note = ("  # no size bound separates them from the temporaries%s; they "
                          "stay in %s" % ("" if call_site_rules else
                                          " (and this policy uses no call-site rules)",
                                          shared))
        else:
            rules_note = ("  # they stay in %s: an arena of their own keeps its "
                          "freed pages apart (more peak RSS); `suggest --resident` "
                          "separates them at %s" % (shared, _size_text(sep[1])))
        rules += comment + [rules_note]
        return
    arenas.append("  resident: {alignment: 4096, hugepages: on}")
    if sep[0] == "size_min":
        match = "{size: {min: %s}}" % _size_text(sep[1])
    else:
        match = "{size: {min: %s, max: %d}}" % (_size_text(BIG), sep[1] - 1)
    misplaced = _misplaced(p, sep)
    comment.append("  # %s %s separates them from the temporaries (%s of big bytes "
                   "on the other side)" % ("size >=" if sep[0] == "size_min" else "size <",
                                           _size_text(sep[1]),
                                           "%.0f%%" % (100 * misplaced / big_b)))
    rules += comment + ["  # -> their own hugepage arena, away from the temporaries' "
                        "dirty pages",
                        "  - name: resident",
                        "    match: %s" % match,
                        "    arena: resident"]
    estimate.append("#   resident: %s of long-lived arrays on hugepages (random access: "
                    "0.92x the default's time in the benchmark's gather)"
                    % human_bytes(res_b))


def _temporaries(p, arenas, rules, estimate):
    """Big temporaries: the reuse arena."""
    T = p.totals
    temp_b = T["temp_bytes"]
    if temp_b <= 0:
        rules.append("  # no big temporaries (>= %s freed within %s): no reuse arena"
                     % (human_bytes(BIG), fmt_time(LONG)))
        return
    peak_t = p.temp_peak
    # a 30 s decay: on the real-job benchmark (python3 -m bench.jobs,
    # fft_image) `dirty: never` with a budget sized to the temporaries' peak
    # (512 MiB) held 1.34x the default's peak RSS against 1.11x, and was no faster.
    sites, nsites = _top_sites(p, "temp_bytes")
    med = p.median_life_temp.median(0)
    arenas.append("  reuse: {alignment: 4096, decay: {dirty: 30s, muzzy: 0ms}}")
    rules += ["  # big temporaries: sizes >= %s freed within %s: %s (%s of bytes), "
              "median lifetime %s,"
              % (human_bytes(BIG), fmt_time(LONG), human_bytes(temp_b),
                 _pct(temp_b, T["bytes"] or 1.0), fmt_time(med)),
              "  # %s arrays (%s freed within %s), peak %s live at once, from %d site%s: %s"
              % (fmt_count(T["temp_allocations"]),
                 "%.0f%%" % (100.0 * T["temp_short_bytes"] / temp_b), fmt_time(SHORT),
                 human_bytes(peak_t), nsites, "" if nsites == 1 else "s", ", ".join(sites)),
              "  # -> reuse arena: freed pages kept 30 s for the next iteration, at most",
              "  #    1/64 of its active bytes of them when it grows (a steady loop that",
              "  #    still faults: dirty: never, budget >= %s, the peak above)"
              % _size_text(_pow2_ceil(int(peak_t))),
              "  - name: temporaries",
              "    match: {size: {min: %s}}" % _size_text(BIG),
              "    arena: reuse"]
    # What reusing them saves is the job's to measure (`datamem tune`): a
    # count of the temporaries' pages as "faults avoided" promised 12x an fft
    # job's whole count and made a pandas job's faults double.
    estimate += ["#   temporaries: %s in %s arrays go to the reuse arena; what that saves"
                 % (human_bytes(temp_b), fmt_count(T["temp_allocations"])),
                 "#     (faults, CPU, peak RSS) is measured, not estimated: " + _tune_hint(p),
                 "#   memory: freed temporaries kept when the arena grows: at most 1/64 "
                 "of its active bytes"]


def _tiny(p, arenas, rules):
    """Tiny arrays: a 16-byte-aligned arena."""
    T = p.totals
    if T["tiny_allocations"] <= 0:
        return
    arenas.insert(1, "  tiny: {alignment: 16}")
    sites, nsites = _top_sites(p, "tiny_bytes")
    rules += ["  # tiny arrays <= 1 KiB: %s arrays (%.0f%% of the count), %s; from %d site%s: %s"
              % (fmt_count(T["tiny_allocations"]),
                 100.0 * T["tiny_allocations"] / (T["allocations"] or 1),
                 human_bytes(T["tiny_bytes"]), nsites, "" if nsites == 1 else "s",
                 ", ".join(sites)),
              "  # -> 16-byte alignment, NumPy's own",
              "  - name: tiny",
              "    match: {size: {max: 1KiB}}",
              "    arena: tiny"]


def suggest(p, call_site_rules=False, resident_arena=False, memory=None,
            spill_dir=suggest_spill.DEFAULT_DIR):
    """Returns the policy text (YAML with comments). "Big" arrays start at BIG,
    4 MiB (a 2 MiB bound measured more peak RSS for no
    speed: module docstring). With `memory` (bytes), a spill arena in
    `spill_dir` when the peak does not fit (suggest_spill.py)."""
    T = p.totals
    total = T["bytes"] or 1.0
    arenas = ["arenas:", "  general: {alignment: 64}"]
    rules = ["rules:"]
    estimate = ["#", "# What it changes (from the profile; measure it with `datamem tune`):"]
    res_b = T["resident_bytes"]
    if res_b > 0 and res_b >= 0.05 * total:
        _resident(p, call_site_rules, resident_arena, arenas, rules, estimate)
    _temporaries(p, arenas, rules, estimate)
    _tiny(p, arenas, rules)
    sp = suggest_spill.spill(p, memory, spill_dir) if memory else None
    if sp:  # its rule first: the first match wins
        arenas += sp["arenas"]
        rules[1:1] = sp["rules"]
        estimate += sp["estimate"]
    rest = max(0.0, T["bytes"] - T["tiny_bytes"] - T["big_bytes"])
    estimate.append("#   everything else (%s, %s of bytes): the 64-byte-aligned default arena, "
                    "served by datamem's block cache up to 256 KiB"
                    % (human_bytes(rest), _pct(rest, total)))
    policies = sorted({q["policy"] for q in p.processes if q["policy"]})
    if policies:
        estimate.append("#   recorded under: %s" % printable(", ".join(policies)))
    if not any(r.startswith("  - name:") for r in rules):
        rules = rules[1:] + ["rules: []"]
    tail = [""] + sp["tail"] if sp and sp["tail"] else []
    return "\n".join(_head(p) + estimate + ["", "version: 1", "default: general", ""] + arenas +
                      [""] + rules + tail) + "\n"
