"""Run by datamem.pth at interpreter start when DATAMEM_CONFIG,
DATAMEM_CONFIG_TEXT or DATAMEM_PROFILE is set. Imports neither NumPy nor
datamem: a process that never imports NumPy (pip, `python -c pass`, a shell
tool written in Python) has no array for the policy to govern, so it pays
for nothing and a bad policy does not stop it.

It puts a finder at the front of sys.meta_path that finds nothing itself: when
`numpy` (or `datamem`) is imported it wraps the loader the other finders
found, and right after that module's code has run, still inside its import,
activates datamem (datamem._activate). Another thread importing NumPy
meanwhile waits on NumPy's module lock, so `import numpy` returns, in any
thread, only once datamem is NumPy's allocator; a bad or missing policy stops
the process there, with the diagnostics and exit status 2. When datamem itself
is being imported (its extension imports NumPy), activation waits for the end
of datamem's own import.

Where NumPy comes from no longer matters: a venv made with
--system-site-packages whose NumPy is the base interpreter's adds that
directory to sys.path after this .pth runs, and the finder only acts at the
import itself.

Activation is eager (at start-up, as soon as NumPy can be found) in two cases:
NumPy is already imported when this runs, and a free-threaded interpreter with
the GIL off. There datamem's import puts its dtype wrappers into PyArray_Type's
slots (pyext/handler.c, dm__handler_init), and CPython reads slots with plain
loads: they must go in before any thread can make arrays. Deferred to NumPy's
import, a thread that reached NumPy through an already imported submodule
(`from numpy.random import ...` waits on no lock of `numpy`'s) could make
arrays while the slots change (docs/design.md, "late-import window").

`python -m datamem ...` (the command-line tools) never activates: the tools
are not a job the policy governs (`ls` would list itself, `check` of a new
policy would be stopped by the broken one exported).
"""
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
        _flush_and_exit()


def _flush_and_exit():
    """Exit status 2 without running the job's atexit or finally blocks (it is
    stopped at `import numpy`), but with what it printed before: os._exit does
    not flush Python's buffers, and a pipe's stdout is block-buffered. Also
    datamem._activate's way out."""
    import os
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # closed, or None under pythonw: nothing to keep
            pass
    os._exit(2)


def _initializing(module):
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _imported(name):
    """`name` (numpy or datamem) has just run its module code, inside its
    import. Activates once both are done with: NumPy imported, datamem not in
    the middle of its own import (its end calls this again)."""
    if name == "datamem" and ("numpy" not in sys.modules or _initializing(sys.modules["numpy"])):
        return  # NumPy's own import is still running: its end activates
    if name == "numpy" and _initializing(sys.modules.get("datamem")):
        return  # datamem's extension imported NumPy: the end of datamem's import activates
    try:
        sys.meta_path.remove(_AfterNumPy)  # the once-guard: list.remove is atomic
    except ValueError:
        return  # another thread activates
    _activate()  # exits the process on failure


class _Loader:
    """The loader another finder found for numpy or datamem, followed by the
    activation. Puts the real loader back on the module before its code runs,
    so that nothing the module sees differs."""

    def __init__(self, name, loader):
        self._name = name
        self._loader = loader

    def __getattr__(self, attr):  # the real loader's other methods (get_resource_reader)
        if attr == "_loader":
            raise AttributeError(attr)  # not made by __init__ (copy.copy)
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        _imported(self._name)


class _AfterNumPy:
    """At the front of sys.meta_path until datamem is activated: finds nothing
    itself, wraps the loader of numpy and datamem."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in ("numpy", "datamem"):
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is cls or find is None:
                continue
            spec = find(name, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(name, spec.loader)
            return spec
        return None


class _WhenNumPyIsThere:
    """Eager activation: a finder that finds nothing, which activates datamem
    at the first import made once NumPy can be found (the next .pth's import,
    or site.py's `import sitecustomize` after it has added every directory),
    then leaves sys.meta_path. Where NumPy is still not found when site.py
    imports sitecustomize (every directory is on sys.path by then), the job has
    no NumPy to govern: the lazy finder takes over, so the job runs and its
    `import numpy`, if it makes one, fails as it would without datamem."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        findable = _numpy_findable()
        if findable or name in ("numpy", "sitecustomize", "usercustomize"):
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                return None  # already activating (a nested import)
            if findable:
                _activate()  # exits the process on failure
            else:
                sys.meta_path.insert(0, _AfterNumPy)
        return None


def _numpy_findable():
    import importlib.machinery
    return importlib.machinery.PathFinder.find_spec("numpy") is not None


def _asked():
    import os
    return bool(os.environ.get("DATAMEM_CONFIG") or os.environ.get("DATAMEM_CONFIG_TEXT") or
                os.environ.get("DATAMEM_PROFILE"))


def _module_run(argv):
    """The module `python [options] -m MODULE` runs (from sys.orig_argv), or None."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-") or a == "-":
            return None  # a script, or stdin
        if a.startswith("--"):
            if a in ("--check-hash-based-pycs",):
                i += 1
            i += 1
            continue
        for j in range(1, len(a)):  # -Im datamem, -mdatamem, -X opt, -c code
            c = a[j]
            if c in "mcWX":
                rest = a[j + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
                if c == "c":
                    return None
                if c == "m":
                    return rest
                i += 0 if a[j + 1:] else 1
                break
        i += 1
    return None


def _free_threaded():
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)  # 3.13+
    return is_gil_enabled is not None and not is_gil_enabled()


def _start():
    if not _asked():
        return  # imported by hand: nothing to activate
    if (_module_run(getattr(sys, "orig_argv", [])) or "").split(".")[0] == "datamem":
        return  # the command-line tools
    if "numpy" in sys.modules and not _initializing(sys.modules["numpy"]):
        _activate()
    elif _free_threaded():
        if _numpy_findable():
            _activate()
        else:
            sys.meta_path.insert(0, _WhenNumPyIsThere)
    else:
        sys.meta_path.insert(0, _AfterNumPy)


_start()
