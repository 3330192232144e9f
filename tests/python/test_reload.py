"""Hot reload: the file watcher (every common way a file changes), the API, SIGHUP,
and a stress run. New arrays follow new rules; live arrays are never moved."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import datamem
from conftest import CONFIGS, ROOT, wait_for

POLICY = """version: 1
default: {default}
arenas:
  a: {{alignment: 64}}
  b: {{alignment: 64}}
  c: {{alignment: 64}}
reload: {{watch: true, debounce: 20ms{extra}}}
"""


def policy_text(default, extra=""):
    return POLICY.format(default=default, extra=extra)


def wait_for_arena(name, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if datamem.arena_of(np.ones(1000)) == name:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def watched(tmp_path):
    d = tmp_path / "conf"
    d.mkdir()
    p = d / "policy.yaml"
    p.write_text(policy_text("a"))
    datamem.install(str(p))
    assert datamem.arena_of(np.ones(1000)) == "a"
    yield p
    datamem.install(os.path.join(CONFIGS, "demo.yaml"))  # also stops watching
    datamem.uninstall()


def test_in_place_write(watched):
    with open(watched, "w") as f:
        f.write(policy_text("b"))
    assert wait_for_arena("b")


def test_rename_and_replace(watched):
    tmp = watched.parent / ".policy.yaml.swp"
    tmp.write_text(policy_text("c"))
    os.replace(tmp, watched)
    assert wait_for_arena("c")
    watched.write_text(policy_text("b"))  # the watch survived the inode swap
    assert wait_for_arena("b")


def test_mv_over_from_elsewhere(watched, tmp_path):
    other = tmp_path / "new.yaml"
    other.write_text(policy_text("c"))
    shutil.move(str(other), str(watched))
    assert wait_for_arena("c")


def test_kubernetes_configmap_symlink_swap(tmp_path):
    d = tmp_path / "cm"
    d.mkdir()
    v1 = d / "..2026_11_22_v1"
    v1.mkdir()
    (v1 / "policy.yaml").write_text(policy_text("a"))
    os.symlink(v1.name, d / "..data")
    os.symlink("..data/policy.yaml", d / "policy.yaml")
    datamem.install(str(d / "policy.yaml"))
    try:
        assert datamem.arena_of(np.ones(1000)) == "a"
        v2 = d / "..2026_11_22_v2"
        v2.mkdir()
        (v2 / "policy.yaml").write_text(policy_text("c"))
        os.symlink(v2.name, d / "..data_tmp")
        os.rename(d / "..data_tmp", d / "..data")  # atomic swap, as the kubelet does
        shutil.rmtree(v1)
        assert wait_for_arena("c")
    finally:
        datamem.install(os.path.join(CONFIGS, "demo.yaml"))
        datamem.uninstall()


def test_noop_write_does_not_reload(watched):
    before = datamem.stats()
    watched.write_text(watched.read_text())  # same bytes
    os.utime(watched)
    wait_for(lambda: datamem.stats()["watch_unchanged"], 10, "the watcher looking at the file",
             until=lambda n: n > before["watch_unchanged"])
    assert datamem.stats()["reloads"] == before["reloads"]


def test_broken_file_keeps_last_good(watched, capfd):
    before = datamem.stats()["reload_failures"]
    watched.write_text(policy_text("b").replace("alignment: 64}", "alignment: 48}", 1))
    wait_for(lambda: datamem.stats()["reload_failures"], 10, "the watcher failing to load",
             until=lambda n: n > before)
    assert datamem.arena_of(np.ones(1000)) == "a"
    err = capfd.readouterr().err
    assert "keeping the last good policy" in err
    assert "policy.yaml:4:" in err  # file:line:column of the bad alignment
    watched.write_text(policy_text("b"))  # and fixing it works
    assert wait_for_arena("b")


def test_deleted_then_recreated(watched, capfd):
    live = np.ones(1000)
    watched.unlink()
    seen = []  # wait until the watcher has looked at the missing file
    wait_for(lambda: seen.append(capfd.readouterr().err) or "".join(seen), 10,
             "the watcher reporting the missing policy", until=lambda e: "cannot be read" in e)
    assert datamem.arena_of(np.ones(1000)) == "a"  # nothing to load: keep going
    watched.write_text(policy_text("c"))
    assert wait_for_arena("c")
    assert datamem.arena_of(live) == "a"  # never moved
    del live


def test_api_reload_raises_with_diagnostics(watched):
    watched.write_text("version: 1\ndefault: a\narenas:\n  a: {alignmnt: 64}\n")
    with pytest.raises(datamem.PolicyError) as e:
        datamem.reload()
    assert ":4:" in str(e.value) and "alignment" in str(e.value)
    assert datamem.arena_of(np.ones(1000)) == "a"


SIGHUP_CHILD = r"""
import sys, time, numpy as np, datamem
print("ready", flush=True)
for _ in range(500):
    if datamem.arena_of(np.ones(1000)) == "c":
        print("reloaded", flush=True)
        sys.exit(0)
    time.sleep(0.01)
