"""python -m datamem: command-line tools.

  check POLICY                        validate; exit 0 with a summary, 1 with diagnostics
  reload PID | --all                  ask a running job (or every datamem process of this
                                      user) to reload its policy (SIGHUP, opt-in)
  explain POLICY --size 8MiB [--dtype float32] [--thread NAME] [--tag T ...] [--table]
          [--module MOD] [--function MOD.QUALNAME]
                                      which rule and arena serve an allocation, and why
                                      each earlier rule did not match
  profile [--out DIR] [--sample BYTES | --full] [--stacks] [--policy P] -- CMD ...
                                      run CMD recording an allocation profile (every
                                      process: DIR/<pid>.dmprof; DATAMEM_PROFILE=DIR)
  report DIR [--html OUT] [--json] [--flamegraph OUT] [--folded OUT [--by count]]
                                      top call sites (your frames) and their stacks, sizes,
                                      lifetimes, peak, threads, tags; flame graphs
  suggest DIR [--resident] [--memory 16GiB [--spill-dir DIR]]
                                      a policy for the profiled job, with its numbers; with
                                      --memory, a spill arena if its peak does not fit
  tune [--out FILE] [--reps N] [--candidates NAME|FILE ...] -- CMD ...
                                      run CMD under NumPy's default, the presets and
                                      suggest's policy; write the one that measured best
"""
import argparse
import os
import sys

from . import _ext, _stats_cli, _stats_reload, _suggest_spill, _text
from ._explain import check, explain

