/*
 * tally.h: live and peak bytes per context tag, tag limits and the worker
 * limit (tally.c). Internal to the runtime.
 */
#ifndef DM_RUNTIME_TALLY_H
#define DM_RUNTIME_TALLY_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runtime/internal.h"

#define DM_TALLY_TAGS_MAX 4096 /* tag rows; rows no context refers to are reused, and
                                  past that names count under "(other)" */
#define DM_TALLY_GRAIN_SHIFT 4 /* shadow entry per 16 bytes: counted blocks are >= 16
                                  bytes and 16-aligned */

/* The shadow of each 1 GiB segment that ever held a counted block: a 16-bit
 * entry per 16 bytes, the block's context id + 1 (0: not counted). */
extern uint16_t *_Atomic dm__tally_shadow[1u << (DM_VA_BITS - DM_SEG_SHIFT)];

/* Under dm__runtime_mu, once: the root context's id and row ("(untagged)"). */
void dm__tally_root_init(struct dm_ctx *root);
/* Under dm__runtime_mu, when a context is made: gives it an id and its tags'
 * rows, or, when every id or row is taken by contexts that are held, the row
 * "(other)". False when out of memory (the context is then not made). */
bool dm__tally_ctx_init(struct dm_ctx *c);
/* Under dm__runtime_mu, when a context is freed (nothing holds it, so no live
 * block carries its id): its id and its rows' references go back. */
void dm__tally_ctx_fini(struct dm_ctx *c);
/* Under dm__runtime_mu: no id or no tag row is free (a sweep may free some). */
bool dm__tally_crowded(void);

/* The worker limit `p` sets, resolved: a size as given; a share of the
 * process's memory limit (os.h, dm__os_memory_limit) read now. */
typedef struct dm__tally_worker {
    uint64_t limit;  /* UINT64_MAX = none */
    char source[16]; /* "", "policy", "env", "cgroup v1", "cgroup v2", "ram" */
} dm__tally_worker_t;

/* At install, before anything changes (no lock needed: reads the environment
 * and files): `p`'s worker limit into *w. A share of a memory limit that
 * cannot be read (a DATAMEM_MEMORY_LIMIT that is not a size) is an error, never
 * a share of something else: DM_EINVALID with one line in `why`. */
int dm__tally_worker_limit(const dm_policy_t *p, dm__tally_worker_t *w, char *why, size_t cap);

/* Under dm__runtime_mu, at install: tag limits from `p`, the worker limit
 * from `w` (dm__tally_worker_limit's for `p`). Returns whether counting is on
 * (sticky: once on, on for the process). */
bool dm__tally_configure(const dm_policy_t *p, const dm__tally_worker_t *w);

/* Reserves `n` bytes for a block about to be allocated in context `c`: against
 * the worker limit, then each of the context's tags' limits (compare-and-swap:
 * a count never passes its limit). False on refusal, with `f` filled (kind,
 * tag, limit, live, request) and nothing reserved. */
bool dm__tally_reserve(const struct dm_ctx *c, uint64_t n, uint64_t request, dm_failure_t *f);
/* The block cache's counted path: reserves `n` bytes (the block's usable
 * size) for block `p` in context `c` as dm__tally_reserve does and records its
 * context, in one call. False on refusal (f filled, nothing reserved). */
bool dm__tally_charge(const struct dm_ctx *c, void *p, uint64_t n, uint64_t request,
                      dm_failure_t *f);
/* Takes back a reservation whose allocation failed. */
void dm__tally_unreserve(const struct dm_ctx *c, uint64_t n);
/* The block `p` was allocated for reservation `n`: settles the counts to its
 * usable size (asks jemalloc unless `exact`: n is that size) and records its
 * context in the shadow; the block holds a reference on the context until
 * its free. The caller is bound to `c` (so holds it). */
void dm__tally_record(const struct dm_ctx *c, void *p, uint64_t n, bool exact);

/* Whether any block may be counted: set (for good) when counting turns on,
 * before the table that counts is published. */
extern _Atomic bool dm__tally_counting;

/* A block is released: if it was counted, its usable size leaves its tags.
 * Call before the block goes back to jemalloc. dm__tally_release_sized: the
 * same for a block whose usable size the caller knows (the block cache's tag
 * names its class), without asking jemalloc. */
void dm__tally_release_sized(const void *p, uint64_t usable);
void dm__tally_release_slow(const void *p);
static inline void dm__tally_release(const void *p) {
    uintptr_t seg = (uintptr_t)p >> DM_SEG_SHIFT;
    if (DM_UNLIKELY(seg < (1u << (DM_VA_BITS - DM_SEG_SHIFT)) &&
                    atomic_load_explicit(&dm__tally_shadow[seg], memory_order_acquire)))
        dm__tally_release_slow(p);
}

/* Stats: fills out's tag fields (caller holds dm__runtime_mu). */
int dm__tally_snapshot(dm_stats_t *out);

#endif /* DM_RUNTIME_TALLY_H */
