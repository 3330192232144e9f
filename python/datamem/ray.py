"""datamem for Ray tasks and actors: `pip install datamem[ray]`.

    import ray, datamem.ray
    ray.init(runtime_env=datamem.ray.runtime_env("policy.yaml"))

A Ray worker is a fresh interpreter started by the raylet with the job's
runtime_env: its `env_vars` are in the process's environment from the start, so
datamem's start-up hook (datamem.pth) installs the policy before NumPy loads,
exactly as for `DATAMEM_CONFIG=policy.yaml python job.py`.

runtime_env() ships the policy with the job (no shared file system needed): its
bytes, read here under the policy's rule, travel in the job's env_vars as
DATAMEM_CONFIG_TEXT (through Ray's control plane, not its files: Ray unpacks a
job's working_dir into its world-writable /tmp/ray, where the rule refuses a
policy, since any local user could swap it there). Each worker writes them to a
file in its own user's directory (datamem._files.policy_file) and installs it.
`stats_http` ("127.0.0.1:0") makes each worker serve /metrics and announce
itself, so `python -m datamem ls --prometheus-sd FILE` on each node keeps
Prometheus' targets current.

Tasks: runtime_env() also turns per-tag byte counting on
(DATAMEM_TAG_BYTES=1) and names worker_setup() as the job's
`worker_process_setup_hook`: each worker then runs every remote function under
datamem.tag(<its name>) and every actor method under datamem.tag(<the class's
name>), or the name given with the tag() decorator; names are made tag-safe
as in datamem.dask.task_tag(). A MemoryError that a datamem limit caused is
raised again as datamem.memory_error(e), naming the tag, the limit and the
request; Ray hands it to the caller as the task's error and the worker carries
on. The hook wraps what Ray's FunctionActorManager.get_execution_info returns
(checked with Ray 2.60): sync and async functions and methods are covered;
generator tasks and methods (num_returns="streaming"/"dynamic") run untagged,
as do threads a task starts itself. stats(address) / tag_table() gather the
per-tag numbers of every Ray worker on every node through the workers' own
endpoints (runtime_env(..., stats_http="127.0.0.1:0")).
"""
import contextlib
import functools
import inspect
import os

import datamem
from datamem import _files
from datamem._tasks import task_tag, tag_rows, format_table, untagged

__all__ = ["runtime_env", "worker_setup", "tag", "stats", "tag_table", "format_table",
           "ENV_TEXT_MAX", "SETUP_HOOK"]

ENV_TEXT_MAX = 120 * 1024  # under the kernel's 128 KiB for one environment string
SETUP_HOOK = __name__ + ".worker_setup"  # imported by name in each worker


def runtime_env(policy, working_dir=None, stats_http=None, base=None, tag_tasks=True):
    """A Ray runtime_env that puts every task and actor of a job under `policy`.

    The policy is checked here first (a bad one raises PolicyError with its
    diagnostics) and read under the policy's rule; its bytes go in env_vars as
    DATAMEM_CONFIG_TEXT (at most ENV_TEXT_MAX bytes: the kernel's limit on one
    environment string is 128 KiB). working_dir: the job's own working_dir, if
    any (the policy need not be in it). base: a runtime_env to extend (its
    env_vars are kept; a working_dir in it is an error unless it is the one
    given here). tag_tasks: run each task and actor method under a tag named
    after it (worker_setup() as the job's worker_process_setup_hook; a base
    with a hook of its own is an error: call datamem.ray.worker_setup() from
    that hook and pass tag_tasks=False)."""
    path = os.path.abspath(os.fspath(policy))
    ok, diag, _ = datamem.check(path)
    if not ok:
        raise datamem.PolicyError(diag)
    text = _files.read_policy(path, _files.POLICY_MAX)  # checked above, read under the same rule
    if len(text) > ENV_TEXT_MAX:
        raise ValueError("datamem: %s is %d bytes: a policy shipped to Ray workers in their "
                         "environment may have at most %d" % (path, len(text), ENV_TEXT_MAX))
    env = dict(base or {})
    if working_dir is not None:
        working_dir = os.path.abspath(os.fspath(working_dir))
        if env.get("working_dir") and env["working_dir"] != working_dir:
            raise ValueError("base already has another working_dir (%r)" % (env["working_dir"],))
        env["working_dir"] = working_dir
    env_vars = dict(env.get("env_vars") or {})
    env_vars.pop("DATAMEM_CONFIG", None)
    env_vars["DATAMEM_CONFIG_TEXT"] = text.decode("utf-8")  # a policy is UTF-8 (checked)
    env_vars["DATAMEM_TAG_BYTES"] = "1"
    if stats_http:
        env_vars["DATAMEM_STATS_HTTP"] = str(stats_http)
    env["env_vars"] = env_vars
    if tag_tasks:
        hook = env.get("worker_process_setup_hook")
        if hook and hook != SETUP_HOOK:
            raise ValueError("base already has a worker_process_setup_hook (%r): call "
                             "datamem.ray.worker_setup() from it and pass tag_tasks=False"
                             % (hook,))
        env["worker_process_setup_hook"] = SETUP_HOOK
    return env


# ---- tags for tasks and actor methods -------------------------------------------------------

