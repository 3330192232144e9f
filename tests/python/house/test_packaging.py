"""Packaging: what the installed extension asks of the machine, and
`python -m datamem --version`."""
import os
import platform
import re
import subprocess
import sys

import numpy
import pytest

import datamem
from datamem import _ext

GLIBC = {"linux-vdso.so.1", "libc.so.6", "libm.so.6", "libpthread.so.0",
         "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def test_version_cli_names_every_component():
    out = subprocess.run([sys.executable, "-m", "datamem", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "datamem " + datamem.__version__
    assert re.fullmatch(r"jemalloc 5\.3\.0-\S+", lines[1]), lines[1]
    assert lines[2] == "NumPy %s (built against %s)" % (numpy.__version__, _ext.BUILD_NUMPY_VERSION)
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", _ext.BUILD_NUMPY_VERSION)
    assert lines[3] == "Python CPython %s (built against %s)" % (
        platform.python_version(), _ext.BUILD_PYTHON_VERSION)
    # A wheel is per minor version: built against the same 3.X that runs it.
    assert _ext.BUILD_PYTHON_VERSION.split(".")[:2] == platform.python_version().split(".")[:2]


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="sanitizer build: links the sanitizer runtimes")
def test_extension_needs_only_glibc_and_its_own_library():
    pkg = os.path.dirname(os.path.realpath(_ext.__file__))
    for so in (_ext.__file__, os.path.join(pkg, "libdatamem_tls.so")):
        out = subprocess.run(["ldd", so], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if "statically linked" in line:
                continue
            parts = line.split()
            lib = os.path.basename(parts[0])
            assert "not found" not in line, line
            if lib in GLIBC:
                continue
            path = os.path.realpath(parts[2])
            assert os.path.dirname(path) == pkg, "%s needs %s from the system" % (so, line.strip())


def test_source_build_without_bazel_says_what_to_install(tmp_path):
    # `pip install datamem-X.tar.gz` (or `pip install .`) on a machine without Bazel:
    # the build backend's answer is one line naming what to install, no traceback.
    from conftest import ROOT
    code = ("import sys; sys.path.insert(0, %r); import datamem_backend; "
            "datamem_backend.build_wheel(%r)" % (os.path.join(ROOT, "tools", "pep517"),
                                                 str(tmp_path / "wheels")))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PATH=str(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Bazel" in lines[0] and "apt-get install bazel-bootstrap" in lines[0], lines[0]
