"""Allocation profiles: recording (the reading is read.py's).

Recording: DATAMEM_PROFILE=DIR (set by `python -m datamem profile`, or by hand)
makes the start-up hook record every process's NumPy allocations into
DIR/<pid>.dmprof through datamem's recording handler (pyext/record.c) and
writer (service/profile.c). Settings, read once at start-up:

  DATAMEM_PROFILE          the directory (created if missing)
  DATAMEM_PROFILE_SAMPLE   mean bytes between samples (default 512KiB), or "full"
  DATAMEM_PROFILE_STACKS   1: record whole Python stacks (default: in full mode)

Without DATAMEM_CONFIG the job runs under a built-in pass-through policy (one
arena, `default`, for everything), written to DIR/passthrough.yaml.

"""
import json
import os
import sys

from .. import _text
DEFAULT_SAMPLE = 512 * 1024


PASSTHROUGH_POLICY = """\
# Written by datamem's profiler: DATAMEM_CONFIG was not set, so the profiled job
# ran with one arena for every array (datamem's defaults, NumPy's 16-byte
# alignment). `python -m datamem suggest DIR` proposes a real policy.
version: 1
default: default
arenas:
  default: {alignment: 16}
"""



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
    from .. import _ext
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
    from .. import _ext
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
    or must be owned by this user and not writable by others (whoever
    owns the directory would otherwise choose the job's policy). The file there
    always holds our own text: an existing one is replaced through a temporary
    file and os.replace (never written through a planted link), unless it is
    already exactly our bytes, ours, and not writable by others."""
    from .._files import owned_dir, write_if_changed
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
    from .._files import owned_dir
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
