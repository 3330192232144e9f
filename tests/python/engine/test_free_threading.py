"""Threads that really run at once: free-threaded CPython (PEP 703, 3.13t).

On a free-threaded interpreter datamem must leave the GIL off (its extension
declares Py_MOD_GIL_NOT_USED) through everything a job does with it, and its
shared state must hold up with any number of threads in it at once. The race
test runs on GIL builds too, where the same threads only race less; the GIL
check needs a free-threaded interpreter (scripts/ft-python.sh makes one).
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import ROOT, run_py

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
RACE = os.path.join(ROOT, "tests", "python", "_race.py")


def hog():
    """A process that only burns CPU, so that the threads are preempted at
    unlucky moments too."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("threads,iterations", [(8, 300), (32, 80)])
def test_threads_race_installs_tags_profiles_and_sites(tmp_path, threads, iterations):
    """`threads` mutators (install, reload, tag, explain, stats, profile start
    and stop, call-site rules on new code objects, installs of a dtype policy
    at once) while threads/2 allocators make, check and hand over arrays: every
    array's arena and contents right, live counts per arena exact
    (tests/python/_race.py)."""
    env = dict(os.environ)
    env.pop("DATAMEM_CONFIG", None)
    env.pop("DATAMEM_PROFILE", None)
    h = hog()
    try:
        r = subprocess.run([sys.executable, RACE, str(tmp_path), str(threads), str(threads // 2),
                            str(iterations)], env=env, capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    finally:
        h.kill()
        h.wait()
    assert r.stdout.strip(), r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["nerrors"] == 0, (out, r.stderr[-4000:])
    c = out["counts"]
    # thousands of arrays, and every kind of operation many times over
    assert c["arrays"] >= 1000 * (threads // 2) // 4, c
    for op in ("installs", "reloads", "profiles", "sites", "explains", "stats", "tags", "handed",
               "pooled"):
        assert c[op] >= threads, (op, c)
    assert c["checked"] >= 2 * c["arrays"], c  # when made, and by whoever freed it
    if FREE_THREADED:
        assert out["gil"] is False, out


GIL_STEPS = textwrap.dedent(r"""
    import json, os, shutil, sys, tempfile, urllib.request, warnings
    warnings.simplefilter("error")  # "The global interpreter lock (GIL) has been enabled ..."
    steps = []

    def check(step):
        if sys._is_gil_enabled():
            sys.exit("the GIL is on after: " + step)
        steps.append(step)

    check("start-up activation (DATAMEM_CONFIG)")
    import numpy as np
    import datamem
    from datamem._profile import recording
    check("import datamem")
    policy = os.environ["POLICY"]
    datamem.install(policy)
    check("install")
    datamem.reload()
    check("reload")
    with datamem.tag("hot"):
        assert datamem.arena_of(np.ones(1000)) == "tagged"
    check("tag")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as ex, datamem.tag("hot"):
        assert datamem.arena_of(ex.submit(np.ones, 1000).result()) == "tagged"
    check("thread pool under a tag")
    assert "arena 'tagged'" in datamem.explain(policy, 2048, "float64", "x", ("hot",))
    check("explain")
    assert datamem.stats()["arenas"]["tagged"]["allocations"] >= 1
    check("stats")
    url = datamem.serve_stats()
    assert b"datamem" in urllib.request.urlopen(url, timeout=30).read()
    check("serve_stats")
    d = tempfile.mkdtemp()
    assert recording.start(d, sample=0).startswith(d)
    np.ones(100)
    datamem._ext.profile_stop()
    shutil.rmtree(d)
    check("profile")
    try:
        import distributed  # noqa: F401
    except ImportError:
        pass
    else:
        import datamem.dask
        datamem.dask.Policy(policy)
        check("datamem.dask")
    try:
        import ray  # noqa: F401
    except ImportError:
        pass
    else:
        import datamem.ray
        datamem.ray.runtime_env(policy)
        check("datamem.ray")
    try:
        import joblib
    except ImportError:
        pass
    else:
        out = joblib.Parallel(n_jobs=2, backend="threading")(
            joblib.delayed(lambda: datamem.arena_of(np.ones(10)))() for _ in range(4))
        assert out == ["general"] * 4, out
        check("joblib")
    print(json.dumps(steps))
""")


@pytest.mark.skipif(not FREE_THREADED, reason="SKIP: needs a free-threaded CPython "
                    "(bash scripts/ft-python.sh make)")
def test_the_gil_stays_off(write_policy):
    """Without PYTHON_GIL=0 forcing it, a free-threaded interpreter turns the
    GIL on when it imports an extension that does not declare
    Py_MOD_GIL_NOT_USED; nothing datamem does may turn it on."""
    policy = write_policy("version: 1\ndefault: general\narenas:\n  general: {}\n  tagged: {}\n"
                          "rules:\n  - name: hot\n    match: {tag: hot}\n    arena: tagged\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    env["POLICY"] = policy
    e = dict(env)
    e.pop("DATAMEM_PROFILE", None)
    r = subprocess.run([sys.executable, "-c", GIL_STEPS], env=dict(e, DATAMEM_CONFIG=policy),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = json.loads(r.stdout.strip().splitlines()[-1])
    assert steps[:9] == ["start-up activation (DATAMEM_CONFIG)", "import datamem", "install",
                         "reload", "tag", "thread pool under a tag", "explain", "stats", "serve_stats"], steps
    assert "profile" in steps, steps


@pytest.mark.skipif(not FREE_THREADED, reason="SKIP: needs a free-threaded CPython")
def test_the_extension_is_built_for_this_interpreter():
    """The extension carries the t ABI (cp313t) and the module says so."""
    r = run_py("import datamem._ext as e, sysconfig; print(e.__file__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(sysconfig.get_config_var("EXT_SUFFIX")), r.stdout
    assert "t-" in sysconfig.get_config_var("EXT_SUFFIX")