def parse_size(text):
    """A size argument (_text.parse_size), as argparse reports a bad one."""
    try:
        return _text.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def spill_dir(text):
    """`suggest --spill-dir`: a path the policy can name (_suggest_spill.check_dir)."""
    try:
        return _suggest_spill.check_dir(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_size(text):
    """`suggest --memory`: a size of at least 1 byte."""
    n = parse_size(text)
    if n < 1:
        raise argparse.ArgumentTypeError("%s: the memory must be at least 1 byte" % text)
    return n


def parse_dtype(text):
    """A dtype name explain() knows (the policy's own list), or an argparse error
    that lists them."""
    if text not in _ext.DTYPES:
        raise argparse.ArgumentTypeError(
            "unknown dtype %r; accepted dtypes are %s" % (text, ", ".join(_ext.DTYPES)))
    return text


catches_sighup = _stats_reload.catches_sighup
reload_pid = _stats_reload.reload_pid  # refuses processes that are not this user's datamem ones


def version_text():
    """`python -m datamem --version`: datamem, the jemalloc linked in, and the NumPy
    and Python it runs under next to those it was built against."""
    import platform
    import numpy
    return ("datamem %s\njemalloc %s\nNumPy %s (built against %s)\nPython %s %s (built against %s)"
            % (_ext.VERSION, _ext.jemalloc_version(), numpy.__version__, _ext.BUILD_NUMPY_VERSION,
               platform.python_implementation(), platform.python_version(),
               _ext.BUILD_PYTHON_VERSION))


def profile_commands(a, pr):
    """profile / report / suggest."""
    from . import _profile
    if a.cmd == "profile":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not cmd:
            pr.error("no command to run: python -m datamem profile [options] -- python job.py")
        if a.full and a.sample is not None:
            pr.error("--full and --sample exclude each other")
        out = a.out or "datamem-profile-%d" % os.getpid()
        from ._files import UnsafeError, owned_dir
        try:  # the job's start-up checks it too; here it fails before the job runs
            os.close(owned_dir(out, create=True))
        except (OSError, UnsafeError) as e:
            pr.error("--out %s: %s" % (out, getattr(e, "strerror", None) or e))
        if any(n.endswith(".dmprof") for n in os.listdir(out)):
            pr.error("%s already holds a profile (.dmprof files); give another --out" % out)
        if a.max_size is not None and 0 < a.max_size < _ext.PROFILE_MAX_BYTES_MIN:
            pr.error("--max-size must be at least %d bytes" % _ext.PROFILE_MAX_BYTES_MIN)
        if a.policy:
            ok, text, _ = check(a.policy)
            if not ok:
                sys.stderr.write(text)
                return 2
        sample = 0 if a.full else (a.sample or _profile.DEFAULT_SAMPLE)
        rc = _profile.run(cmd, out, sample, a.stacks, a.policy, a.max_size)
        files = [n for n in os.listdir(out) if n.endswith(".dmprof")] if os.path.isdir(out) else []
        size = sum(os.path.getsize(os.path.join(out, n)) for n in files)
        sys.stderr.write("datamem: profile of %d process%s in %s (%.1f MB); %s\n"
                         % (len(files), "" if len(files) == 1 else "es", _text.printable(out),
                            size / 1e6, _text.shell_command("python", "-m", "datamem", "report",
                                                            out)))
        return rc
    try:
        prof = _profile.load(a.dir, user_sites=a.cmd == "report")
    except (OSError, _profile.ProfileError) as e:
        sys.stderr.write("datamem: %s\n" % e)
        return 1
    for w in prof.warnings:  # files cut short, or at the writer's size cap
        sys.stderr.write("datamem: warning: %s\n" % w)
    if a.cmd == "suggest":
        from . import _suggest
        sys.stdout.write(_suggest.suggest(prof, resident_arena=a.resident, memory=a.memory,
                                          spill_dir=a.spill_dir))
        return 0
    from . import _report
    s = _report.summarize(prof, top=a.top)
    if a.html:
        from ._files import write_atomic
        try:  # temp file + rename in a directory of this user's: never through a link
            write_atomic(a.html, _report.html(prof, s), mode=0o644)
        except OSError as e:
            sys.stderr.write("datamem: --html: %s\n" % e)
            return 1
    from . import _flame
    for opt, path, make in (("--folded", a.folded, lambda: _flame.folded(prof, a.by)),
                            ("--flamegraph", a.flamegraph, lambda: _flame.html(prof))):
        if path:
            from ._files import write_new_file
            try:
                write_new_file(path, make(), mode=0o644)
            except OSError as e:
                sys.stderr.write("datamem: %s: %s\n" % (opt, e))
                return 1
    if a.json:
        sys.stdout.write(_report.to_json(s) + "\n")
    elif not (a.html or a.folded or a.flamegraph):
        sys.stdout.write(_report.text(s))
    return 0


def tune_command(a, tp):
    """`tune`: measure, pick, write (_tune.py)."""
    from . import _tune
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        tp.error("no command to run: python -m datamem tune [options] -- python job.py")
    argv = ["python", "-m", "datamem", "tune"] + (["--out", a.out] if a.out else []) + [
        "--reps", str(a.reps)] + (["--candidates"] + a.candidates if a.candidates else []) + [
        "--"] + cmd
    try:
        text, _ = _tune.tune(cmd, a.out, a.reps, a.candidates or _tune.PRESETS + (
            _tune.SUGGESTED,), argv)
    except _tune.TuneError as e:
        sys.stderr.write("datamem: tune: %s\n" % e)
        return 1
    if text is not None:
        sys.stdout.write(text)
    return 0


def add_tune_command(sub):
    """tune; returns its parser (for its errors)."""
    from . import _tune
    tp = sub.add_parser(
        "tune", help="measure NumPy's default, the presets and suggest's policy on a command; "
        "write the best", description="Runs CMD (a child process per run, interleaved, --reps "
        "each) with DATAMEM_CONFIG unset, under minimal.yaml, throughput.yaml and the policy "
        "suggest makes from a profile of one first run; measures each run's small and THP "
        "faults, bytes zeroed, CPU time and peak RSS, and writes the policy that measured "
        "best with the table in its header. Pick: %s. When NumPy's default wins, the file is "
        "minimal.yaml under a header saying to leave DATAMEM_CONFIG unset." % _tune.RULE)
    tp.add_argument("--out", metavar="FILE", help="write the policy here (temp + rename; a "
                    "symbolic link is refused); default: stdout")
    tp.add_argument("--reps", type=int, default=3, help="runs per configuration (default 3)")
    tp.add_argument("--candidates", nargs="+", metavar="NAME|FILE",
                    help="what to measure against the default: minimal, throughput, suggested "
                    "or policy files (default: minimal throughput suggested)")
    tp.add_argument("command", nargs=argparse.REMAINDER, help="-- python job.py ARGS...")
    return tp


def add_profile_commands(sub):
    """profile, report and suggest; returns profile's parser (for its errors)."""
    pr = sub.add_parser("profile", help="run a command recording an allocation profile")
    pr.add_argument("--out", metavar="DIR", help="where the profile goes (default: "
                    "./datamem-profile-PID; must hold no .dmprof files)")
    pr.add_argument("--sample", type=parse_size, default=None, metavar="BYTES",
                    help="mean bytes between samples (default 512KiB)")
    pr.add_argument("--full", action="store_true", help="record every allocation (short jobs)")
    pr.add_argument("--stacks", action="store_true", default=None,
                    help="record whole Python stacks (default: with --full)")
    pr.add_argument("--policy", help="run under this policy (default: one pass-through arena)")
    pr.add_argument("--max-size", type=parse_size, default=None, metavar="BYTES",
                    help="each process's profile stops at this size (default 256MiB, "
                         "DATAMEM_PROFILE_MAX)")
    pr.add_argument("command", nargs=argparse.REMAINDER, help="-- python job.py ARGS...")
    rp = sub.add_parser("report", help="summarize an allocation profile")
    rp.add_argument("dir", help="the profile directory (profile --out)")
    rp.add_argument("--html", metavar="OUT", help="write one self-contained HTML page")
    rp.add_argument("--json", action="store_true", help="print JSON for tools")
    rp.add_argument("--flamegraph", metavar="OUT", help="write flame graphs of bytes and of "
                    "allocations by stack as one self-contained HTML page")
    rp.add_argument("--folded", metavar="OUT", help="write the stacks in folded-stack text "
                    "(flamegraph.pl, inferno, speedscope)")
    rp.add_argument("--by", choices=("bytes", "count"), default="bytes",
                    help="what --folded counts (default bytes)")
    rp.add_argument("--top", type=int, default=10, help="call sites listed (default 10)")
    sg = sub.add_parser("suggest", help="propose a policy from an allocation profile")
    sg.add_argument("dir", help="the profile directory (profile --out)")
    sg.add_argument("--resident", action="store_true",
                    help="give long-lived big arrays an arena of their own (faster random "
                         "access on hugepages, more peak RSS)")
    sg.add_argument("--memory", type=memory_size, metavar="SIZE",
                    help="the memory the job will have (16GiB): if its peak does not fit, "
                         "spill to disk what does not")
    sg.add_argument("--spill-dir", type=spill_dir, default=_suggest_spill.DEFAULT_DIR,
                    metavar="DIR", help="with --memory: where spilled arrays go (default "
                    "%(default)s; yours, on local disk)")
    return pr


def parser():
    """The CLI's parser, every subcommand and option with its help; returns
    (parser, {command: its subparser}) (a command's errors are its parser's)."""
    ap = argparse.ArgumentParser(prog="python -m datamem", description=__doc__ + _stats_cli.USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_text())
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    c = sub.add_parser("check", help="validate a policy")
    c.add_argument("policy", help="the policy file (YAML)")
    e = sub.add_parser("explain", help="which rule and arena serve an allocation, and what "
                                       "the policy's worker_limit comes to here now")
    e.add_argument("policy", help="the policy file (YAML)")
    e.add_argument("--size", type=parse_size, help="allocation size (required unless --table)")
    e.add_argument("--dtype", type=parse_dtype, default="unknown",
                   help="the array's dtype, as match.dtype names it (float64, int32, ...; "
                        "default: unknown)")
    e.add_argument("--thread", default="MainThread",
                   help="the allocating thread's name (match.thread; default MainThread)")
    e.add_argument("--tag", action="append", default=[],
                   help="a tag in force (match.tag, tag_limits); repeat for several")
    e.add_argument("--table", action="store_true", help="print the compiled table")
    e.add_argument("--module", help="the call site's module (match.module)")
    e.add_argument("--function", help="the call site's qualified function, module.qualname "
                   "(match.function)")
    r = sub.add_parser("reload", help="ask a running process to reload its policy (SIGHUP)")
    r.add_argument("pid", type=int, nargs="?", help="the process to reload")
    r.add_argument("--all", action="store_true",
                   help="every datamem process of this user that handles SIGHUP")
    r.add_argument("--match", metavar="TEXT",
                   help="with --all: only processes whose command line contains TEXT")
    add_profile_commands(sub)
    add_tune_command(sub)
    _stats_cli.add_commands(sub)
    return ap, sub.choices


def cmd_check(a, p):
    """`check POLICY`: the diagnostics, and ok with a summary."""
    ok, text, summary = check(a.policy)
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
    if ok:
        from . import _shown
        print("%s: ok: %s" % (_shown(a.policy), summary))
    return 0 if ok else 1


def cmd_explain(a, p):
    """`explain POLICY --size N ...` (or --table): check's diagnostics first."""
    if a.size is None and not a.table:  # explaining size 0 by default misled
        p.error("the following arguments are required: --size (or --table for the whole table)")
    ok, text, _ = check(a.policy)  # the same diagnostics as check, warnings included
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
    if not ok:
        return 1
    try:
        sys.stdout.write(explain(a.policy, a.size or 0, a.dtype, a.thread, a.tag, a.table,
                                 a.module, a.function))
    except _ext.PolicyError as err:
        sys.stderr.write(str(err) + "\n")
        return 1
    return 0


def cmd_reload(a, p):
    """`reload PID` or `reload --all [--match TEXT]`."""
    if a.all == (a.pid is not None):
        p.error("reload needs a PID or --all (not both)")
    return _stats_reload.reload_all(a.match) if a.all else reload_pid(a.pid)


def cmd_stats(a, p):
    """stats, ls, top, record, plot (_stats_cli.py)."""
    return _stats_cli.run(a)


# Every command, one way: run(args, its parser) -> exit status.
RUN = (("check", cmd_check), ("explain", cmd_explain), ("reload", cmd_reload),
       ("profile", profile_commands), ("report", profile_commands),
       ("suggest", profile_commands), ("tune", tune_command)) + tuple(
           (name, cmd_stats) for name in _stats_cli.COMMANDS)


def main(argv=None):
    ap, parsers = parser()
    a = ap.parse_args(argv)
    if a.cmd is None:  # no command: the whole help, not only "cmd is required"
        sys.stderr.write(ap.format_help())
        return 2
    return dict(RUN)[a.cmd](a, parsers[a.cmd])


if __name__ == "__main__":
    sys.exit(main())
