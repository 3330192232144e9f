/*
 * bigblock.c: big blocks, treated the way NumPy's default allocator treats big
 * arrays, so that turning a policy on never makes a job slower than NumPy
 * (docs/performance.md, "Real jobs").
 *
 *   - Hugepage advice. NumPy's default handler advises MADV_HUGEPAGE on every
 *     array of 4 MiB or more (unless NUMPY_MADVISE_HUGEPAGE=0 or
 *     np._core.multiarray._set_madvise_hugepage(False)); with the kernel's THP
 *     mode at `madvise` (Debian's default) only advised memory gets hugepages.
 *     An arena left at `hugepages: system` without that advice gets 0 MB of
 *     AnonHugePages where NumPy has 284 MB, and a random gather over 2 GiB runs
 *     1.37x slower. So a block of >= 4 MiB from such an arena gets the advice
 *     while NumPy's own setting is on (the Python layer reads it at install).
 *     Only whole 2 MiB frames are advised (a partial frame cannot be a
 *     hugepage anyway), so
 *     mappings split less than NumPy's per-array advice splits them, and each
 *     frame once: a bitmap of advised frames makes a reused block cost a few
 *     loads instead of a system call (np.empty(4 MiB) create/destroy stays
 *     ~0.4 us). The advice is never taken back (an arena's memory stays its
 *     own), as NumPy's stays on a heap it reuses. Such blocks are allocated
 *     2 MiB-aligned (dm__bigblock_flags): page-aligned, a 23 MB block loses up to
 *     two frames at its ends to 4 KiB pages, and NumPy's heap, whose advised
 *     neighbours merge into one hugepage mapping, does not (pandas_etl: 39.6k
 *     faults page-aligned, 29.6k aligned, the default 21.3k). jemalloc's
 *     size classes from 8 MiB are multiples of 2 MiB, so the padding is the
 *     split-off lead of an extent, which serves the next request. `on` / `off`
 *     advise or forbid whole extents instead (arena.c, place()).
 *   - Zeroing. jemalloc clears a reused block for calloc with memset (our
 *     extent hooks make it so: its default purge-and-refault is 18-45x slower
 *     for np.zeros + use up to 16 MiB). But NumPy's default gets fresh pages
 *     from the kernel for every block of 32 MiB or more (glibc maps them), so
 *     an np.zeros(64 MiB) that is only partly used costs it 13 us where a
 *     memset costs 8 ms. From 32 MiB the block's pages are given back
 *     instead (MADV_DONTNEED) and the kernel supplies zero pages on first
 *     touch, as it does for the default: a used block pays the same faults as
 *     the default, an unused one a system call. Except when every page of the
 *     block is resident (mincore, 16 MiB per call, stopping at the first page
 *     that is not; the last array used the whole block): then clearing in
 *     place writes what the kernel's zero-fill would write and saves the
 *     faults and the freeing and re-allocating of the pages (np.zeros + touch
 *     at 64 MiB: 0.19x the default, against 1.11x when such a block is given
 *     back too; untouched, 0.35x against 0.16x).
 *     Below 32 MiB glibc clears reused heap memory too, and memset stays.
 *   - Reuse. A loop of big temporaries (`d = a * b + c` at 64 MiB in two
 *     threads) frees and allocates blocks of one size over and over. jemalloc
 *     keeps them as dirty pages, but its time-based decay still purges one
 *     now and then, in the middle of the loop: 2.5-34 page faults per
 *     iteration where the target is none. So the last few freed blocks of
 *     4 MiB or more (DM_REUSE_MAX, 1 GiB in all, per jemalloc arena) stay out
 *     of jemalloc, still allocated, and the next allocation of their size
 *     class and alignment takes one back without a jemalloc call. Peak RSS
 *     does not grow: a kept block is memory jemalloc would have kept as dirty
 *     pages, and an allocation that finds no block of its size takes the
 *     kept blocks' frames before the kernel's new pages ("Lending"); a kept
 *     block comes back at its colour only where the rule's alignment holds
 *     it (a reload may have made it stricter). A block waits at most the arena's
 *     decay.dirty (checked at each reuse operation and each stats snapshot);
 *     decay.dirty 0 keeps none. Tracked arenas (`limit`) keep none, and
 *     neither does a small half (arena.c, "Big halves"): no allocation
 *     would ever look there.
 *   - Trimming. jemalloc serves a big block from a size class (four per
 *     doubling: a 24,000,000-byte array gets 24 MiB, a 4.1 MiB one 5 MiB),
 *     and the pages past the request are left as the last user of the
 *     extent left them: resident when a block of the same class, or an
 *     earlier extent at that address, wrote there. Nobody else can use them
 *     (glibc splits the same chunk and serves the rest). At pandas3_etl's
 *     peak 69 live arrays asked for 768.9 MiB and held 836.8 MiB of size
 *     classes. So as a block is handed out, its pages past the request go
 *     back to the kernel when they are 64 KiB or more: a block fresh from
 *     jemalloc, whose history is unknown, up to the end of its class (one
 *     madvise, ~0.6 us, against the 200 us and more a 4 MiB array takes to
 *     fill); a kept block only up to what its last user asked for, since
 *     the rest went when that user got it (a loop of one size makes no
 *     system call). minimal.yaml went from 1.030x to 1.016x NumPy's default
 *     peak RSS on pandas3_etl, sklearn_pipeline under a three-arena policy
 *     (bench/policies/throughput.yaml) from 1.034x to 1.022x (bench/results/jobs-size-class-trim.md).
 *   - Colour. Every block of a big half starts on a 2 MiB frame
 *     (dm__bigblock_flags), so its frames are whole hugepages. Handed out at
 *     the frame's start, every big array began at 0 mod 2 MiB, physically too
 *     on hugepages, and the arrays a sparse matvec streams at once (the CSR
 *     matrix's data and indices, the vector) fell into the same cache sets:
 *     200 matvecs of scipy_cg took 5.6-7.1 s against NumPy's default
 *     1.05-1.14 s on the 2-vCPU VM, 2.22-2.28 s against 1.40-1.68 s on 16
 *     cores (docs/performance.md). So a block is handed out at a colour, an
 *     offset taken from its size class's slack that varies from block to
 *     block, as jemalloc's cache-oblivious placement varies the blocks it does
 *     not align: a multiple of the rule's alignment (at least 64 bytes), one of
 *     COLOURS, within COLOUR_SPAN; 0.76-0.80 s for the same matvecs. The block
 *     under a pointer is the pointer rounded down to its frame (dm__block_of,
 *     internal.h), which free, realloc and the live-byte counts use. A kept
 *     block comes back at the colour it had: a new one would trim the pages
 *     its last user left resident (a CG loop of 6.5 MB vectors at colours 4 KiB
 *     apart faulted 15.8k times where it faulted 4).
 *
 * Thread safety: the advice, zeroing and trimming are lock-free. The bitmap
 * is updated with relaxed atomic ORs; two threads racing on one frame both
 * advise it, which is harmless. Reuse takes the arena's reuse_mu, never across
 * a jemalloc call.
 */
