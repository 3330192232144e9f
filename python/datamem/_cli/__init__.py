"""python -m datamem: command-line tools, one module per command in this package
(NAMES, add(sub), run(args, parser)); the stats family (stats, ls, top, record,
plot) is stats.py.

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
import sys

from .. import _ext
from . import check, explain, profile, reload, report, stats, suggest, tune

# Every command, one way: the names it serves, add(sub) makes its parser,
# run(args, its parser) -> exit status.
COMMANDS = (check, explain, reload, profile, report, suggest, tune, stats)


def version_text():
    """`python -m datamem --version`: datamem, the jemalloc linked in, and the NumPy
    and Python it runs under next to those it was built against."""
    import platform
    import numpy
    return ("datamem %s\njemalloc %s\nNumPy %s (built against %s)\nPython %s %s (built against %s)"
            % (_ext.VERSION, _ext.jemalloc_version(), numpy.__version__, _ext.BUILD_NUMPY_VERSION,
               platform.python_implementation(), platform.python_version(),
               _ext.BUILD_PYTHON_VERSION))


def parser():
    """The CLI's parser, every subcommand and option with its help; returns
    (parser, {command: its subparser}) (a command's errors are its parser's)."""
    ap = argparse.ArgumentParser(prog="python -m datamem", description=__doc__ + stats.USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_text())
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        command.add(sub)
    return ap, sub.choices


def main(argv=None):
    ap, parsers = parser()
    a = ap.parse_args(argv)
    if a.cmd is None:  # no command: the whole help, not only "cmd is required"
        sys.stderr.write(ap.format_help())
        return 2
    command = next(c for c in COMMANDS if a.cmd in c.NAMES)
    return command.run(a, parsers[a.cmd])
