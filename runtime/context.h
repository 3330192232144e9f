/*
 * context.h: contexts, interned tag sets (context.c): what a dm_ctx_t is, the
 * root and stale ones, and the references their holders take. A context's
 * tally fields are tally.c's.
 *
 * Thread safety: a context is immutable once made, but for `refs` (atomic),
 * `retired` (atomic) and the intern table's links (dm__mem_mu).
 */
#ifndef DM_RUNTIME_CONTEXT_H
#define DM_RUNTIME_CONTEXT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runtime/datamem.h"

#define DM_CTX_MAX 4096 /* context ids (tally.c); contexts themselves are recycled */

struct dm_ctx {
    struct dm_ctx *next;         /* hash chain of interned contexts (dm__mem_mu) */
    uint64_t hash;               /* of its tags (dm__tally_hash) */
    _Atomic uint64_t refs;       /* holders, bound threads and live counted blocks */
    bool interned;               /* false: root, stale and tally's "(other)": static */
    int ntags;
    char **tags;                 /* sorted, unique */
    _Atomic bool retired;        /* lookups no longer find it: a counted one replaces it
                                    (context.c: set under dm__mem_mu, read by
                                    dm_ctx_retired); it lives until its last holder
                                    lets go */
    uint16_t id;                 /* tally.c: its id, in the shadow as id + 1 */
    int ntally;
    uint16_t *tally;             /* tally rows its blocks count under */
    uint64_t uncounted;          /* tally.c: bit i, tags[i] counts under "(other)" (its
                                    own row or an id was not free when it was made) */
    struct dm_ctx *onext, *oprev; /* tally.c: the contexts with `uncounted` bits
                                    (dm__mem_mu) */
};

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

/* context.c: the root context (what NULL means) and one never handed out,
 * which forces the next allocation to bind. */
extern struct dm_ctx dm__context_root, dm__context_stale;
/* Under dm__mem_mu: the root context's tally ids (tally.c), once. */
void dm__context_root_tally_init(void);
int dm__context_count(void); /* under dm__mem_mu */
/* A reference on a context its caller already holds one on (or is bound to);
 * giving one back never frees (context.c: freed by a sweep under
 * dm__mem_mu). Static contexts are not counted. */
static inline void dm__context_hold(const struct dm_ctx *c) {
    if (c && c->interned)
        atomic_fetch_add_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_relaxed);
}
static inline void dm__context_drop(const struct dm_ctx *c) {
    if (c && c->interned)
        atomic_fetch_sub_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_release);
}
/* The same for a context known to be made (interned: tally.c's ids from
 * DM_TALLY_ID_FIRST on), without the checks: a counted block's reference. */
static inline void dm__context_hold_made(const struct dm_ctx *c) {
    atomic_fetch_add_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_relaxed);
}
static inline void dm__context_drop_made(const struct dm_ctx *c) {
    atomic_fetch_sub_explicit(&((struct dm_ctx *)c)->refs, 1, memory_order_release);
}

#pragma GCC visibility pop

#endif /* DM_RUNTIME_CONTEXT_H */
