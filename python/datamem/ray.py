"""datamem for Ray tasks and actors: `pip install datamem[ray]`.

    import ray, datamem.ray
    ray.init(runtime_env=datamem.ray.runtime_env("policy.yaml"))

A Ray worker is a fresh interpreter started by the raylet with the job's
runtime_env: its `env_vars` are in the process's environment from the start and
its `working_dir` is the process's current directory before Python runs, so
datamem's start-up hook (datamem.pth) installs the policy before NumPy loads,
exactly as for `DATAMEM_CONFIG=policy.yaml python job.py`.

runtime_env() ships the policy with the job (no shared file system needed):
it becomes the job's `working_dir` (a directory holding only the policy, or one
you name that contains it) and DATAMEM_CONFIG names it relative to that
directory, which Ray unpacks on every node. `stats_http` ("127.0.0.1:0") makes
each worker serve /metrics and announce itself, so `python -m datamem ls
--prometheus-sd FILE` on each node keeps Prometheus' targets current.
"""
import os
import shutil
import tempfile

import datamem

__all__ = ["runtime_env", "POLICY_NAME"]

POLICY_NAME = "datamem-policy.yaml"


def runtime_env(policy, working_dir=None, stats_http=None, base=None):
    """A Ray runtime_env that puts every task and actor of a job under `policy`.

    working_dir: None to ship a directory holding only the policy (a copy, made
    here); or the job's own working_dir, which must contain `policy`. base: a
    runtime_env to extend (its env_vars are kept; a working_dir in it is an
    error unless it is the one given here). The policy is checked here first: a
    bad one raises PolicyError with its diagnostics."""
    path = os.path.abspath(os.fspath(policy))
    ok, diag, _ = datamem.check(path)
    if not ok:
        raise datamem.PolicyError(diag)
    env = dict(base or {})
    if working_dir is None:
        if env.get("working_dir"):
            raise ValueError("base already has a working_dir: pass it as working_dir= "
                             "and keep the policy inside it")
        working_dir = tempfile.mkdtemp(prefix="datamem-ray-")
        shutil.copyfile(path, os.path.join(working_dir, POLICY_NAME))
        rel = POLICY_NAME
    else:
        working_dir = os.path.abspath(os.fspath(working_dir))
        rel = os.path.relpath(path, working_dir)
        if rel.startswith(os.pardir):
            raise ValueError("%s is not inside working_dir %s" % (path, working_dir))
    env["working_dir"] = working_dir
    env_vars = dict(env.get("env_vars") or {})
    env_vars["DATAMEM_CONFIG"] = rel  # resolved in the worker's working_dir at start
    if stats_http:
        env_vars["DATAMEM_STATS_HTTP"] = str(stats_http)
    env["env_vars"] = env_vars
    return env
