/*
 * mem.c: what the memory floor (mem.h) shares: the engine lock, the log and
 * its rate limit, the segment map.
 *
 * Thread safety: the segment map's entries are relaxed atomics (a segment is
 * marked before any extent in it is handed out, and cleared only once nothing
 * in it is); the log's rate limit is a compare-and-swap per message kind.
 */
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "runtime/mem.h"

pthread_mutex_t dm__mem_mu = PTHREAD_MUTEX_INITIALIZER;

_Atomic uint16_t dm__mem_seg_owner[1u << (DM_VA_BITS - DM_SEG_SHIFT)];
dm__arena_je_t *dm__mem_by_slot[DM_JE_MAX];

/* ---- logging (never on the fast path) ---------------------------------- */

void dm_log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* Whether a rate-limited message (at most one a second, `last_s` its own
 * clock) may be logged now: failure paths only. */
bool dm__mem_log_due(_Atomic int64_t *last_s) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    int64_t prev = atomic_load_explicit(last_s, memory_order_relaxed);
    return !(prev && ts.tv_sec - prev < 1) &&
           atomic_compare_exchange_strong_explicit(last_s, &prev, (int64_t)ts.tv_sec,
                                                   memory_order_relaxed, memory_order_relaxed);
}
