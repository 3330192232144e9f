"""The built extension: private jemalloc, nothing exported, glibc malloc kept."""
import glob
import os
import subprocess

import datamem
from conftest import run_py


def ext_path():
    return datamem._ext.__file__


def test_exports_only_init():
    out = subprocess.run(["nm", "-D", "--defined-only", ext_path()], capture_output=True,
                         text=True, check=True).stdout
    names = [l.split()[-1] for l in out.splitlines() if l.strip()]
    assert names == ["PyInit__ext"], names


def test_no_jemalloc_symbols_exported():
    out = subprocess.run(["nm", "-D", ext_path()], capture_output=True, text=True).stdout
    defined = [l for l in out.splitlines() if " U " not in l and l.strip()]
    assert not [l for l in defined if "je" in l.split()[-1] and l.split()[-1] != "PyInit__ext"]


def test_not_linked_to_system_jemalloc():
    out = subprocess.run(["ldd", ext_path()], capture_output=True, text=True).stdout
    assert "jemalloc" not in out


def test_imports_after_numpy_without_tricks():
    r = run_py("import numpy, datamem, ctypes\n"
               "maps = open('/proc/self/maps').read()\n"
               "print('libjemalloc' in maps)\n",
               env={"LD_PRELOAD": "", "GLIBC_TUNABLES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