#include "runtime/bigblock.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "runtime/datamem.h"
#include "runtime/mem.h"
#include "runtime/os.h"
#include "runtime/spill.h"

#define LG_ALIGN_MASK 0x3f /* MALLOCX_LG_ALIGN's bits of a flags word */
#define FRAME_SHIFT 21 /* 2 MiB: one PMD-mapped hugepage */
#define FRAME ((uintptr_t)1 << FRAME_SHIFT)
#define NFRAMES ((uintptr_t)1 << (DM_VA_BITS - FRAME_SHIFT))

/* One bit per 2 MiB frame of the user address space (8 MiB of zero-filled
 * bss; only the words covering datamem's regions are ever touched, 64 bytes per
 * GiB reserved). Set once the frame was advised MADV_HUGEPAGE. */
static _Atomic uint64_t advised[NFRAMES / 64];
static _Atomic bool numpy_thp = true;

void dm__bigblock_set_numpy_thp(bool on) {
    atomic_store_explicit(&numpy_thp, on, memory_order_relaxed);
}

void dm_runtime_set_numpy_hugepages(bool on) { dm__bigblock_set_numpy_thp(on); }

bool dm__bigblock_numpy_thp(void) { return atomic_load_explicit(&numpy_thp, memory_order_relaxed); }

static bool frames_advised(uintptr_t f0, uintptr_t f1) {
    for (uintptr_t f = f0; f < f1; f++)
        if (!(atomic_load_explicit(&advised[f / 64], memory_order_relaxed) &
              (UINT64_C(1) << (f % 64))))
            return false;
    return true;
}

/* Whether ja's big blocks get NumPy's advice (and so the 2 MiB alignment). */
static bool takes_numpy_advice(const dm__arena_je_t *ja) {
    return atomic_load_explicit(&numpy_thp, memory_order_relaxed) && !ja->spill &&
           atomic_load_explicit(&ja->place->thp, memory_order_relaxed) == DM_THP_SYSTEM;
}

