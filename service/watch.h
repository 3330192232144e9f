/*
 * watch.h: the policy file watcher (watch.c), told of installs and forks by
 * service.c. Internal: never installed.
 *
 * Thread safety: any thread; the watcher serialises on its own lock.
 */
#ifndef DM_SERVICE_WATCH_H
#define DM_SERVICE_WATCH_H

#include <stdbool.h>

#include "runtime/datamem.h"

void dm__watch_init(void);
void dm__watch_on_install(const dm_policy_t *p);
void dm__watch_on_fork_child(void);

/* watch_test's seam into the thread: see watch.c. */
extern void (*dm__watch_seam)(bool before);

#endif /* DM_SERVICE_WATCH_H */
