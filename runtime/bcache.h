/*
 * bcache.h: the block cache's tags and bins, shared by the allocation paths
 * (alloc.c, which inlines everything here into the fast path) and bcache.c.
 *
 * Most of what NumPy allocates is small and short-lived, and jemalloc's own
 * paths cost about 95 instructions per malloc+free pair even at their fastest
 * (each call fetches jemalloc's thread state through __tls_get_addr), 260 with
 * an explicit cache. So each thread keeps a few freed blocks per size class up
 * to 256 KiB (a bin, dm__bcache_bin_t, holds blocks of one arena, named by its
 * tag), and an allocation whose size class the bound view sends wholly to one
 * arena with alignment <= 64 (t->memo, dm__bcache_memo_t, says which) pops one
 * from that arena's bin: no policy lookup, no jemalloc call (alloc.c,
 * alloc_impl).
 *
 * Free must know a block's class, and NumPy's size argument is only a guess
 * (NEP 49). So the cached allocation path records it in a global tag table,
 * one 64-bit word per address hash:
 *     address (47 bits) | class (6) | je arena slot + 1 (11).
 * A free whose address matches its word owns the tag: it clears the word and,
 * when the arena is the thread's bound one, caches the block. Every path that
 * releases a block (free, realloc) clears a matching word first, so a word
 * never describes a block that was freed; a collision only overwrites another
 * block's word, which sends that block down the slow path (untagged blocks are
 * always freed correctly, by address). Words are single relaxed atomics: never
 * torn, and a block's allocation happens-before its free, so the free sees its
 * tag or a later word.
 *
 * Names: the block cache is `bcache` in code (dm__bcache_* across files,
 * bcache_* inside alloc.c).
 */
#ifndef DM_RUNTIME_BCACHE_H
#define DM_RUNTIME_BCACHE_H

#include <stdatomic.h>
#include <stdint.h>

#include "runtime/arena.h"
#include "runtime/mem.h"
#include "runtime/sizeclass.h"

#define DM_BCACHE_TAG_BITS 14
#define DM_BCACHE_TAG_PMASK (((uint64_t)1 << DM_VA_BITS) - 1)
#define DM_BCACHE_TAG_CLASS_SHIFT DM_VA_BITS
#define DM_BCACHE_TAG_ARENA_SHIFT (DM_VA_BITS + 6)
_Static_assert(DM_SC_COUNT <= 64, "class field is 6 bits");
_Static_assert(DM_JE_MAX + 1 <= (1 << (64 - DM_BCACHE_TAG_ARENA_SHIFT)), "arena field too small");

#define DM_BCACHE_SLOTS 8                      /* most blocks per class and thread */
#define DM_BCACHE_CLASS_BYTES ((size_t)64 << 10) /* fewer for big classes (at least 1):
                                                2.3 MiB per thread at most */

typedef struct dm__bcache_bin {
    _Atomic uint32_t n;          /* written by its thread, read by stats */
    uint32_t tag;                /* the je arena (slot + 1) of every block here */
    dm__ctr_t *nfree;            /* that arena's free counter in this thread */
    void *items[DM_BCACHE_SLOTS];
} dm__bcache_bin_t;

/* What the bound view does with one raw size class, learnt on first use
 * (bcache.c, dm__bcache_learn) and forgotten at every bind. */
/* CACHED_TALLY: cached, and bytes are counted per tag (alloc.c, bcache_tallied). */
typedef enum {
    DM_MEMO_UNKNOWN = 0,
    DM_MEMO_SLOW,
    DM_MEMO_CACHED,
    DM_MEMO_CACHED_TALLY
} dm__bcache_memo_state_t;
typedef struct dm__bcache_memo {
    dm__bcache_bin_t *bin;       /* the bin of the class its blocks have */
    uint64_t tag_bits;           /* class and arena fields of its blocks' tags */
    dm__ctrs_t *arena_ctrs, *rule_ctrs;
    uint32_t tag;                /* its je arena (slot + 1) */
    uint16_t rule;               /* its slot in the table */
    uint8_t state;               /* dm__bcache_memo_state_t */
    uint8_t cls;                 /* its blocks' class: dm_sc_size(cls) is their usable size */
} dm__bcache_memo_t;

struct dm__thread;

#pragma GCC visibility push(hidden) /* reached as directly as a static (no GOT load) */

extern _Atomic uint64_t dm__bcache_tags[1u << DM_BCACHE_TAG_BITS];
extern uint8_t dm__bcache_cap[DM_SC_COUNT]; /* blocks a bin may hold; set once at init */

static inline uint32_t dm__bcache_count(const dm__bcache_bin_t *b) {
    return atomic_load_explicit(&b->n, memory_order_relaxed);
}
static inline void dm__bcache_set_count(dm__bcache_bin_t *b, uint32_t n) {
    atomic_store_explicit(&b->n, n, memory_order_relaxed);
}

static inline _Atomic uint64_t *dm__bcache_tag_word(uintptr_t u) {
    return &dm__bcache_tags[(uint32_t)(((uint64_t)u * 0x9E3779B97F4A7C15ull) >>
                                       (64 - DM_BCACHE_TAG_BITS))];
}

/* The block is being released some other way than the cached free: its tag,
 * if it still has one, goes with it. */
static inline void dm__bcache_tag_drop(const void *p) {
    _Atomic uint64_t *w = dm__bcache_tag_word((uintptr_t)p);
    if ((atomic_load_explicit(w, memory_order_relaxed) & DM_BCACHE_TAG_PMASK) == (uintptr_t)p)
        atomic_store_explicit(w, 0, memory_order_relaxed);
}

/* Once, at init: each class's bin capacity. */
void dm__bcache_init(void);
/* Gives every block in t's bins back to its arena, past any jemalloc cache. */
void dm__bcache_flush(struct dm__thread *t);
/* Learns what the bound view does with raw size class k (t->memo[k]). */
void dm__bcache_learn(struct dm__thread *t, unsigned k);
/* The size class a block's tag records, or -1 when it has none (tests). */
int dm__bcache_tag_class(const void *p);

#pragma GCC visibility pop

#endif /* DM_RUNTIME_BCACHE_H */