void dm__bigblock_advise(void *p, size_t n) {
    dm__arena_je_t *ja = dm__mem_owner_of(p);
    if (!ja || !takes_numpy_advice(ja))
        return;
    void *b = dm__block_of(ja, p); /* the block's frames, from its start: its colour too */
    n += (size_t)((char *)p - (char *)b);
    uintptr_t lo = ((uintptr_t)b + FRAME - 1) & ~(FRAME - 1);
    uintptr_t hi = ((uintptr_t)b + n) & ~(FRAME - 1);
    if (hi <= lo || (hi >> FRAME_SHIFT) > NFRAMES)
        return;
    uintptr_t f0 = lo >> FRAME_SHIFT, f1 = hi >> FRAME_SHIFT;
    if (frames_advised(f0, f1))
        return;
    if (dm__os_thp((void *)lo, hi - lo, DM_THP_ON) != 0) {
        atomic_fetch_add_explicit(&ja->place->placement_errors, 1, memory_order_relaxed);
        return;
    }
    for (uintptr_t f = f0; f < f1; f++)
        atomic_fetch_or_explicit(&advised[f / 64], UINT64_C(1) << (f % 64),
                                 memory_order_relaxed);
}

int dm__bigblock_flags(const dm__arena_je_t *ja, int flags) {
    if ((flags & LG_ALIGN_MASK) >= FRAME_SHIFT || !(ja->is_big || takes_numpy_advice(ja)))
        return flags;
    return (flags & ~LG_ALIGN_MASK) | MALLOCX_LG_ALIGN(FRAME_SHIFT);
}

/* ---- Colour ------------------------------------------------------------------ */

#define COLOURS 64u                  /* offsets in use: 64 cache lines, one 4 KiB page */
#define COLOUR_SPAN ((size_t)64 << 10) /* and at most 64 KiB (an L2's set period) */
static _Atomic unsigned colour_next;

size_t dm__bigblock_colour(const dm__arena_je_t *ja, size_t n, int rule_flags, int flags) {
    if (!ja->is_big || (flags & LG_ALIGN_MASK) != FRAME_SHIFT)
        return 0; /* not a big half, or a rule's own alignment of 2 MiB or more */
    size_t unit = (size_t)1 << (rule_flags & LG_ALIGN_MASK);
    if (unit < 64)
        unit = 64;
    size_t usable = dmje_nallocx(n, flags);
    if (usable < n + unit)
        return 0; /* no slack: n is the size class itself */
    size_t m = (usable - n) / unit + 1;
    if (m > COLOURS)
        m = COLOURS;
    if (m * unit > COLOUR_SPAN)
        m = COLOUR_SPAN / unit ? COLOUR_SPAN / unit : 1;
    /* a stride prime to COLOURS: blocks made one after another sit far apart */
    unsigned k = atomic_fetch_add_explicit(&colour_next, 1, memory_order_relaxed) * 37u;
    return (size_t)(k % m) * unit;
}

void *dm__bigblock_zero(void *p, size_t n) {
    uintptr_t page = dm__os_page_size();
    uintptr_t b = (uintptr_t)p, e = b + n;
    uintptr_t lo = (b + page - 1) & ~(page - 1), hi = e & ~(page - 1);
    /* Memory registered with the CUDA runtime (`pinned: cuda`) must keep its
     * pages: MADV_DONTNEED would swap them under the GPU's mapping. */
    dm__arena_je_t *ja = dm__mem_owner_of(p);
    if (ja && ja->spill) { /* a file's pages: MADV_DONTNEED would not zero them */
        dm__spill_zero(ja, p, n);
        return p;
    }
    bool keep = ja && atomic_load_explicit(&ja->ever_pinned, memory_order_relaxed);
    /* Every page resident (the last user touched the whole block): clearing
     * in place costs what the kernel's zero-fill would, without the faults or
     * freeing and allocating the pages again. Otherwise the pages go back. */
    if (!keep && hi > lo && !dm__os_resident((void *)lo, hi - lo) &&
        dm__os_purge((void *)lo, hi - lo, true) == 0) {
        memset(p, 0, lo - b);
        memset((void *)hi, 0, e - hi);
    } else { /* pinned, locked pages (EINVAL), or less than a page */
        memset(p, 0, n);
    }
    return p;
}

/* ---- Trimming ---------------------------------------------------------------- */

void dm__bigblock_trim(void *p, size_t n, size_t touched) {
    uintptr_t page = dm__os_page_size();
    size_t usable = dmje_sallocx(p, 0);
    uintptr_t lo = ((uintptr_t)p + n + page - 1) & ~(page - 1);
    uintptr_t hi = touched < usable ? ((uintptr_t)p + touched + page - 1) & ~(page - 1)
                                    : ((uintptr_t)p + usable) & ~(page - 1);
    if (hi <= lo || hi - lo < DM_BIG_TRIM_MIN)
        return;
    dm__arena_je_t *ja = dm__mem_owner_of(p);
    if (!ja || ja->spill || atomic_load_explicit(&ja->ever_pinned, memory_order_relaxed) ||
        atomic_load_explicit(&ja->ever_locked, memory_order_relaxed))
        return; /* registered or locked pages stay as they are; a file's are the page cache's */
    dm__os_purge((void *)lo, hi - lo, true);
}

