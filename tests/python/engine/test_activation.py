"""DATAMEM_CONFIG activation through the .pth start-up hook."""
import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest

from conftest import ROOT, SHADOW, run_py, shadow_like

PROBE = r"""
import asyncio, json, threading
from concurrent.futures import ThreadPoolExecutor
import numpy as np
try:
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name
import datamem
out = {}
out["main"] = get_handler_name(np.ones(10))
out["main_arena_small"] = datamem.arena_of(np.ones(10))
out["main_arena_big"] = datamem.arena_of(np.ones(1 << 20))
def in_thread(key):
    a = np.ones(1000)
    out[key] = [get_handler_name(a), datamem.arena_of(a)]
t = threading.Thread(target=in_thread, args=("thread",), name="worker-7"); t.start(); t.join()
t = threading.Thread(target=in_thread, args=("thread_plain",), name="other"); t.start(); t.join()
with ThreadPoolExecutor(2) as ex: ex.submit(in_thread, "pool").result()
async def task():
    with datamem.tag("ingest"):
        await asyncio.sleep(0)
        a = np.ones(1000)
        out["task_tagged"] = [get_handler_name(a), datamem.arena_of(a)]
    a = np.ones(1000)
    out["task"] = [get_handler_name(a), datamem.arena_of(a)]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, in_thread, "executor")
    await asyncio.to_thread(in_thread, "to_thread")
asyncio.run(task())
print(json.dumps(out))
"""


def test_handler_covers_every_context(demo_policy):
    r = run_py(PROBE, config=demo_policy)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["main"] == "datamem"
    assert out["main_arena_small"] == "small"
    assert out["main_arena_big"] == "big"
    assert out["thread"] == ["datamem", "workers"]        # thread rule on the name
    assert out["thread_plain"] == ["datamem", "general"]
    assert out["pool"][0] == "datamem"                    # ThreadPoolExecutor
    assert out["executor"][0] == "datamem"                # run_in_executor
    assert out["to_thread"][0] == "datamem"
    assert out["task_tagged"] == ["datamem", "ingest"]    # tag across await
    assert out["task"] == ["datamem", "general"]          # tag ends with the block


