"""The built extension: private jemalloc, nothing exported, glibc malloc kept."""
import glob
import os
import subprocess

import datamem
from conftest import run_py


def ext_path():
    return datamem._ext.__file__


def dynamic_symbols():
    """(type letter, name) of the defined symbols in the dynamic symbol table."""
    out = subprocess.run(["nm", "-D", "--defined-only", ext_path()], capture_output=True,
                         text=True, check=True).stdout
    return [(l.split()[-2], l.split()[-1]) for l in out.splitlines() if l.strip()]


def test_exports_only_init():
    # Upper-case type letters are global (exported) symbols. jemalloc's TLS block
    # appears as a local ('d') entry because TLS relocations need it; it binds
    # nowhere else.
    exported = [name for kind, name in dynamic_symbols() if kind.isupper()]
    assert exported == ["PyInit__ext"], exported


def test_no_jemalloc_symbols_exported():
    syms = dynamic_symbols()
    assert not [n for k, n in syms if k.isupper() and ("je" in n or "malloc" in n)]
    assert all(k.islower() for k, n in syms if n.startswith("dmje_")), syms


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


def test_tls_anchor_library():
    # The fast path's thread pointer lives alone in libdatamem_tls.so, next to the
    # extension (runtime/tls_anchor.c): 8 bytes of static TLS, one exported symbol.
    lib = os.path.join(os.path.dirname(ext_path()), "libdatamem_tls.so")
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    exported = sorted(l.split()[-1] for l in out.splitlines()
                      if l.strip() and l.split()[-2].isupper() and not l.split()[-1].startswith("_"))
    assert exported == ["datamem_tls_anchor"], exported
    phdrs = subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True,
                           check=True).stdout
    tls = [l.split() for l in phdrs.splitlines() if l.strip().startswith("TLS")]
    assert len(tls) == 1 and int(tls[0][5], 16) <= 16, tls
    needed = subprocess.run(["readelf", "-dW", ext_path()], capture_output=True, text=True,
                            check=True).stdout
    assert "[libdatamem_tls.so]" in needed and "$ORIGIN" in needed


def test_writable_data_is_not_stored_in_the_file():
    # Initialised writable data is stored in the shared object and read from
    # it; the big tables (the profiler's 1 MiB buffer, the hugepage bitmaps)
    # belong in .bss, which costs nothing on disk or in page cache until used.
    out = subprocess.run(["readelf", "-SW", ext_path()], capture_output=True, text=True,
                         check=True).stdout
    sizes = {f[1]: int(f[5], 16) for f in (l.replace("[ ", "[").split() for l in out.splitlines())
             if len(f) > 5 and f[0].startswith("[") and f[1] in (".data", ".bss")}
    assert sizes[".data"] <= 64 * 1024, sizes
    assert sizes[".bss"] >= 1 << 20, sizes
