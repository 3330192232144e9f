/*
 * bigblock.h: what NumPy's default allocator does for big arrays, done for the
 * blocks datamem serves (bigblock.c): hugepage advice from 4 MiB while NumPy's
 * own setting asks for it, zeroing by giving pages back from 32 MiB, the
 * last freed blocks of 4 MiB or more kept for the next array of their size,
 * and the pages of a block's size class past its request given back.
 *
 * Thread safety: every function may be called from any thread; the advice,
 * zeroing and trimming are lock-free, reuse takes the arena's reuse_mu (never
 * across a jemalloc call).
 */
#ifndef DM_RUNTIME_BIGBLOCK_H
#define DM_RUNTIME_BIGBLOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* NumPy advises MADV_HUGEPAGE on every array of this size or more
 * (numpy/_core/src/multiarray/alloc.c). */
#define DM_BIG_THP_MIN ((size_t)4 << 20)
/* From this size calloc gives the block's pages back instead of clearing them:
 * glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), from
 * which NumPy's default always gets fresh, never-touched pages. */
#define DM_BIG_ZERO_PURGE_MIN ((size_t)32 << 20)

/* A block of n >= DM_BIG_THP_MIN bytes was handed out: if its arena is at
 * `hugepages: system` and NumPy's setting is on, the whole 2 MiB frames inside
 * it are advised MADV_HUGEPAGE (once: later blocks at the same place cost a
 * bitmap look-up). */
void dm__bigblock_advise(void *p, size_t n);

/* Makes [p, p+n) read as zeros: whole pages are given back to the kernel
 * (MADV_DONTNEED: zero pages on next touch), the partial pages at the ends
 * cleared; memset where the pages cannot be given back (mlock, pinned: cuda).
 * Returns p. */
void *dm__bigblock_zero(void *p, size_t n);

/* A block of n >= DM_BIG_THP_MIN bytes about to be handed out: its pages
 * past n, up to `touched` bytes from p (its last user's request; SIZE_MAX:
 * unknown) and at most to the end of its size class, go back to the kernel
 * when there are DM_BIG_TRIM_MIN bytes of them or more (bigblock.c,
 * "Trimming"). */
#define DM_BIG_TRIM_MIN ((size_t)64 << 10)
void dm__bigblock_trim(void *p, size_t n, size_t touched);

#define DM_REUSE_MAX 8 /* freed big blocks kept per je arena */

/* A kept big block: allocated from jemalloc, freed by its user, held for the
 * next array (bigblock.c, "Reuse" and "Lending"). */
typedef struct dm__kept {
    void *p;
    size_t usable;
    size_t touched;  /* its last user's end: the pages past it are not resident */
    size_t colour;   /* its last user's offset in it, the next user's too */
    size_t lent;     /* its first `lent` bytes (whole frames) went to other blocks */
    int64_t at_ms;
} dm__kept_t;

/* One jemalloc arena's kept big blocks, oldest first, under `mu`, which is
 * never held across a jemalloc call or a system call. */
typedef struct dm__reuse {
    pthread_mutex_t mu;
    int n;
    dm__kept_t blocks[DM_REUSE_MAX];
    /* Kept blocks out on loan (a miss lending their frames, with no lock held),
     * so that a fork child, where the lending thread does not exist, gives them
     * back: `orphans` is set in the child, and the next take, keep or expiry
     * there hands them to jemalloc. */
    dm__kept_t loaned[DM_REUSE_MAX];
    int nloaned;
    _Atomic bool orphans;
    _Atomic size_t bytes;    /* their bytes still their own (usable - lent) */
    _Atomic size_t lent;     /* their bytes lent away or given back (the sum of `lent`) */
    _Atomic uint64_t lent_total; /* bytes its kept blocks ever lent to new blocks */
    /* Bytes that blocks given back to jemalloc had lent away: jemalloc counts
     * them dirty, but no page is behind them, so the purge on growth leaves
     * them out of the footprint (arena.c). Added to as such a block goes
     * back; taken from by whatever leaves jemalloc's dirty pages (a block it
     * serves without growing, a purge or decommit of any range: either may
     * be of them, dm__bigblock_dirty_gone), so that it drops with them; and
     * the footprint never takes more than the dirty count from it. */
    _Atomic uint64_t unbacked;
    /* Kept blocks handed out again, which jemalloc does not count (the floor
     * above reads it: an arena that reuses is not idle). */
    _Atomic uint64_t reused;
} dm__reuse_t;

struct dm__arena_je;

/* The jemalloc flags for a block of n >= DM_BIG_THP_MIN bytes from ja: 2 MiB
 * alignment where dm__bigblock_advise will advise it, and always in a big
 * half (every block there starts on a frame: dm__block_of). */
int dm__bigblock_flags(const struct dm__arena_je *ja, int flags);

