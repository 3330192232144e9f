"""Dask and Ray clusters as real hosts are: each node in its own network
namespace (its own address on a private network this test makes: a bridge in a
namespace of its own, a veth pair per node, addresses in 10.213.0.0/24 that
exist only inside these namespaces, which have no route out) and its own mount
namespace with a private tmpfs on /tmp and /dev/shm. Nothing passes through a shared directory, so what
docs/cluster.md says is tested as it would be on separate machines: the Dask
plugin assumes no shared file system (the policy reaches every worker through
the plugin), the cluster-wide tag table covers every worker, and a reload reaches
them all; Ray's runtime_env ships the policy to a second node and
datamem.ray.tag_table() reads the workers of both. Needs root (namespaces,
mounts); run by scripts/test.sh's "Dask, Ray and joblib workers" stage."""
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, need

SUBNET = "10.213.0"


def _ip(*args, check=True):
    return subprocess.run(["ip"] + list(args), capture_output=True, text=True, timeout=30,
                          check=check)


def _skip_reason():
    if os.geteuid() != 0:
        return "SKIP: network and mount namespaces need root"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "SKIP: needs ip (iproute2) and unshare (util-linux); scripts/setup.sh installs them"
    return None


class Hosts:
    """Hosts `names` on one private network: each a network namespace with
    address 10.213.0.<i+1>, joined by a bridge in one more namespace. run()
    starts a process there in a fresh mount and UTS namespace (hostname: the
    host's name) with a private tmpfs on /tmp and /dev/shm. close() kills every
    process left in the namespaces (by pid: `ip netns pids`) and deletes them,
    which deletes the veths and the bridge with them."""

    def __init__(self, names, logdir):
        self.prefix = "dm%d-%d" % (os.getpid(), time.monotonic_ns() % 100000)
        self.names = list(names)
        self.logdir = logdir
        self.made = []
        self.procs = []

    def ns(self, name):
        return "%s-%s" % (self.prefix, name)

    def addr(self, name):
        return "%s.%d" % (SUBNET, self.names.index(name) + 1)

    def open(self):
        hub = self.ns("hub")
        _ip("netns", "add", hub)
        self.made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self.ns(name)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", "v%d" % i, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", hub, "link", "set", "v%d" % i, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", self.addr(name) + "/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        return self

    def run(self, name, argv, env, stdout=None):
        """Starts argv on host `name`; its output goes to logdir/<name>.log
        unless stdout is given."""
        # A checkout under /tmp (a CI clone in mktemp -d) would vanish under the
        # host's fresh /tmp with its interpreter and code: it is held open
        # (fd 3) before the mount and bound back at its path, and nothing else.
        before = after = ""
        if os.path.realpath(ROOT).startswith("/tmp/"):
            q = shlex.quote(os.path.realpath(ROOT))
            before = "exec 3<%s && " % q
            after = ("mkdir -p %s && mount --no-canonicalize --bind /proc/self/fd/3 %s && "
                     "exec 3<&- && " % (q, q))
        wrap = (before + "mount -t tmpfs -o size=512m,mode=1777 tmpfs /tmp && " + after +
                "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && "
                'hostname "$0" && exec "$@"')
        log = open(os.path.join(self.logdir, name + ".log"), "ab")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(name), "unshare", "--mount", "--uts",
                              "--propagation", "private", "sh", "-c", wrap, name] + list(argv),
                             env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                             stdout=stdout or log, stderr=subprocess.STDOUT if stdout is None
                             else log, start_new_session=True, text=True)
        log.close()
        self.procs.append(p)
        return p

    def log(self, name):
        try:
            with open(os.path.join(self.logdir, name + ".log"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def close(self):
        for _ in range(50):  # processes first: a namespace lives on while one holds it
            pids = []
            for ns in self.made:
                r = _ip("netns", "pids", ns, check=False)
                pids += [int(p) for p in r.stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self.procs:
                if p.poll() is None:
                    try:
                        p.wait(timeout=0.1)
                    except subprocess.TimeoutExpired:
                        pass
            time.sleep(0.1)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)


@pytest.fixture
def hosts(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    made = []

    def make(*names):
        h = Hosts(names, str(tmp_path))
        made.append(h)
        try:
            return h.open()
        except subprocess.CalledProcessError as e:
            pytest.skip("SKIP: cannot make network namespaces here: %s" % (e.stderr.strip(),))
    yield make
    for h in made:
        h.close()
        left = [ns for ns in h.made if _ip("netns", "pids", ns, check=False).returncode == 0]
        assert not left, "namespaces left behind: %s" % left


def _env():
    """The nodes' environment: no datamem variable of this test's process, and
    no TMPDIR (a node's temp dir is its own /tmp)."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("DATAMEM_") and k not in ("TMPDIR", "TEMP", "TMP")}
    e.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    return e


def _finish(p, hosts, timeout, nodes=()):
    """The JSON the driver `p` printed last, within `timeout` s and while the
    processes `nodes` run; else the logs."""
    end = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < end and all(n.poll() is None for n in nodes):
        time.sleep(0.2)
    if p.poll() is None:
        p.kill()
    out, _ = p.communicate()
    logs = "\n".join("--- %s\n%s" % (n, hosts.log(n)) for n in hosts.names)
    assert p.returncode == 0 and out.strip(), "driver rc=%s\n%s\n%s" % (p.returncode,
                                                                        out[-3000:], logs)
    return json.loads(out.strip().splitlines()[-1])


# ---- the policy: task arrays (1,000,000 bytes) go to arena "tasks", then, reloaded, "later" --

POLICY = """version: 1
default: general
arenas:
  general: {}
  tasks: {}
  later: {}
rules:
  - name: task-arrays
    match: {size: {min: 1000000, max: 1000000}}
    arena: tasks
"""
POLICY2 = POLICY.replace("arena: tasks", "arena: later")

# ---- Dask: a scheduler, two workers (with nannies), a client, each on its own host ---------

DASK_CLIENT = r"""
import json, os, socket, sys, time
import numpy as np
from dask.distributed import Client, wait
import datamem, datamem.dask

def hold(i):
    import datamem
    a = np.full(125000, float(i))                   # 1,000,000 bytes: rule task-arrays
    return a, datamem.arena_of(a)

def where():
    return {"host": socket.gethostname(), "tmp": os.stat("/tmp").st_dev,
            "policy": datamem.current_policy(), "config": os.environ.get("DATAMEM_CONFIG")}

def deadline(what, cond, bound=60.0):
    end = time.monotonic() + bound
    while True:
        try:                                        # a worker restarting answers nothing
            v = what()
            if cond(v):
                return v
        except Exception as e:
            v = e
        if time.monotonic() > end:
            raise SystemExit("not within %g s: %r" % (bound, v))
        time.sleep(0.1)

policy_text, policy2_text, scheduler = sys.argv[1:4]
os.makedirs("/tmp/client-only")                     # only this host has it
pol = "/tmp/client-only/policy.yaml"
with open(pol, "w") as f:
    f.write(policy_text)
out = {"client": where()}
with Client(scheduler, timeout=60) as c:
    deadline(lambda: len(c.scheduler_info()["workers"]), lambda n: n == 2)
    out["before"] = c.run(where)
    c.register_plugin(datamem.dask.Policy(pol))     # restarts each worker under the policy
    deadline(lambda: c.run(datamem.current_policy),
             lambda r: len(r) == 2 and all(r.values()))
    out["after"] = c.run(where)
    out["sched_tmp"] = c.run_on_scheduler(lambda: os.stat("/tmp").st_dev)
    out["client_file_seen"] = c.run(os.path.exists, pol)
    # The path each nanny wrote the policy to on its own host, by the documented call.
    out["policy_file"] = c.run(lambda: datamem.dask.policy_file(policy_text.encode()))
    workers = sorted(c.scheduler_info()["workers"])
    futs = {w: [c.submit(hold, i, workers=[w], pure=False) for i in range(8)] for w in workers}
    wait(sum(futs.values(), []))
    out["arenas"] = {w: sorted({f.result()[1] for f in fs}) for w, fs in futs.items()}
    out["table"] = datamem.dask.tag_table(c)
    out["text"] = datamem.dask.format_table(out["table"])
    out["stats_hash"] = {w: s["policy_hash"] for w, s in datamem.dask.stats(c).items()}
    pids = c.run(os.getpid)
    with open(pol + ".v2", "w") as f:
        f.write(policy2_text)
    out["reload"] = datamem.dask.reload(c, pol + ".v2")
    out["same_pids"] = c.run(os.getpid) == pids
    later = {w: c.submit(hold, 99, workers=[w], pure=False) for w in workers}
    out["arenas_after"] = {w: f.result()[1] for w, f in later.items()}
    out["workers"] = workers
print(json.dumps(out))
"""


def test_dask_workers_on_separate_hosts(hosts):
    need("distributed", "dask")
    h = hosts("sched", "w1", "w2", "client")
    sched = "tcp://%s:8786" % h.addr("sched")
    env = _env()
    py = sys.executable
    nodes = [h.run("sched", [py, "-m", "distributed.cli.dask_scheduler", "--host",
                             h.addr("sched"), "--port", "8786", "--no-dashboard"], env)]
    for w in ("w1", "w2"):
        nodes += [h.run(w, [py, "-m", "distributed.cli.dask_worker", sched, "--host", h.addr(w),
                  "--nworkers", "1", "--nthreads", "1", "--memory-limit", "1GiB",
                  "--no-dashboard"], env)]
    drv = h.run("client", [py, "-c", DASK_CLIENT, POLICY, POLICY2, sched], env,
                stdout=subprocess.PIPE)
    out = _finish(drv, h, timeout=150, nodes=nodes)
    workers = out["workers"]
    ip = {w: w.split("//")[1].split(":")[0] for w in workers}
    assert sorted(ip.values()) == [h.addr("w1"), h.addr("w2")]
    # Four hosts, four /tmp, none this test's: what one writes there no other sees.
    devs = {out["client"]["tmp"], out["sched_tmp"]} | {v["tmp"] for v in out["after"].values()}
    assert len(devs) == 4 and os.stat("/tmp").st_dev not in devs, out
    assert sorted(v["host"] for v in out["after"].values()) == ["w1", "w2"]
    assert not any(out["client_file_seen"].values())
    # The policy reached both workers through the plugin: no policy before, and after,
    # each worker's own copy, written by its nanny in that host's /tmp.
    assert not any(v["policy"] for v in out["before"].values()), out["before"]
    for w, v in out["after"].items():
        assert v["policy"] == v["config"] == out["policy_file"][w], out["after"]
        assert v["policy"].startswith("/tmp/datamem-dask-%d/policy-" % os.geteuid())
    assert out["arenas"] == {w: ["tasks"] for w in workers}
    # The tag table covers both workers: 8 arrays of 1,000,000 bytes live on each.
    rows = [r for r in out["table"] if r[1] == "hold"]
    assert sorted(r[0] for r in rows) == workers, out["text"]
    assert all(r[2] >= 8 * 1000000 for r in rows), out["text"]
    assert len(set(out["stats_hash"].values())) == 1
    # A reload reaches both, in place.
    assert sorted(out["reload"]) == workers
    assert all(r["ok"] for r in out["reload"].values()), out["reload"]
    new = {r["policy_hash"] for r in out["reload"].values()}
    assert len(new) == 1 and new != set(out["stats_hash"].values())
    assert out["same_pids"]
    assert out["arenas_after"] == {w: "later" for w in workers}


# ---- Ray: a head node (with the driver) and a worker node, each on its own host ------------

RAY_START = ["-m", "ray.scripts.scripts", "start", "--num-cpus", "1",
             "--object-store-memory", str(80 << 20), "--disable-usage-stats"]

RAY_DRIVER = r"""
import json, os, socket, subprocess, sys, time
import numpy as np, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
import datamem, datamem.ray

start, ip, policy_text = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
subprocess.run([sys.executable] + start + ["--head", "--include-dashboard=false",
                                            "--node-ip-address", ip, "--port", "6379"],
               check=True, stdout=sys.stderr, timeout=120)
print("head is up", flush=True)
os.makedirs("/tmp/driver-only")                     # only the head's host has it
pol = "/tmp/driver-only/policy.yaml"
with open(pol, "w") as f:
    f.write(policy_text)
ray.init(address="%s:6379" % ip, log_to_driver=False, logging_level="ERROR",
         runtime_env=datamem.ray.runtime_env(pol, stats_http="127.0.0.1:0"))

@ray.remote
class Holder:
    def fill(self):
        from datamem import _ext
        self.a = [np.full(125000, 1.0) for _ in range(8)]   # 8 x 1,000,000 bytes
        return {"host": socket.gethostname(), "tmp": os.stat("/tmp").st_dev,
                "policy": datamem.current_policy(), "config": os.environ.get("DATAMEM_CONFIG"),
                "arena": datamem.arena_of(self.a[0]),
                "tags": list(_ext.handler_tags(_ext.get_handler()) or []),
                "driver_file_seen": os.path.exists(pol)}

end = time.monotonic() + 60
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    if time.monotonic() > end:
        raise SystemExit("the worker node did not join: %r" % ray.nodes())
    time.sleep(0.2)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
holders = [Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
           .remote() for n in nodes]
out = {"driver_tmp": os.stat("/tmp").st_dev,
       "holders": ray.get([h.fill.remote() for h in holders], timeout=120)}
out["stats"] = {k: s.get("policy_hash") for k, s in datamem.ray.stats().items()}
out["table"] = datamem.ray.tag_table()
out["text"] = datamem.ray.format_table(out["table"])
print(json.dumps(out), flush=True)
"""


def test_ray_nodes_on_separate_hosts(hosts):
    need("ray", "ray")
    h = hosts("head", "node")
    env = _env()
    py = sys.executable
    drv = h.run("head", [py, "-c", RAY_DRIVER, json.dumps(RAY_START), h.addr("head"), POLICY],
                env, stdout=subprocess.PIPE)
    ready, _, _ = select.select([drv.stdout], [], [], 150)
    first = drv.stdout.readline() if ready else "(nothing within 150 s)"
    assert first.strip() == "head is up", first + h.log("head")
    node = h.run("node", [py] + RAY_START + ["--address", "%s:6379" % h.addr("head"),
                                             "--node-ip-address", h.addr("node"), "--block"], env)
    out = _finish(drv, h, timeout=180, nodes=[node])
    by_host = {v["host"]: v for v in out["holders"]}
    assert sorted(by_host) == ["head", "node"], out["holders"]
    # Two hosts, two /tmp (the driver runs on the head's host).
    assert by_host["head"]["tmp"] == out["driver_tmp"] != by_host["node"]["tmp"]
    assert os.stat("/tmp").st_dev not in (by_host["head"]["tmp"], by_host["node"]["tmp"])
    # The policy reached the worker node with the job (runtime_env's env_vars, written
    # there into the worker's own directory), not through a file the driver wrote.
    for v in by_host.values():
        assert v["arena"] == "tasks" and v["tags"] == ["Holder"], v
        assert os.path.basename(v["policy"]).startswith("policy-") and \
            v["policy"] == v["config"], v
    assert by_host["head"]["driver_file_seen"] and not by_host["node"]["driver_file_seen"]
    # stats() and tag_table() read the workers of both nodes, each on its own host.
    assert {k.split(":")[0] for k in out["stats"]} == {"head", "node"}, out["stats"]
    rows = [r for r in out["table"] if r[1] == "Holder"]
    assert sorted(r[0].split(":")[0] for r in rows) == ["head", "node"], out["text"]
    assert all(r[2] >= 8 * 1000000 for r in rows), out["text"]
    assert "Holder" in out["text"]
