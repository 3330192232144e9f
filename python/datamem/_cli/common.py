"""What several commands share: argument types as argparse reports a bad value,
and a profile directory loaded for `report` and `suggest`."""
import argparse
import sys

from .. import _ext, _text
from .._profile import read, suggest_spill
from .._profile.dmprof import ProfileError


def parse_size(text):
    """A size argument (_text.parse_size), as argparse reports a bad one."""
    try:
        return _text.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def spill_dir(text):
    """`suggest --spill-dir`: a path the policy can name (suggest_spill.check_dir)."""
    try:
        return suggest_spill.check_dir(text)
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


def add_job(parser):
    """The job a command runs: everything after `--`."""
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python job.py ARGS...")


def job(a, parser):
    """The job's command line (add_job), or the parser's error when there is none."""
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        parser.error("no command to run: python -m datamem %s [options] -- python job.py" % a.cmd)
    return cmd


def load_profile(directory, user_sites):
    """The profile in `directory` with its warnings on stderr (files cut short,
    or at the writer's size cap), or None after saying why it cannot be read."""
    try:
        prof = read.load(directory, user_sites=user_sites)
    except (OSError, ProfileError) as e:
        sys.stderr.write("datamem: %s\n" % e)
        return None
    for w in prof.warnings:
        sys.stderr.write("datamem: warning: %s\n" % w)
    return prof