print("timeout", flush=True)
"""


def test_sighup_opt_in_and_cli(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(policy_text("a").replace("watch: true", "watch: false")
                 .replace("debounce: 20ms", "debounce: 20ms, signal: true"))
    env = dict(os.environ, DATAMEM_CONFIG=str(p))
    child = subprocess.Popen([sys.executable, "-c", SIGHUP_CHILD], env=env,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "ready"
        p.write_text(policy_text("c").replace("watch: true", "watch: false")
                     .replace("debounce: 20ms", "debounce: 20ms, signal: true"))
        r = subprocess.run([sys.executable, "-m", "datamem", "reload", str(child.pid)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert child.stdout.readline().strip() == "reloaded"
    finally:
        child.kill()
        child.wait()


def test_cli_reload_refuses_without_opt_in():
    # A datamem process (reload refuses any other: test_stats_cli.py) that has not
    # opted in to SIGHUP.
    sleeper = subprocess.Popen([sys.executable, "-c", "import datamem, time; print('ready', "
                                "flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        r = subprocess.run([sys.executable, "-m", "datamem", "reload", str(sleeper.pid)],
                           capture_output=True, text=True)
        assert r.returncode == 1
        assert "does not handle SIGHUP" in r.stderr
        assert sleeper.poll() is None  # not killed
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()


def test_stress_reload_while_allocating(watched):
    """Threads allocate across all arenas while the file is rewritten hundreds of
    times (valid and broken) and reload() is called from another thread."""
    stop = threading.Event()
    errors = []
    base = datamem.stats()["arenas"]
    threads_before = datamem.stats()["threads"]

    def allocate():
        try:
            keep = []
            while not stop.is_set():
                keep.append(np.ones(1 + len(keep) * 97 % 20000))
                if len(keep) > 50:
                    keep.clear()
        except Exception as e:
            errors.append(e)

    def api_reload():
        while not stop.is_set():
            try:
                datamem.reload()
            except datamem.PolicyError:
                pass
            time.sleep(0.003)

    threads = [threading.Thread(target=allocate) for _ in range(3)]
    threads.append(threading.Thread(target=api_reload))
    for t in threads:
        t.start()
    good = [policy_text(x) for x in "abc"]
    bad = policy_text("zz")  # default names a missing arena
    for i in range(300):
        text = good[i % 3] if i % 2 == 0 else bad
        tmp = watched.parent / "tmp.yaml"
        tmp.write_text(text)
        os.replace(tmp, watched)
        time.sleep(0.002)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    # Thread.join returns before the OS thread's exit handlers, which hand its
    # caches and its table back: wait until every worker is counted out.
    wait_for(lambda: datamem.stats()["threads"], 30, "the workers counted out (%d before them)"
             % threads_before, until=lambda n: n <= threads_before)
    import gc
    gc.collect()
    s = datamem.stats()
    for name in "abc":
        a, b = s["arenas"][name], base.get(name, {"allocations": 0, "frees": 0})
        assert a["allocations"] > b["allocations"], name  # every arena was used
        live_now = a["allocations"] - a["frees"]
        live_before = b["allocations"] - b["frees"]
        assert live_now - live_before <= 2, (name, a)  # at most the probes' arrays
    assert s["reload_failures"] > 0 and s["reloads"] > 0
    # the allocating threads are gone: at most the table in force and one the
    # main thread still holds (it lets go on its next allocation)
    assert s["tables_live"] <= 2, s["tables_live"]
    np.ones(10)
    assert datamem.stats()["tables_live"] == 1


def test_unreadable_policy_keeps_last_good(watched, capfd):
    # Root ignores file modes, so make the path unreadable by replacing the file
    # with a directory: open() then fails for every user.
    watched.unlink()
    watched.mkdir()
    deadline = time.monotonic() + 5
    while "cannot be read" not in capfd.readouterr().err:
        assert time.monotonic() < deadline, "the watcher did not report the unreadable file"
        time.sleep(0.02)
    assert datamem.arena_of(np.ones(1000)) == "a"
    watched.rmdir()
    watched.write_text(policy_text("b"))
    assert wait_for_arena("b")


# Bug pinned (issue 24): a policy's warnings were printed again on every reload
# (2000 reloads: 6003 lines of stderr). A set is printed once per process, by
# datamem.reload() and the file watcher alike (they share the record); a
# changed set is printed again.
WARNS_ONCE = r"""
import sys, time
import datamem

def wait_watch(before, what):
    deadline = time.monotonic() + 10
    while datamem.stats()["watch_reloads"] == before:
        if time.monotonic() > deadline:
            sys.exit("the watcher did not reload after %s" % what)
        time.sleep(0.01)

p = sys.argv[1]
datamem.install(p)
for _ in range(2000):
    datamem.reload()
for i in range(5):  # the watcher reloads a changed file with the same warnings
    before = datamem.stats()["watch_reloads"]
    with open(p, "a") as f:
        f.write("# edit %d\n" % i)
    wait_watch(before, "edit %d" % i)
before = datamem.stats()["watch_reloads"]
with open(p) as f:
    text = f.read()
with open(p, "w") as f:  # another warning: printed, once
    f.write(text.replace("dirty: 10", "dirty: 20"))
wait_watch(before, "the new warning")
for _ in range(100):
    datamem.reload()
print("reloads", datamem.stats()["reloads"])
"""


def test_warnings_print_once_per_distinct_set(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("version: 1\ndefault: a\narenas:\n  a: {decay: {dirty: 10}}\n"
                 "reload: {watch: true, debounce: 20ms}\n")
    r = subprocess.run([sys.executable, "-c", WARNS_ONCE, str(p)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 2000 + 5 + 1 + 100
    assert r.stderr.count("dirty: 10 is read as 10 ms") == 1, r.stderr[-3000:]
    assert r.stderr.count("dirty: 20 is read as 20 ms") == 1, r.stderr[-3000:]
    assert r.stderr.count("warning:") == 2, r.stderr[-3000:]
