/*
 * budget.c: the worker limit a policy sets, resolved (budget.h,
 * dm__budget_worker_limit): a size as given, or a share of the process's
 * memory limit read now (DATAMEM_MEMORY_LIMIT, the cgroup's, physical memory:
 * cgroup.c); and dm_runtime_budget, which reports it with the cgroup's charge.
 * Reads files only; no engine state, so no lock.
 */
#include <stdio.h>

#include "runtime/budget.h"
#include "runtime/os.h"

int dm__budget_worker_limit(const dm_policy_t *p, dm__budget_worker_t *w, char *why, size_t cap) {
    uint64_t bytes = 0;
    unsigned permille = 0;
    w->limit = UINT64_MAX;
    w->base = 0;
    w->source[0] = w->group[0] = 0;
    w->group_version = 0;
    if (!p->worker_limit[0] || dm_parse_share(p->worker_limit, &bytes, &permille) != 0)
        return 0; /* none (the validator refused any other value) */
    if (!permille) {
        w->limit = bytes;
        snprintf(w->source, sizeof(w->source), "policy");
        return 0;
    }
    uint64_t base = 0;
    char reason[320] = "";
    int rc = dm__cgroup_process_limit(&base, w->source, sizeof(w->source), reason, sizeof(reason),
                                 w->group, sizeof(w->group), &w->group_version);
    if (rc == 0 && base == 0) {
        rc = DM_EINVALID;
        snprintf(reason, sizeof(reason), "no memory limit can be read here (no "
                 "DATAMEM_MEMORY_LIMIT, no cgroup limit, physical memory unknown); give "
                 "worker_limit as a size");
    }
    if (rc) {
        snprintf(why, cap, "%s of the process's memory limit: %s", p->worker_limit, reason);
        w->source[0] = 0;
        return rc;
    }
    w->base = base;
    w->limit = base > UINT64_MAX / 1000 ? base / 1000 * permille : base * permille / 1000;
    return 0;
}

int dm_runtime_budget(const dm_policy_t *p, dm_budget_t *out, char *why, size_t cap) {
    dm__budget_worker_t w;
    int rc = dm__budget_worker_limit(p, &w, why, cap);
    *out = (dm_budget_t){.limit = rc ? UINT64_MAX : w.limit, .base = w.base, .held = UINT64_MAX};
    if (rc)
        return rc;
    snprintf(out->source, sizeof(out->source), "%s", w.source);
    snprintf(out->group, sizeof(out->group), "%s", w.group);
    if (w.group[0])
        out->held = dm__cgroup_charge(w.group, w.group_version);
    return 0;
}
