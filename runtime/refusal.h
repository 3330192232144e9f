/*
 * refusal.h: what an allocation does when its arena fails it or a limit says no
 * (refusal.c), for the allocation paths (alloc.c). Internal: never installed.
 *
 * Thread safety: the calling thread's state and relaxed counters, as alloc.c.
 */
#ifndef DM_RUNTIME_REFUSAL_H
#define DM_RUNTIME_REFUSAL_H

#include <stddef.h>

#include "runtime/internal.h"

#pragma GCC visibility push(hidden)

/* Slot `s` (rule `rule` of the thread's table) served nothing: counted as a
 * failure, a limit's refusal (t->limit_refused) recorded under the rule's
 * name, then the table's `fallback` arena tried; NULL when that fails too
 * (the thread's last failure says why, logged at most once a second). */
void *dm__refusal_failed(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule, size_t size,
                         int zero) __attribute__((cold));
/* A tag's or the worker limit's reservation was refused (t->refusal): the
 * spill arena that limit names serves it instead, if any, else the refusal
 * becomes the thread's last failure, counted for slot `s` and rule `rule`,
 * logged. */
void *dm__refusal_tallied(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule, size_t size,
                          int zero) __attribute__((cold));
/* realloc's refusal by a limit (t->limit_refused): the rule named, counted,
 * logged; the old block stays. */
void dm__refusal_realloc(dm__thread_t *t, const dm__dispatch_slot_t *s, int rule);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_REFUSAL_H */
