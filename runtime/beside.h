/*
 * beside.h: the memory beside the arrays that counts against the worker limit
 * (beside.c; tally.c compares the worker total with the limit less it).
 * dm__beside_now reads it again first when the last reading is
 * DM_TALLY_BESIDE_STALE_MS old; dm__beside_last
 * is the last figure; dm__beside_relieved gives the arenas' idle pages back
 * before a refusal (whether it did: then the next look reads again);
 * dm__beside_configure (under dm__mem_mu, at install) starts a fresh window,
 * names the cgroup directory whose charge is read ("": this process's) and
 * the count of live bytes that is not beside (tally.c's worker total).
 */
#ifndef DM_RUNTIME_BESIDE_H
#define DM_RUNTIME_BESIDE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define DM_TALLY_BESIDE_STALE_MS 10 /* the figure is read again once this old */
#define DM_TALLY_BESIDE_WINDOW_MS 30000 /* and is the most it has been over this long */

#pragma GCC visibility push(hidden)

/* DM_TALLY_BESIDE_WINDOW_MS; tests shorten it */
extern uint64_t dm__beside_window_ms;

uint64_t dm__beside_now(void);
uint64_t dm__beside_last(void);
bool dm__beside_relieved(void);
void dm__beside_configure(const char *group, int version, const _Atomic uint64_t *live);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_BESIDE_H */
