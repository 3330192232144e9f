"""Assembles datamem's wheel from Bazel outputs (no setuptools, no network).

Usage: build_wheel.py --ext _ext.so [--lib LIB.so]... --info python_info.txt --out DIR/datamem.whl FILE...
FILEs are the Python package sources (python/datamem/**/*.py), the preset policy
`tune` measures (configs/minimal.yaml), datamem.pth and
_datamem_boot.py (the last two go to the top of site-packages).
The output path is fixed for Bazel; `scripts/build.sh` copies it to dist/ under
its proper PEP 427 name.
"""
import argparse
import base64
import hashlib
import os
import zipfile

NAME = "datamem"


def read_info(path):
    info = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            info[k] = v
    return info


def digest(data):
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + h.decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ext", required=True)
    ap.add_argument("--lib", action="append", default=[],
                    help="a shared library the extension needs, installed next to it")
    ap.add_argument("--info", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name-out", required=True, help="file receiving the PEP 427 file name")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    info = read_info(a.info)
    # cp313-cp313t-...: a free-threaded interpreter's ABI tag carries its "t"
    # (PEP 703), the Python tag does not.
    tag = "%s-%s-%s" % (info["python_tag"], info["abi"], info["platform"])
    dist = "%s-%s.dist-info" % (NAME, a.version)
    entries = []
    for f in a.files:
        base = os.path.basename(f)
        # the start-up hook and its boot module sit at the top of site-packages;
        # the package keeps its sub-packages' paths (python/datamem/_cli/check.py
        # is datamem/_cli/check.py); the presets go into the package
        top = base.endswith(".pth") or base == "_datamem_boot.py"
        inside = f.replace(os.sep, "/").partition("python/%s/" % NAME)[2]
        arc = base if top else "%s/%s" % (NAME, inside or base)
        entries.append((arc, open(f, "rb").read()))
    entries.append(("%s/_ext%s" % (NAME, info["ext_suffix"]), open(a.ext, "rb").read()))
    for lib in a.lib:
        entries.append(("%s/%s" % (NAME, os.path.basename(lib)), open(lib, "rb").read()))
    entries.append((dist + "/METADATA", (
        "Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
        "Summary: Declarative memory policy for NumPy arrays (NEP 49 handler on jemalloc arenas)\n"
        "Requires-Python: >=3.10\nRequires-Dist: numpy>=1.22\n"
        # Extras for the engines of docs/cluster.md, never hard dependencies.
        "Provides-Extra: dask\nRequires-Dist: distributed>=2023.4; extra == 'dask'\n"
        "Requires-Dist: prometheus_client>=0.17; extra == 'dask'\n"
        "Provides-Extra: ray\nRequires-Dist: ray>=2.9; extra == 'ray'\n"
        "Provides-Extra: joblib\nRequires-Dist: joblib>=1.3; extra == 'joblib'\n"
        % (NAME, a.version)).encode()))
    entries.append((dist + "/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: datamem-build-wheel\nRoot-Is-Purelib: false\n"
        "Tag: %s\n" % tag).encode()))
    record = "".join("%s,%s,%d\n" % (arc, digest(data), len(data)) for arc, data in entries)
    record += dist + "/RECORD,,\n"
    entries.append((dist + "/RECORD", record.encode()))
    with zipfile.ZipFile(a.out, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in entries:
            zi = zipfile.ZipInfo(arc, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    with open(a.name_out, "w") as f:
        f.write("%s-%s-%s.whl\n" % (NAME, a.version, tag))


if __name__ == "__main__":
    main()
