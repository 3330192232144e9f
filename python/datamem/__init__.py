"""datamem: a declarative memory policy for NumPy arrays.

One NEP 49 handler routes every array-data allocation to a named jemalloc arena
chosen by a YAML policy (size, dtype, thread name, tags). Usually activated with
no code change::

    DATAMEM_CONFIG=policy.yaml python job.py

or explicitly::

    import datamem
    datamem.install("policy.yaml")
    with datamem.tag("ingest"):
        ...
"""
import contextlib
import json
import os
import re
import sys
import threading
import weakref

from . import _arrow, _ext, _text

from ._stats import tables as _tables
from ._ext import PolicyError

__all__ = ["install", "uninstall", "reload", "tag", "stats", "current_policy",
           "arena_of", "check", "explain", "PolicyError", "HANDLER_NAME", "__version__",
           "metrics", "stats_url", "serve_stats", "sweep_textfiles", "last_failure",
           "memory_error", "refusals"]

HANDLER_NAME = _ext.HANDLER_NAME
__version__ = _ext.VERSION

# Module state and its guards (docs/design.md, "Free-threaded CPython"): _state
# changes only under _lock (install, reload, uninstall, the
# first tag's wrap of ThreadPoolExecutor.submit); _covered, added to by
# every starting thread, only under _covered_lock, which also orders the
# publications of the uncovered threads (it is taken under _lock, never the
# other way round).
_state = {"path": None, "threads_patched": False, "orig_bootstrap": None,
          "pools_patched": False}
_covered = weakref.WeakSet()  # threads that set datamem's handler themselves
_lock = threading.Lock()
_covered_lock = threading.Lock()


def _quiet_from_env():
    """DATAMEM_QUIET=1: datamem prints no warnings (policy warnings at start-up
    and reload, a thread it could not cover); errors are printed all the same.
    Read once, when datamem is imported (the C side reads it when loaded)."""
    v = os.environ.get("DATAMEM_QUIET", "")
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    sys.stderr.write("datamem: DATAMEM_QUIET=%r: use 1 (no warnings) or 0; warnings stay on\n"
                     % v)
    return False


_QUIET = _quiet_from_env()


def _warn(text):
    """A warning (never an error) on stderr, unless DATAMEM_QUIET=1."""
    if text and not _QUIET:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")


def _warn_policy(text):
    """A load's warnings ("" if none), printed once per distinct set in this
    process, not on every reload (2000 reloads printed 6003 lines).
    The file watcher shares the record (_ext.warnings_changed)."""
    if _ext.warnings_changed(text):
        _warn(text)


def _policy_path(policy):
    """An absolute path (str, bytes or os.PathLike) as str. Paths are bytes: one
    that is not UTF-8 comes back as os.fsdecode gives it, and _ext turns it into
    the same bytes again."""
    return os.path.abspath(os.fsdecode(policy))  # the watcher must survive chdir


