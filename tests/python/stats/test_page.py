"""The stats endpoint's page (GET /): served over TCP and the Unix socket with a
strict Content-Security-Policy, and checked in a real browser (Debian's
headless Chromium) against /stats.json.

The job runs in its own interpreter; it allocates through every demo arena,
makes one allocation fail (fault injection) and one reload fail, then idles,
so the numbers the page shows stay put while the test compares them.
"""
import base64
import contextlib
import hashlib
import html
import http.client
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from _prometheus import tool_env
from conftest import CONFIGS, ROOT, job_died

PAGE = os.path.join(ROOT, "service", "page", "index.html")

JOB = r"""
import json, os, sys, threading, time
import numpy as np
import datamem
keep = [np.ones(10), np.ones(10_000), np.ones(1 << 20)]
def worker():
    keep.append(np.ones(1000))
t = threading.Thread(target=worker, name="worker-1"); t.start(); t.join()
with datamem.tag("ingest"):
    keep.append(np.ones(1000))
with datamem.tag("spilled"):                 # 16 MiB in the file-backed arena
    keep.append(np.ones(2 << 20))
deadline = time.monotonic() + 30             # its pager brings it under resident_max
while (datamem.stats()["arenas"]["spill"]["backing_resident_bytes"] > 4 << 20
       and time.monotonic() < deadline):
    time.sleep(0.05)
datamem._ext.fault_extent_alloc(-1)      # the next big array fails: a failure in "big"
try:
    np.empty(1 << 28)
except MemoryError:
    pass
datamem._ext.fault_extent_alloc(0)
try:
    datamem.reload(sys.argv[1])          # a bad policy: one failed reload
except datamem.PolicyError:
    pass
print(json.dumps({"pid": os.getpid(), "url": datamem.stats_url()}), flush=True)
sys.stdin.readline()
"""


def write_policy(tmp_path, unix_socket=None):
    # demo.yaml, with a limit on one arena (the page shows live / limit).
    text = open(os.path.join(CONFIGS, "demo.yaml")).read().replace(
        "  ingest:\n    alignment: 64\n", "  ingest:\n    alignment: 64\n    limit: 1GiB\n")
    assert "limit: 1GiB" in text
    text += "\ntag_limits: [{tag: ingest, limit: 64MiB}]\n"  # the page's bytes-per-tag card
    # A file-backed arena (the page's spill card), for arrays tagged "spilled".
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    text = text.replace("arenas:\n", "arenas:\n  spill:\n    backing: {dir: %s, resident_max: 4MiB}\n"
                        % json.dumps(str(spill)), 1)
    text = text.replace("rules:\n", "rules:\n  - name: spilled\n    match: {tag: spilled}\n"
                        "    arena: spill\n", 1)
    assert "resident_max" in text and "name: spilled" in text
    if unix_socket:
        text += "\nstats: {unix_socket: %s}\n" % json.dumps(unix_socket)
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: nowhere\narenas: {a: {}}\n")
    return str(p), str(bad)


