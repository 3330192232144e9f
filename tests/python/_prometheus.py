"""A real Prometheus server for tests: Debian's `prometheus` binary run directly
(never the packaged service) on 127.0.0.1 with a free port, storage in a
temporary directory, a 1 s scrape interval, and bounded waits everywhere.

    from _prometheus import Prometheus, skip_reason
    if skip_reason():
        pytest.skip(skip_reason())
    with Prometheus(tmp_path, targets=["127.0.0.1:9464"], labels={"pid": "12"}) as prom:
        prom.wait_for('up{job="datamem"} == 1')
        vector = prom.query("sum(datamem_arena_allocated_bytes)")

Targets: `targets` (static, one job) and/or `file_sd` (a list of groups in
Prometheus' file_sd format, written to a file that the test may rewrite with
`write_file_sd()` while the server runs). `rule_files` are loaded too, so
alert rules can be evaluated (`alerts()`).

Each query goes through the HTTP API (`/api/v1/query`); an API error raises
PrometheusError with Prometheus' own message (a PromQL syntax error, say).
"""
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

BINARY = "prometheus"
PROMTOOL = "promtool"


class PrometheusError(AssertionError):
    """Prometheus answered with an error (or did not answer in time)."""


def binary():
    return shutil.which(BINARY)


def skip_reason():
    """None when a Prometheus binary is on PATH, else why the test cannot run."""
    if binary() is None:
        return ("Debian's prometheus is not installed (apt-get install prometheus; "
                "scripts/setup.sh does it)")
    return None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_env():
    """The environment for a helper program (Prometheus, a browser): the test's own,
    without the sanitizer runtimes scripts/asan-python.sh preloads into Python."""
    env = dict(os.environ)
    for k in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS"):
        env.pop(k, None)
    return env


def _yaml_str(s):
    return json.dumps(str(s))  # a JSON string is a valid YAML flow scalar


class Prometheus:
    """One Prometheus process. Use as a context manager, or start()/stop()."""

    def __init__(self, workdir, targets=(), labels=None, file_sd=None, job="datamem",
                 scrape_interval="1s", rule_files=(), evaluation_interval="1s",
                 metrics_path="/metrics", start_timeout=30.0):
        self.dir = os.path.join(str(workdir), "prometheus")
        os.makedirs(self.dir, exist_ok=True)
        self.targets = list(targets)
        self.labels = dict(labels or {})
        self.file_sd = file_sd
        self.job = job
        self.scrape_interval = scrape_interval
        self.rule_files = [os.path.abspath(str(r)) for r in rule_files]
        self.evaluation_interval = evaluation_interval
        self.metrics_path = metrics_path
        self.start_timeout = start_timeout
        self.proc = None
        self.port = None
        self.log_path = os.path.join(self.dir, "prometheus.log")
        self.sd_path = os.path.join(self.dir, "targets.json")

    # ---- configuration -------------------------------------------------------

    def write_file_sd(self, groups):
        """Rewrites the file_sd targets (a list of {"targets": [...], "labels": {...}});
        Prometheus picks the change up on its own (inotify)."""
        tmp = self.sd_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(groups, f)
        os.replace(tmp, self.sd_path)

    def _config(self):
        lines = ["global:",
                 "  scrape_interval: %s" % self.scrape_interval,
                 "  scrape_timeout: %s" % self.scrape_interval,
                 "  evaluation_interval: %s" % self.evaluation_interval]
        if self.rule_files:
            lines.append("rule_files:")
            lines += ["  - %s" % _yaml_str(r) for r in self.rule_files]
        lines += ["scrape_configs:",
                  "  - job_name: %s" % _yaml_str(self.job),
                  "    metrics_path: %s" % _yaml_str(self.metrics_path)]
        if self.targets:
            lines += ["    static_configs:",
                      "      - targets: [%s]" % ", ".join(_yaml_str(t) for t in self.targets)]
            if self.labels:
                lines.append("        labels:")
                lines += ["          %s: %s" % (k, _yaml_str(v)) for k, v in self.labels.items()]
        if self.file_sd is not None or not self.targets:
            self.write_file_sd(self.file_sd or [])
            lines += ["    file_sd_configs:",
                      "      - files: [%s]" % _yaml_str(self.sd_path),
                      "        refresh_interval: 1s"]
        return "\n".join(lines) + "\n"

    # ---- life cycle --------------------------------------------------------------

    def start(self):
        if binary() is None:
            raise PrometheusError(skip_reason())
        cfg = os.path.join(self.dir, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write(self._config())
        last = ""
        for _ in range(3):  # a free port can be taken between probe and bind: retry
            self.port = free_port()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [binary(), "--config.file=" + cfg,
                 "--storage.tsdb.path=" + os.path.join(self.dir, "data"),
                 "--web.listen-address=127.0.0.1:%d" % self.port,
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.dir, env=tool_env())
            log.close()
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.1)
            last = self.log_tail()
            self.stop()
            if "address already in use" not in last:
                break
        raise PrometheusError("prometheus did not become ready on 127.0.0.1:%s; its log:\n%s"
                              % (self.port, last))

    def stop(self, timeout=10.0):
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, n=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    # ---- the HTTP API --------------------------------------------------------------

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def api(self, path, **params):
        """GET /api/v1/<path>; returns `data`, raises PrometheusError on an error."""
        q = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(self.url("/api/v1/" + path + ("?" + q if q else "")),
                                        timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            try:
                body = json.load(e)
            except ValueError:
                raise PrometheusError("%s: HTTP %d" % (path, e.code)) from None
        if body.get("status") != "success":
            raise PrometheusError("%s %s: %s: %s" % (path, params, body.get("errorType"),
                                                     body.get("error")))
        return body["data"]

    def query(self, promql, at=None):
        """An instant query. Returns the result: a list of {"metric", "value"} for a
        vector, [time, "value"] for a scalar."""
        params = {"query": promql}
        if at is not None:
            params["time"] = "%.3f" % at
        return self.api("query", **params)["result"]

    def wait_for(self, promql, timeout=20.0, ok=bool):
        """Polls `promql` until ok(result) holds; returns the result. Raises with the
        last result and the targets' health when it does not in time."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(promql)
            if ok(res):
                return res
            if time.monotonic() > deadline:
                raise PrometheusError("%r gave %r after %.0f s; targets: %s"
                                      % (promql, res, timeout, self.target_health()))
            time.sleep(0.25)

    def targets_active(self):
        return self.api("targets", state="active")["activeTargets"]

    def target_health(self):
        return [(t["scrapeUrl"], t["health"], t.get("lastError", ""))
                for t in self.targets_active()]

    def metadata(self):
        """{metric family: [{"type", "help", "unit"}]} as scraped."""
        return self.api("metadata")

    def alerts(self):
        return self.api("alerts")["alerts"]

    def rules(self):
        return self.api("rules")["groups"]


def promtool(*args, timeout=60):
    """Runs promtool; returns the CompletedProcess (text)."""
    exe = shutil.which(PROMTOOL)
    if exe is None:
        raise PrometheusError("promtool is not installed (Debian's prometheus package has it)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env=tool_env())
