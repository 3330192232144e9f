"""datamem's PEP 517 build backend: `pip install .`, `python -m build`.

No second build system: build_wheel runs `bazel build //:wheel` with
DATAMEM_PYTHON set to the interpreter running the hook (the one pip installs
into; its NumPy, from pyproject.toml's build requirements, gives the headers),
and hands back the wheel tools/build_wheel.py assembled. build_sdist packs the
checkout's tracked files (every file Bazel needs: WORKSPACE, third_party/, ...)
plus PKG-INFO; an unpacked sdist builds the same way, fetching jemalloc, libyaml
and numactl from Debian's source archive as a checkout does.

Needs on the build machine what scripts/setup.sh installs: Bazel (Debian's
bazel-bootstrap), gcc, dpkg-dev and deb-src entries. The wheel it makes carries
no system library but glibc's, so it runs anywhere pip put it.
"""
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

NAME = "datamem"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Never packed into an sdist: build outputs, virtual environments, caches.
_SKIP_DIRS = {".git", "dist", "build", "__pycache__", ".pytest_cache", ".hypothesis"}


class BuildError(SystemExit):
    """A build that cannot go on: pip (and `python -m build`) show its one-line
    message as the hook's whole output, with no traceback."""


def _version():
    with open(os.path.join(ROOT, "BUILD")) as f:
        m = re.search(r'^VERSION = "([^"]+)"', f.read(), re.M)
    if not m:
        raise BuildError("datamem: no VERSION = \"...\" in %s" % os.path.join(ROOT, "BUILD"))
    return m.group(1)


def _metadata():
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Declarative memory policy for NumPy arrays (NEP 49 handler on jemalloc arenas)\n"
            "Requires-Python: >=3.10\nRequires-Dist: numpy>=1.22\n" % (NAME, _version()))


def _bazel():
    bazel = shutil.which("bazel")
    if not bazel:
        raise BuildError("datamem: building from source needs Bazel, and `bazel` is not on "
                         "PATH: on Debian or Ubuntu, apt-get install bazel-bootstrap dpkg-dev "
                         "build-essential (or run scripts/setup.sh from the source tree), then "
                         "pip install again.")
    return bazel


def _run(args, env=None):
    # pip shows the backend's output with -v; errors are printed in full.
    print("datamem backend: " + " ".join(args), file=sys.stderr, flush=True)
    res = subprocess.run(args, cwd=ROOT, env=env, stdout=sys.stderr)
    if res.returncode != 0:
        raise BuildError("datamem: `%s` failed with status %d (output above)"
                         % (" ".join(args), res.returncode))


def _from_sdist():
    return os.path.exists(os.path.join(ROOT, "PKG-INFO")) and not os.path.exists(
        os.path.join(ROOT, ".git"))


# ---- PEP 517 hooks -------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    bazel = _bazel()
    env = dict(os.environ)
    env["DATAMEM_PYTHON"] = sys.executable
    # An unpacked sdist is a throw-away workspace: its Bazel server exits soon
    # after the build instead of idling for hours.
    startup = ["--max_idle_secs=60"] if _from_sdist() else []
    _run([bazel] + startup + ["build", "//:wheel"], env=env)
    out = subprocess.run([bazel] + startup + ["info", "bazel-bin"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise BuildError("datamem: `bazel info bazel-bin` failed:\n" + out.stderr)
    bin_dir = out.stdout.strip()
    with open(os.path.join(bin_dir, "datamem.whl.name")) as f:
        name = f.read().strip()
    os.makedirs(wheel_directory, exist_ok=True)
    dest = os.path.join(wheel_directory, name)
    shutil.copyfile(os.path.join(bin_dir, "datamem.whl"), dest)
    os.chmod(dest, 0o644)
    return name


def _sdist_files():
    """The checkout's tracked files (git), or, in a tree without git (an unpacked
    sdist), every file but build outputs, virtual environments and caches."""
    if os.path.isdir(os.path.join(ROOT, ".git")) and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
        if out.returncode == 0:
            return sorted(p for p in out.stdout.decode().split("\0")
                          if p and os.path.isfile(os.path.join(ROOT, p)))
    files = []
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS
                         and not x.startswith((".venv", "bazel-"))
                         and not os.path.islink(os.path.join(d, x)))
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(d, n), ROOT)
            if rel != "PKG-INFO" and not os.path.islink(os.path.join(ROOT, rel)):
                files.append(rel)
    return files


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, _version())
    name = base + ".tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))

    def norm(ti):
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = mtime
        return ti

    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as t:
        for rel in _sdist_files():
            t.add(os.path.join(ROOT, rel), arcname="%s/%s" % (base, rel), filter=norm,
                  recursive=False)
        data = _metadata().encode()
        ti = norm(tarfile.TarInfo("%s/PKG-INFO" % base))
        ti.size = len(data)
        ti.mode = 0o644
        t.addfile(ti, io.BytesIO(data))
    return name