/* ---- Reuse ------------------------------------------------------------------ */

#define REUSE_BYTES_MAX ((size_t)1 << 30)

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A kept block's bytes that are still its own: not lent away or given back. */
static size_t held(const dm__kept_t *k) { return k->usable - k->lent; }

/* Counts k into (sign 1) or out of (-1) the list's totals (under reuse_mu:
 * the atomics are for readers without it). */
static void count_kept(dm__arena_je_t *ja, const dm__kept_t *k, int sign) {
    size_t bytes = atomic_load_explicit(&ja->reuse.bytes, memory_order_relaxed);
    size_t lent = atomic_load_explicit(&ja->reuse.lent, memory_order_relaxed);
    atomic_store_explicit(&ja->reuse.bytes, sign > 0 ? bytes + held(k) : bytes - held(k),
                          memory_order_relaxed);
    atomic_store_explicit(&ja->reuse.lent, sign > 0 ? lent + k->lent : lent - k->lent,
                          memory_order_relaxed);
}

/* Whether ja may keep anything: a racy peek that spares an empty list its lock. */
static bool keeps_any(const dm__arena_je_t *ja) {
    return atomic_load_explicit(&ja->reuse.bytes, memory_order_relaxed) != 0 ||
           atomic_load_explicit(&ja->reuse.orphans, memory_order_relaxed);
}

/* Removes entry i (under reuse_mu). */
static void drop_at(dm__arena_je_t *ja, int i) {
    count_kept(ja, &ja->reuse.blocks[i], -1);
    memmove(&ja->reuse.blocks[i], &ja->reuse.blocks[i + 1], (size_t)(ja->reuse.n - i - 1) * sizeof(ja->reuse.blocks[0]));
    ja->reuse.n--;
}

/* k goes back to jemalloc, through *out: the bytes it lent away go with it
 * as address space jemalloc counts dirty and no page is behind (`unbacked`). */
static int to_jemalloc(dm__arena_je_t *ja, const dm__kept_t *k, void **out) {
    if (k->lent)
        atomic_fetch_add_explicit(&ja->reuse.unbacked, k->lent, memory_order_relaxed);
    *out = k->p;
    return 1;
}

void dm__bigblock_dirty_gone(dm__arena_je_t *ja, size_t n) {
    uint64_t u = atomic_load_explicit(&ja->reuse.unbacked, memory_order_relaxed);
    while (u && !atomic_compare_exchange_weak_explicit(&ja->reuse.unbacked, &u, u > n ? u - n : 0,
                                                       memory_order_relaxed, memory_order_relaxed))
        ;
}

void dm__bigblock_fresh(dm__arena_je_t *ja, void *p, size_t n) {
    if (atomic_load_explicit(&ja->region.grown, memory_order_relaxed) == 0)
        dm__bigblock_dirty_gone(ja, n);
    dm__bigblock_trim(p, n, SIZE_MAX);
}

/* Moves the entries that waited ttl ms or longer into out[] (under reuse_mu);
 * returns how many. all: every entry. */
static int take_expired(dm__arena_je_t *ja, int64_t ttl, int64_t now, bool all, void **out) {
    int n = 0;
    while (ja->reuse.n > 0 && (all || now - ja->reuse.blocks[0].at_ms >= ttl)) {
        n += to_jemalloc(ja, &ja->reuse.blocks[0], out + n);
        drop_at(ja, 0);
    }
    return n;
}

static void give_back(void **blocks, int n) {
    for (int i = 0; i < n; i++)
        dmje_dallocx(blocks[i], MALLOCX_TCACHE_NONE);
}

static int64_t ttl_of(const dm__arena_je_t *ja) {
    int64_t ms = atomic_load_explicit(&ja->place->reuse_ms, memory_order_relaxed);
    return ms < 0 ? INT64_MAX : ms;
}

static _Atomic bool cannot_move; /* the kernel said EINVAL (before 5.7, valgrind) or ENOSYS */

/* Whether ja's kept blocks lend their frames ("Lending"): a big half (its
 * blocks start on frames) of plain anonymous memory (a spill arena's pages
 * are its file's; locked, pinned and NUMA-placed extents have a state of
 * their own that a move would not carry), where the kernel moves pages. */
