/*
 * thread.h: per-thread state (thread.c): the bound table and view, the block
 * cache (bcache.h: bins per size class, memo per size class), explicit
 * jemalloc thread caches (one per je arena) and counters; the registry of
 * live threads; binding a thread to the table in force. Reached through
 * datamem_tls_anchor (tls_anchor.c) on the fast path.
 *
 * Thread safety: a thread's state is its own; what others read (stats, the
 * view sweep) is written under dm__mem_mu or through relaxed atomics.
 */
#ifndef DM_RUNTIME_THREAD_H
#define DM_RUNTIME_THREAD_H

#include <stdbool.h>
#include <stdint.h>

#include "policy/policy.h"
#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/context.h"
#include "runtime/datamem.h"
#include "runtime/dispatch.h"
#include "runtime/mem.h"
#include "runtime/sizeclass.h"
#include "runtime/tally.h"

typedef struct dm__thread {
    /* hot: the bound (table, context) and its view */
    dm__dispatch_t *table;
    const dm_ctx_t *ctx;
    const dm_view_t *view;
    /* The jemalloc arena this thread is bound to ("thread.arena"), whose small
     * blocks go through jemalloc's own malloc/free fast paths and the thread's
     * automatic cache; NULL = none. Only blocks of this arena ever enter that
     * cache, so it cannot mix arenas. */
    dm__arena_je_t *auto_je;
    bool fast;                   /* bound: the fast paths may run */
    bool auto_stale;             /* recompute auto_je at the next bind */
    /* The block cache (bcache.h): per size class, freed blocks of one arena,
     * and per raw size class what the bound view does with it (DM_MEMO_*). */
    dm__bcache_memo_t memo[DM_SC_COUNT];
    dm__bcache_bin_t bins[DM_SC_COUNT];
    dm__ctrs_t *rule_ctrs;       /* per slot of `table` (nfree unused) */
    /* explicit jemalloc thread caches, per je arena slot: index + 1, 0 = none */
    unsigned tcache[DM_JE_MAX];
    dm__ctrs_t ctrs[DM_RT_ARENAS_MAX];
    char thread_name[DM_NAME_MAX];
    dm_failure_t last_failure;   /* the thread's last allocation refused by a limit */
    dm_failure_t refusal;        /* a tag's or the worker's refusal, before it becomes
                                    last_failure (a spill arena may serve it) */
    bool limit_refused;          /* set by the tracked path, read by alloc_failed */
    dm__tally_held_t tally_held; /* counted frees held back (tally.h) */
    bool registered, exiting;
    /* The context this thread holds a reference on (context.c): the one it
     * is bound to, kept until it binds another or exits, so that `ctx` is
     * never the address of a context freed and made again. NULL: none. */
    const struct dm_ctx *held;
    struct dm__thread *next, *prev; /* registry, under the runtime mutex */
} dm__thread_t;

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

/* thread.c: the calling thread's state, the registry of live threads (under
 * dm__mem_mu) and binding a thread to the table in force. */
extern __thread dm__thread_t dm__thread_self;
extern dm__thread_t *dm__thread_registry;
extern int dm__thread_n;
void dm__thread_init(void); /* once, at dm_runtime_init */
void dm__thread_register(dm__thread_t *t); /* under dm__mem_mu */
bool dm__thread_bind(dm__thread_t *t, const dm_ctx_t *key);
/* fork, in the child: dm__thread_fork_unlink (under dm__mem_mu) takes every
 * thread but the caller out of the registry; dm__thread_fork_release (no lock
 * held) frees what they held. */
dm__thread_t *dm__thread_fork_unlink(void);
void dm__thread_fork_release(dm__thread_t *gone);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_THREAD_H */
