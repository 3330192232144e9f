import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

# scripts/asan-python.sh preloads the sanitizer runtimes into every interpreter
# the tests start. ASan turns mlock into a no-op and reserves terabytes of shadow
# memory (no address-space limit can hold it), and its quarantine changes RSS.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
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
