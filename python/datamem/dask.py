"""datamem for Dask (`distributed`) workers: `pip install datamem[dask]`.

    from dask.distributed import Client
    import datamem.dask
    client = Client(cluster)
    client.register_plugin(datamem.dask.Policy("policy.yaml"))
    ...
    datamem.dask.reload(client, "policy.yaml")   # new rules on every worker, no restart
    datamem.dask.stats(client)                   # {worker address: datamem.stats()}

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
"""
import hashlib
import logging
import os
import tempfile
import warnings

import datamem
from datamem import _files
from distributed.diagnostics.plugin import NannyPlugin

__all__ = ["Policy", "reload", "stats", "policy_file", "PLUGIN_NAME"]

PLUGIN_NAME = "datamem-policy"
_PRELOAD = __name__  # "datamem.dask": run in each worker, calls dask_setup(worker)
logger = logging.getLogger(__name__)


def policy_file(text):
    """Writes policy `text` (bytes) to a file named after its SHA-256 in this
    user's directory under the temp dir and returns the path. A file with the
    same name that this user wrote and that holds the same bytes is left alone
    (never rewritten under a running process); anything else there is replaced.

    The directory is checked the way the C side checks its own (issue 24): a
    real directory, not a symbolic link, owned by this user and writable by no
    one else, checked on the descriptor that the file is then written through
    (_files.owned_dir). Its name is predictable, so another user may have made
    it first, or a symbolic link there: both are refused, since whoever can
    change the directory or swap the link chooses the policy a worker loads."""
    d = os.path.join(tempfile.gettempdir(), "datamem-dask-%d" % os.geteuid())
    try:
        fd = _files.owned_dir(d, create=True)
    except _files.UnsafeError as e:
        raise PermissionError("datamem: %s; remove it or set TMPDIR" % e) from None
    try:
        name = "policy-%s.yaml" % hashlib.sha256(text).hexdigest()[:20]
        _files.write_if_changed(fd, name, text)
    finally:
        os.close(fd)
    return os.path.join(d, name)


def _read_checked(policy):
    """The bytes of `policy` (a path), validated here so that a bad policy fails
    on the client with its diagnostics instead of in every worker."""
    path = os.fspath(policy)
    with open(path, "rb") as f:
        text = f.read()
    ok, diag, _ = datamem.check(path)
    if not ok:
        raise datamem.PolicyError(diag)
    return path, text


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

    def environ(self):
        """The variables a worker process gets (on the nanny's host)."""
        env = {"DATAMEM_CONFIG": policy_file(self.text)}
        if self.stats_http:
            env["DATAMEM_STATS_HTTP"] = str(self.stats_http)
        return env

    def setup(self, nanny):
        env = self.environ()
        nanny.pre_spawn_env.update(env)
        nanny.env.update(env)
        _add_preload(nanny)
        logger.info("datamem: workers of nanny %s start under %s", nanny.address,
                    env["DATAMEM_CONFIG"])

    def teardown(self, nanny):
        for key in ("DATAMEM_CONFIG", "DATAMEM_STATS_HTTP"):
            value = nanny.pre_spawn_env.pop(key, None)
            nanny.env.pop(key, None)
            if value is not None and os.environ.get(key) == value:
                del os.environ[key]  # pre-spawn variables were copied there
        # Workers keep the policy until they restart; the preload stays (it only
        # exports metrics, and does nothing where datamem is not installed).


def _add_preload(nanny):
    """Adds this module to the preloads the nanny passes to its worker (in place,
    so a WorkerProcess that is restarted with its old arguments sees it too)."""
    pre = nanny.preload
    if isinstance(pre, str):
        pre = nanny.preload = [pre]
    elif pre is None:
        pre = nanny.preload = []
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


_collector = None


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
    try:
        import prometheus_client
    except ImportError:
        return
    if _collector is None:
        _collector = _Collector()
        prometheus_client.REGISTRY.register(_collector)


def dask_teardown(worker):
    global _collector
    if _collector is not None:
        import prometheus_client
        prometheus_client.REGISTRY.unregister(_collector)
        _collector = None


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
