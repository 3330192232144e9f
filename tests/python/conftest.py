import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

# scripts/asan-python.sh preloads the sanitizer runtimes into every interpreter
# the tests start. ASan turns mlock into a no-op and reserves terabytes of shadow
# memory (no address-space limit can hold it), and its quarantine changes RSS.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
# scripts/tsan-ft.sh runs the tests on a CPython built --with-thread-sanitizer:
# TSan keeps shadow memory and a record per synchronised address, so RSS there
# grows with what was touched, freed or not.
UNDER_TSAN = "--with-thread-sanitizer" in (sysconfig.get_config_var("CONFIG_ARGS") or "")
skip_under_asan = pytest.mark.skipif(
    UNDER_ASAN, reason="SKIP under ASan: mlock is a no-op, RLIMIT_AS cannot hold its "
                       "shadow memory, RSS includes its quarantine")


def wait_for(probe, timeout, what, until=bool, interval=0.01):
    """Polls probe() until until(value) holds and returns that value; after
    `timeout` seconds fails naming `what` and the value last seen (a test that
    waits waits for the exact condition it means, bounded: CPython's
    support.sleeping_retry)."""
    end = time.monotonic() + timeout
    while True:
        seen = probe()
        if until(seen):
            return seen
        if time.monotonic() > end:
            raise AssertionError("%s: not within %g s (last seen: %r)" % (what, timeout, seen))
        time.sleep(interval)


def run_py(code, config=None, env=None, timeout=120):
    """Runs `code` in a fresh interpreter (what DATAMEM_CONFIG affects happens at
    start-up, so it is tested in a subprocess with its own environment)."""
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    if config is not None:
        e["DATAMEM_CONFIG"] = config
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def untrusted_dir(d, how):
    """Makes directory `d` one an attacker could write into: "another user's"
    (owned by nobody; root only, else the test skips), "writable by others",
    or, for any other `how`, a symbolic link to it. Returns the path to name it
    by (the link, or d)."""
    d.mkdir(mode=0o755)
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("SKIP: making a directory of another user needs root")
        os.chown(d, 65534, 65534)
    elif how == "writable by others":
        os.chmod(d, 0o777)
    else:
        link = d.parent / (d.name + "-link")
        link.symlink_to(d)
        return link
    return d


# A root-only file shaped like /etc/shadow (never the real one): what a policy
# path pointed elsewhere must not copy to stderr.
SHADOW = "".join("user%d:$6$rounds=5000$%08xsecret$%032x:19700:0:99999:7:::\n" % (i, i * 7, i)
                 for i in range(40))


def shadow_like(tmp_path):
    """tmp_path/secret/shadow (directory 0700, file 0600) holding SHADOW."""
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    shadow = secret / "shadow"
    shadow.write_text(SHADOW)
    os.chmod(shadow, 0o600)
    return shadow


def last_json(r):
    """The JSON object a job printed last; the job must have exited 0."""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def need(module, extra):
    """Skips unless `module` is installed (an engine from datamem's extras)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip("%s is not installed (pip install 'datamem[%s]'; scripts/test.sh installs "
                    "it in the 'Dask, Ray and joblib workers' stage)" % (module, extra))


def run_script(tmp_path, name, text, args, timeout):
    """Writes `text` to tmp_path/name and runs it as __main__ with sys.argv = [name] + args."""
    script = tmp_path / name
    script.write_text(text)
    return run_py("import runpy, sys; sys.argv = %r; runpy.run_path(%r, run_name='__main__')"
                  % ([name] + [str(a) for a in args], str(script)), timeout=timeout)


# ---- real memory cgroups (v1 memory.limit_in_bytes, v2 memory.max) ----------------------

def _mounts():
    """(type, root, mount point, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, sup = pre.split(), post.split()
            if sup and sup[0] in ("cgroup", "cgroup2"):
                out.append((sup[0], fields[3], fields[4], sup[2].split(",")))
    return out


def _memory_base(version):
    """Where a test can make memory groups in cgroup `version`, or why not:
    v1: this process's memory group; v2: the root of a cgroup2 mount whose
    controllers include memory (a v2 group with processes cannot hand
    controllers to children)."""
    for typ, root, mount, sup in _mounts():
        if version == 1 and typ == "cgroup" and "memory" in sup:
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, ctl, path = line.rstrip("\n").split(":", 2)
                    r = root.rstrip("/")
                    if "memory" in ctl.split(",") and (path + "/").startswith(r + "/"):
                        return mount + path[len(r):], None
        if version == 2 and typ == "cgroup2":
            try:
                ctl = open(os.path.join(mount, "cgroup.controllers")).read().split()
            except OSError:
                continue
            if "memory" in ctl and root == "/":
                return mount, None
    return None, ("no cgroup v1 memory controller is mounted here" if version == 1 else
                  "no cgroup v2 hierarchy here holds the memory controller (this host binds "
                  "it to v1); runtime/os_test.c covers the v2 reader with fake trees")


@pytest.fixture(params=[1, 2], ids=["cgroup-v1", "cgroup-v2"])
def memory_groups(request):
    """(version, make): make(limits) creates one nested memory group per limit
    (outermost first) in cgroup v1 or v2 and returns the innermost; all are
    removed afterwards, innermost first, even when the test fails."""
    version = request.param
    base, why = _memory_base(version)
    if base is None:
        pytest.skip("SKIP: " + why)
    if os.geteuid() != 0 or not os.access(base, os.W_OK):
        pytest.skip("SKIP: making a cgroup under %s needs root" % base)
    limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    made = []

    def write(d, name, text):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)

    def make(limits):
        d = base
        for limit in limits:
            if version == 2:  # children of d get the memory controller
                write(d, "cgroup.subtree_control", "+memory")
            d = os.path.join(d, "datamem-test-%d-%d" % (os.getpid(), len(made)))
            os.mkdir(d)
            made.append(d)
            write(d, limit_file, str(limit))
        return d
    yield version, make
    for d in reversed(made):
        for _ in range(100):  # a task that just exited can take a moment to leave
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.05)


