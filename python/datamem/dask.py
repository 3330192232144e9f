"""datamem for Dask (`distributed`) workers: `pip install datamem[dask]`.

    from dask.distributed import Client
    import datamem.dask
    client = Client(cluster)
    client.register_plugin(datamem.dask.Policy("policy.yaml"))
    ...
    datamem.dask.reload(client, "policy.yaml")   # new rules on every worker, no restart
    datamem.dask.stats(client)                   # {worker address: datamem.stats()}
    print(datamem.dask.tag_table(client))        # live / peak bytes per task tag per worker

How the policy reaches a worker process. DATAMEM_CONFIG must be in a process's
environment when the interpreter starts: the start-up hook (datamem.pth) installs
the handler before NumPy can allocate anything. A nanny (checked with distributed
2026.8) starts its worker with multiprocessing's `spawn` and has two environments:
`nanny.env` (config `distributed.nanny.environ`, and what distributed's own
`Environ` plugin sets) is applied *inside* the worker after it has started, too
late for the hook; `nanny.pre_spawn_env` (`distributed.nanny.pre-spawn-environ`)
is copied into the nanny's os.environ just before each spawn. `Policy` is a
NannyPlugin that puts DATAMEM_CONFIG in the latter (and the former, for
completeness) and asks for a restart, so every worker — those running when it is
registered, those the nanny restarts after a crash, and nannies that join later
(the scheduler hands them its nanny plugins before their first worker starts) —
starts under the policy. Side effect, the same as for any pre-spawn variable:
the nanny's own process keeps DATAMEM_CONFIG in os.environ (with LocalCluster
that is the client's process) until the plugin is unregistered.

No shared file system is assumed: the plugin carries the policy's text (read on
the client when it is made), and each nanny writes it to
$TMPDIR/datamem-dask-<uid>/policy-<sha256 prefix>.yaml on its own host (same
text, same file: nannies of one host share it, and a file in use is never
rewritten with other bytes).

Metrics: the plugin also adds this module to the worker's preloads; its
dask_setup() registers a prometheus_client collector, so each worker's datamem
metrics appear on the worker's own `/metrics` (the Dask dashboard port): a Dask
deployment needs no extra port. Worker processes started with `fork` or
`forkserver` (distributed.worker.multiprocessing-method) do not run the start-up
hook; dask_setup() installs the policy there itself and says that threads the
worker started before it are not covered.

Tasks: dask_setup() also makes every task run under
datamem.tag(<name>): the task's `datamem` annotation (tasks made, by
collections or client.submit, inside `with dask.annotate(datamem="name"):`),
else its key prefix as the dashboard groups it (dask.utils.key_split). The tag is set in
the coroutine that Worker.execute runs as its own asyncio task; the worker
hands the task to its thread pool with the coroutine's contextvars copied, and
NumPy's handler is a ContextVar, so the arrays the task makes carry the tag in
the pool thread. Names are made tag-safe by task_tag(). With per-tag counting
on (the plugin sets DATAMEM_TAG_BYTES=1, and DATAMEM_MEMORY_LIMIT from the
nanny's memory_limit for a policy's `worker_limit: 85%`), datamem.stats()
["tags"] holds each tag's live and peak bytes, and a policy's `tag_limits`
refuse the one task that passes its tag's limit: it fails with a MemoryError
naming the tag, the limit and the request (datamem.memory_error, applied in
the pool thread that allocated), and the worker and its other tasks carry on.
Not covered: threads a task starts itself (they start with an empty context
unless the task copies it: contextvars.copy_context().run; work the task hands
to a ThreadPoolExecutor carries its tag, datamem._patch_pools), and tasks run by a
process-pool executor (annotate executor=...), whose processes get no context.
"""
import functools
import logging
import os
import threading
import warnings

import datamem
from datamem import _files
from datamem._tasks import TaskTag, task_tag, tag_rows, format_table
from distributed.diagnostics.plugin import NannyPlugin

__all__ = ["Policy", "reload", "stats", "tag_table", "tag_rows", "format_table", "task_tag", "policy_file",
           "PLUGIN_NAME", "ANNOTATION"]

PLUGIN_NAME = "datamem-policy"
ANNOTATION = "datamem"  # dask.annotate(datamem="name"): the tag of the tasks made inside
_PRELOAD = __name__  # "datamem.dask": run in each worker, calls dask_setup(worker)
logger = logging.getLogger(__name__)


def policy_file(text):
    """Writes policy `text` (bytes) to a file named after its SHA-256 in this
    user's own directory under the temp dir and returns the path
    (datamem._files.policy_file: the directory rule, the file left alone when
    it already holds these bytes)."""
    return _files.policy_file(text)


def _read_checked(policy):
    """The bytes of `policy` (a path), validated here so that a bad policy fails
    on the client with its diagnostics instead of in every worker."""
    path = os.fspath(policy)
    ok, diag, _ = datamem.check(path)  # the policy's rule too: refused in one line
    if not ok:
        raise datamem.PolicyError(diag)
    return path, _files.read_policy(path, _files.POLICY_MAX)