/* The colour of the next block of n bytes from ja, allocated with `flags`
 * (dm__bigblock_flags of the rule's `rule_flags`): in a big half, an offset
 * of a multiple of the rule's alignment (at least 64 bytes), below 4 KiB when
 * that alignment is 64, that varies from block to block and fits the size
 * class's slack; 0 elsewhere or without slack (bigblock.c, "Colour"). The
 * block is then allocated as n + colour bytes and handed out at its start
 * plus the colour. */
size_t dm__bigblock_colour(const struct dm__arena_je *ja, size_t n, int rule_flags, int flags);

/* Reuse of freed big blocks (bigblock.c, "Reuse"). dm__bigblock_take: a kept block
 * of the size class jemalloc would serve for mallocx(n, flags), aligned as
 * `flags` asks, trimmed for n at *colour, the offset its last user had (0
 * where n does not fit the class at that offset or the alignment of
 * `rule_flags` does not hold it), or NULL, in which case the blocks the arena
 * kept are in `donors` to lend their frames to the block allocated instead
 * (dm__bigblock_lend, which must follow), or, where the arena does not lend
 * or `donors` is NULL (a calloc), have gone back to jemalloc so that it can
 * split or merge them for this request. dm__bigblock_keep: keeps p (a live block
 * of the arena, not yet freed, last asked for as `hint` bytes at offset
 * `colour`) for the next allocation of its size; false if it is not kept (the
 * caller frees it). A block reused at the offset it had keeps the pages its
 * last user had resident: a colour of its own would trim them.
 * dm__bigblock_expire_all (under dm__mem_mu): every arena hands back what waited longer
 * than its decay.dirty, and all it keeps once it counts live bytes (`limit`).
 * dm__bigblock_fork: 0 before fork() (takes every arena's lock), 1 after it in
 * the parent, 2 in the child (blocks out on loan there become orphans). */

/* The kept blocks a miss took out to lend their frames (dm__bigblock_take). */
typedef struct dm__donors {
    int n;
    dm__kept_t b[DM_REUSE_MAX];
} dm__donors_t;

void *dm__bigblock_take(struct dm__arena_je *ja, size_t n, int flags, int rule_flags,
                        size_t *colour, dm__donors_t *donors);
/* After a miss: the empty 2 MiB frames of the block [p, p+n) (p from the same
 * arena, frame-aligned) get the donors' resident frames (moved, not copied),
 * then each donor is kept again while it has frames to lend, or goes back to
 * jemalloc (bigblock.c, "Lending"). p NULL (jemalloc could not serve the
 * block): every donor goes back to jemalloc. */
void dm__bigblock_lend(struct dm__arena_je *ja, void *p, size_t n, dm__donors_t *donors);
/* n bytes left ja's dirty pages in jemalloc (served as a block without
 * growing, purged or decommitted): `unbacked` drops by as much. */
void dm__bigblock_dirty_gone(struct dm__arena_je *ja, size_t n);
/* A block [p, p+n) jemalloc just served ja (no kept block did): its pages
 * past n go (dm__bigblock_trim), and where jemalloc took no new pages for it,
 * it came from dirty ones (dm__bigblock_dirty_gone). */
void dm__bigblock_fresh(struct dm__arena_je *ja, void *p, size_t n);
/* Frames that received lent pages and are still marked, process-wide: each
 * may be a mapping of its own, so lending stops at DM_LEND_FRAMES_MAX of
 * them (bigblock.c, "Mappings"); tests lower the cap (a negative value: back
 * to DM_LEND_FRAMES_MAX). */
#define DM_LEND_FRAMES_MAX 8192
int64_t dm__bigblock_moved_frames(void);
/* Moves not made because the count was at the cap, process-wide (stats). */
uint64_t dm__bigblock_capped_moves(void);
void dm__bigblock_set_lend_cap(int64_t frames);
int64_t dm__bigblock_lend_cap(void);
bool dm__bigblock_keep(struct dm__arena_je *ja, void *p, size_t hint, size_t colour);
void dm__bigblock_expire_all(void);
/* Any thread: ja hands back what waited longer than its decay.dirty (all it
 * keeps once it counts live bytes), as dm__bigblock_expire_all does for each. */
void dm__bigblock_expire(struct dm__arena_je *ja);
/* Any thread: every block ja keeps goes back to jemalloc now (the worker
 * limit, near its edge, wants the pages: arena.c, dm__arena_give_back_idle). */
void dm__bigblock_release(struct dm__arena_je *ja);
/* Any thread: ja's kept blocks give `bytes` back (or up to a frame more):
 * first those that lent (what they have left serves no exact reuse), then
 * the oldest; a block's frames from its `lent` on where only some of it must
 * go, the whole block back to jemalloc otherwise (arena.c, the purge on
 * growth). */
void dm__bigblock_release_some(struct dm__arena_je *ja, size_t bytes);
void dm__bigblock_fork(int phase);

/* What NumPy's default handler does (np._core.multiarray._get_madvise_hugepage();
 * NUMPY_MADVISE_HUGEPAGE). On until told otherwise, as in NumPy. */
void dm__bigblock_set_numpy_thp(bool on);
bool dm__bigblock_numpy_thp(void);

#endif /* DM_RUNTIME_BIGBLOCK_H */
