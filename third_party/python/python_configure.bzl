"""Finds the Python and NumPy headers of the `python3` first on PATH.

A free-threaded interpreter (PEP 703, Py_GIL_DISABLED: python3.13t) gives an
extension for it: its pyconfig.h defines Py_GIL_DISABLED, the extension suffix
and the wheel's ABI tag carry the "t" (cp313t), and NumPy must be >= 2.1, its
first free-threaded release.

Bazel rejects absolute -I paths, so the directories are symlinked into this
repository (the pattern TensorFlow's python_configure uses). The rule re-runs when
PATH or DATAMEM_PYTHON changes, so a new virtual environment is picked up.

Two more settings, for scripts/wheels.sh:
  DATAMEM_PYTHON_ROOT  a Debian root (scripts/roots.sh) in which DATAMEM_PYTHON runs
                       (through chroot, as root): an interpreter this machine lacks,
                       such as Debian testing's CPython 3.14. Its paths are taken
                       inside the root.
  DATAMEM_TARGET       a zig target such as aarch64-linux-gnu.2.28: the wheel's
                       platform tag (manylinux_2_28_aarch64) and extension suffix
                       name that architecture and glibc.
                       The headers stay the interpreter's: CPython's and NumPy's
                       public headers are the same on x86_64 and aarch64 Linux (both
                       LP64, little-endian; docs/building.md).
"""

_SCRIPT = """
import sys, sysconfig
try:
    import numpy
except ImportError:
    sys.exit("numpy is not installed for " + sys.executable + ": run scripts/setup.sh")
ft = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
nv = tuple(int(x) for x in numpy.__version__.split(".")[:2])
if ft and nv < (2, 1):
    sys.exit("datamem for free-threaded CPython builds against NumPy >= 2.1, its first"
             " free-threaded release (found %s)" % numpy.__version__)
if int(numpy.__version__.split(".")[0]) < 2:
    sys.exit("datamem builds against NumPy >= 2 headers (found %s)" % numpy.__version__)
print(sysconfig.get_paths()["include"])
print(numpy.get_include())
print(sys.executable)
print("cp%d%d%s" % (sys.version_info[:2] + ("t" if ft else "",)))
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(sysconfig.get_platform().replace("-", "_").replace(".", "_"))
print(numpy.__version__)
print(sys.version.split()[0])
print("cp%d%d" % sys.version_info[:2])
# Debian's pythonX.Y-dev: include/pyconfig.h only picks <MULTIARCH/pythonX.Y/pyconfig.h>.
h, multi = sysconfig.get_config_h_filename(), sysconfig.get_config_var("MULTIARCH")
real = "/usr/include/%s/python%d.%d/pyconfig.h" % ((multi,) + sys.version_info[:2])
with open(h) as f:
    print(real if multi and ("include <%s/python" % multi) in f.read() else h)
"""

def _python_configure_impl(rctx):
    python = rctx.os.environ.get("DATAMEM_PYTHON") or rctx.which("python3")
    if not python:
        fail("python3 not found on PATH")
    root = rctx.os.environ.get("DATAMEM_PYTHON_ROOT", "").rstrip("/")
    cmd = [python, "-c", _SCRIPT]
    if root:
        chroot = rctx.which("chroot") or "/usr/sbin/chroot"
        cmd = [chroot, root] + cmd
    res = rctx.execute(cmd)
    if res.return_code != 0:
        fail("python_configure: %s\n%s" % (res.stdout, res.stderr))
    lines = res.stdout.strip().split("\n")
    include, config_h = root + lines[0], root + lines[9]
    if config_h == include + "/pyconfig.h":
        rctx.symlink(include, "python_include")
    else:
        # Debian's pyconfig.h only includes <ARCH-linux-gnu/pythonX.Y/pyconfig.h>
        # from a directory outside the include directory: link the real one in.
        for entry in rctx.path(include).readdir():
            if entry.basename != "pyconfig.h":
                rctx.symlink(entry, "python_include/" + entry.basename)
        rctx.symlink(config_h, "python_include/pyconfig.h")
    rctx.symlink(root + lines[1], "numpy_include")

    # A zig build (scripts/wheels.sh), maybe for another architecture: the wheel is
    # tagged for the glibc it is built against (auditwheel checks it there).
    target = rctx.os.environ.get("DATAMEM_TARGET", "")
    if target:
        arch, glibc = target.split("-")[0], target.partition(".")[2]
        host = lines[5].split("_", 1)[1]  # linux_x86_64 -> x86_64
        lines[4] = lines[4].replace(host + "-linux-gnu", arch + "-linux-gnu")
        lines[5] = ("manylinux_%s_%s" % (glibc.replace(".", "_"), arch)) if glibc else "linux_" + arch
    rctx.file("python_info.txt", "\n".join([
        "executable=" + lines[2],
        "abi=" + lines[3],
        "python_tag=" + lines[8],
        "ext_suffix=" + lines[4],
        "platform=" + lines[5],
        "numpy=" + lines[6],
        "python=" + lines[7],
    ]) + "\n")
    # What the extension was built against, for `python -m datamem --version`.
    rctx.file("dm_build_info.h", "\n".join([
        "#define DM_BUILD_NUMPY_VERSION \"%s\"" % lines[6],
        "#define DM_BUILD_PYTHON_VERSION \"%s\"" % lines[7],
    ]) + "\n")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", "workspace(name = \"local_python\")\n")

python_configure = repository_rule(
    implementation = _python_configure_impl,
    attrs = {
        "build_file": attr.label(default = "//third_party/python:python.BUILD"),
    },
    environ = ["PATH", "DATAMEM_PYTHON", "DATAMEM_PYTHON_ROOT", "DATAMEM_TARGET", "PYENV_VERSION"],
    local = True,
)
