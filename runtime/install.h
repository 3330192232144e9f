/*
 * install.h: what the top floor's files share: the observers' notice of an
 * install (runtime.c, called by install.c) and the reload counts (install.c,
 * read by stats.c).
 */
#ifndef DM_RUNTIME_INSTALL_H
#define DM_RUNTIME_INSTALL_H

#include <stdint.h>

#include "policy/policy.h"
#include "runtime/datamem.h"

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

/* runtime.c: after a successful install, outside dm__mem_mu: the observers
 * see it, in install order (an install older than the last one delivered is
 * dropped). */
void dm__runtime_notify_install(const dm_policy_t *p, uint64_t seq);

/* install.c (under dm__mem_mu): the reload counts, into a snapshot. */
void dm__install_stats(dm_stats_t *out);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_INSTALL_H */
