"""The Prometheus file_sd list (`ls --prometheus-sd FILE`): one target per
process serving stats over HTTP, rewritten atomically when the set changes.
"""
import json
import os
import sys
import time
import urllib.parse

from .. import _files
from .discovery import TargetError, list_processes


def sd_targets(procs):
    """Prometheus file_sd groups for discovery entries: one target per process
    serving HTTP (Prometheus cannot scrape a Unix socket), labelled with its pid
    and program, so that one scrape config covers workers that come and go."""
    groups = []
    for e in procs:
        u = urllib.parse.urlsplit(e.get("url") or "")
        if not u.hostname or not u.port:
            continue
        labels = {"pid": str(e.get("pid")), "datamem_version": str(e.get("version", ""))}
        argv0 = os.path.basename(str(e.get("argv0") or ""))
        if argv0:
            labels["program"] = argv0
        if u.path and u.path not in ("/", "/metrics"):
            labels["__metrics_path__"] = u.path
        groups.append({"targets": ["%s:%d" % (u.hostname, u.port)], "labels": labels})
    return groups


def write_sd(path, groups):
    """Writes `groups` to `path` through a temporary file renamed over it, so
    Prometheus never reads half a file. The temporary file's name is
    unpredictable and created with O_EXCL|O_NOFOLLOW (_files.write_atomic):
    with a predictable name, a symbolic link planted at "FILE.tmp.<pid>" would
    make a root `ls --prometheus-sd` overwrite any file. Returns the text written."""
    text = json.dumps(groups, indent=2, sort_keys=True) + "\n"
    _files.write_atomic(path, text, mode=0o644)
    return text


def cmd_prometheus_sd(path, interval=5.0, once=False, out=sys.stderr):
    """Keeps `path` a Prometheus file_sd list of every datamem process serving
    HTTP on this host: rewritten (atomically) whenever the set changes, checked
    every `interval` seconds until ^C or SIGTERM; `once`: write and exit."""
    import signal
    stop = []
    if not once and threading_main():
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    last = None
    try:
        while True:
            groups = sd_targets(list_processes())
            if groups != last:
                try:
                    write_sd(path, groups)
                except OSError as e:
                    raise TargetError("cannot write %s: %s" % (path, e.strerror or e))
                out.write("%s: %d target(s)\n" % (path, len(groups)))
                out.flush()
                last = groups
            if once or stop:
                return 0
            time.sleep(interval)
            if stop:
                return 0
    except KeyboardInterrupt:
        return 0


def threading_main():
    import threading
    return threading.current_thread() is threading.main_thread()
