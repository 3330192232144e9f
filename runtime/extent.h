/*
 * extent.h: each jemalloc arena's address space (extent.c): the extent hooks
 * every arena of ours is created with, and the part of the arena they own,
 * its bump region.
 *
 * Thread safety: a region is written under its `mu` (a leaf lock, taken inside
 * jemalloc's hooks); `grown` is an atomic any thread may take.
 */
#ifndef DM_RUNTIME_EXTENT_H
#define DM_RUNTIME_EXTENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "jemalloc/jemalloc.h"

#define DM_JE_OLD_MAX 8 /* earlier regions kept per je arena (beyond: not in stats) */

/* One jemalloc arena's address space: a committed-on-demand bump region over
 * PROT_NONE reservations, and the committed parts of the regions before it,
 * for hugepage accounting (stats scan only these, not the reservations: ~14 us
 * per GiB otherwise). */
typedef struct dm__region {
    pthread_mutex_t mu;      /* guards the fields below but `grown` */
    char *cur, *end;         /* the bump pointer and the reservation's end */
    size_t reserved;         /* bytes of address space reserved */
    char *base;              /* start of the current region */
    int nold;                /* earlier regions; beyond DM_JE_OLD_MAX not kept */
    char *old[DM_JE_OLD_MAX][2];
    /* Bytes of memory the arena has started to use (fresh extents, retained
     * ranges committed again) since the floor above last looked (arena.c,
     * dm__arena_after_growth). */
    _Atomic uint64_t grown;
    bool creating;           /* inside arenas.create (under dm__mem_mu) */
} dm__region_t;

#pragma GCC visibility push(hidden)
extern const extent_hooks_t dm__extent_hooks;
#pragma GCC visibility pop

#endif /* DM_RUNTIME_EXTENT_H */