static bool lends(const dm__arena_je_t *ja) {
    return ja->is_big && !ja->spill && !atomic_load_explicit(&cannot_move, memory_order_relaxed) &&
           !atomic_load_explicit(&ja->ever_locked, memory_order_relaxed) &&
           !atomic_load_explicit(&ja->ever_pinned, memory_order_relaxed) &&
           !atomic_load_explicit(&ja->place->lock, memory_order_relaxed) &&
           atomic_load_explicit(&ja->place->pinned, memory_order_relaxed) == DM_PIN_NONE &&
           atomic_load_explicit(&ja->place->numa, memory_order_relaxed) == DM_NUMA_NONE;
}

/* The end of the frames a kept block can still lend (from its `lent`). */
static size_t lendable_end(const dm__kept_t *k) {
    size_t t = (k->touched + FRAME - 1) & ~(FRAME - 1), u = k->usable & ~(FRAME - 1);
    return t < u ? t : u;
}

/* In a fork child: the blocks another thread had out on loan when the parent
 * forked go to out[] (under reuse_mu); returns how many. */
static int take_orphans(dm__arena_je_t *ja, void **out) {
    if (!atomic_load_explicit(&ja->reuse.orphans, memory_order_relaxed))
        return 0;
    int n = ja->reuse.nloaned;
    for (int i = 0; i < n; i++)
        out[i] = ja->reuse.loaned[i].p;
    ja->reuse.nloaned = 0;
    atomic_store_explicit(&ja->reuse.orphans, false, memory_order_relaxed);
    return n;
}

void *dm__bigblock_take(dm__arena_je_t *ja, size_t n, int flags, int rule_flags, size_t *colour,
                        dm__donors_t *donors) {
    *colour = 0;
    if (donors)
        donors->n = 0;
    if (!keeps_any(ja))
        return NULL; /* a racy peek: a miss here only costs a jemalloc call */
    size_t want = dmje_nallocx(n, flags & LG_ALIGN_MASK);
    uintptr_t align = (uintptr_t)1 << (flags & LG_ALIGN_MASK);
    void *out[2 * DM_REUSE_MAX], *p = NULL;
    size_t touched = 0, c = 0;
    pthread_mutex_lock(&ja->reuse.mu);
    int nout = take_orphans(ja, out);
    for (int i = ja->reuse.n - 1; i >= 0; i--) { /* the newest: its pages are warmest */
        if (ja->reuse.blocks[i].usable == want && ja->reuse.blocks[i].lent == 0 &&
            ((uintptr_t)ja->reuse.blocks[i].p & (align - 1)) == 0) {
            p = ja->reuse.blocks[i].p;
            touched = ja->reuse.blocks[i].touched;
            c = ja->reuse.blocks[i].colour;
            /* its colour, where n fits after it and the rule's alignment holds */
            c = n + c <= want && (c & (((size_t)1 << (rule_flags & LG_ALIGN_MASK)) - 1)) == 0 ? c : 0;
            drop_at(ja, i);
            atomic_fetch_add_explicit(&ja->reuse.reused, 1, memory_order_relaxed);
            break;
        }
    }
    if (!p && donors && lends(ja) && ja->reuse.nloaned + ja->reuse.n <= DM_REUSE_MAX) {
        /* no block of this size: they lend their frames, on loan meanwhile */
        memcpy(donors->b, ja->reuse.blocks, (size_t)ja->reuse.n * sizeof(donors->b[0]));
        memcpy(ja->reuse.loaned + ja->reuse.nloaned, ja->reuse.blocks,
               (size_t)ja->reuse.n * sizeof(donors->b[0]));
        ja->reuse.nloaned += ja->reuse.n;
        donors->n = ja->reuse.n;
        while (ja->reuse.n > 0)
            drop_at(ja, ja->reuse.n - 1);
    } else if (!p) /* jemalloc gets them all back to split or merge */
        nout += take_expired(ja, 0, 0, true, out + nout);
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
    if (p) /* a block that served a bigger array: its pages past n go */
        dm__bigblock_trim(p, n + c, touched);
    *colour = c;
    return p;
}

/* Adds k to ja's kept blocks, the oldest going to out[] while there is no
 * room (under reuse_mu); returns how many went. */
static int put(dm__arena_je_t *ja, const dm__kept_t *k, void **out) {
    int nout = 0;
    while (ja->reuse.n > 0 &&
           (ja->reuse.n == DM_REUSE_MAX ||
            atomic_load_explicit(&ja->reuse.bytes, memory_order_relaxed) + held(k) >
                REUSE_BYTES_MAX)) { /* room: the oldest goes */
        nout += to_jemalloc(ja, &ja->reuse.blocks[0], out + nout);
        drop_at(ja, 0);
    }
    int i = ja->reuse.n; /* oldest first: after those kept earlier */
    while (i > 0 && ja->reuse.blocks[i - 1].at_ms > k->at_ms)
        i--;
    memmove(&ja->reuse.blocks[i + 1], &ja->reuse.blocks[i],
            (size_t)(ja->reuse.n - i) * sizeof(ja->reuse.blocks[0]));
    ja->reuse.blocks[i] = *k;
    ja->reuse.n++;
    count_kept(ja, k, 1);
    return nout;
}

