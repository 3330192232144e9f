/*
 * refusal.h: what an allocation does when its arena fails it or a limit says no
 * (refusal.c), for the allocation paths (alloc.c). Internal: never installed.
 *
 * Thread safety: the calling thread's state and relaxed counters, as alloc.c.
 */
#ifndef DM_RUNTIME_REFUSAL_H
#define DM_RUNTIME_REFUSAL_H

#include <stdbool.h>
#include <stddef.h>

#include "runtime/dispatch.h"
#include "runtime/thread.h"

#pragma GCC visibility push(hidden)

/* What a failed allocation carries to its fallback's outcome. */
typedef struct dm__refusal {
    bool limited;       /* a limit said no (not the arena's memory) */
    dm_failure_t first; /* the thread's last failure before the fallback was tried */
} dm__refusal_t;

/* Slot `s` (rule `rule` of the thread's table) served nothing: counted as a
 * failure, a limit's refusal (t->limit_refused) recorded under the rule's
 * name. Returns the table's `fallback` slot for the caller to try, then to
 * hand what it got to dm__refusal_fallback; or NULL: the allocation fails
 * (the thread's last failure says why, logged at most once a second). */
const dm__dispatch_slot_t *dm__refusal_failed(dm__thread_t *t, const dm__dispatch_slot_t *s,
                                              int rule, dm__refusal_t *r) __attribute__((cold));
/* The fallback's block p (NULL: it failed too, which is counted, recorded and
 * logged); returns p. */
void *dm__refusal_fallback(dm__thread_t *t, int rule, const dm__refusal_t *r, void *p)
    __attribute__((cold));
/* A tag's or the worker limit's reservation was refused (t->refusal): the
 * spill arena that limit names serves it instead (dm__refusal_spill_target,
 * or NULL; the caller allocates from it and hands the block, or NULL, to
 * dm__refusal_spilled, which counts it). What no spill arena serves,
 * dm__refusal_tallied makes the thread's last failure, counted for slot `s`
 * and rule `rule`, logged; it returns NULL. */
const dm__dispatch_slot_t *dm__refusal_spill_target(const dm__thread_t *t) __attribute__((cold));
void *dm__refusal_spilled(dm__thread_t *t, const dm__dispatch_slot_t *sp, int rule, void *p)
    __attribute__((cold));
void *dm__refusal_tallied(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule)
    __attribute__((cold));
/* realloc's refusal by a limit (t->limit_refused): the rule named, counted,
 * logged; the old block stays. */
void dm__refusal_realloc(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_REFUSAL_H */
