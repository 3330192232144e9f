"""The policy aside (never installed): check() and explain() for the library
(datamem.check, datamem.explain) and the CLI's `check` and `explain`; explain
adds what the policy's worker_limit comes to here and now (budget_text)."""
from . import _ext, _text
from ._text import short_bytes


def check(path):
    """Returns (ok, diagnostics text, summary) for a policy file; installs nothing."""
    return _ext.check(path)


def explain(path, size, dtype="unknown", thread="MainThread", tags=(), table=False,
            module=None, function=None):
    """Explains which rule and arena would serve an allocation (or dumps the table)."""
    if function is not None and module is None and "." in function:
        module = function.rsplit(".", 1)[0]  # a plain function's module; give --module for methods
    text = _ext.explain(path, int(size), dtype, thread, list(tags), bool(table), module,
                        function)
    return text if table else text + budget_text(path, int(size))


_SOURCES = (("env", "DATAMEM_MEMORY_LIMIT"), ("ram", "physical memory"),
            ("cgroup v1", "the cgroup v1 limit"), ("cgroup v2", "the cgroup v2 limit"))


def budget_text(path, size):
    """explain's lines on what the policy's worker_limit comes to here and now,
    and what it would do with an array of `size` bytes ("" without one). With a
    share of a cgroup's limit the budget is the whole cgroup's, whose charge is
    read now; else each process has its own, which only `top PID` can show."""
    try:
        b = _ext.budget(path)
    except ValueError as e:
        return "   budget now: cannot be read here: %s\n" % _text.printable(e)
    if b is None:
        return ""
    what = short_bytes(b["limit"])
    if b["base"]:
        what += " (%g%% of %s %s)" % (round(100.0 * b["limit"] / b["base"], 1),
                                      dict(_SOURCES).get(b["source"], b["source"]),
                                      short_bytes(b["base"]))
    past = ("spills to arena '%s'" % _text.printable(b["spill"]) if b["spill"]
            else "MemoryError (no worker_spill)")
    if not b["group"]:
        return ("   budget now: %s per process: each process's arrays and what it holds\n"
                "     beside them count against its own (a running job's: python -m datamem "
                "top PID)\n   an array past it: %s\n" % (what, past))
    text = ("   budget now: %s, one budget for every process in\n     cgroup %s\n"
            % (what, _text.printable(b["group"])))
    if b["held"] is None:
        return text + "   what the cgroup holds cannot be read (its memory.stat)\n"
    left = b["limit"] - b["held"]
    text += "   the cgroup holds %s now (anonymous and shmem pages): %s\n" % (
        short_bytes(b["held"]), "%s left" % short_bytes(left) if left > 0 else "past it")
    return text + "   an array of %s now: %s\n" % (
        short_bytes(size), "fits" if size <= left else past)