/* ---- Lending -----------------------------------------------------------------
 *
 * A big block that finds no kept block of its size comes from jemalloc, and
 * where jemalloc takes new pages for it the kernel zeroes each on first touch,
 * while the kept blocks hold resident pages of other sizes that nobody uses:
 * on bench/'s mixed sizes the purge on growth gave 2.35 GB back and the next
 * arrays faulted them in again. So the new block's empty frames get the kept
 * blocks' frames, moved by the kernel (mremap with MREMAP_DONTUNMAP: page
 * tables change hands, nothing is copied or zeroed, a 2 MiB hugepage moves as
 * one entry, and the donor's range stays mapped, reading zeros). Oldest donor
 * first, each up to the frame its last user's request ended in; a donor with
 * frames left is kept again (a kept block that lent serves no exact reuse: its
 * first frames are gone), one with none goes back to jemalloc. Moves go frame
 * to frame (a big half's blocks start on frames) and only into frames with no
 * resident page (mincore), so nothing jemalloc reused is replaced; the block's
 * last frame is filled whole where its size class holds it (trimming then
 * gives back its pages past the request: kept, they raised sklearn_pipeline's
 * peak 3.6 MB for nothing). A calloc takes no frames (its pages must
 * read zero), nor does a spill, locked, pinned or NUMA-placed arena (their
 * extents have a state of their own that a move would not carry). While the
 * donors are out of the list they are the allocating thread's alone; if
 * jemalloc cannot serve the block, they go back to it and it is asked again.
 * bench/results/lend-*.md has the measurements. */

/* Mappings. A moved frame keeps its old address's page offset, so its mapping
 * never merges with its neighbours': every frame that received pages may be a
 * mapping of its own, and a process may have 65,530 (vm.max_map_count; past
 * it every mmap fails, Python's and glibc's too). So each such frame has a
 * bit here, `nmoved` counts them, and a move that would take the count past
 * DM_LEND_FRAMES_MAX is not made (the block faults its pages in, as without
 * lending). A marked frame that lends its pages on is mapped afresh, empty
 * (MAP_FIXED over itself: its mapping merges again), advised again if it was,
 * and unmarked: the count drains as blocks are recycled. Frames that never
 * lend again (a long-lived array's) stay counted, as their mappings stay. */
static _Atomic uint64_t moved[NFRAMES / 64];
static _Atomic int64_t nmoved;
static _Atomic int64_t lend_cap = DM_LEND_FRAMES_MAX;
static _Atomic uint64_t capped; /* moves not made at the cap (stats: lend_capped_total) */

int64_t dm__bigblock_moved_frames(void) { return atomic_load_explicit(&nmoved, memory_order_relaxed); }

int64_t dm__bigblock_lend_cap(void) { return atomic_load_explicit(&lend_cap, memory_order_relaxed); }

uint64_t dm__bigblock_capped_moves(void) { return atomic_load_explicit(&capped, memory_order_relaxed); }

void dm__bigblock_set_lend_cap(int64_t frames) {
    atomic_store_explicit(&lend_cap, frames < 0 ? DM_LEND_FRAMES_MAX : frames, memory_order_relaxed);
}

static size_t count_moved(uintptr_t f0, size_t m) {
    size_t k = 0;
    for (uintptr_t f = f0; f < f0 + m; f++)
        k += (atomic_load_explicit(&moved[f / 64], memory_order_relaxed) >> (f % 64)) & 1;
    return k;
}

/* Sets (on) or clears the frames' bits; returns how many changed. */
static size_t mark_moved(uintptr_t f0, size_t m, bool on) {
    size_t k = 0;
    for (uintptr_t f = f0; f < f0 + m; f++) {
        uint64_t bit = UINT64_C(1) << (f % 64);
        uint64_t was = on ? atomic_fetch_or_explicit(&moved[f / 64], bit, memory_order_relaxed)
                          : atomic_fetch_and_explicit(&moved[f / 64], ~bit, memory_order_relaxed);
        k += !(was & bit) == on;
    }
    atomic_fetch_add_explicit(&nmoved, on ? (int64_t)k : -(int64_t)k, memory_order_relaxed);
    return k;
}