class Policy(NannyPlugin):
    """Puts every worker of a cluster under a datamem policy (see the module
    docstring for how). `policy`: a path on the client; its text travels with
    the plugin. `stats_http`: also serve datamem's own endpoint in each worker
    (DATAMEM_STATS_HTTP, e.g. "127.0.0.1:0"), for `python -m datamem ls / top
    --all`; not needed for Prometheus, which can scrape the workers' /metrics."""

    name = PLUGIN_NAME
    restart = True  # the running workers must start again to run the hook

    def __init__(self, policy, stats_http=None, restart=True):
        self.path, self.text = _read_checked(policy)
        self.stats_http = stats_http
        self.restart = restart

    def environ(self, nanny=None):
        """The variables a worker process gets (on the nanny's host): the
        policy, per-tag byte counting on, and the worker's memory_limit (bytes;
        what a policy's `worker_limit: 85%` is a share of) when its nanny has one."""
        env = {"DATAMEM_CONFIG": policy_file(self.text), "DATAMEM_TAG_BYTES": "1"}
        limit = _memory_limit(nanny)
        if limit:
            env["DATAMEM_MEMORY_LIMIT"] = str(int(limit))
        if self.stats_http:
            env["DATAMEM_STATS_HTTP"] = str(self.stats_http)
        return env

    def setup(self, nanny):
        env = self.environ(nanny)
        nanny.pre_spawn_env.update(env)
        nanny.env.update(env)
        _add_preload(nanny)
        logger.info("datamem: workers of nanny %s start under %s", nanny.address,
                    env["DATAMEM_CONFIG"])

    def teardown(self, nanny):
        for key in _ENV_KEYS:
            value = nanny.pre_spawn_env.pop(key, None)
            nanny.env.pop(key, None)
            if value is not None and os.environ.get(key) == value:
                del os.environ[key]  # pre-spawn variables were copied there
        # Workers keep the policy until they restart; the preload stays (it only
        # exports metrics, and does nothing where datamem is not installed).


def _memory_limit(nanny):
    """The nanny's memory_limit in bytes, or None (distributed 2026.8 keeps it
    on nanny.memory_manager; older releases on the nanny)."""
    for owner in (getattr(nanny, "memory_manager", None), nanny):
        limit = getattr(owner, "memory_limit", None)
        if isinstance(limit, (int, float)) and limit > 0:
            return int(limit)
    return None


_ENV_KEYS = ("DATAMEM_CONFIG", "DATAMEM_STATS_HTTP", "DATAMEM_TAG_BYTES", "DATAMEM_MEMORY_LIMIT")


def _add_preload(nanny):
    """Adds this module to the preloads the nanny passes to its worker (in place,
    so a WorkerProcess that is restarted with its old arguments sees it too).
    The nanny holds them as given: a string, None, a list, or the tuple that
    the `dask worker` command line's --preload makes (checked with distributed
    2026.8)."""
    pre = nanny.preload
    if isinstance(pre, str):
        pre = nanny.preload = [pre]
    elif pre is None:
        pre = nanny.preload = []
    elif not isinstance(pre, list):
        pre = nanny.preload = list(pre)
    if _PRELOAD not in pre:
        pre.append(_PRELOAD)
    proc = getattr(nanny, "process", None)
    kw = getattr(proc, "worker_kwargs", None)
    if isinstance(kw, dict) and kw.get("preload") is not pre:
        kw["preload"] = pre


# ---- inside the worker process --------------------------------------------------------------

class _Collector:
    """prometheus_client collector: datamem's metrics, rendered by the C runtime
    and parsed back into families at each scrape of the worker's /metrics."""

    def describe(self):
        return []  # nothing to check at registration (and no scrape then)

    def collect(self):
        if datamem.current_policy() is None:
            return
        from prometheus_client.parser import text_string_to_metric_families
        yield from text_string_to_metric_families(datamem.metrics())


_collector = None  # registered with prometheus_client; set and cleared under _collector_lock
_collector_lock = threading.Lock()


def _tag_of(worker, key):
    """The tag of task `key` on `worker`: its annotation, else its key prefix."""
    ts = worker.state.tasks.get(key)
    ann = getattr(ts, "annotations", None) or {}
    name = ann.get(ANNOTATION)
    if not name:
        from dask.utils import key_split
        name = key_split(key)
    return task_tag(name)


def _tag_tasks(worker):
    """Wraps this worker's execute (an instance attribute that shadows the
    method: the state machine calls self.execute) so each task runs under its
    tag. Worker.execute runs as its own asyncio task, so the tag set here stays
    in that task's context and reaches the executor thread through
    run_in_executor_with_context's copy (checked with distributed 2026.8).
    The wrapper runs outside the task and never raises (TaskTag): an exception
    there would leave the task executing for good."""
    execute = worker.execute
    if getattr(execute, "_datamem", False):
        return

    @functools.wraps(execute)
    async def tagged_execute(key, *args, **kwargs):
        tag = TaskTag(lambda: _tag_of(worker, key))  # never raises: untagged on failure
        try:
            return await execute(key, *args, **kwargs)
        finally:
            tag.close()

    tagged_execute._datamem = True
    worker.execute = tagged_execute