def _shown(path):
    """`path` for a message: bytes that are not UTF-8 as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def install(policy):
    """Loads `policy` (a path) and makes datamem NumPy's allocator for the current
    context and for every thread started from now on. Raises PolicyError with
    file:line:column diagnostics if the policy is bad (nothing changes then)."""
    path = _policy_path(policy)
    with _lock:
        _stats_from_env()
        _ext.set_cudart(os.environ.get("DATAMEM_CUDART") or None)  # pinned: cuda
        _warn_policy(_ext.load(path))
        _state["path"] = path
        _ext.set_thread_name(threading.current_thread().name)
        _cover(threading.current_thread())
        _ext.set_handler(_ext.handler())
        _patch_threads()
        _apply_settings()
        _publish_uncovered()
        _arrow.watch()


def reload(policy=None):
    """Re-reads the policy in force (or loads a new path in its place) in a
    process where install() put datamem in force. New arrays follow the new
    rules; live arrays are not moved. On error the last good policy stays in
    force and PolicyError is raised. In a process that never called install()
    (nor ran with DATAMEM_CONFIG) it raises RuntimeError and changes nothing:
    a reload only replaces the rules of an installed allocator, and would
    otherwise name a policy that serves no array; call datamem.install(path)."""
    path = _policy_path(policy) if policy is not None else None
    with _lock:  # the path in force, read where no install can change it
        if _state["path"] is None:
            raise RuntimeError("no policy is installed in this process; call "
                               "datamem.install(path) first")
        if path is None:
            path = _state["path"]
        _warn_policy(_ext.load(path))
        _state["path"] = path
        _apply_settings()


def uninstall():
    """Restores NumPy's default allocator for the current context and for threads
    started from now on. Arrays allocated by datamem stay valid and are still
    freed through datamem."""
    with _lock:
        _ext.set_handler(None)
        _unpatch_threads()


def current_policy():
    """The path of the policy in force, or None."""
    return _state["path"] if _ext.active() else None


def check(policy):
    """Validates a policy file without installing it: (ok, diagnostics, summary)."""
    from ._explain import check as _check
    return _check(os.fsdecode(policy))


def explain(policy, size, dtype="unknown", thread="MainThread", tags=(), table=False,
            module=None, function=None):
    """Which rule and arena would serve an allocation, and why earlier rules did not.
    `module` and `function` ("module.qualname") name the call site for rules with
    match.module / match.function; None: unknown, as for a realloc."""
    from ._explain import explain as _explain
    return _explain(os.fsdecode(policy), size, dtype, thread, tags, table, module, function)


def stats():
    """Every number as a plain dict: /stats.json's own JSON (one renderer, the
    same keys and types at every depth), with every tag's row in "tags"
    (/stats.json keeps the 50 biggest plus "(other)"). `threads_not_covered`
    names live Python threads that do not allocate through datamem (started
    before datamem was installed, or created outside `threading`).
    `process_resident_bytes` is the process's resident set and
    `outside_arenas_resident_bytes` the part of it no arena holds (what a policy
    does not govern); `pyarrow_allocated_bytes`, present while pyarrow is
    loaded, is its pool's total (docs/what-a-policy-governs.md)."""
    s = json.loads(_ext.stats())  # /stats.json's renderer: one shape for both
    s["threads_not_covered"] = _publish_uncovered()
    s["threads_not_covered_count"] = len(s["threads_not_covered"])
    arrow = _arrow.publish()
    if arrow is not None:
        s["pyarrow_allocated_bytes"] = arrow
    return s


def _publish_uncovered():
    """The live threads not covered, told to C for /metrics and /stats.json (the
    endpoint's thread never touches Python). Called at install, when a thread
    started through threading starts or ends, and by stats(). Under
    _covered_lock: the set is read whole, and the last list handed to C is
    the one computed last."""
    with _covered_lock:
        names = sorted(t.name for t in threading.enumerate()
                       if t not in _covered) if _ext.active() else []
        _ext.set_threads_not_covered(names)
    return names


def _cover(thread):
    with _covered_lock:
        _covered.add(thread)


def last_failure():
    """Why the calling thread's last allocation failed, when a limit refused
    it: {"kind" ("arena", "tag" or "worker"), "tag" (the tag at its limit, or
    ""), "arena", "rule", "request", "limit", "live", "fallback_tried",
    "count"} (bytes; count = refusals so far on this thread), or None. NumPy's
    MemoryError text cannot carry this; datamem also logs it on stderr, at most
    once a second:

        try:
            batch = np.empty(n)
        except MemoryError:
            print(datamem.last_failure())
    """
    return _ext.last_failure()


def metrics():
    """The current stats as Prometheus text exposition (format 0.0.4)."""
    return _ext.metrics()


def stats_url():
    """The URL of this process's /metrics endpoint, or None when not serving."""
    return _ext.stats_endpoint()[0] or None


def serve_stats(http="127.0.0.1:0", unix_socket=None):
    """Serves /metrics and /stats.json from a C thread (it answers while Python
    holds the GIL), overriding the policy's `stats.http` (port 0: any free port)
    and, if given, `stats.unix_socket`. Returns stats_url(). Raises OSError if it
    cannot listen; the reason is also logged."""
    rc = _ext.stats_serve(http, unix_socket)
    if rc == -10:  # DM_EDENIED
        raise PermissionError("datamem: refusing to serve stats on %r: not a loopback address "
                              "(write it in the policy's stats.http to expose metrics beyond "
                              "this machine)" % (http,))
    if rc != 0:
        raise OSError("datamem: cannot serve stats (http=%r, unix_socket=%r); see the "
                      "message above" % (http, unix_socket))
    return stats_url()


