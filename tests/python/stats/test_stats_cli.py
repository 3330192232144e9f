"""The stats client (python/datamem/_cli/stats.py: `stats`, `ls`, `top`, `reload`)
against hostile input: a discovery directory or entries it
must not trust, files it must not delete or write through, endless or malformed
replies, escape sequences meant for the terminal, and processes it must not
signal. CI runs as root: "another user" is uid 65534 (files chowned to it, a
child started as it), and the code compares against os.geteuid()."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from conftest import ROOT, UNDER_ASAN

from datamem import _text
from datamem._stats import discovery, sd

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="SKIP: needs root, to play another "
                             "user (chown to uid 65534, a child started as it)")


def cli(*args, env=None, timeout=60):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    e.pop("DATAMEM_PROFILE", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "datamem"] + [str(a) for a in args], env=e,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def one_line_error(r):
    """The command failed with exactly one line on stderr, and no traceback."""
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("datamem: "), r.stderr
    return r.stderr


def entry(pid, **kw):
    """A discovery entry as service/discovery.c writes it."""
    e = {"datamem": 1, "pid": pid, "url": "http://127.0.0.1:9/metrics", "unix_socket": None,
         "argv0": "python3", "cmdline": "python3 job.py", "started": time.time(),
         "version": "0.1.0"}
    e.update(kw)
    return e


def write_entry(d, e, name=None):
    p = d / (name or "%d.json" % e["pid"])
    p.write_text(json.dumps(e))
    return p


def dead_pid():
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    return int(p.stdout)


# ---- the discovery directory ------------------------------------------------------------------

@as_root
@pytest.mark.parametrize("how", ["other-owner", "world-writable", "symlink"])
def test_a_discovery_directory_the_c_side_refuses_is_refused(tmp_path, how):
    # Attack: another user makes /tmp/datamem-0 (or a world-writable or linked one)
    # and fills it with entries: fake targets and labels reached root's file_sd
    # output and `top --all`. The C side announces nothing there, so neither is
    # anything read from it.
    disc = tmp_path / "discovery"
    real = tmp_path / "real"
    real.mkdir()
    write_entry(real, entry(os.getpid(), url="http://10.6.6.6:9100/metrics"))
    if how == "symlink":
        disc.symlink_to(real)
    else:
        real.rename(disc)
        if how == "other-owner":
            os.chown(disc, NOBODY, NOBODY)
        else:
            os.chmod(disc, 0o777)
    env = {"DATAMEM_STATS_DIR": str(disc)}
    sd_file = tmp_path / "sd.json"
    for args in (["ls"], ["ls", "--json"], ["ls", "--prometheus-sd", sd_file, "--once"],
                 ["top", "--all", "--once", "--interval", "0"], ["stats", os.getpid()]):
        err = one_line_error(cli(*args, env=env))
        assert "10.6.6.6" not in err
        assert ("discovery directory refused: %s" % disc) in err, err
    assert not sd_file.exists()


@as_root
def test_entries_not_owned_by_this_user_are_skipped(tmp_path):
    # Attack: a file another user got into the directory (or left from before a
    # chown) names a target; it is not listed, and not deleted either.
    disc = tmp_path / "discovery"
    disc.mkdir()
    p = write_entry(disc, entry(os.getpid(), url="http://10.6.6.6:9100/metrics"))
    os.chown(p, NOBODY, NOBODY)
    r = cli("ls", "--json", env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    assert "owned by uid %d" % NOBODY in r.stderr and "Traceback" not in r.stderr
    assert p.exists()


def test_bad_entries_are_skipped_with_one_warning_each(tmp_path):
    # Attack: one `[]` entry ended `ls` in a traceback (and a FIFO would hang it).
    disc = tmp_path / "discovery"
    disc.mkdir()
    me = os.getpid()
    good = entry(me, url="http://127.0.0.1:1/metrics")
    bad = {
        "100001.json": "[]",
        "100002.json": "{not json",
        "100003.json": json.dumps(dict(entry(100003), pid="100003")),
        "100004.json": json.dumps(dict(entry(100004), started="soon")),
        "100005.json": json.dumps(dict(entry(100005), url=["x"])),
        "100006.json": json.dumps(dict(entry(100006), url="http://127.0.0.1:99999/")),
        "100007.json": "[" * 100000 + "]" * 100000,
        "100008.json": json.dumps(entry(100008))[:-1] + ", \"pad\": \"%s\"}" % ("x" * (1 << 20)),
        "100009.json": b"\xff\xfe".decode("latin-1"),
        "100010.json": json.dumps(entry(4242)),            # another pid's entry
        "100011.json": json.dumps(dict(entry(100011), started=float("nan"))),
        "100014.json": json.dumps({k: v for k, v in entry(100014).items() if k != "datamem"}),
        "100015.json": json.dumps(dict(entry(100015), datamem=True)),
    }
    for name, text in bad.items():
        (disc / name).write_text(text, encoding="latin-1")
    (disc / "100012.json").symlink_to(tmp_path / "elsewhere.json")  # not followed
    (tmp_path / "elsewhere.json").write_text(json.dumps(entry(100012)))
    os.mkfifo(disc / "100013.json")
    write_entry(disc, good)
    r = cli("ls", "--json", env={"DATAMEM_STATS_DIR": str(disc)}, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert [e["pid"] for e in json.loads(r.stdout)] == [me]
    warned = r.stderr.splitlines()
    assert len(warned) == 15, r.stderr
    for n in range(100001, 100016):
        assert sum(("/%d.json" % n) in w for w in warned) == 1, (n, r.stderr)
    assert all(len(w) < 400 for w in warned)
    # top --all and --prometheus-sd read the same way
    r = cli("ls", "--prometheus-sd", tmp_path / "sd.json", "--once",
            env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert [g["labels"]["pid"] for g in json.loads((tmp_path / "sd.json").read_text())] == \
        [str(me)]


def test_ls_deletes_only_entries_the_c_side_wrote(tmp_path):
    # Attack (data loss): DATAMEM_STATS_DIR pointed at a directory with other
    # files; `ls` deleted every <number>.json that parsed as JSON.
    disc = tmp_path / "discovery"
    disc.mkdir()
    dead, gone = dead_pid(), dead_pid()
    keep = {
        "%d.json" % dead: json.dumps({"pid": dead, "url": "http://127.0.0.1:1/metrics"}),
        "1000001.json": json.dumps({"invoice": 17}),
        "1000002.json": json.dumps(entry(dead)),       # a whole entry, not its pid's name
        "1000003.json": json.dumps(dict(entry(1000003), datamem=None)),   # no mark
    }
    for name, text in keep.items():
        (disc / name).write_text(text)
    ours = write_entry(disc, entry(gone))
    r = cli("ls", env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(disc)) == sorted(keep)   # ours (a dead process's) went
    for name, text in keep.items():
        assert (disc / name).read_text() == text
    assert not ours.exists()


@as_root
def test_ls_does_not_delete_another_users_entry(tmp_path):
    disc = tmp_path / "discovery"
    disc.mkdir()
    p = write_entry(disc, entry(dead_pid()))
    os.chown(p, NOBODY, NOBODY)
    r = cli("ls", env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert p.exists()


# ---- --prometheus-sd ----------------------------------------------------------------------

def test_prometheus_sd_never_writes_through_a_planted_link(tmp_path):
    # Attack: `ls --prometheus-sd FILE` wrote FILE.tmp.<pid> with open("w"): a
    # symbolic link planted at that name made a root job overwrite any file.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "targets.json"
    (tmp_path / ("targets.json.tmp.%d" % os.getpid())).symlink_to(victim)
    text = sd.write_sd(str(out), [{"targets": ["127.0.0.1:1"], "labels": {}}])
    assert victim.read_text() == "precious\n"
    assert json.loads(out.read_text()) == json.loads(text)
    assert not out.is_symlink()
    assert stat.S_IMODE(out.stat().st_mode) == 0o644     # Prometheus may run as another user
    assert [n for n in os.listdir(tmp_path) if ".tmp." in n] == \
        ["targets.json.tmp.%d" % os.getpid()]          # only the planted link, untouched


# Attack: `record --out FILE` appended with open("a") and `plot --out PNG` wrote
# with savefig(path): a symbolic link planted at the name (in /tmp, say) made a
# root user's command write any file. record refuses a link (and a file that is
# not its user's own); plot writes a temporary file and renames it over the link.
def test_record_and_plot_never_write_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    rec = tmp_path / "rec.jsonl"
    rec.symlink_to(victim)
    r = cli("record", "http://127.0.0.1:1", "--out", rec, "--count", "1")
    assert "%s: a symbolic link, not a file" % rec in one_line_error(r)
    assert victim.read_text() == "precious\n"
    rec.unlink()
    if importlib.util.find_spec("matplotlib") is None:  # the wheel's fresh venvs lack it
        pytest.skip("SKIP the plot half: matplotlib is not installed here")
    snap = {"time": 1.0, "pid": 1, "arenas": {"a": {"resident_bytes": 1, "allocated_bytes": 1}}}
    rec.write_text(json.dumps(snap) + "\n" + json.dumps(dict(snap, time=2.0)) + "\n")
    png = tmp_path / "arenas.png"
    png.symlink_to(victim)
    r = cli("plot", rec, "--out", png)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious\n"
    assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- replies ----------------------------------------------------------------------------------

class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            data += chunk
        path = data.split(b" ")[1].decode()
        try:
            for part in self.server.reply(path):
                self.request.sendall(part)
        except OSError:   # the client stopped reading: what a bounded client does
            pass


@contextlib.contextmanager
def server(reply):
    """A loopback HTTP server; reply(path) yields the bytes to send. Yields its URL."""
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.reply = reply
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield "http://127.0.0.1:%d" % srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def ok(body, ctype=b"text/plain"):
    return [b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nConnection: close\r\n\r\n",
            body]


def endless(path):
    # No Content-Length, no end: 48 MiB here (so that a client without a bound
    # ends too, and the test fails instead of hanging), endless for a real attacker.
    yield b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    block = b"datamem_x 1\n" * (1 << 16)
    for _ in range(48 * (1 << 20) // len(block)):
        yield block


# Runs `python -m datamem ARGS` and writes its peak RSS (VmHWM) to the file
# $HWM_OUT at exit. Not ru_maxrss from wait4: Linux carries the parent's peak
# into a child's across vfork+exec (subprocess's way), so a long pytest run
# reported its own ~140 MiB for the client.
_MEASURED = r"""
import os, runpy, sys
sys.argv = ["datamem"] + sys.argv[1:]
try:
    runpy.run_module("datamem", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as f:
        hwm = [l for l in f if l.startswith("VmHWM:")][0].split()[1]
    with open(os.environ["HWM_OUT"], "w") as f:
        f.write(hwm)
"""


def run_measured(args, timeout=120):
    """(returncode, stdout, stderr, peak RSS in MiB) of `python -m datamem ARGS`."""
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    with tempfile.TemporaryDirectory() as d:
        e["HWM_OUT"] = os.path.join(d, "hwm")
        p = subprocess.run([sys.executable, "-c", _MEASURED] + [str(a) for a in args], env=e,
                           cwd=ROOT, capture_output=True, timeout=timeout)
        with open(e["HWM_OUT"]) as f:
            hwm_kib = int(f.read())
    return p.returncode, p.stdout, p.stderr.decode(), hwm_kib / 1024


@pytest.mark.parametrize("cmd", ["stats", "top"])
def test_an_endless_reply_is_cut_at_the_bound(cmd):
    # Attack: an endless reply grew `top`/`stats URL` to 3 GB.
    with server(endless) as url:
        args = [cmd, url] + (["--once", "--interval", "0"] if cmd == "top" else [])
        rc, out, err, rss = run_measured(args)
    assert rc == 1 and "Traceback" not in err, (rc, err[-2000:])
    assert len(err.splitlines()) == 1 and "reply larger than 16 MiB" in err, err
    assert not out
    if not UNDER_ASAN:  # its shadow memory and quarantine are not the client's
        assert rss < 16 + 120, "max RSS %.0f MiB" % rss  # the bound, plus the interpreter


@pytest.mark.parametrize("body, says", [
    (b"{not json", "the reply is not JSON"),
    (b"[" * 100000 + b"]" * 100000, "the reply is not JSON"),
    (b"\xff\xfe", "the reply is not JSON"),
    (b"[]", "not a datamem snapshot (not a JSON object)"),
    (b'{"time": "noon"}', "not a datamem snapshot ('time' is not a number)"),
    (b'{"time": 1e999}', "not a datamem snapshot ('time' is not a number)"),
    (b'{"threads": null}', "not a datamem snapshot ('threads' is not a number)"),
    (b'{"arenas": []}', "not a datamem snapshot ('arenas' is not an object)"),
    (b'{"arenas": {"a": 1}}', "not a datamem snapshot (arena 'a' is not an object)"),
    (b'{"arenas": {"a": {"allocated_bytes": "1"}}}',
     "not a datamem snapshot (arena 'a': 'allocated_bytes' is not a number)"),
], ids=lambda v: v[:20].decode("latin-1") if isinstance(v, bytes) else None)
def test_a_malformed_snapshot_is_one_line_error(body, says, tmp_path):
    # Bug: `top` ended in a traceback on malformed JSON or an unexpected shape.
    with server(lambda path: ok(body, b"application/json")) as url:
        r = cli("top", url, "--once", "--interval", "0")
        assert says in one_line_error(r)
        r = cli("record", url, "--out", tmp_path / "rec.jsonl", "--count", "1")
        assert says in one_line_error(r)


@pytest.mark.parametrize("raw", [b"HELLO\r\n\r\n", b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200,
                                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                                 b""], ids=["status", "headers", "chunk", "empty"])
def test_a_broken_http_reply_is_one_line_error(raw):
    with server(lambda path: [raw]) as url:
        assert "cannot reach" in one_line_error(cli("stats", url))


# ---- the terminal ---------------------------------------------------------------------------

HOSTILE = "\x1b]0;owned\x07\x1b[2J\nfake line\r\u202eevil\x9b31m"


def clean(text):
    """No control character but newline reached the terminal."""
    return not any((ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0 or c == "\u202e"
                   for c in text)


def test_top_escapes_what_the_target_sends():
    # Attack: a path or name with escape sequences and newlines printed raw by
    # `top`: it can retitle the terminal, clear it, or forge lines.
    arena = {"allocated_bytes": 1, "active_bytes": 1, "resident_bytes": 1, "dirty_bytes": 0,
             "hugepage_bytes": 0, "allocations": 1, "failures": 0, "limit_bytes": None}
    snap = {"time": time.time(), "pid": HOSTILE, "version": HOSTILE, "reloads": 1,
            "reload_failures": 0, "threads": 1, "policy_path": "/p/" + HOSTILE,
            "arenas": {"a" + HOSTILE: arena}}
    body = json.dumps(snap).encode()
    with server(lambda path: ok(body, b"application/json")) as url:
        labelled = cli("top", url + "/x" + HOSTILE, "--once", "--interval", "0")
        r = cli("top", url, "--once", "--interval", "0")
    assert labelled.returncode == 0 and clean(labelled.stdout), repr(labelled.stdout)
    assert r.returncode == 0, r.stderr
    assert clean(r.stdout), repr(r.stdout)
    assert "\\x1b]0;owned\\x07" in r.stdout
    assert not any(l.startswith("fake line") for l in r.stdout.splitlines())
    assert all(len(l) <= 80 for l in r.stdout.splitlines()), r.stdout


def test_stats_and_ls_escape_what_they_print(tmp_path):
    body = ("datamem_up 1\n# HELP x " + HOSTILE + "\n").encode()
    with server(lambda path: ok(body)) as url:
        r = cli("stats", url)
    assert r.returncode == 0, r.stderr
    assert clean(r.stdout) and "datamem_up 1\n" in r.stdout, repr(r.stdout)
    disc = tmp_path / "discovery"
    disc.mkdir()
    write_entry(disc, entry(os.getpid(), cmdline="python3 " + HOSTILE, argv0=HOSTILE,
                            url="http://127.0.0.1:1/" + HOSTILE))
    r = cli("ls", env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0, r.stderr
    assert clean(r.stdout) and str(os.getpid()) in r.stdout, repr(r.stdout)
    assert len(r.stdout.splitlines()) == 2


# ---- reload -----------------------------------------------------------------------------------

# Maps a file (any name: here one called libdatamem_tls.so), handles SIGHUP by
# printing "hup" and SIGUSR1 by printing "usr1". argv: the file, a token.
MAPPER = r"""
import mmap, signal, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
signal.signal(signal.SIGHUP, lambda *a: print("hup", flush=True))
signal.signal(signal.SIGUSR1, lambda *a: print("usr1", flush=True))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def python_for(uid):
    """An interpreter that user `uid` can run (root's home is often closed); none is a
    failure."""
    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not exe:
            continue
        try:
            if subprocess.run([exe, "-c", "pass"], user=uid, capture_output=True,
                              cwd="/").returncode == 0:
                return exe
        except OSError:  # cannot even be started by that user
            continue
    # Only root tests call this, and root can always give that user an
    # interpreter it can run: a skip here would hide the very case (another
    # user's process) the test exists for.
    pytest.fail("no Python that uid %d can run (tried %s, %s, /usr/bin/python3): install "
                "a python3 outside root's home" % (uid, sys.executable, shutil.which("python3")))


@contextlib.contextmanager
def mapper(lib, token, user=None):
    exe = python_for(user) if user is not None else sys.executable
    p = subprocess.Popen([exe, "-c", MAPPER, str(lib), token], user=user,
                         stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def not_signalled(p):
    """No SIGHUP reached `p`: a SIGUSR1 sent now is the first thing it reports
    (a SIGHUP sent before it would have been reported first)."""
    os.kill(p.pid, signal.SIGUSR1)
    return p.stdout.readline().strip() == "usr1"


def fake_lib(d):
    os.makedirs(d, exist_ok=True)
    lib = os.path.join(d, "libdatamem_tls.so")
    with open(lib, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(lib, 0o644)
    return lib


@as_root
def test_reload_does_not_signal_another_users_process():
    # Attack: as root, `reload --all` signalled other users' processes that
    # merely mapped a file named libdatamem_tls.so, and `reload PID` any process.
    token = "dm-not-ours-" + uuid.uuid4().hex
    d = tempfile.mkdtemp()
    try:
        os.chmod(d, 0o755)
        with mapper(fake_lib(d), token, user=NOBODY) as p:
            r = cli("reload", "--all", "--match", token)
            assert r.returncode == 1 and "no process of this user" in r.stderr, r.stderr
            assert str(p.pid) not in r.stdout
            err = one_line_error(cli("reload", p.pid))
            assert "belongs to uid %d" % NOBODY in err and "not signalled" in err, err
            assert not_signalled(p)
    finally:
        shutil.rmtree(d)


def test_reload_does_not_signal_a_process_that_only_maps_the_name(tmp_path):
    # The same user's process with a file named libdatamem_tls.so mapped, but no
    # datamem install loaded (no extension next to it): not a datamem process.
    token = "dm-fake-lib-" + uuid.uuid4().hex
    with mapper(fake_lib(str(tmp_path / "lib")), token) as p:
        r = cli("reload", "--all", "--match", token)
        assert r.returncode == 1 and "no process of this user" in r.stderr, r.stderr
        err = one_line_error(cli("reload", p.pid))
        assert "has no datamem loaded" in err, err
        assert not_signalled(p)


def test_reload_all_signals_a_datamem_process_that_serves_nothing(tmp_path):
    # The rule still covers processes that register nowhere (no stats endpoint):
    # a datamem install loaded is proof enough.
    token = "dm-plain-" + uuid.uuid4().hex
    pol = tmp_path / "p.yaml"
    pol.write_text("version: 1\ndefault: general\narenas:\n  general: {}\n"
                   "reload: {signal: true}\n")
    code = ("import datamem, sys, time; print('ready', flush=True)\n"
            "while datamem.stats()['reloads'] < 2: time.sleep(0.01)\nprint('reloaded')")
    e = dict(os.environ, DATAMEM_CONFIG=str(pol))
    e.pop("DATAMEM_STATS_HTTP", None)
    p = subprocess.Popen([sys.executable, "-c", code, token], env=e, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "ready"
        r = cli("reload", "--all", "--match", token)
        assert r.returncode == 0 and "sent SIGHUP to 1 process(es): %d" % p.pid in r.stdout, \
            (r.stdout, r.stderr)
        out, _ = p.communicate(timeout=30)
        assert out.strip() == "reloaded"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_printable_escapes_controls():
    assert _text.printable("a\x1b[2Jb\nc\u202e") == "a\\x1b[2Jb\\x0ac\\u202e"
    assert _text.printable("a\tb\nc\x07", keep="\n\t") == "a\tb\nc\\x07"



def test_discovery_entry_check_fuzz():
    # Discovery entries are parsed from files anyone with this uid can write:
    # any JSON value (and any mutation of a real entry) is accepted or given a
    # reason, never an exception.
    from hypothesis import given, settings, strategies as st
    good = {"datamem": 1, "pid": 4242, "url": "http://127.0.0.1:1/metrics", "unix_socket": "",
            "argv0": "python", "cmdline": "python job.py", "started": 1.0, "version": "0.1.0"}
    assert discovery._entry_problem(good, 4242) is None
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                     max_size=4),
        max_leaves=12)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(json_values, st.dictionaries(st.sampled_from(sorted(good)), json_values, max_size=3))
    def check(value, overrides):
        for entry in (value, dict(good, **overrides)):
            problem = discovery._entry_problem(entry, 4242)
            assert problem is None or isinstance(problem, str)

    check()


def test_top_of_a_job_without_an_endpoint_says_how_to_get_one(tmp_path):
    """Bug pinned: `top PID` on a job that serves no stats said only that it serves
    none. It says how to make it serve them (the environment variable, the
    policy key) and where to list those that do; a pid with no process says so."""
    env = {"DATAMEM_STATS_DIR": str(tmp_path)}
    pol = tmp_path / "p.yaml"
    pol.write_text("version: 1\ndefault: a\narenas: {a: {}}\n")
    e = dict(os.environ, DATAMEM_CONFIG=str(pol), **env)
    e.pop("DATAMEM_STATS_HTTP", None)
    job = subprocess.Popen([sys.executable, "-c", "import sys, datamem; print('up', flush=True);"
                            " sys.stdin.read()"], env=e, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "up\n"
        err = one_line_error(cli("top", job.pid, "--once", env=env))
        assert "process %d is not serving datamem stats" % job.pid in err, err
        assert "DATAMEM_STATS_HTTP=127.0.0.1:0" in err and "stats: {http:" in err, err
        assert "python -m datamem ls" in err, err
    finally:
        job.stdin.close()
        job.wait(timeout=30)
    err = one_line_error(cli("top", dead_pid(), "--once", env=env))
    assert "no process %d" % job.pid not in err and err.startswith("datamem: no process "), err