def test_without_config_nothing_happens():
    r = run_py("import sys, numpy as np\n"
               "from numpy._core.multiarray import get_handler_name\n"
               "print(get_handler_name(np.ones(3)), 'datamem' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["default_allocator", "False"]


def test_hook_imports_nothing_heavy_without_config():
    r = run_py("import sys; print('numpy' in sys.modules, 'datamem' in sys.modules)")
    assert r.stdout.split() == ["False", "False"]


# Bug pinned: the hook imported NumPy and datamem at start-up, so an exported
# DATAMEM_CONFIG cost every Python process (`python -c pass` 26 -> 128 ms CPU),
# `python -m datamem ls` listed itself and a broken policy stopped pip. It now
# activates at the end of the process's `import numpy` (_datamem_boot.py). On a
# free-threaded interpreter with the GIL off activation stays eager (PyArray_Type's
# slots change at datamem's import: before any thread can make arrays).
EAGER = bool(sysconfig.get_config_var("Py_GIL_DISABLED")) and os.environ.get("PYTHON_GIL") != "1"

PROBE_FIRST_ARRAY = r"""
import sys
before = [m for m in ("numpy", "datamem", "datamem._ext") if m in sys.modules]
%s
a = np.ones(10)
try:
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name
import datamem
print(before, get_handler_name(a), datamem.arena_of(a))
"""


@pytest.mark.parametrize("var", ["DATAMEM_CONFIG", "DATAMEM_CONFIG_TEXT", "DATAMEM_PROFILE"])
def test_exported_config_imports_nothing_until_numpy(demo_policy, tmp_path, var):
    value = {"DATAMEM_CONFIG": demo_policy, "DATAMEM_CONFIG_TEXT": open(demo_policy).read(),
             "DATAMEM_PROFILE": str(tmp_path / "prof")}[var]
    r = run_py("import sys; print([m for m in ('numpy', 'datamem', 'datamem._ext') "
               "if m in sys.modules])", env={var: value, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("['numpy', 'datamem', 'datamem._ext']" if EAGER else "[]")
    if not EAGER:  # no policy file written (TEXT), no profile directory made
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.parametrize("how", ["import numpy as np", "from numpy import ones\nimport numpy as np",
                                 "import numpy.linalg\nimport numpy as np",
                                 "import datamem\nimport numpy as np"])
def test_first_array_after_import_numpy_is_datamems(demo_policy, how):
    r = run_py(PROBE_FIRST_ARRAY % how, config=demo_policy)
    assert r.returncode == 0, r.stderr
    before = "['numpy', 'datamem', 'datamem._ext']" if EAGER else "[]"
    assert r.stdout.strip() == before + " datamem small", r.stdout


def test_numpy_imported_first_in_another_thread_activates(demo_policy):
    """The thread that imports NumPy, the threads started after it, and the main
    thread (which takes the handler between two of its bytecodes) all allocate
    through datamem. A thread already running then cannot be given the handler
    (only a thread can set its own): stats() names it."""
    code = r"""
import json, sys, threading
out = {"before": [m for m in ("numpy", "datamem") if m in sys.modules]}
go = threading.Event()
early = threading.Thread(target=go.wait, name="early"); early.start()
def work():
    import numpy as np
    from numpy._core.multiarray import get_handler_name
    out["importer"] = get_handler_name(np.ones(10))
    def later():
        out["later"] = get_handler_name(np.ones(10))
    t = threading.Thread(target=later); t.start(); t.join()
t = threading.Thread(target=work, name="importer"); t.start(); t.join()
import numpy as np, datamem
from numpy._core.multiarray import get_handler_name
out["main"] = get_handler_name(np.ones(10))
out["not_covered"] = datamem.stats()["threads_not_covered"]
go.set(); early.join()
print(json.dumps(out))
"""
    r = run_py(code, config=demo_policy)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"before": ["numpy", "datamem"] if EAGER else [], "importer": "datamem",
                   "later": "datamem", "main": "datamem",
                   "not_covered": [] if EAGER else ["early"]}, out


def test_broken_policy_stops_only_processes_that_import_numpy(write_policy):
    bad = write_policy("version: 1\ndefault: general\narenas:\n  general:\n    alignmnt: 64\n")
    r = run_py("print('JOB RAN')", config=bad)
    if EAGER:
        assert r.returncode == 2 and bad + ":5:5: error" in r.stderr, r.stderr
        return
    assert (r.returncode, r.stdout, r.stderr) == (0, "JOB RAN\n", "")
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, DATAMEM_CONFIG=bad))
    assert r.returncode == 0 and r.stdout.startswith("pip "), (r.returncode, r.stderr)
    # what the job printed before stays, though stdout is a block-buffered pipe
    # (os._exit does not flush; PYTHONUNBUFFERED, where this machine sets it, hid that)
    e = dict(os.environ, DATAMEM_CONFIG=bad)
    e.pop("PYTHONUNBUFFERED", None)
    r = subprocess.run([sys.executable, "-c", "print('before'); import numpy; print('JOB RAN')"],
                       env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "before\n", (r.returncode, r.stdout)
    assert bad + ":5:5: error: arenas.general: unknown key 'alignmnt'" in r.stderr, r.stderr


def test_command_line_tools_do_not_activate(write_policy, demo_policy, tmp_path):
    """`python -m datamem ...` is a tool, not a job: `ls` with a policy that serves
    stats exported lists no process of its own, and `check` of a good policy works
    with a broken one exported."""
    d = tmp_path / "stats"
    d.mkdir(mode=0o700)
    env = dict(os.environ, DATAMEM_CONFIG=demo_policy, DATAMEM_STATS_HTTP="127.0.0.1:0",
               DATAMEM_STATS_DIR=str(d))
    r = subprocess.run([sys.executable, "-m", "datamem", "ls"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.lower().startswith("no datamem process is serving stats"), r.stdout
    assert os.listdir(d) == []
    env["DATAMEM_CONFIG"] = write_policy("version: 1\nnot a policy\n")
    for argv in (["-m", "datamem", "check", demo_policy], ["-Im", "datamem", "check", demo_policy]):
        r = subprocess.run([sys.executable] + argv, env=env, capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == 0 and ": ok: " in r.stdout, (argv, r.stdout, r.stderr)


def test_bad_policy_stops_before_job_code(write_policy):
    bad = write_policy("version: 1\ndefault: general\narenas:\n  general:\n    alignmnt: 64\n")
    r = run_py("import numpy; print('JOB RAN')", config=bad)
    assert r.returncode == 2
    assert "JOB RAN" not in r.stdout
    assert bad + ":5:5: error" in r.stderr, r.stderr
    assert "alignment" in r.stderr  # the suggestion


def test_missing_policy_stops(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    r = run_py("import numpy; print('JOB RAN')", config=missing)
    assert r.returncode == 2
    assert "JOB RAN" not in r.stdout
    assert "nope.yaml" in r.stderr


def test_fifo_policy_stops_start_up_instead_of_hanging(fifo):
    # Before: open() blocked forever waiting for a writer (timeout here).
    r = run_py("import numpy; print('job ran')", config=fifo, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "job ran" not in r.stdout
    assert "%s: error: not a regular file (a FIFO)" % fifo in r.stderr


def test_readme_error_example_is_the_real_output(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"A bad policy stops the job.*?```\n(.*?)```", readme, re.S).group(1)
    lines = block.splitlines()
    assert lines[0].startswith("$ DATAMEM_CONFIG=policy.yaml ")
    shown = "\n".join(lines[1:]) + "\n"
    (tmp_path / "policy.yaml").write_text(
        "version: 1\ndefault: general\narenas:\n  general:\n    alignmnt: 64\n")
    e = dict(os.environ, DATAMEM_CONFIG="policy.yaml")
    r = subprocess.run([sys.executable, "-c", "import numpy; print('job ran')"], env=e, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    real = r.stderr.replace(str(tmp_path), "/srv/job")
    assert real.rstrip("\n") + "\n" == shown


def test_pth_hook_is_installed():
    import site
    import datamem
    site_dir = os.path.dirname(os.path.dirname(datamem.__file__))
    assert os.path.exists(os.path.join(site_dir, "datamem.pth"))


def test_uncovered_threads_are_visible_in_stats(demo_policy, tmp_path):
    code = (
        "import threading, time, datamem, numpy as np\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait, name='early'); t.start()\n"   # before install
        "datamem.install(%r)\n"
        "u = threading.Thread(target=ev.wait, name='late'); u.start()\n"
        "time.sleep(0.1)\n"
        "print(datamem.stats()['threads_not_covered'])\n"
        "ev.set(); t.join(); u.join()\n") % demo_policy
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['early']"


def test_threads_that_run_in_their_own_context(demo_policy):
    """CPython 3.14 runs Thread.run inside thread._context (a fresh or copied
    Context); datamem must set its handler inside that context. Simulated on
    older CPythons with a Thread that does what 3.14's _bootstrap_inner does (on
    3.14 threading enters the context itself: entering it twice is an error)."""
    code = r"""
import contextvars, sys, threading, numpy as np, datamem
try:
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name
out = []
class T(threading.Thread):
    def __init__(self):
        super().__init__(name="ctx-thread")
        self._context = contextvars.Context()   # empty: NumPy's default handler
    def run(self):
        if sys.version_info >= (3, 14):
            out.append(get_handler_name(np.ones(10)))
        else:
            self._context.run(lambda: out.append(get_handler_name(np.ones(10))))
t = T(); t.start(); t.join()
print(out[0])
"""
    r = run_py(code, config=demo_policy)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "datamem"


# ---- paths are bytes --------------------------------------------------------------
# Bug pinned: a policy path that is not UTF-8 made start-up exit 2 with a codec
# error and `python -m datamem check PATH` end in a traceback.

NOT_UTF8 = b"pol\xff\xfe.yaml"


def _bytes_path(tmp_path, text=None):
    p = os.path.join(os.fsencode(str(tmp_path)), NOT_UTF8)
    if text is not None:
        with open(p, "wb") as f:
            f.write(text.encode())
    return os.fsdecode(p)  # as os.environ and sys.argv hold it


def test_policy_path_that_is_not_utf8_activates(tmp_path):
    path = _bytes_path(tmp_path, "version: 1\ndefault: a\narenas:\n  a: {}\n")
    r = run_py("import os, datamem, numpy as np\n"
               "print(datamem.arena_of(np.ones(10)), os.fsencode(datamem.current_policy()))",
               config=path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["a", repr(os.fsencode(path))], r.stdout


def test_policy_path_that_is_not_utf8_works_as_str_and_bytes(tmp_path):
    path = _bytes_path(tmp_path, "version: 1\ndefault: a\narenas:\n  a: {decay: {dirty: 10}}\n")
    r = run_py("import os, datamem\n"
               "p = %r\n"
               "print(datamem.check(os.fsencode(p))[0], datamem.check(p)[0])\n"
               "datamem.install(os.fsencode(p)); datamem.reload(p)\n"
               "print(os.fsencode(datamem.current_policy()) == os.fsencode(p))" % path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True"], r.stdout
    # the warning names the file with the bytes that are not UTF-8 escaped
    assert "pol\\xff\\xfe.yaml:4:22: warning:" in r.stderr, r.stderr


def test_check_of_a_path_that_is_not_utf8(tmp_path):
    path = _bytes_path(tmp_path, "version: 1\ndefault: a\narenas:\n  a: {}\n")
    r = subprocess.run([sys.executable, "-m", "datamem", "check", path], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("pol\\xff\\xfe.yaml: ok: 1 arena, 0 rules, default 'a'\n"), r.stdout
    missing = path.replace("pol", "nope")
    r = subprocess.run([sys.executable, "-m", "datamem", "check", missing], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.endswith("nope\\xff\\xfe.yaml: error: cannot read the policy: No such file "
                             "or directory\n"), r.stderr
    assert "Traceback" not in r.stderr


def test_missing_policy_path_that_is_not_utf8_stops_with_its_name(tmp_path):
    path = _bytes_path(tmp_path)
    r = run_py("import numpy; print('job ran')", config=path)
    assert r.returncode == 2 and "job ran" not in r.stdout
    assert "DATAMEM_CONFIG=%s" % os.fsencode(path).decode("utf-8", "backslashreplace") in r.stderr
    assert "codec" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_activates_in_a_venv_whose_numpy_is_the_base_interpreters(tmp_path, demo_policy):
    """A virtual environment made with --system-site-packages, datamem installed
    in it and NumPy only in the base interpreter: site.py runs the venv's
    datamem.pth before the base site-packages is on sys.path, so the hook must
    wait for NumPy (_datamem_boot) instead of failing to import datamem and
    letting the job run without its policy."""
    import glob
    import importlib.util
    import platform
    base = getattr(sys, "_base_executable", sys.executable)
    if subprocess.run([base, "-c", "import numpy"], capture_output=True).returncode != 0:
        pytest.skip("SKIP: NumPy is not in the base interpreter (%s): this one is a venv "
                    "with its own NumPy (scripts/wheel-venv-test.sh, scripts/root-test.sh)" % base)
    # this interpreter's wheel (dist/ may hold others'); cp313-cp313t when free-threaded
    py = "cp%d%d" % sys.version_info[:2]
    abi = py + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else "")
    wheels = glob.glob(os.path.join(ROOT, "dist", "datamem-*-%s-%s-*linux_*%s.whl"
                                    % (py, abi, platform.machine())))
    assert wheels, "build and install first (scripts/build.sh, or scripts/wheels.sh)"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    site_dir = subprocess.run([str(venv / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", site_dir, wheels[0]], check=True)
    assert not os.path.exists(os.path.join(site_dir, "numpy"))      # NumPy: the base's
    assert os.path.exists(os.path.join(site_dir, "datamem.pth"))
    assert importlib.util.find_spec("numpy") is not None
    code = ("import numpy as np, datamem\n"
            "print(np.core.multiarray.get_handler_name() if np.__version__ < '2' else "
            "np._core.multiarray.get_handler_name(), datamem.__file__.startswith(%r))" % site_dir)
    env = dict(os.environ, DATAMEM_CONFIG=demo_policy)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["datamem", "True"], (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    # No NumPy at all (a venv without the base's site-packages): a job that never
    # imports NumPy has no array to govern and runs; its `import numpy` fails as
    # it would without datamem.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    bare_site = subprocess.run([str(bare / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", bare_site, wheels[0]], check=True)
    r = subprocess.run([str(bare / "bin" / "python"), "-c", "print('JOB RAN')"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout == "JOB RAN\n" and r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([str(bare / "bin" / "python"), "-c", "import numpy"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "No module named 'numpy'" in r.stderr, r.stderr
    assert "datamem" not in r.stderr, r.stderr


# ---- who may write the policy ------------------------------------------------------------

def _root_only():
    if os.geteuid() != 0:
        pytest.skip("SKIP: files of another user need root (chown to nobody)")


def _planted_link(tmp_path, target):
    """A link to `target` planted by another user (nobody), in nobody's directory."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    link = theirs / "policy.yaml"
    os.symlink(target, link)
    os.lchown(link, 65534, 65534)
    return link


def _textfile_policy(prom):
    return ("version: 1\ndefault: a\narenas:\n  a: {}\n"
            "stats:\n  textfile: %s\n  interval: 20ms\n" % prom)


# Attack pinned: a root job whose DATAMEM_CONFIG named a file owned by nobody in a
# world-writable directory loaded it silently, and its stats.textfile replaced a
# root-only file. The policy, and every directory on its way, must be the user's
# or root's and writable by no one else; anything else stops start-up with one
# line that says why and how to fix it, before a byte of the file is read.
@pytest.mark.parametrize("how", ["a file of another user", "a directory writable by others",
                                 "a directory of another user", "a link planted by another user"])
def test_a_policy_another_user_could_write_stops_start_up(tmp_path, how):
    _root_only()
    guarded = tmp_path / "root-only"
    guarded.mkdir(mode=0o700)
    victim = guarded / "job.prom"
    victim.write_text("precious\n")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    pol = shared / "policy.yaml"
    pol.write_text(_textfile_policy(victim))
    name = pol
    if how == "a file of another user":
        os.chown(pol, 65534, 65534)
    elif how == "a directory writable by others":
        os.chmod(shared, 0o777)
    elif how == "a directory of another user":
        os.chown(shared, 65534, 65534)
    else:  # the link sits in nobody's directory; what it names is root's and fine
        name = _planted_link(tmp_path, pol)
    r = run_py("import numpy; print('job ran')", config=str(name), timeout=60)
    assert r.returncode == 2 and "job ran" not in r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("%s: error: refused: " % name), r.stderr
    assert "must be owned by this user or root and writable by no one else" in errors[0]
    assert errors[0].endswith("chown or chmod go-w, or move the policy"), errors[0]
    assert "textfile" not in r.stderr  # not one line of the file quoted
    assert victim.read_text() == "precious\n"
    # The same policy in a directory of root's loads (the rule, not the policy, refused it).
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o755)
    (ok / "policy.yaml").write_text(_textfile_policy(tmp_path / "ok" / "job.prom"))
    r = run_py("import numpy; print('job ran')", config=str(ok / "policy.yaml"), timeout=60)
    assert r.returncode == 0 and "job ran" in r.stdout, r.stderr


# A Kubernetes ConfigMap volume: policy.yaml -> ..data/policy.yaml, ..data ->
# ..<timestamp>/, every name root's (with fsGroup, the directories setgid).
def test_a_configmap_mount_activates(tmp_path):
    mount = tmp_path / "config"
    mount.mkdir(mode=0o755)
    stamp = mount / "..2026_11_27_10_00_00.123456789"
    stamp.mkdir(mode=0o755)
    os.chmod(stamp, 0o2755)
    (stamp / "policy.yaml").write_text("version: 1\ndefault: cm\narenas:\n  cm: {}\n")
    os.chmod(stamp / "policy.yaml", 0o644)
    os.symlink(stamp.name, mount / "..data")
    os.symlink("..data/policy.yaml", mount / "policy.yaml")
    r = run_py("import numpy as np, datamem; print(datamem.arena_of(np.ones(1000)))",
               config=str(mount / "policy.yaml"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cm", r.stdout


# Attack pinned: the policy path made a symbolic link to a root-only file (a
# fixture shaped like /etc/shadow): the root job's stderr quoted its lines five
# times. The link lives in a directory of another user, so the rule refuses it
# before the file is read: no line of it reaches stderr.
def test_a_link_to_a_root_only_file_quotes_none_of_it(tmp_path):
    _root_only()
    link = _planted_link(tmp_path, shadow_like(tmp_path))
    r = run_py("import numpy; print('job ran')", config=str(link), timeout=60)
    assert r.returncode == 2, r.stderr
    assert "refused: %s: directory owned by uid 65534" % link.parent in r.stderr, r.stderr
    assert "secret" not in r.stderr and "$6$" not in r.stderr, r.stderr


# A policy with many errors quotes one source line, the first error's; the rest
# name their line and column. Pointed (by its owner) at a file that is not a
# policy, the report shows at most that file's first line.
def test_a_bad_policy_quotes_at_most_one_source_line(tmp_path):
    pol = tmp_path / "policy.yaml"
    pol.write_text("version: 1\ndefault: a\narenas:\n  a:\n" +
                   "".join("    bad%d: 1\n" % i for i in range(10)))
    r = run_py("import numpy; print('job ran')", config=str(pol), timeout=60)
    assert r.returncode == 2
    assert r.stderr.count(": error: ") == 10, r.stderr
    quoted = [line for line in r.stderr.splitlines() if line.startswith("    bad")]
    assert quoted == ["    bad0: 1"], r.stderr
    assert "policy.yaml:14:5: error: arenas.a: unknown key 'bad9'" in r.stderr
    r = run_py("import numpy; print('job ran')", config=str(shadow_like(tmp_path)), timeout=60)
    assert r.returncode == 2
    assert sum(line in r.stderr for line in SHADOW.splitlines()) <= 1, r.stderr


# ---- the policy's text in the environment (how Ray workers get it) ----------------------

def test_config_text_activates_from_a_file_of_the_users_own(tmp_path):
    """DATAMEM_CONFIG_TEXT: the policy itself, written under the directory rule into
    this user's directory and installed as DATAMEM_CONFIG would be; it wins over an
    inherited DATAMEM_CONFIG (a Ray worker's raylet may carry one)."""
    text = "version: 1\ndefault: shipped\narenas: {shipped: {}}\n"
    code = ("import json, os, numpy as np, datamem\n"
            "p = datamem.current_policy()\n"
            "print(json.dumps({'arena': datamem.arena_of(np.ones(1000)), 'policy': p,\n"
            "                  'config': os.environ.get('DATAMEM_CONFIG'),\n"
            "                  'text': open(p).read(), 'mode': os.stat(os.path.dirname(p)).st_mode}))")
    env = {"DATAMEM_CONFIG_TEXT": text, "TMPDIR": str(tmp_path)}
    r = run_py(code, config=os.path.join(ROOT, "configs", "minimal.yaml"), env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["arena"] == "shipped" and out["text"] == text, out
    assert out["policy"] == out["config"], out  # what the job's own children inherit
    assert os.path.dirname(out["policy"]) == str(tmp_path / ("datamem-dask-%d" % os.geteuid()))
    assert out["mode"] & 0o077 == 0, oct(out["mode"])
    r = run_py("import numpy; print('job ran')", env={"DATAMEM_CONFIG_TEXT": "version: 1\nnot a policy\n",
                                        "TMPDIR": str(tmp_path)})
    assert r.returncode == 2 and "job ran" not in r.stdout, r.stdout + r.stderr
    assert "datamem: cannot activate" in r.stderr, r.stderr
