"""Checks datamem wheels for what a user's machine must provide.

For each wheel given (scripts/wheels.sh writes them to dist/):
  1. its tag is manylinux, not linux_x86_64;
  2. `ldd` on every shared object in it: each dependency is glibc's or a file in
     the wheel, none is missing;
  3. no other library name (lib*.so*) appears in the binaries, so nothing is
     dlopen'ed from the system either (the stats endpoint once dlopen'ed
     libmicrohttpd.so.12);
  4. it imports and serves arrays under DATAMEM_CONFIG, with its stats endpoint
     on, in the interpreter it was built for (.venv-wheels/cp3X from
     scripts/wheels.sh), with the system's libyaml, libnuma and libmicrohttpd
     hidden: a private mount namespace (unshare -m, needs root) binds /dev/null
     over each, and the check first proves they no longer load.

Usage: python3 tools/check_wheels.py dist/*manylinux*.whl
"""
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = {"linux-vdso.so.1", "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2",
         "librt.so.1", "ld-linux-x86-64.so.2", "libutil.so.1", "libresolv.so.2"}
HIDE = ["libyaml-0.so.2", "libnuma.so.1", "libmicrohttpd.so.12"]
# dlopen'ed when the stats endpoint starts, if the build still uses it: optional,
# so without it the job must go on and the error must name Debian's package.
OPTIONAL = {"libmicrohttpd.so", "libmicrohttpd.so.12"}
OPTIONAL_PACKAGE = "libmicrohttpd12"
# The CUDA runtime, dlopen'ed only when a policy asks for `pinned: cuda` (and such
# a policy fails to load with a clear error where it is missing): never needed to
# import or run otherwise, and never shipped.
ON_DEMAND = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"}
LIBNAME = re.compile(rb"lib[A-Za-z0-9_+-]+\.so(?:\.[0-9]+)*")

IMPORT_CHECK = r"""
import ctypes, site, sys
for lib in sys.argv[2].split(","):
    try:
        ctypes.CDLL(lib)
    except OSError:
        continue
    sys.exit("check_wheels: %s still loads: hiding it did not work" % lib)
site.addsitedir(sys.argv[1])          # runs datamem.pth, as at start-up
import numpy as np, datamem
a = np.empty(1 << 20)
assert datamem._ext.active(), "DATAMEM_CONFIG did not activate datamem"
arena = datamem.arena_of(a)
assert arena, "the array is not in a datamem arena"
url = datamem.stats_url()
if url:
    import urllib.request
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "datamem_" in body, "the stats endpoint did not answer with metrics: %r" % body[:200]
print("ok: datamem %s, numpy %s, arena %s, endpoint %s" % (datamem.__version__, np.__version__, arena, url))
"""


def fail(msg):
    print("FAIL: " + msg)
    return 1


def check(whl):
    errors = 0
    name = os.path.basename(whl)
    print("--- " + name)
    m = re.match(r"datamem-[^-]+-(cp\d+)-(cp\d+t?)-([^.]+)\.whl$", name)  # cp313t: free-threaded
    if not m:
        return fail("%s: not a datamem CPython wheel name" % name)
    abi, plat = m.group(2), m.group(3)
    if not plat.startswith("manylinux_"):
        errors += fail("%s: platform tag %s is not manylinux" % (name, plat))
    uses_optional = False
    with tempfile.TemporaryDirectory() as d:
        with zipfile.ZipFile(whl) as z:
            z.extractall(d)
        sos = sorted(glob.glob(os.path.join(d, "**", "*.so*"), recursive=True))
        inside = {os.path.basename(p) for p in sos}
        if not any(os.path.basename(p).startswith("_ext.") for p in sos):
            errors += fail("%s: no extension module in the wheel" % name)
        for so in sos:
            rel = os.path.relpath(so, d)
            out = subprocess.run(["ldd", so], capture_output=True, text=True)
            for line in out.stdout.splitlines():
                if "statically linked" in line:
                    continue
                parts = line.split()
                lib = os.path.basename(parts[0])
                path = parts[2] if len(parts) > 2 and parts[1] == "=>" else parts[0]
                if "not found" in line:
                    errors += fail("%s: %s needs %s, which is not found" % (name, rel, lib))
                elif lib in GLIBC:
                    continue
                elif not os.path.realpath(path).startswith(os.path.realpath(d) + os.sep):
                    errors += fail("%s: %s needs %s from the system (%s)" % (name, rel, lib, path))
            with open(so, "rb") as f:
                named = {n.decode() for n in LIBNAME.findall(f.read())}
            for lib in sorted(named & OPTIONAL):
                print("note: %s names %s (optional, dlopen'ed)" % (rel, lib))
                uses_optional = True
            for lib in sorted(named & ON_DEMAND):
                print("note: %s names %s (dlopen'ed only for pinned: cuda)" % (rel, lib))
            for lib in sorted(named - GLIBC - inside - OPTIONAL - ON_DEMAND):
                errors += fail("%s: %s names %s, which the wheel does not carry" % (name, rel, lib))
        py = os.path.join(ROOT, ".venv-wheels", abi, "bin", "python")
        if not os.path.exists(py):
            return errors + fail("%s: no %s to import it with (run scripts/wheels.sh)" % (name, py))
        env = dict(os.environ, DATAMEM_CONFIG=os.path.join(ROOT, "configs", "demo.yaml"),
                   DATAMEM_STATS_HTTP="127.0.0.1:0")
        env.pop("LD_LIBRARY_PATH", None)
        env.pop("PYTHONPATH", None)
        cmd = [py, "-c", IMPORT_CHECK, d, ",".join(HIDE)]
        hidden = [p for p in (os.path.realpath(os.path.join("/usr/lib/x86_64-linux-gnu", h))
                              for h in HIDE) if os.path.exists(p)]
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            print("SKIP hiding the system libraries: unshare -m is not permitted here (%s); "
                  "importing without hiding them" % probe.stderr.strip())
            run = cmd
        else:
            script = "".join("mount --bind /dev/null %s && " % p for p in hidden)
            run = ["unshare", "-m", "sh", "-c", script + 'exec "$@"', "sh"] + cmd
        res = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, cwd=d)
        if res.returncode != 0:
            errors += fail("%s: import with %s hidden failed:\n%s%s"
                           % (name, ", ".join(HIDE), res.stdout, res.stderr))
        elif "endpoint None" in res.stdout and not (
                uses_optional and OPTIONAL_PACKAGE in res.stderr and "job runs on" in res.stderr):
            errors += fail("%s: the stats endpoint did not start, and its error does not name "
                           "the package to install (%s):\n%s" % (name, OPTIONAL_PACKAGE, res.stderr))
        else:
            print(res.stdout.strip() + " (hidden: %s)" % (", ".join(hidden) or "none present"))
            if res.stderr.strip():
                print("  stderr: " + res.stderr.strip().replace("\n", "\n  stderr: "))
    return errors


def main(argv):
    if not argv:
        sys.exit("usage: check_wheels.py WHEEL...")
    errors = sum(check(w) for w in argv)
    print("check_wheels: %d wheel(s), %d problem(s)" % (len(argv), errors))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