def _detailed(run):
    """Wraps distributed.worker's _run_task_simple / _run_task_async (they run
    the task in the thread that allocates and turn its exception into the
    message the client gets): a MemoryError caused by a datamem limit during
    this task is replaced by datamem.memory_error(e), which names the tag or
    arena, the limit and the request, chained to NumPy's. Built in the thread
    that was refused, against the refusal count taken before the task (a pool
    thread's earlier refusal never explains a later task's MemoryError); not in
    execute, which runs on the event loop."""
    from distributed.core import error_message

    def redo(msg, since):
        e = msg.get("actual_exception") if isinstance(msg, dict) else None
        if msg.get("op") != "task-erred" or not isinstance(e, MemoryError):
            return msg  # memory_error() itself leaves alone an error it made
        try:
            detail = datamem.memory_error(e, since=since)
        except Exception:  # an explanation must never cost the task's own error
            detail = None
        if detail is None:
            return msg
        try:
            raise detail.with_traceback(e.__traceback__) from e
        except MemoryError as d:
            new = error_message(d)
        for k in ("status", "exception", "traceback", "exception_text", "traceback_text"):
            if k in new:
                msg[k] = new[k]
        msg["actual_exception"] = detail
        return msg

    if getattr(run, "_datamem", False) or not hasattr(datamem, "memory_error"):
        return run
    import inspect
    if inspect.iscoroutinefunction(run):
        @functools.wraps(run)
        async def wrapped(*args, **kwargs):
            since = datamem.refusals()
            return redo(await run(*args, **kwargs), since)
    else:
        @functools.wraps(run)
        def wrapped(*args, **kwargs):
            since = datamem.refusals()
            return redo(run(*args, **kwargs), since)
    wrapped._datamem = True
    return wrapped


def _detail_errors():
    """Installs _detailed() on distributed.worker's task runners, once per
    process; a distributed without them keeps NumPy's message."""
    import distributed.worker as w
    for name in ("_run_task_simple", "_run_task_async"):
        run = getattr(w, name, None)
        if callable(run):
            setattr(w, name, _detailed(run))


def dask_setup(worker):
    """Preload hook, run by each worker process at start."""
    global _collector
    path = os.environ.get("DATAMEM_CONFIG")
    if path and datamem.current_policy() is None:
        # fork / forkserver workers: the start-up hook did not run here.
        datamem.install(path)
        warnings.warn("datamem: worker %s installed %s after start (multiprocessing-method "
                      "is not spawn); threads it started before are not covered" %
                      (worker.address, path), RuntimeWarning)
    if datamem.current_policy() is not None:
        _tag_tasks(worker)
        _detail_errors()
    try:
        import prometheus_client
    except ImportError:
        return
    with _collector_lock:  # two workers' setup in one process register it once
        if _collector is None:
            _collector = _Collector()
            prometheus_client.REGISTRY.register(_collector)


def dask_teardown(worker):
    global _collector
    with _collector_lock:
        if _collector is not None:
            import prometheus_client
            prometheus_client.REGISTRY.unregister(_collector)
            _collector = None  # registered with prometheus_client; set and cleared under _collector_lock
_collector_lock = threading.Lock()


# ---- from the client ---------------------------------------------------------------------------

def _worker_reload(text):
    try:
        datamem.reload(policy_file(text))
    except (datamem.PolicyError, RuntimeError, OSError) as e:
        return {"ok": False, "error": str(e)}
    s = datamem.stats()
    return {"ok": True, "policy_path": s["policy_path"], "policy_hash": s["policy_hash"],
            "reloads": s["reloads"]}


def _registered(dask_scheduler):
    """(client path, stats_http) of the Policy the scheduler holds, or None."""
    import pickle
    blob = dask_scheduler.nanny_plugins.get(PLUGIN_NAME)
    if blob is None:
        return None
    p = pickle.loads(blob)
    return p.path, p.stats_http


def reload(client, policy=None):
    """Loads a new policy (or the registered file again, re-read on this machine)
    in every worker of `client`, without restarting them; live arrays stay where
    they are. Workers the nannies start later (restarts, new nannies) get it too.
    Returns {worker address: {"ok": True, "policy_hash": ...} or {"ok": False,
    "error": diagnostics}}. A policy that is bad here raises PolicyError and
    changes nothing."""
    registered = client.run_on_scheduler(_registered)
    if policy is None:
        if registered is None:
            raise RuntimeError("no datamem.dask.Policy is registered with this client's "
                               "scheduler; pass the policy's path")
        policy = registered[0]
    plugin = Policy(policy, stats_http=registered[1] if registered else None, restart=False)
    client.register_plugin(plugin, name=PLUGIN_NAME)  # nannies: env for the next spawn
    return client.run(_worker_reload, plugin.text)


def stats(client):
    """{worker address: datamem.stats() of that worker}."""
    return client.run(datamem.stats)


def tag_table(client):
    """Live and peak bytes per task tag on every worker of `client`, as rows
    (worker, tag, live, peak, limit, refused); format_table(rows) prints them."""
    return tag_rows(stats(client))
