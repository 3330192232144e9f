"""Run by datamem.pth at interpreter start when DATAMEM_CONFIG,
DATAMEM_CONFIG_TEXT or DATAMEM_PROFILE is set: activates datamem (datamem._activate) before the job's
first line.

datamem needs NumPy, and site.py runs each site directory's .pth files as it
adds that directory. In a virtual environment made with
--system-site-packages whose NumPy lives in the base interpreter's
site-packages, the venv's datamem.pth runs before the base directory is on
sys.path: importing datamem then would fail. So when NumPy cannot be found yet,
activation waits, as a finder at the front of sys.meta_path, for the first
import made once NumPy can be found (the next .pth's import, or site.py's own
`import sitecustomize` after it has added every directory), or for the import
of NumPy itself, whichever comes first: still before any job code runs. Where
NumPy is not installed at all, site.py's sitecustomize import triggers it and
the activation fails as it should, with its one-line reason and exit status 2.
"""
import importlib.machinery
import sys


def _activate():
    """datamem._activate reports its own failures (exit status 2); this covers
    the one before it can: datamem itself failing to import (no NumPy)."""
    try:
        import datamem._activate  # noqa: F401
    except Exception as e:
        import os
        what = ", ".join("%s=%s" % (k, os.fsencode(os.environ[k]).decode("utf-8", "backslashreplace"))
                         for k in ("DATAMEM_CONFIG", "DATAMEM_PROFILE") if os.environ.get(k)) or \
            "DATAMEM_CONFIG_TEXT"
        sys.stderr.write("datamem: cannot activate (%s):\n%s: %s\n" % (what, type(e).__name__, e))
        sys.stderr.flush()
        os._exit(2)


def _numpy_findable():
    return importlib.machinery.PathFinder.find_spec("numpy") is not None


class _WhenNumPyIsThere:
    """A finder that finds nothing: it activates datamem at the first import
    made once NumPy can be found, then leaves sys.meta_path."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in ("numpy", "sitecustomize", "usercustomize") or _numpy_findable():
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                return None  # already activating (a nested import)
            _activate()  # exits the process on failure
        return None


def _asked():
    import os
    return bool(os.environ.get("DATAMEM_CONFIG") or os.environ.get("DATAMEM_CONFIG_TEXT") or
                os.environ.get("DATAMEM_PROFILE"))


if not _asked():
    pass  # imported by hand: nothing to activate
elif _numpy_findable():
    _activate()
else:
    sys.meta_path.insert(0, _WhenNumPyIsThere)
