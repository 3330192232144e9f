"""Imported by the start-up hook (datamem.pth, _datamem_boot.py) when
DATAMEM_CONFIG, DATAMEM_CONFIG_TEXT or DATAMEM_PROFILE (record an allocation
profile: _profile/recording.py) is set, at the end of the process's import of NumPy (or
of datamem), in whichever thread made it.

DATAMEM_CONFIG_TEXT carries the policy itself, for a process started where no
file of ours can be (a Ray worker unpacks its job into Ray's own world-writable
/tmp/ray, which the policy's rule refuses): it is written under the directory
rule (datamem._files.policy_file) and DATAMEM_CONFIG set to that file, for this
process and the processes it starts. It wins over a DATAMEM_CONFIG that the
process inherited (a raylet's own): the policy shipped with the job is the job's.

Installs datamem before `import numpy` returns to the job. A bad or missing
policy stops the process here, with the diagnostics and exit status 2, before
the job can make an array (an exception would reach the job's `import numpy`,
or site.py would print it and carry on without datamem). Imported in a thread
other than the main one, install() covers that thread and those started after
it; the main thread sets datamem's handler itself, between two of its
bytecodes (datamem._sync_main_thread, scheduled by every install).
"""
import os
import sys


def _shown(path):
    """A path from the environment for a message: bytes that are not UTF-8 (a
    path is bytes; os.environ holds them as surrogates) as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _activate():
    path = os.environ.get("DATAMEM_CONFIG", "")
    try:
        text = os.environ.get("DATAMEM_CONFIG_TEXT")
        if text:
            from datamem import _files
            path = os.environ["DATAMEM_CONFIG"] = _files.policy_file(os.fsencode(text))
        if os.environ.get("DATAMEM_PROFILE"):  # record an allocation profile
            from datamem._profile import recording
            import datamem
            datamem._cover_main_thread_later()
            path = recording.activate_from_env()
            return
        import datamem
        datamem._cover_main_thread_later()
        datamem.install(path)
    except Exception as e:  # PolicyError, or an import failure
        msg = str(e) if str(e) else type(e).__name__
        what = "DATAMEM_CONFIG=%s" % _shown(path)
        if os.environ.get("DATAMEM_PROFILE"):
            what += ", DATAMEM_PROFILE=%s" % _shown(os.environ["DATAMEM_PROFILE"])
        sys.stderr.write("datamem: cannot activate (%s):\n%s\n" % (what, msg))
        from _datamem_boot import _flush_and_exit  # our importer: already loaded
        _flush_and_exit()


_activate()
