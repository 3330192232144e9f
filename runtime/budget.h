/*
 * budget.h: the worker limit a policy sets, resolved (budget.c). Internal to
 * the runtime.
 */
#ifndef DM_RUNTIME_BUDGET_H
#define DM_RUNTIME_BUDGET_H
#include <stddef.h>
#include <stdint.h>

#include "policy/policy.h"
#include "runtime/datamem.h"

#pragma GCC visibility push(hidden)

/* The worker limit `p` sets, resolved: a size as given; a share of the
 * process's memory limit (os.h, dm__os_memory_limit) read now. */
typedef struct dm__budget_worker {
    uint64_t limit;  /* UINT64_MAX = none */
    uint64_t base;   /* the memory limit a share is of; 0 for a size */
    char source[16]; /* "", "policy", "env", "cgroup v1", "cgroup v2", "ram" */
    /* A share of a cgroup's limit: that cgroup's directory, whose charge
     * (every process in it) counts against the limit; "" otherwise. */
    char group[4096];
    int group_version; /* its hierarchy: 1 or 2; 0 without a group */
} dm__budget_worker_t;

/* At install, before anything changes (no lock needed: reads the environment
 * and files): `p`'s worker limit into *w. A share of a memory limit that
 * cannot be read (a DATAMEM_MEMORY_LIMIT that is not a size) is an error, never
 * a share of something else: DM_EINVALID with one line in `why`. */
int dm__budget_worker_limit(const dm_policy_t *p, dm__budget_worker_t *w, char *why, size_t cap);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_BUDGET_H */