def sweep_textfiles(template, min_age=30.0):
    """Removes the node_exporter textfiles of dead processes for a `{pid}`
    template (the policy's stats.textfile): files named after a pid that does
    not exist, owned by this user and unchanged for `min_age` seconds (a live
    writer in another pid namespace keeps its file fresh). A process removes its
    own `{pid}` file when it exits and sweeps on every write; this is for files
    left by processes that were killed. Returns how many were removed."""
    rc = _ext.stats_textfile_sweep(str(template), int(min_age * 1000))
    if rc == -8:  # DM_ERANGE
        raise ValueError("datamem: %r: '{pid}' must appear once, in the file name" % (template,))
    if rc < 0:  # the directory is refused (the file rules) or cannot be read: logged
        raise OSError("datamem: cannot sweep %r; see the message above" % (template,))
    return rc


def _stats_from_env():
    """DATAMEM_STATS_HTTP=host:port serves stats without a policy change. Read
    here, at install, and handed to C: the runtime never calls getenv on a path
    that matters. A failure to listen is logged and the job runs on."""
    http = os.environ.get("DATAMEM_STATS_HTTP")
    if http:
        _ext.stats_serve(http, None)


def arena_of(array):
    """Name of the datamem arena holding `array`'s data (None if not datamem's)."""
    return _ext.owner_arena(array)


# A policy's match.tag accepts only these names (policy/units.c, dm__units_name_valid),
# so tag() refuses the rest rather than tagging what no rule can match;
# tests/python/engine/test_tags.py checks both sides agree.
_TAG_PATTERN = "[A-Za-z_][A-Za-z0-9_-]*"
_TAG = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}")


def tag(*names):
    """Tags the allocations made inside the block (and inside tasks it creates:
    the tag rides on NumPy's handler ContextVar, so it follows await and
    asyncio tasks and stays isolated between tasks; work handed to a
    concurrent.futures.ThreadPoolExecutor, by submit, map or
    loop.run_in_executor, carries it too: see _patch_pools). Nested tags accumulate.
    A name a policy's match.tag could not hold (see _TAG_PATTERN) raises
    ValueError here, at the call."""
    for n in names:
        if not isinstance(n, str):
            raise TypeError("tag names must be strings, got %r" % (n,))
        if not _TAG.fullmatch(n):
            raise ValueError("invalid tag %r: no rule could ever match it; tags match %s "
                             "and are 1 to 63 bytes (the policy's match.tag grammar)"
                             % (n, _TAG_PATTERN))
    return _tagged(names)


@contextlib.contextmanager
def _tagged(names):
    if not _ext.active():
        yield
        return
    current = _ext.get_handler()
    base = _ext.handler_tags(current)
    if base is None:  # this context is not served by datamem: leave it alone
        yield
        return
    if not _state["pools_patched"]:
        _patch_pools()
    with _handler_set(_ext.handler(tuple(base) + names)):
        yield


@contextlib.contextmanager
def _handler_set(handler):
    """`handler` (a tag set's) in force in this context for the block; a
    MemoryError a datamem limit caused in this thread comes out as
    memory_error() makes it."""
    prev = _ext.set_handler(handler)
    seen = _thread_refusals()
    try:
        yield
    except MemoryError as e:
        better = memory_error(e, since={"thread": seen})
        if better is None:
            raise
        try:
            raise better from e
        finally:
            better = None  # no cycle through this frame: the task's arrays go at once
    finally:
        _ext.set_handler(prev)


# ---- thread pools --------------------------------------------------------------
# A ThreadPoolExecutor runs submitted work in its worker thread's own context,
# not the submitter's (asyncio.to_thread copies the submitter's context; submit,
# map and loop.run_in_executor do not), so a tag would stop at the pool and a
# tag_limits entry around one would limit nothing. The first datamem.tag() that
# tags wraps ThreadPoolExecutor.submit, the base class's (map and
# run_in_executor call it, and so do subclasses that call super().submit):
# work submitted while a datamem tag is in force runs with the submitter's
# handler, that is its tag set, in force in the worker for that call only, and
# a MemoryError a limit caused there names the limit, as inside the block.
# Nothing else of the submitter's context travels (other ContextVars keep the
# executor's usual semantics), and work submitted with no tag is submitted as
# it was. The wrapper holds no state: it survives fork as the class does, and
# on a free-threaded build it reads only the submitting context. A
# ProcessPoolExecutor's work gets no tag: tags do not cross processes.