def run_in_group(group, code, config, timeout=120):
    """Runs `code` in a fresh interpreter that joins cgroup `group` before it
    starts (its pid written to cgroup.procs), so DATAMEM_CONFIG reads the
    group's limit at install."""
    procs = os.path.join(group, "cgroup.procs")

    def join():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    e = dict(os.environ)
    e.pop("DATAMEM_MEMORY_LIMIT", None)
    e["DATAMEM_CONFIG"] = config
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=join)


@pytest.fixture
def demo_policy():
    return os.path.join(CONFIGS, "demo.yaml")


@pytest.fixture
def write_policy(tmp_path):
    def w(text, name="policy.yaml"):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return w


def spill_policy(write_policy, spill_dir, tail="", spill_from=None, dirty="0"):
    """A policy with a spill arena `disk` in `spill_dir` (its `decay.dirty`:
    `dirty`) beside `general`, the default; arrays of `spill_from` bytes or
    more (a size such as "8MiB") go to `disk`, then `tail`, YAML."""
    text = ("version: 1\ndefault: general\narenas:\n  general: {}\n"
            "  disk: {decay: {dirty: %s}, backing: {dir: '%s'}}\n" % (dirty, spill_dir))
    if spill_from:
        text += ("rules:\n  - {name: big, match: {size: {min: %s}}, arena: disk}\n"
                 % spill_from)
    return write_policy(text + tail)


# ---- a FIFO as the policy ----------------------------------------------------------------

@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "policy.yaml"
    os.mkfifo(p)
    return str(p)


# ---- a stand-in CUDA runtime (pinned: cuda) ----------------------------------------------

FAKE_CUDART = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
/* A stand-in for libcudart: records registrations in $FAKE_CUDART_LOG; fails
 * them with error 2 when $FAKE_CUDART_FAIL is set. */