def tag(name):
    """Decorator: the tasks of a function, or the methods of an actor class,
    run under tag `name` (made tag-safe) instead of their function's or class's
    name. Put it under @ray.remote:

        @ray.remote
        @datamem.ray.tag("loader")
        def load(path): ...
    """
    t = task_tag(name)

    def mark(obj):
        if inspect.isclass(obj):
            for v in vars(obj).values():
                f = getattr(v, "__func__", v)
                if inspect.isfunction(f):
                    f.__datamem_tag__ = t
        obj.__datamem_tag__ = t
        return obj
    return mark


@contextlib.contextmanager
def _in_tag(name):
    """datamem.tag(name) (which, on its way out, raises a MemoryError that a
    datamem limit caused as datamem.memory_error(e): naming the tag, the limit
    and the request), in a context that datamem serves even where Ray runs
    the call in one it does not: an async actor's methods run as asyncio tasks
    whose context is copied from Ray's C++ task thread, where NumPy's handler
    is still the default one (checked with Ray 2.60: such methods allocated
    outside the policy). The handler set here is put back on the way out. A
    failure to enter the tag never fails the task: it runs untagged (said once
    per process, datamem._tasks.untagged)."""
    from datamem import _ext
    with contextlib.ExitStack() as stack:
        try:
            prev = _ext.get_handler()
            if _ext.active() and _ext.handler_tags(prev) is None:
                _ext.set_handler(_ext.handler())
                stack.callback(_ext.set_handler, prev)
            stack.enter_context(datamem.tag(name))
        except Exception as e:  # never let tagging fail the task: it runs untagged
            untagged(e)
        yield


def _tagged(fn, name, attrs=None):
    """`fn` run under tag `name`, or fn itself where a tag cannot follow it
    (generators: their body runs between the caller's steps)."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        return fn
    probe = (attrs or {}).get("method", fn)
    if inspect.isgeneratorfunction(probe) or inspect.isasyncgenfunction(probe):
        return fn
    if inspect.iscoroutinefunction(probe):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            with _in_tag(name):
                return await fn(*args, **kwargs)
    else:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with _in_tag(name):
                return fn(*args, **kwargs)
    for k, v in (attrs or {}).items():
        setattr(run, k, v)
    run.__datamem_wrapped__ = True
    return run


def _wrap(function, descriptor):
    """The execution function Ray will call, tagged: a remote function by its
    (or its tag()'s) name; an actor method (Ray's executor, carrying .name and
    .method, which Ray reads to tell async methods apart) by its class's name."""
    if getattr(function, "__datamem_wrapped__", False):
        return function
    method = getattr(function, "method", None)
    if method is not None and hasattr(function, "name"):  # an actor method's executor
        if str(function.name).startswith("__ray"):
            return function  # Ray's own methods (__ray_ready__, __ray_terminate__, ...)
        name = getattr(method, "__datamem_tag__", None) or getattr(descriptor, "class_name", "")
        return _tagged(function, task_tag(name or function.name),
                       {"name": function.name, "method": method})
    name = getattr(function, "__datamem_tag__", None) or getattr(function, "__name__", None) \
        or str(getattr(descriptor, "function_name", "")).rsplit(".", 1)[-1]
    return _tagged(function, task_tag(name))


def worker_setup():
    """Ray's worker_process_setup_hook (runtime_env() names it): from now on
    each task and actor method this worker runs is tagged (see the module
    docstring). Does nothing where no policy is installed or on a Ray whose
    worker has no FunctionActorManager.get_execution_info."""
    if datamem.current_policy() is None:
        return
    import ray
    manager = getattr(ray._private.worker.global_worker, "function_actor_manager", None)
    get = getattr(manager, "get_execution_info", None)
    if get is None or getattr(get, "__datamem_wrapped__", False):
        return

    @functools.wraps(get)
    def get_execution_info(job_id, descriptor):
        info = get(job_id, descriptor)
        try:
            return info._replace(function=_wrap(info.function, descriptor))
        except Exception:  # never let tagging fail a task
            return info

    get_execution_info.__datamem_wrapped__ = True
    manager.get_execution_info = get_execution_info


# ---- numbers over the cluster ---------------------------------------------------------------

def _node_stats():
    """{"host:pid": stats} of the Ray workers on this node that serve stats."""
    import socket
    from datamem._stats import client, reload
    out = {}
    host = socket.gethostname()
    for pid, snap in client.scrape_all().items():
        if isinstance(snap, Exception):
            continue
        try:
            cmd = reload._cmdline(pid)
        except OSError:
            continue
        if cmd.startswith("ray::"):  # Ray names its workers' processes ray::<task>
            out["%s:%d" % (host, pid)] = snap
    return out


def stats(timeout=60):
    """{"host:pid": datamem stats} of every Ray worker process (tasks and
    actors) on every alive node of the connected cluster, read from the
    workers' own endpoints (runtime_env(..., stats_http="127.0.0.1:0")): one
    small task per node, pinned there. Workers that do not serve stats are not
    seen."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    probe = ray.remote(num_cpus=0)(_node_stats)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in ray.nodes() if n.get("Alive")]
    out = {}
    for part in ray.get(refs, timeout=timeout):
        out.update(part)
    return out


def tag_table(timeout=60):
    """Rows (worker, tag, live, peak, limit, refused) over every Ray worker of
    the cluster (see stats()); format_table(rows) prints them."""
    return tag_rows(stats(timeout))
