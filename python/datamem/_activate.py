"""Imported by datamem.pth at interpreter start when DATAMEM_CONFIG is set.

Installs datamem before the job's first line runs. A bad or missing policy stops
the process here, with the diagnostics and exit status 2, before any job code
runs (site.py would otherwise print the error and carry on without datamem).
"""
import os
import sys


def _activate():
    path = os.environ.get("DATAMEM_CONFIG", "")
    try:
        import datamem
        datamem.install(path)
    except Exception as e:  # PolicyError, or an import failure
        msg = str(e) if str(e) else type(e).__name__
        sys.stderr.write("datamem: cannot activate (DATAMEM_CONFIG=%s):\n%s\n" % (path, msg))
        sys.stderr.flush()
        os._exit(2)


_activate()