enum { MOVED, CAPPED, FAILED };

/* Moves m frames from src to dst (both frame-aligned, ours alone): MOVED;
 * CAPPED when that would take the count past the cap; FAILED when the
 * kernel refused it. */
static int move_frames(char *src, char *dst, size_t m) {
    uintptr_t fs = (uintptr_t)src >> FRAME_SHIFT, fd = (uintptr_t)dst >> FRAME_SHIFT;
    if ((fs + m > NFRAMES) | (fd + m > NFRAMES) ||
        atomic_load_explicit(&cannot_move, memory_order_relaxed))
        return FAILED;
    size_t healed = count_moved(fs, m);
    if (atomic_load_explicit(&nmoved, memory_order_relaxed) - (int64_t)healed + (int64_t)m >
        atomic_load_explicit(&lend_cap, memory_order_relaxed))
        return CAPPED;
    int rc = dm__os_move(src, dst, m * FRAME);
    if (rc != 0) {
        if (rc == -EINVAL || rc == -ENOSYS)
            atomic_store_explicit(&cannot_move, true, memory_order_relaxed);
        return FAILED;
    }
    if (healed && dm__os_map_fresh(src, m * FRAME) == 0) { /* a mapping that merges again */
        mark_moved(fs, m, false);
        if (frames_advised(fs, fs + m))
            (void)dm__os_thp(src, m * FRAME, DM_THP_ON);
    }
    mark_moved(fd, m, true);
    return MOVED;
}

/* The next donor of d from k on with frames to lend and not stopped. */
static int next_donor(const dm__donors_t *d, int k, const bool *stopped) {
    while (k < d->n && (stopped[k] || d->b[k].lent >= lendable_end(&d->b[k])))
        k++;
    return k;
}

/* Fills the empty frames of [p, p+whole) from d's donors, oldest first, and
 * returns the bytes moved. At the cap a run goes frame by frame, and a donor
 * whose next frame would add to the count stops lending (it is kept with the
 * rest). */
static size_t lend_frames(char *p, size_t whole, dm__donors_t *d) {
    bool stopped[DM_REUSE_MAX] = {false};
    int k = 0;
    size_t moved_bytes = 0;
    for (size_t off = 0; off < whole; off += 64 * FRAME) {
        if ((k = next_donor(d, k, stopped)) == d->n)
            return moved_bytes;
        size_t len = whole - off < 64 * FRAME ? whole - off : 64 * FRAME, nf = len / FRAME;
        uint64_t empty = 0;
        if (dm__os_empty_frames(p + off, len, FRAME, &empty) != 0)
            return moved_bytes;
        for (size_t f = 0; f < nf;) {
            if (!(empty >> f & 1)) {
                f++;
                continue;
            }
            if ((k = next_donor(d, k, stopped)) == d->n)
                return moved_bytes;
            size_t m = 1; /* a run of empty frames, as long as the donor's */
            size_t have = (lendable_end(&d->b[k]) - d->b[k].lent) / FRAME;
            while (m < have && f + m < nf && (empty >> (f + m) & 1))
                m++;
            int r = move_frames((char *)d->b[k].p + d->b[k].lent, p + off + f * FRAME, m);
            if (r == CAPPED && m > 1)
                r = move_frames((char *)d->b[k].p + d->b[k].lent, p + off + f * FRAME, m = 1);
            if (r == FAILED)
                return moved_bytes;
            if (r == CAPPED) {
                atomic_fetch_add_explicit(&capped, 1, memory_order_relaxed);
                stopped[k] = true;
                continue;
            }
            d->b[k].lent += m * FRAME;
            moved_bytes += m * FRAME;
            f += m;
        }
    }
    return moved_bytes;
}

void dm__bigblock_lend(dm__arena_je_t *ja, void *p, size_t n, dm__donors_t *d) {
    if (p && ((uintptr_t)p & (FRAME - 1)) == 0) {
        /* to n's last frame, whole, where the block's size class holds it */
        size_t whole = (n + FRAME - 1) & ~(FRAME - 1), u = dmje_sallocx(p, 0) & ~(FRAME - 1);
        size_t lent = lend_frames(p, whole < u ? whole : u, d);
        atomic_fetch_add_explicit(&ja->reuse.lent_total, lent, memory_order_relaxed);
    }
    void *out[3 * DM_REUSE_MAX];
    int nout = 0;
    pthread_mutex_lock(&ja->reuse.mu);
    nout += take_orphans(ja, out);
    for (int i = 0; i < d->n; i++) {
        for (int j = 0; j < ja->reuse.nloaned; j++) /* back from loan */
            if (ja->reuse.loaned[j].p == d->b[i].p)
                ja->reuse.loaned[j] = ja->reuse.loaned[--ja->reuse.nloaned];
        if (!p || d->b[i].lent >= lendable_end(&d->b[i]))
            nout += to_jemalloc(ja, &d->b[i], out + nout); /* nothing left to lend */
        else
            nout += put(ja, &d->b[i], out + nout);
    }
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
    d->n = 0;
}