def _patch_pools():
    import concurrent.futures.thread as cft  # outside _lock: an import takes its own
    with _lock:
        cls = cft.ThreadPoolExecutor
        orig = cls.__dict__["submit"]
        if not getattr(orig, "_datamem", False):  # a second datamem import: wrapped once
            def submit(self, fn, /, *args, **kwargs):
                handler = _ext.get_handler()
                if _ext.handler_tags(handler):  # a tag is in force: it goes with fn
                    return orig(self, _run_tagged, handler, fn, *args, **kwargs)
                return orig(self, fn, *args, **kwargs)

            submit.__wrapped__ = orig
            submit.__doc__ = orig.__doc__
            submit._datamem = True
            cls.submit = submit
        _state["pools_patched"] = True


def _run_tagged(handler, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) in a pool thread with the submitter's `handler`;
    the thread's own handler is back in force for its next task."""
    with _handler_set(handler):
        return fn(*args, **kwargs)


# ---- MemoryError that says why ----------------------------------------------------
# NumPy's MemoryError text is fixed ("Unable to allocate ..."). When a datamem
# limit refused the allocation, memory_error() makes one that names the limit:
# the calling thread's own refusal (exact), or, from another thread (a Dask
# worker's event loop explaining its task's error), the last refusal of one of
# the given tags or of the worker limit that happened after `since`.

def _thread_refusals():
    f = _ext.last_failure()
    return f["count"] if f else 0


def _holders(kind, n=3):
    """"largest holders: tags 'load' 48.0 MiB, (untagged) 16.0 MiB; ..." from a
    stats snapshot: the tags that hold the most live bytes, and for the worker
    limit (or when no tag is counted) the arenas, and for the worker limit the
    memory beside the arrays it counts; "" when there is nothing to name or no
    snapshot to be had."""
    try:
        s = json.loads(_ext.stats())
    except Exception:  # an explanation never costs the error its own text
        return ""

    def top(rows, label):
        rows = sorted(((v, k) for k, v in rows if v), reverse=True)[:n]
        if not rows:
            return None
        return "%s %s" % (label, ", ".join(
            "%s %s" % (k if k.startswith("(") else repr(k), _text.human_bytes(v, "bytes"))
            for v, k in rows))

    tags = top(((k, t.get("live") or 0) for k, t in (s.get("tags") or {}).items()), "tags")
    arenas = top(((k, a.get("allocated_bytes") or 0) for k, a in (s.get("arenas") or {}).items()),
                 "arenas")
    # the worker limit counts what the process holds beside its arrays too, and
    # with a share of a cgroup's limit what the group's other processes hold
    tb = s.get("tag_bytes") or {}
    beside = tb.get("worker_beside") if kind == "worker" else None
    group = _tables.budget_is_shared(tb)
    beside = "beside the arrays (%smalloc, Arrow, Python objects) %s" % (
        "the cgroup's other processes, " if group else "",
        _text.human_bytes(beside, "bytes")) if beside else None
    parts = [p for p in ((arenas, tags, beside) if kind == "worker" else (tags or arenas,)) if p]
    return "largest holders: %s" % "; ".join(parts) if parts else ""


def _explain(kind, who, request, limit, live):
    if kind == "tag":
        what = "tag %r is at its limit of %s" % (who, _text.human_bytes(limit, "bytes"))
    elif kind == "worker":
        what = "the worker limit of %s is reached" % _text.human_bytes(limit, "bytes")
    else:
        what = "arena %r is at its limit of %s" % (who, _text.human_bytes(limit, "bytes"))
    held = _holders(kind)
    return ("datamem: %s (%s live): a request of %s was refused%s"
            % (what, _text.human_bytes(live, "bytes"), _text.human_bytes(request, "bytes"),
               "; " + held if held else ""))


# NumPy raises its own MemoryError (_ArrayMemoryError) for an array it could
# not allocate, whose text names only that array ("Unable to allocate 8 bytes
# for an array with shape ()": the scalar that came after the arrays that
# filled a limit). The first install wraps the class: made in the thread whose
# allocation a datamem limit has just refused (a refusal newer than the last
# one explained in this thread, of the array's size), the error carries
# memory_error()'s explanation (`.datamem`) and its text starts with it. Other
# MemoryErrors (the system's) keep NumPy's text. The wrap holds no state but a
# per-thread count, which a fork child's thread inherits as it is.
_numpy_seen = threading.local()


