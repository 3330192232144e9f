/*
 * failure.c: the line a refusal by a limit writes to stderr.
 *
 * NumPy's MemoryError text is fixed ("Unable to allocate ... for an array with
 * shape ..."), so a refusal by a limit also says, on stderr, which arena, rule,
 * limit and request it was: at most one line a second (a job that catches
 * MemoryError in a loop is not flooded), with the number not shown. Failure
 * path only; datamem.last_failure() gives the same for the calling thread.
 */
#include <stdatomic.h>
#include <stdio.h>

#include "runtime/internal.h"

/* "8 bytes", "1.5 KiB", "64.0 MiB", "2.0 GiB" */
static void fmt_bytes(char *buf, size_t cap, uint64_t v) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (v < 1024) {
        snprintf(buf, cap, "%llu bytes", (unsigned long long)v);
        return;
    }
    double x = (double)v / 1024.0;
    int u = 0;
    while (x >= 1024.0 && u < 3)
        x /= 1024.0, u++;
    snprintf(buf, cap, "%.1f %s", x, units[u]);
}

void dm__failure_log(const dm_failure_t *f) {
    static _Atomic int64_t last_s;
    static _Atomic uint64_t quiet;
    if (!dm__runtime_log_due(&last_s)) {
        atomic_fetch_add_explicit(&quiet, 1, memory_order_relaxed);
        return;
    }
    uint64_t more = atomic_exchange_explicit(&quiet, 0, memory_order_relaxed);
    char more_text[64] = "";
    if (more)
        snprintf(more_text, sizeof(more_text), " (%llu more refusals not shown)",
                 (unsigned long long)more);
    char lim[32], live[32], req[32];
    fmt_bytes(lim, sizeof(lim), f->limit);
    fmt_bytes(live, sizeof(live), f->live);
    fmt_bytes(req, sizeof(req), f->request);
    if (f->kind == DM_REFUSED_TAG)
        dm__log("datamem: MemoryError: tag '%s' is at its limit of %s with %s live: a "
                "request of %s was refused%s", f->tag, lim, live, req, more_text);
    else if (f->kind == DM_REFUSED_WORKER)
        dm__log("datamem: MemoryError: the worker limit of %s is reached with %s live: a "
                "request of %s was refused%s", lim, live, req, more_text);
    else
        dm__log("datamem: MemoryError: arena '%s' (rule '%s') is at its limit of %s with %s "
                "live: a request of %s was refused%s%s", f->arena, f->rule, lim, live, req,
                f->fallback_tried ? "; the fallback arena had no room either" : "", more_text);
}

