"""Handler semantics through NumPy, in a process where datamem is installed."""
import gc
import os
import threading
import tracemalloc

import numpy as np
import pytest

import datamem
from conftest import CONFIGS, run_py

try:
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name


@pytest.fixture(scope="module", autouse=True)
def installed():
    datamem.install(os.path.join(CONFIGS, "demo.yaml"))
    yield
    datamem.uninstall()


def test_name_and_views():
    a = np.arange(100.0)
    assert get_handler_name(a) == "datamem"
    assert get_handler_name(a[::2]) is None  # views do not own data
    assert datamem.arena_of(a[::2]) == datamem.arena_of(a)


def test_sizes_route_to_arenas():
    assert datamem.arena_of(np.empty(0)) == "small"          # size 0 -> 1 byte
    assert datamem.arena_of(np.empty(10)) == "small"
    assert datamem.arena_of(np.empty(10_000)) == "general"
    assert datamem.arena_of(np.empty(1 << 20)) == "big"      # 8 MiB


def test_alignment_per_arena():
    for n in (1, 7, 100, 1000, 5000, 70_000):
        a = np.empty(n, dtype=np.uint8)
        want = 16 if n <= 4096 else 64
        assert a.ctypes.data % want == 0, (n, a.ctypes.data)
    assert np.empty(1 << 20).ctypes.data % 4096 == 0


def test_zeros_are_zero_after_reuse():
    for n in (100, 10_000, 3_000_000):
        a = np.empty(n)
        a.fill(7.0)
        del a
        assert not np.zeros(n).any()


def test_resize_realloc_moves_across_arenas():
    a = np.arange(10, dtype=np.float64)
    assert datamem.arena_of(a) == "small"
    a.resize(1 << 20, refcheck=False)  # realloc to 8 MiB -> "big"
    assert datamem.arena_of(a) == "big"
    assert (a[:10] == np.arange(10)).all() and not a[10:].any()
    before = datamem.stats()["rules"]["tiny"]["reallocs"]
    a.resize(5, refcheck=False)
    assert datamem.arena_of(a) == "small"
    assert datamem.stats()["rules"]["tiny"]["reallocs"] == before + 1
    assert list(a) == [0, 1, 2, 3, 4]


def test_realloc_users_without_gil():
    # fromstring(sep=...) reallocs with the GIL released; the free size is wrong
    x = np.fromstring("1 2 3 4 5 6 7 8 9 10 " * 1000, sep=" ")
    assert x.shape == (10_000,) and x.sum() == 55_000
    assert get_handler_name(x) == "datamem"
    empty = np.fromstring("", sep=" ")  # allocated elsize, freed as 1 (NumPy)
    del empty
    it = np.fromiter(range(100_000), dtype=np.int64)
    assert it[-1] == 99_999


def test_sort_buffers_and_pickle():
    import pickle
    a = np.random.rand(100_000)
    s = np.sort(a, kind="mergesort")  # scratch buffers through the handler
    assert (np.diff(s) >= 0).all()
    b = pickle.loads(pickle.dumps(a))
    assert (a == b).all()


def test_memory_error_not_crash():
    datamem._ext.fault_extent_alloc(-1)
    try:
        with pytest.raises(MemoryError):
            np.empty(1 << 28)  # 2 GiB: needs a fresh extent
    finally:
        datamem._ext.fault_extent_alloc(0)
    assert datamem.stats()["arenas"]["big"]["failures"] >= 1
    assert datamem.stats()["rules"]["huge"]["failures"] >= 1  # and per rule
    assert np.empty(1 << 28).nbytes == 1 << 31  # and the job goes on


def test_tracemalloc_domain_still_tracks():
    tracemalloc.start()
    try:
        a = np.ones(1 << 16)
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
        assert sum(s.size for s in snap.statistics("filename")) >= a.nbytes
    finally:
        tracemalloc.stop()


def test_stats_counts():
    before = datamem.stats()["arenas"]["general"]["allocations"]
    keep = [np.empty(10_000) for _ in range(10)]
    s = datamem.stats()
    g = s["arenas"]["general"]
    assert g["allocations"] >= before + 10
    assert g["allocated_bytes"] >= 10 * 80_000
    assert g["alignment"] == 64 and g["in_policy"]
    assert s["rules"]["default"]["arena"] == "general"
    assert s["policy_path"].endswith("demo.yaml")
    del keep


def test_threads_allocate_concurrently():
    errors = []

    def work():
        try:
            for i in range(2000):
                a = np.empty(1 + (i * 37) % 50_000)
                a[:] = 1
                assert a.sum() == a.size
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors


def test_uninstall_restores_default_and_keeps_arrays():
    a = np.ones(1000)
    datamem.uninstall()
    try:
        b = np.ones(1000)
        assert get_handler_name(b) == "default_allocator"
        del a  # freed through datamem's handler, as it was allocated
        gc.collect()
    finally:
        datamem.install(os.path.join(CONFIGS, "demo.yaml"))
    assert get_handler_name(np.ones(3)) == "datamem"


def test_dtype_rules():
    r = run_py(
        "import numpy as np, datamem\n"
        "print(datamem.arena_of(np.ones(1000, dtype=np.float32)),"
        " datamem.arena_of(np.ones(1000, dtype=np.complex128)),"
        " datamem.arena_of(np.ones(1000)),"
        " datamem.arena_of((np.ones(100, dtype=np.float32) * 2)),"
        " datamem.arena_of(np.ones(100, dtype=np.float64).astype(np.float32)))\n"
        "s = datamem.stats()\n"
        "print(s['arenas']['f32']['dtype_known'] > 0,"
        " s['rules']['float32']['dtype_known'] == s['rules']['float32']['allocations'] > 0)\n",
        config=os.path.join(CONFIGS, "dtype.yaml"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].split() == ["f32", "cplx", "general", "f32", "f32"]
    assert lines[1] == "True True"


def test_reload_changes_new_arrays_only(write_policy):
    old = np.ones(1000)
    assert datamem.arena_of(old) == "general"
    p = write_policy("version: 1\ndefault: fresh\narenas:\n  fresh: {alignment: 64}\n")
    datamem.reload(p)
    try:
        assert datamem.arena_of(np.ones(1000)) == "fresh"
        assert datamem.arena_of(old) == "general"
        bad = write_policy("version: 1\ndefault: x\narenas: {}\n", name="bad.yaml")
        with pytest.raises(datamem.PolicyError):
            datamem.reload(bad)
        assert datamem.arena_of(np.ones(1000)) == "fresh"  # last good kept
    finally:
        datamem.reload(os.path.join(CONFIGS, "demo.yaml"))
    del old


def test_active_bytes_count_jemalloc_pages():
    # jemalloc counts active and dirty memory in pages of its own size (LG_PAGE: 64 KiB
    # in the aarch64 wheels, whatever the kernel's page), not the kernel's: counted in
    # kernel pages, an aarch64 wheel on a 4 KiB-page kernel reported 1/16 of the truth.
    arrays = [np.ones(100_000) for _ in range(10)]  # 8 MB, touched
    a = datamem.stats()["arenas"][datamem.arena_of(arrays[0])]
    assert a["active_bytes"] >= a["allocated_bytes"] > 0, a
