/*
 * export.h: where stats go (export.c): which endpoints and which textfile run
 * for the policy's `stats:` section and dm_stats_serve's override, started and
 * stopped on installs, forks and exit. Internal: never installed.
 *
 * Thread safety: any thread; export.c serialises on its own lock.
 */
#ifndef DM_SERVICE_EXPORT_H
#define DM_SERVICE_EXPORT_H

#include "runtime/datamem.h"

/* The policy's stats section after each install (outside the engine's lock,
 * in install order). */
void dm__export_configure(const dm_stats_spec_t *spec);
/* In a fork child (dm_runtime_after_fork_child): the child's own endpoint. */
void dm__export_restart_in_child(void);

#endif /* DM_SERVICE_EXPORT_H */
