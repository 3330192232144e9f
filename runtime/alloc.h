/*
 * alloc.h: what the allocation paths (alloc.c) share with the files beside and
 * above them: the count of foreign frees, and the ThreadSanitizer model of
 * jemalloc's hand-off of a block between threads.
 */
#ifndef DM_RUNTIME_ALLOC_H
#define DM_RUNTIME_ALLOC_H

#include <stdint.h>

/* jemalloc is not instrumented, so ThreadSanitizer cannot see that a block freed
 * on one thread and handed out again on another was passed through jemalloc's
 * locks. In TSan builds free releases and alloc acquires one sync object
 * (alloc.c), which models that hand-off (coarsely: it orders every free before
 * every later allocation). Compiled out otherwise. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
extern char dm__alloc_tsan_sync;
#define DM_TSAN_ACQUIRE() __tsan_acquire(&dm__alloc_tsan_sync)
#define DM_TSAN_RELEASE() __tsan_release(&dm__alloc_tsan_sync)
#else
#define DM_TSAN_ACQUIRE() ((void)0)
#define DM_TSAN_RELEASE() ((void)0)
#endif

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

/* alloc.c: frees of blocks that were not ours (stats). */
uint64_t dm__alloc_foreign_frees(void);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_ALLOC_H */