def _numpy_error_explain(err):
    if not _ext.active():
        return
    f = _ext.last_failure()
    if not f or f["count"] <= getattr(_numpy_seen, "count", 0):
        return
    try:
        size = int(err._total_size)
    except Exception:
        return
    if f["request"] != size and size != 0:  # not this array's refusal
        return
    _numpy_seen.count = f["count"]
    who = f["tag"] if f["kind"] == "tag" else f["arena"]
    err.datamem = {"message": _explain(f["kind"], who, f["request"], f["limit"], f["live"])}


def _patch_numpy_errors():
    import importlib
    for mod in ("numpy._core._exceptions", "numpy.core._exceptions"):  # NumPy 2.x, 1.x
        try:
            cls = importlib.import_module(mod)._ArrayMemoryError
            break
        except (ImportError, AttributeError):
            cls = None
    if cls is None or getattr(cls.__init__, "_datamem", False):
        return
    orig_init, orig_str = cls.__init__, cls.__str__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            _numpy_error_explain(self)
        except Exception:  # the array's own error is raised whatever happens here
            pass

    def __str__(self):
        text = orig_str(self)
        d = getattr(self, "datamem", None)
        return "%s; %s" % (d["message"], text) if d else text

    __init__._datamem = True
    __init__.__wrapped__ = orig_init
    cls.__init__, cls.__str__ = __init__, __str__


def refusals(tags=()):
    """A token for memory_error(since=...): how many refusals this thread, each
    of `tags` and the worker limit have had so far."""
    counts = {}
    for name in tags:
        r = _ext.refusals(name)
        counts[name] = r[0] if r else 0
    w = _ext.refusals(None)
    return {"thread": _thread_refusals(), "tags": counts, "worker": w[0] if w else 0}


def memory_error(exc, since=None, tags=()):
    """A MemoryError naming the limit that refused the allocation behind `exc`
    (the tag, arena or worker limit, the limit, the live bytes and the request),
    or None when no datamem limit refused anything since `since` (a refusals()
    token; None: any refusal this thread has had), or when `exc` is one it made
    (a pool thread's, seen again where the submitter waits on the future).
    Chain it: `raise datamem.memory_error(e) or e from e`."""
    if not isinstance(exc, MemoryError) or not _ext.active():
        return None
    made = getattr(exc, "datamem", None)
    if made is not None:
        if type(exc) is MemoryError:  # one this function made: seen again
            return None
        # NumPy's own error, explained where it was raised: a plain MemoryError
        # with the same text, which keeps it through pickling (a Dask or Ray
        # task's error reaches its client by pickle, where NumPy's class would
        # be made again from its shape and dtype alone).
        err = MemoryError(str(exc))
        err.datamem = made
        return err
    since = since or {}
    f = _ext.last_failure()
    if f and f["count"] > since.get("thread", 0):
        who = f["tag"] if f["kind"] == "tag" else f["arena"]
        msg = _explain(f["kind"], who, f["request"], f["limit"], f["live"])
    else:
        msg = None
        for name in list(tags) + [None]:
            r = _ext.refusals(name)
            before = since.get("worker", 0) if name is None else since.get("tags", {}).get(name, 0)
            if r and r[0] > before:
                msg = _explain("worker" if name is None else "tag", name, r[1], r[2], r[3])
                break
        if msg is None:
            return None
    err = MemoryError("%s; %s" % (msg, exc) if str(exc) else msg)
    err.datamem = {"message": msg}
    return err


# ---- reload by signal, fork ---------------------------------------------------
# SIGHUP is opt-in (reload.signal: true): a process that has not asked for it
# keeps SIGHUP's default meaning. `python -m datamem reload PID` checks that the
# target catches SIGHUP before sending it. The handler runs in the main thread
# between bytecodes (Python's signal model), so a reload waits for a long C call
# to return; the file watcher has no such delay.

def _on_sighup(signum, frame):
    try:
        reload()
        sys.stderr.write("datamem: reloaded %s on SIGHUP\n" % _shown(_state["path"]))
    except PolicyError as e:
        sys.stderr.write("datamem: reload on SIGHUP failed; keeping the last good policy:\n%s\n" % e)


