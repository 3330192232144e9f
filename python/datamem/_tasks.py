"""Task tags for engines, shared by datamem.dask and datamem.ray:
the rule that turns a task's name into a tag datamem.tag() accepts, entering
and leaving a task's tag without ever failing the task, and the per-tag table
gathered over a cluster's workers. Imports no engine."""
import logging
import re

import datamem

__all__ = ["task_tag", "TaskTag", "untagged", "tag_rows", "format_table", "TABLE_COLUMNS"]

logger = logging.getLogger("datamem")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
TABLE_COLUMNS = ("worker", "tag", "live", "peak", "limit", "refused")


def task_tag(name):
    """`name` (a Dask key prefix or annotation, a Ray function or class name)
    as a tag datamem.tag() accepts ([A-Za-z_][A-Za-z0-9_-]{0,62}): each
    character outside [A-Za-z0-9_-] becomes "_" (a non-ASCII letter too: one
    "_" per character), a name that does not start with a letter or "_" gets
    "_" in front, and the result is cut to 63 characters; an empty name is "_".
    Distinct names can meet ("a.b" and "a/b" both give "a_b"): their bytes then
    add up under one tag."""
    s = _UNSAFE.sub("_", str(name))
    if not s or not (s[0].isascii() and (s[0].isalpha() or s[0] == "_")):
        s = "_" + s
    return s[:63]




class TaskTag:
    """datamem.tag(name_of()) entered for one task by an engine's wrapper,
    which must never raise outside the task: a Dask worker's execute wrapper
    that raises leaves the task `executing` for good, and a worker whose thread
    slots all hold such tasks runs nothing more. Any failure here (naming the
    task, entering or leaving its tag) runs the task untagged and is said once
    per process on the "datamem" logger. close() leaves the tag and never
    raises either; a failure of the task itself is not seen here."""

    def __init__(self, name_of):
        self._cm = None
        try:
            cm = datamem.tag(name_of())
            cm.__enter__()
            self._cm = cm
        except Exception as e:  # the task runs untagged
            untagged(e)

    def close(self):
        cm, self._cm = self._cm, None
        if cm is None:
            return
        try:
            cm.__exit__(None, None, None)
        except Exception as e:
            untagged(e)


_said = False


def untagged(e):
    """Says, once per process, that a task runs untagged because its tag
    failed with `e`."""
    global _said
    if _said:
        return
    _said = True
    logger.warning("datamem: a task runs untagged: its tag failed (%s: %s); later tasks "
                   "whose tag fails run untagged too, and are not reported again",
                   type(e).__name__, e)


def tag_rows(per_worker):
    """Rows (worker, tag, live, peak, limit, refused) from {worker: snapshot},
    a snapshot being datamem.stats() or a worker's /stats.json; biggest live
    first, then by worker and tag; bytes as ints, limit None when the tag has
    none. A worker without per-tag counting gives no rows."""
    rows = []
    for w, s in per_worker.items():
        for tag, t in ((s or {}).get("tags") or {}).items():
            rows.append((str(w), str(tag), int(t.get("live", 0)), int(t.get("peak", 0)),
                         t.get("limit"), int(t.get("refused", 0))))
    rows.sort(key=lambda r: (-r[2], -r[3], r[0], r[1]))
    return rows


def format_table(rows):
    """tag_rows() as an aligned text table, then one total line per tag over
    all workers (live and peak summed: the peaks of different workers need not
    have been at the same time)."""
    from datamem._text import human_bytes

    def size(n):
        return "-" if n is None else human_bytes(n)

    totals = {}
    for _, tag, live, peak, _, refused in rows:
        t = totals.setdefault(tag, [0, 0, 0])
        t[0] += live
        t[1] += peak
        t[2] += refused
    body = [(w, tag, size(live), size(peak), size(limit), str(refused))
            for w, tag, live, peak, limit, refused in rows]
    body += [("(all workers)", tag, size(t[0]), size(t[1]), "", str(t[2]))
             for tag, t in sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))]
    widths = [max([len(c)] + [len(r[i]) for r in body]) for i, c in enumerate(TABLE_COLUMNS)]
    lines = []
    for r in [TABLE_COLUMNS] + body:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        cells += [c.rjust(widths[i + 2]) for i, c in enumerate(r[2:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