@contextlib.contextmanager
def job(tmp_path, unix_socket=None):
    policy, bad = write_policy(tmp_path, unix_socket)
    env = dict(os.environ, DATAMEM_CONFIG=policy, DATAMEM_STATS_HTTP="127.0.0.1:0",
               DATAMEM_STATS_DIR=str(tmp_path / "discovery"))
    p = subprocess.Popen([sys.executable, "-c", JOB, bad], env=env, cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(job_died(p))
        info = json.loads(line)
        info["base"] = info["url"].rsplit("/", 1)[0]
        yield info
    finally:
        with contextlib.suppress(OSError):
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def request(conn, method, path):
    conn.request(method, path)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def csp_hash(text):
    return "'sha256-%s'" % base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def check_page_response(status, headers, body, head=False):
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["x-content-type-options"] == "nosniff"
    page = open(PAGE, "rb").read()
    if head:
        assert body == b"" and int(headers["content-length"]) == len(page)
        return
    assert body == page
    csp = headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["connect-src"] == "'self'"
    # Only the page's own style and script run, by hash; no origin but our own.
    text = re.sub(r"<!--.*?-->", "", page.decode(), flags=re.S)
    script = re.search(r"<script>(.*?)</script>", text, re.S).group(1)
    style = re.search(r"<style>(.*?)</style>", text, re.S).group(1)
    assert directives["script-src"] == csp_hash(script)
    assert directives["style-src"] == csp_hash(style)
    assert "unsafe" not in csp and "http" not in csp and "*" not in csp


def test_page_over_tcp_and_unix_socket(tmp_path):
    sock = str(tmp_path / "stats.sock")
    with job(tmp_path, unix_socket=sock) as j:
        host, port = j["base"][len("http://"):].rsplit(":", 1)
        for path in ("/", "/index.html", "/?interval=5"):
            check_page_response(*request(http.client.HTTPConnection(host, int(port), timeout=10),
                                         "GET", path))
            check_page_response(*request(UnixConnection(sock), "GET", path))
        check_page_response(*request(http.client.HTTPConnection(host, int(port), timeout=10),
                                     "HEAD", "/"), head=True)
        check_page_response(*request(UnixConnection(sock), "HEAD", "/"), head=True)
        status, _, body = request(UnixConnection(sock), "GET", "/nope")
        assert status == 404 and b"try /," in body


def test_embed_page_refuses_what_would_load_from_outside(tmp_path):
    """tools/embed_page.py is the build step: a page that would need a looser CSP
    (an external script, an inline handler) fails the build with the reason."""
    tool = os.path.join(ROOT, "tools", "embed_page.py")
    good = open(PAGE).read()
    for bad, why in [
        (good.replace('<script>\n"use strict";',
                      '<script src="https://cdn.example.org/x.js"></script><script>\n"use strict";'),
         "external script"),
        (good.replace('<body data-polls="0">', '<body data-polls="0" onload="go()">', 1),
         "inline event handler"),
        (good.replace("<h1>datamem</h1>", '<h1 style="color:red">datamem</h1>', 1),
         "style attribute"),
    ]:
        assert bad != good, why
        src = tmp_path / "page.html"
        src.write_text(bad)
        r = subprocess.run([sys.executable, tool, str(src), str(tmp_path / "out.c")],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and why in r.stderr, (why, r.stderr)
    src.write_text(good)
    r = subprocess.run([sys.executable, tool, str(src), str(tmp_path / "out.c")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "dm__page_index" in (tmp_path / "out.c").read_text()


# ---- in a browser ------------------------------------------------------------------------

def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    return None


def browse(tmp_path, url, *args):
    """Headless Chromium on `url` with a virtual time budget (timers run fast,
    network requests complete first): `--dump-dom` or `--screenshot=`."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-extensions", "--hide-scrollbars", "--user-data-dir=%s" % (tmp_path / "profile"),
           "--virtual-time-budget=6000", *args, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=tool_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_bytes(text):
    num, unit = text.split()
    return float(num) * UNITS[unit]


def close_bytes(text, values):
    """The page shows 3 significant digits: within 0.6% of one of `values`."""
    shown = parse_bytes(text)
    return any(abs(shown - v) <= max(0.006 * v, 0.5) for v in values)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


@pytest.mark.skipif(chromium() is None,
                    reason="Chromium is not installed (apt-get install chromium; scripts/setup.sh "
                           "does it)")
def test_page_in_headless_chromium(tmp_path):
    with job(tmp_path) as j:
        url = j["base"] + "/?interval=1"
        before = json.load(urllib.request.urlopen(j["base"] + "/stats.json", timeout=10))
        dom = browse(tmp_path, url, "--dump-dom")
        after = json.load(urllib.request.urlopen(j["base"] + "/stats.json", timeout=10))
        shots = {}
        for w, h in ((1280, 800), (390, 844)):
            shot = tmp_path / ("page-%dx%d.png" % (w, h))
            browse(tmp_path, url, "--screenshot=%s" % shot, "--window-size=%d,%d" % (w, h))
            shots[(w, h)] = shot
    (tmp_path / "page-dom.html").write_text(dom)
    print("page DOM and screenshots in", tmp_path)

    polls = int(re.search(r'<body[^>]*data-polls="(\d+)"', dom).group(1))
    assert polls >= 2, "the page polled %d times" % polls
    cells = {html.unescape(k): html.unescape(v).strip()
             for k, v in re.findall(r'data-k="([^"]+)"[^>]*>([^<]*)<', dom)}
    ids = {k: html.unescape(v).strip() for k, v in re.findall(r'id="([^"]+)"[^>]*>([^<]*)<', dom)}
    both = (before, after)

    assert ids["pid"] == str(j["pid"])
    assert ids["threads"] == str(after["threads"])
    assert ids["policy-hash"] == after["policy_hash"]
    assert ids["reloads"] == str(after["reloads"])
    assert ids["reload-failures"] == "1" == str(after["reload_failures"])
    assert ids["last-reload"].startswith("FAILED")  # the bad reload came last
    assert close_bytes(ids["total-allocated"],
                       [sum(a["allocated_bytes"] for a in s["arenas"].values()) for s in both])
    assert ids["total-fail-rate"] == "0/s"  # the failure happened before the first poll
    for name, a in after["arenas"].items():
        k = "arena:%s:" % name
        for field in ("allocated_bytes", "resident_bytes", "dirty_bytes", "hugepage_bytes"):
            assert close_bytes(cells[k + field], [s["arenas"][name][field] for s in both]), \
                (name, field, cells[k + field], [s["arenas"][name][field] for s in both])
        if a["limit_bytes"] is None:
            assert cells[k + "limit"] == "-", (name, cells[k + "limit"])
        else:
            live, limit = cells[k + "limit"].split(" / ")
            assert close_bytes(live, [s["arenas"][name]["live_bytes"] for s in both])
            assert close_bytes(limit, [a["limit_bytes"]]), cells[k + "limit"]
        assert cells[k + "allocations"] == format(a["allocations"], ","), (name, cells)
        assert cells[k + "failures"] == format(a["failures"], ",")
        assert cells[k + "alloc_rate"] == "0/s"  # an idle job, rates from two polls
    assert after["arenas"]["big"]["failures"] >= 1
    assert after["arenas"]["ingest"]["limit_bytes"] == 1 << 30
    for rule, r in after["rules"].items():
        k = "rule:%s:" % rule
        assert cells[k + "arena"] == r["arena"]
        assert cells[k + "allocations"] == format(r["allocations"], ",")
        assert close_bytes(cells[k + "bytes_requested"], [s["rules"][rule]["bytes_requested"]
                                                          for s in both])
    # The process around the arenas: its resident set moves a little between
    # polls (the endpoint's own buffers), the arenas' sum is the table's.
    rss = [s["process_resident_bytes"] for s in both]
    assert min(rss) * 0.97 <= parse_bytes(ids["process-resident"]) <= max(rss) * 1.03, ids
    outside = [s["outside_arenas_resident_bytes"] for s in both]
    assert min(outside) * 0.9 <= parse_bytes(ids["outside-arenas"]) <= max(outside) * 1.1, ids
    assert close_bytes(ids["process-arenas"], [sum(a["resident_bytes"] for a in s["arenas"].values())
                                               for s in both])
    assert re.fullmatch(r"\(\d+% of resident\)", ids["process-arenas-share"]), ids
    assert ids["pyarrow"] == "not loaded"  # the job never imports pyarrow
    assert after["tag_bytes"]["on"]
    for name, t in after["tags"].items():
        k = "tag:%s:" % name
        assert close_bytes(cells[k + "live"], [s["tags"][name]["live"] for s in both]), \
            (t, cells[k + "live"])
        assert close_bytes(cells[k + "peak"], [t["peak"]]), (t, cells[k + "peak"])
        assert cells[k + "limit"] == ("-" if t["limit"] is None else cells[k + "limit"])
    ingest = after["tags"]["ingest"]
    assert ingest["limit"] == 64 << 20 and ingest["live"] >= 8000, ingest
    assert close_bytes(cells["tag:ingest:limit"], [64 << 20]), cells["tag:ingest:limit"]
    # The spill card: bytes on disk and in memory of the file-backed arena.
    sp = after["arenas"]["spill"]
    assert sp["backed"] and sp["backing_disk_bytes"] >= 16 << 20, sp
    assert not any(a["backed"] for n, a in after["arenas"].items() if n != "spill")
    assert not any(k.startswith("spill:") and not k.startswith("spill:spill:") for k in cells)
    for field, key in (("disk", "backing_disk_bytes"), ("resident", "backing_resident_bytes"),
                       ("paged_out", "backing_paged_out_bytes")):
        assert close_bytes(cells["spill:spill:" + field], [s["arenas"]["spill"][key] for s in both]), \
            (field, cells["spill:spill:" + field], [s["arenas"]["spill"][key] for s in both])
    assert cells["spill:spill:max"] == "-"
    assert cells["spill:spill:resident_max"] == "4.00 MiB", cells["spill:spill:resident_max"]
    assert cells["spill:spill:full"] == "0"
    if "threads_not_covered" in after:
        assert ids["threads-not-covered-count"] == str(len(after["threads_not_covered"]))
    else:
        assert ids["threads-not-covered-count"] == "n/a"

    for (w, h), shot in shots.items():
        assert png_size(shot) == (w, h)
        assert os.path.getsize(shot) > 10_000  # drawn, not a blank page