def _numpy_hugepages():
    """NumPy's own hugepage setting (NUMPY_MADVISE_HUGEPAGE, _set_madvise_hugepage):
    arenas at `hugepages: system` advise blocks >= 4 MiB as NumPy's default
    handler advises arrays >= 4 MiB (docs/performance.md, "Real jobs")."""
    import numpy as np
    for mod in ("_core", "core"):  # NumPy 2.x, 1.x
        get = getattr(getattr(getattr(np, mod, None), "multiarray", None),
                      "_get_madvise_hugepage", None)
        if get is not None:
            return bool(get())
    return os.environ.get("NUMPY_MADVISE_HUGEPAGE", "1") != "0"


def _apply_settings():
    """Called with _lock held after every successful load."""
    _ext.set_numpy_hugepages(_numpy_hugepages())
    _patch_numpy_errors()
    if threading.current_thread() is threading.main_thread():
        _sync_main_thread()
    # else: every install also schedules _sync_main_thread in the main thread


def _cover_main_thread_later():
    """The start-up hook activates in whichever thread imported NumPy: when that
    is not the main thread, the main thread takes datamem's handler at its next
    _sync_main_thread (every install schedules one). Set before install()."""
    if threading.current_thread() is not threading.main_thread():
        _state["cover_main"] = True


def _cover_main_thread():
    """In the main thread, in its current context: datamem's handler, as
    install() sets it for the thread that calls it."""
    _ext.set_thread_name(threading.current_thread().name)
    _cover(threading.current_thread())
    _set_if_not_datamem()
    _publish_uncovered()


def _sync_main_thread():
    """datamem's handler for the main thread when start-up activation ran in
    another (_cover_main_thread_later), and the SIGHUP handler as the policy in
    force asks (reload.signal). Signal
    handlers can only be changed from the main thread: called there after a
    load from it, and, for any install (the file watcher's C thread, another
    thread's reload()), by the extension through Py_AddPendingCall, between two
    bytecodes of the main thread. Only the main thread touches the handler and
    _state["prev_sighup"], so it takes no lock."""
    import signal
    if threading.current_thread() is not threading.main_thread():
        return
    if _state.pop("cover_main", False) and _ext.active():
        _cover_main_thread()
    settings = _ext.policy_settings() or {}
    want = bool(settings.get("reload_signal"))
    current = signal.getsignal(signal.SIGHUP)
    if want and current is not _on_sighup:
        _state["prev_sighup"] = current
        signal.signal(signal.SIGHUP, _on_sighup)
    elif not want and current is _on_sighup:
        signal.signal(signal.SIGHUP, _state.pop("prev_sighup", signal.SIG_DFL))


def _after_fork_child():
    """A thread of the parent that held a lock at fork() does not exist in the
    child (no lock is held by the forking thread itself: none is held across
    a call that could fork)."""
    global _lock, _covered_lock
    _lock = threading.Lock()
    _covered_lock = threading.Lock()
    _ext.after_fork_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)


# ---- threads -------------------------------------------------------------------
# NumPy's handler lives in a ContextVar, and threads started with `threading` do
# not inherit the starting thread's context on CPython <= 3.13 (on 3.14 only with
# sys.flags.thread_inherit_context). Each new thread therefore sets datamem's
# handler itself, before run(), inside the context run() will use.

def _thread_setup(thread):
    _cover(thread)
    _ext.set_thread_name(thread.name)
    ctx = getattr(thread, "_context", None)
    if ctx is not None:  # 3.14+: run() executes inside thread._context
        ctx.run(_set_if_not_datamem)
    else:
        _ext.set_handler(_ext.handler())


def _set_if_not_datamem():
    if _ext.handler_tags(_ext.get_handler()) is None:
        _ext.set_handler(_ext.handler())


def _patch_threads():
    if _state["threads_patched"]:
        return
    orig = threading.Thread._bootstrap_inner

    def _bootstrap_inner(self):
        try:
            _thread_setup(self)
        except Exception as e:  # never stop a thread from starting
            _warn("datamem: thread %r not covered: %s" % (self.name, e))
        try:
            return orig(self)
        finally:  # the thread has left threading's list: an uncovered one may be gone
            try:
                _publish_uncovered()
            except Exception:  # interpreter shutdown
                pass

    _state["orig_bootstrap"] = orig
    threading.Thread._bootstrap_inner = _bootstrap_inner
    _state["threads_patched"] = True


def _unpatch_threads():
    if _state["threads_patched"]:
        threading.Thread._bootstrap_inner = _state["orig_bootstrap"]
        _state["threads_patched"] = False