static void note(const char *what, void *p, size_t n) {
    const char *path = getenv("FAKE_CUDART_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) { fprintf(f, "%s %lu %lu\n", what, (unsigned long)p, (unsigned long)n); fclose(f); }
}
int cudaHostRegister(void *p, size_t n, unsigned int flags) {
    if (getenv("FAKE_CUDART_FAIL")) return 2;
    note(flags == 1 ? "register-portable" : "register", p, n);
    return 0;
}
int cudaHostUnregister(void *p) { note("unregister", p, 0); return 0; }
const char *cudaGetErrorString(int e) { return e == 2 ? "out of memory" : "unknown"; }
"""


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("SKIP: no C compiler to build the CUDA stand-in")
    d = tmp_path_factory.mktemp("cudart")
    src = d / "fake_cudart.c"
    src.write_text(FAKE_CUDART)
    lib = d / "libcudart.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


# ---- a job that serves stats (test_stats_export.py, test_http.py) ---------------------

DEMO = os.path.join(CONFIGS, "demo.yaml")

# A job that allocates through every demo arena, says where it serves, then
# waits for its stdin to close (readline releases the GIL).
SERVE = r"""
import json, os, sys, threading
import numpy as np
import datamem
keep = [np.ones(10), np.ones(10_000), np.ones(1 << 20)]
def worker():
    keep.append(np.ones(1000))
t = threading.Thread(target=worker, name="worker-1"); t.start(); t.join()
with datamem.tag("ingest"):
    keep.append(np.ones(1000))
print(json.dumps({"pid": os.getpid(), "url": datamem.stats_url()}), flush=True)
sys.stdin.readline()
"""


def job_env(tmp_path, http="127.0.0.1:0", config=DEMO, extra=None):
    e = dict(os.environ)
    e.pop("DATAMEM_STATS_HTTP", None)
    e["DATAMEM_STATS_DIR"] = str(tmp_path / "discovery")
    if config:
        e["DATAMEM_CONFIG"] = config
    else:
        e.pop("DATAMEM_CONFIG", None)
    if http is not None:
        e["DATAMEM_STATS_HTTP"] = http
    if extra:
        e.update(extra)
    return e


def job_died(p):
    """What a job that closed its stdout before its first line left: its exit
    status (a negative one is the signal that ended it) and its stderr."""
    err = p.communicate(timeout=30)[1]
    return "job died (exit status %s): %s" % (p.returncode, err)


@contextlib.contextmanager
def job(tmp_path, code=SERVE, argv=(), **kw):
    """Starts `code` (sys.argv[1:] = `argv`); yields (Popen, first stdout line as
    JSON); ends it."""
    p = subprocess.Popen([sys.executable, "-c", code] + list(argv), env=job_env(tmp_path, **kw),
                         cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(job_died(p))
        yield p, json.loads(line)
    finally:
        if p.poll() is None:
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        p.stdout.close()
        p.stderr.close()


def get(url, method="GET", timeout=5):
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request(method, u.path or "/")
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def families(text):
    """{name: family} of Prometheus exposition `text`, through the official parser."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams, name):
    """{frozenset(labels.items()): value} of one family's samples named `name`."""
    for f in fams.values():
        for s in f.samples:
            if s.name == name:
                yield s.labels, s.value


# ---- under qemu-user (the aarch64 wheels: scripts/root-test.sh arm64) -------------
# What qemu-user emulates differently from a kernel, so that these tests cannot say
# anything about datamem there (each failed under qemu 7.2 with the reason given,
# and passes natively). Everything else runs.

def _under_qemu_user():
    """qemu-user catches every signal on the host side to forward it to the guest:
    the kernel shows SIGHUP caught in a process that installed no handler for it."""
    import signal
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
        return False
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & 1)
    except OSError:
        pass
    return False


_SIGCGT = "its host process catches every signal, so /proc/PID/status says SIGHUP is handled"
_MADVISE = "madvise(MADV_HUGEPAGE / MADV_NOHUGEPAGE) is accepted and ignored (no hg/nh in smaps)"
_RLIMIT = "setrlimit(RLIMIT_AS) is not passed to the host (it would bound qemu itself); mbind is ENOSYS"
QEMU_USER_LIMITS = {
    "test_reload_all_signals_every_process_that_opted_in": _SIGCGT,
    "test_cli_reload_refuses_without_opt_in": _SIGCGT,
    "test_system_arena_advises_big_blocks_like_numpy": _MADVISE,
    "test_hugepages_off_still_forbids": _MADVISE,
    "test_jobs_start_under_an_address_space_limit": _RLIMIT,
    "test_an_address_space_limit_is_mostly_usable": _RLIMIT,
    "test_impossible_sizes_raise_memoryerror_at_once":
        "guest mmaps are qemu's: a 32 TiB np.zeros was not refused, and the job was killed (SIGKILL)",
    "test_zeros_of_a_fully_used_big_block_clears_it_in_place":
        "page faults counted include qemu's own (about 3,250 per run, whatever the block size)",
    "test_prometheus_sd_follows_processes_that_come_and_go":
        "it looks for temporary files while the 0.1 s writer still runs; emulated, a write "
        "lasts long enough to be seen",
}


def pytest_collection_modifyitems(config, items):
    if not _under_qemu_user():
        return
    for item in items:
        why = QEMU_USER_LIMITS.get(getattr(item, "originalname", None) or item.name)
        if why:
            item.add_marker(pytest.mark.skip(reason="SKIP under qemu-user: " + why))
