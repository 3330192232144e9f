"""Finds the Python and NumPy headers of the `python3` first on PATH.

Bazel rejects absolute -I paths, so the directories are symlinked into this
repository (the pattern TensorFlow's python_configure uses). The rule re-runs when
PATH or DATAMEM_PYTHON changes, so a new virtual environment is picked up.
"""

_SCRIPT = """
import sys, sysconfig
try:
    import numpy
except ImportError:
    sys.exit("numpy is not installed for " + sys.executable + ": run scripts/setup.sh")
if sysconfig.get_config_var("Py_GIL_DISABLED"):
    sys.exit("datamem does not support free-threaded CPython yet: " + sys.executable +
             " is built without the GIL, and datamem's handler and Python package rely on"
             " it (docs/design.md, 'Free-threaded CPython'). Build with a regular CPython"
             " 3.10-3.13 (DATAMEM_PYTHON=/path/to/python3).")
if int(numpy.__version__.split(".")[0]) < 2:
    sys.exit("datamem builds against NumPy >= 2 headers (found %s)" % numpy.__version__)
print(sysconfig.get_paths()["include"])
print(numpy.get_include())
print(sys.executable)
print("cp%d%d" % sys.version_info[:2])
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(sysconfig.get_platform().replace("-", "_").replace(".", "_"))
print(numpy.__version__)
print(sys.version.split()[0])
"""

def _python_configure_impl(rctx):
    python = rctx.os.environ.get("DATAMEM_PYTHON") or rctx.which("python3")
    if not python:
        fail("python3 not found on PATH")
    res = rctx.execute([python, "-c", _SCRIPT])
    if res.return_code != 0:
        fail("python_configure: %s\n%s" % (res.stdout, res.stderr))
    lines = res.stdout.strip().split("\n")
    rctx.symlink(lines[0], "python_include")
    rctx.symlink(lines[1], "numpy_include")
    rctx.file("python_info.txt", "\n".join([
        "executable=" + lines[2],
        "abi=" + lines[3],
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
    environ = ["PATH", "DATAMEM_PYTHON", "PYENV_VERSION"],
    local = True,
)