bool dm__bigblock_keep(dm__arena_je_t *ja, void *p, size_t hint, size_t colour) {
    int64_t ttl = ttl_of(ja);
    /* Only the arena that serves the big blocks ever takes one back: a small
     * half's kept block would wait out its decay for nothing, resident. */
    if (ttl == 0 || atomic_load_explicit(&ja->tracked, memory_order_relaxed) ||
        atomic_load_explicit(&ja->big, memory_order_relaxed))
        return false;
    size_t usable = dmje_sallocx(p, 0);
    if (usable < DM_BIG_THP_MIN || usable > REUSE_BYTES_MAX)
        return false;
    void *out[3 * DM_REUSE_MAX + 1];
    dm__kept_t k = {.p = p, .usable = usable, .touched = hint + colour, .colour = colour,
                    .lent = 0, .at_ms = now_ms()};
    pthread_mutex_lock(&ja->reuse.mu);
    int nout = take_orphans(ja, out);
    nout += take_expired(ja, ttl, k.at_ms, false, out + nout);
    nout += put(ja, &k, out + nout);
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
    return true;
}

void dm__bigblock_expire(dm__arena_je_t *ja) {
    if (!keeps_any(ja))
        return;
    void *out[2 * DM_REUSE_MAX];
    int64_t now = now_ms();
    /* An arena that has started counting live bytes (a reload gave it a
     * limit) takes no kept block back: they all go now. */
    bool all = atomic_load_explicit(&ja->tracked, memory_order_relaxed);
    pthread_mutex_lock(&ja->reuse.mu);
    int nout = take_orphans(ja, out);
    nout += take_expired(ja, ttl_of(ja), now, all, out + nout);
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
}

void dm__bigblock_release(dm__arena_je_t *ja) {
    if (!keeps_any(ja))
        return;
    void *out[2 * DM_REUSE_MAX];
    pthread_mutex_lock(&ja->reuse.mu);
    int nout = take_orphans(ja, out);
    nout += take_expired(ja, 0, 0, true, out + nout);
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
}

void dm__bigblock_release_some(dm__arena_je_t *ja, size_t bytes) {
    void *out[2 * DM_REUSE_MAX + 1];
    int nout = 0;
    bool partial = lends(ja);
    pthread_mutex_lock(&ja->reuse.mu);
    while (bytes > 0 && ja->reuse.n > 0) {
        int i = 0; /* the oldest that lent (what it has left only lends), else the oldest */
        while (i < ja->reuse.n && ja->reuse.blocks[i].lent == 0)
            i++;
        i = i == ja->reuse.n ? 0 : i;
        dm__kept_t k = ja->reuse.blocks[i];
        drop_at(ja, i);
        size_t end = lendable_end(&k), avail = end > k.lent ? end - k.lent : 0;
        size_t shed = (bytes + FRAME - 1) & ~(FRAME - 1);
        if (!partial || shed >= avail) { /* the whole block goes back */
            nout += to_jemalloc(ja, &k, out + nout);
            bytes -= bytes < held(&k) ? bytes : held(&k);
            continue;
        }
        /* its oldest frames only, given back as lent ones are (out of the
         * lock: the block is this thread's while it is out of the list) */
        pthread_mutex_unlock(&ja->reuse.mu);
        (void)dm__os_purge((char *)k.p + k.lent, shed, true);
        k.lent += shed;
        pthread_mutex_lock(&ja->reuse.mu);
        nout += put(ja, &k, out + nout);
        break;
    }
    pthread_mutex_unlock(&ja->reuse.mu);
    give_back(out, nout);
}

void dm__bigblock_expire_all(void) {
    for (int i = 0; i < DM_JE_MAX && dm__mem_by_slot[i]; i++)
        dm__bigblock_expire(dm__mem_by_slot[i]);
}

void dm__bigblock_fork(int phase) {
    for (int i = 0; i < DM_JE_MAX && dm__mem_by_slot[i]; i++) {
        dm__reuse_t *r = &dm__mem_by_slot[i]->reuse;
        if (phase == 0) {
            pthread_mutex_lock(&r->mu);
            continue;
        }
        if (phase == 2 && r->nloaned > 0) /* their lender did not come along */
            atomic_store_explicit(&r->orphans, true, memory_order_relaxed);
        pthread_mutex_unlock(&r->mu);
    }
}
