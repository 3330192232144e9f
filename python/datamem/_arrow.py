"""pyarrow's memory pool next to datamem's arenas (docs/what-a-policy-governs.md).

A policy governs NumPy's data buffers; under pandas 3 much of a job's data sits
in Arrow buffers from pyarrow's own pool. datamem.stats() reads
pyarrow.total_allocated_bytes() when it is called. The stats endpoint's C
thread never calls Python, so for /metrics, /stats.json, the page and `top` a
daemon thread, "datamem-pyarrow", hands the figure to C every REFRESH_S
seconds while pyarrow is loaded. It starts when pyarrow is first imported (an
entry at the front of sys.meta_path that only notices the name, finds nothing
and then removes itself) or at install when pyarrow already is; a fork child
whose parent ran it starts its own. It holds the GIL for microseconds a second;
while another thread keeps the GIL, the figure the endpoint shows is older.
"""
import importlib.machinery
import os
import sys
import threading
import time

from . import _ext

REFRESH_S = 1.0
_state = {"thread": None}
_lock = threading.Lock()


def allocated():
    """pyarrow.total_allocated_bytes(), or None while pyarrow is not loaded."""
    f = getattr(sys.modules.get("pyarrow"), "total_allocated_bytes", None)
    if f is None:  # not imported, or its import has not finished
        return None
    try:
        return int(f())
    except Exception:  # a broken or shutting-down pyarrow: no figure
        return None


def publish():
    """Reads pyarrow's figure and hands it to C; returns it (None: not loaded)."""
    n = allocated()
    _ext.set_pyarrow_bytes(-1 if n is None else n)
    return n


def _run():
    while True:
        try:
            publish()
        except Exception:  # interpreter shutdown
            return
        time.sleep(REFRESH_S)


def _start():
    with _lock:
        t = _state["thread"]
        if t is not None and t.is_alive():
            return
        t = _state["thread"] = threading.Thread(target=_run, name="datamem-pyarrow",
                                                daemon=True)
    t.start()


class _Watch:
    """Notices the first import of pyarrow; finds nothing itself."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pyarrow" and path is None:
            _unwatch()
            # Only when the import can succeed: pandas tries `import pyarrow`
            # where it is not installed too.
            if importlib.machinery.PathFinder.find_spec(name) is not None:
                _start()
        return None


def _unwatch():
    try:
        sys.meta_path.remove(_Watch)
    except ValueError:
        pass


def watch():
    """Called at install: refreshes now if pyarrow is loaded, else waits for it."""
    if sys.modules.get("pyarrow") is not None:  # None: a job that hides pyarrow
        _start()
    elif _Watch not in sys.meta_path:
        sys.meta_path.insert(0, _Watch)


def _after_fork_child():
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it
    if _state["thread"] is not None:  # the parent's thread does not exist here
        _start()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)
