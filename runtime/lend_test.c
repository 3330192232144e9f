/* lend_test: kept big blocks lend their 2 MiB frames to the next block that
 * finds none of its size (bigblock.c, "Lending"), and the mappings that makes
 * stay bounded (bigblock.c, "Mappings"). Where the kernel cannot move pages
 * (valgrind answers MREMAP_DONTUNMAP with EINVAL) nothing is lent and every
 * block is served as before: the checks that need a move say so and check
 * that instead. Run under ASan, TSan and valgrind as well. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "jemalloc/jemalloc.h"
#include "runtime/arena.h"
#include "runtime/bigblock.h"
#include "runtime/datamem.h"
#include "runtime/mem.h"
#include "runtime/os.h"
#include "runtime/test_policy.h"
#include "testing/test.h"

#define MB ((size_t)1 << 20)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define RUNNING_UNDER_VALGRIND() RUNNING_ON_VALGRIND
#else
#define RUNNING_UNDER_VALGRIND() 0
#endif
#define FRAME ((size_t)2 << 20)

static bool moves; /* whether this kernel (or valgrind) moves pages */

static bool kernel_moves(void) {
    char *a = mmap(NULL, 2 * FRAME, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED)
        return false;
    a[0] = 7;
    bool ok = dm__os_move(a, a + FRAME, FRAME) == 0 && a[FRAME] == 7 && a[0] == 0;
    munmap(a, 2 * FRAME);
    return ok;
}

static size_t resident(const void *p, size_t n) {
    static unsigned char vec[(64 * MB) / 4096];
    size_t page = 4096, np = n / page;
    if (np > sizeof(vec) || mincore((void *)p, np * page, vec) != 0)
        return SIZE_MAX;
    size_t r = 0;
    for (size_t i = 0; i < np; i++)
        r += vec[i] & 1;
    return r * page;
}

static int mappings(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    int n = 0, c;
    while (f && (c = fgetc(f)) != EOF)
        n += c == '\n';
    if (f)
        fclose(f);
    return n;
}

static void fill(char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n - 1; i += 4096) /* the last byte is the seed's alone */
        p[i] = (char)(seed * 31u + (unsigned)(i >> 12));
    p[n - 1] = (char)seed;
}

static bool filled(const char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n - 1; i += 4096)
        if (p[i] != (char)(seed * 31u + (unsigned)(i >> 12)))
            return false;
    return p[n - 1] == (char)seed;
}

/* What stats say of lending: arena c's lent_bytes and the process's
 * lend_frames, lend_frames_max and lend_capped, as /metrics exports them. */
typedef struct {
    uint64_t lent, capped;
    int64_t frames, max;
} lend_stats_t;

static lend_stats_t lend_stats(void) {
    dm_stats_t *s = malloc(sizeof(*s));
    lend_stats_t v = {UINT64_MAX, 0, 0, 0};
    if (!s || dm_stats_snapshot(s) != 0) {
        free(s);
        return v;
    }
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, "c") == 0)
            v.lent = s->arenas[i].lent_bytes;
    v.capped = s->lend_capped;
    v.frames = s->lend_frames;
    v.max = s->lend_frames_max;
    dm_stats_release(s);
    free(s);
    return v;
}

/* Bytes arena c's kept blocks have lent so far. */
static uint64_t lent_bytes(void) { return lend_stats().lent; }

/* Each test starts from arena c with no kept block. */
static void load(void) {
    test_load_policy("lend_test", "version: 1\ndefault: c\narenas:\n  c: {}\n");
    EXPECT(dm__arena_give_back_idle(), "the kept blocks go back");
}

static uint64_t unbacked(const void *p) {
    return atomic_load_explicit(&dm__mem_owner_of(p)->reuse.unbacked, memory_order_relaxed);
}

/* A block that lent all its frames goes back to jemalloc, which counts it
 * dirty though no page is behind it: `unbacked` says so, and drops as
 * jemalloc purges it; the purge on growth's malloc_trim leaves it out of the
 * footprint it compares. Runs first: the footprint's peak is the process's,
 * and no earlier test has raised it. */
static void test_unbacked(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *a = dm_alloc(root, 64 * MB, DM_DT_UNKNOWN); /* the peak: 64 MiB, trimmed at */
    fill(a, 64 * MB, 1);
    EXPECT(unbacked(a) == 0, "none before: %llu", (unsigned long long)unbacked(a));
    dm_free_hint(a, 64 * MB);
    uint64_t t0 = dm__arena_growth_trims();
    char *c = dm_alloc(root, 24 * MB, DM_DT_UNKNOWN); /* a lends 12 frames, stays kept */
    fill(c, 24 * MB, 2);
    dm_free_hint(c, 24 * MB);
    /* a lends its other 20 frames, c 4: a goes back to jemalloc with no page
     * behind it, which jemalloc counts as 64 MiB dirty beside d's 48: its
     * count says 1.9x the peak, the memory is at it (no malloc_trim) */
    char *d = dm_alloc(root, 48 * MB, DM_DT_UNKNOWN);
    EXPECT(d != NULL, "d");
    if (moves)
        EXPECT(dm__arena_growth_trims() == t0, "no malloc_trim for memory without pages: %llu",
               (unsigned long long)(dm__arena_growth_trims() - t0));
    fill(d, 48 * MB, 3);
    EXPECT(filled(d, 48 * MB, 3), "d holds its data");
    dm_free_hint(d, 48 * MB);
    EXPECT(dm__arena_give_back_idle(), "the kept blocks go back");
    EXPECT(unbacked(a) == 0, "purged: none left: %llu", (unsigned long long)unbacked(a));
    /* Below the peak (no purge on growth): a 16 MiB block lends its 8 frames
     * to a 24 MiB one and goes back to jemalloc, unbacked; a purge of the
     * arena takes it. */
    char *e = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(e, 16 * MB, 4);
    dm_free_hint(e, 16 * MB);
    char *f = dm_alloc(root, 24 * MB, DM_DT_UNKNOWN);
    EXPECT(unbacked(f) == (moves ? 16 * MB : 0), "e's 8 frames, lent, then e back to jemalloc: %llu",
           (unsigned long long)unbacked(f));
    dm_free_hint(f, 24 * MB);
    EXPECT(dm__arena_give_back_idle(), "the kept blocks go back");
    EXPECT(unbacked(f) == 0, "purged: none left: %llu", (unsigned long long)unbacked(f));
}

/* A freed 16 MiB block is kept; a 24 MiB one (another size class) finds no
 * block of its size and gets the kept block's eight frames: resident before
 * anyone writes, with no page fault to come. */
static void test_lends(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *a = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(a, 16 * MB, 1);
    dm_free_hint(a, 16 * MB);
    lend_stats_t s0 = lend_stats();
    char *b = dm_alloc(root, 24 * MB + 1000, DM_DT_UNKNOWN);
    EXPECT(b != NULL, "the 24 MiB block");
    char *blk = dm__block_of(dm__mem_owner_of(b), b);
    lend_stats_t s1 = lend_stats();
    uint64_t lent = s1.lent - s0.lent;
    EXPECT(s1.frames == dm__bigblock_moved_frames() && s1.max == DM_LEND_FRAMES_MAX,
           "stats: %lld frames of %lld", (long long)s1.frames, (long long)s1.max);
    if (moves) {
        EXPECT(lent == 16 * MB, "the kept block lent its 8 frames: %llu bytes",
               (unsigned long long)lent);
        /* 8 more hold lent pages, less those of the donor that held some
         * before (test_unbacked's) and were mapped afresh as they lent on */
        EXPECT(s1.frames - s0.frames <= 8 && s1.frames >= 8, "stats: lent frames %lld -> %lld",
               (long long)s0.frames, (long long)s1.frames);
        EXPECT(resident(blk, 16 * MB) == 16 * MB, "its first 16 MiB resident before any write: %zu",
               resident(blk, 16 * MB));
    } else {
        EXPECT(lent == 0, "no move where the kernel makes none: %llu", (unsigned long long)lent);
    }
    fill(b, 24 * MB + 1000, 2);
    EXPECT(filled(b, 24 * MB + 1000, 2), "the block holds what is written");
    dm_free_hint(b, 24 * MB + 1000);
}

/* A calloc's block reads zero, whatever the kept blocks hold, and takes none
 * of their frames. */
static void test_calloc(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *a = dm_alloc(root, 12 * MB, DM_DT_UNKNOWN);
    memset(a, 0x7f, 12 * MB);
    dm_free_hint(a, 12 * MB);
    uint64_t before = lent_bytes();
    char *z = dm_calloc(root, 20 * MB, DM_DT_UNKNOWN);
    bool zero = z != NULL;
    for (size_t i = 0; z && i < 20 * MB; i += 512)
        zero = zero && z[i] == 0;
    EXPECT(zero, "calloc: zeros");
    EXPECT(lent_bytes() == before, "calloc: nothing lent");
    dm_free_hint(z, 20 * MB);
}

/* Only freed blocks lend: a live block's contents never change, however many
 * blocks are served around it. */
static void test_live_untouched(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *live = dm_alloc(root, 10 * MB, DM_DT_UNKNOWN);
    fill(live, 10 * MB, 9);
    for (unsigned i = 0; i < 64; i++) {
        size_t n = (4 + i % 13) * MB + i * 4096;
        char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        fill(p, n, i);
        EXPECT(filled(p, n, i), "block %u holds its data", i);
        dm_free_hint(p, n);
    }
    EXPECT(filled(live, 10 * MB, 9), "the live block kept its data");
    dm_free_hint(live, 10 * MB);
}

/* Threads that allocate, fill, check and free blocks of changing sizes: no
 * block ever holds another's data (a donor is one thread's alone). */
#define THREADS 4
#define ROUNDS 60
static void *worker(void *arg) {
    unsigned id = (unsigned)(uintptr_t)arg, bad = 0;
    const dm_ctx_t *root = dm_ctx_root();
    char *held = NULL;
    size_t held_n = 0;
    for (unsigned r = 0; r < ROUNDS; r++) {
        size_t n = (4 + (r * 7 + id * 3) % 21) * MB + r * 64;
        char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        if (!p) {
            bad++;
            continue;
        }
        fill(p, n, id * 1000 + r);
        if (held && !filled(held, held_n, id * 1000 + r - 1))
            bad++;
        if (held)
            dm_free_hint(held, held_n);
        held = p, held_n = n;
    }
    if (held && !filled(held, held_n, id * 1000 + ROUNDS - 1))
        bad++;
    dm_free_hint(held, held_n);
    return (void *)(uintptr_t)bad;
}

static void test_threads(void) {
    load();
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
    uintptr_t bad = 0;
    for (int i = 0; i < THREADS; i++) {
        void *r;
        pthread_join(t[i], &r);
        bad += (uintptr_t)r;
    }
    EXPECT(bad == 0, "threads: %lu blocks with another's data or refused", (unsigned long)bad);
}

/* The cap on frames that received pages: 4 here, 100x as many blocks served.
 * The count never passes it, the process's mappings grow by a bounded number,
 * lending goes on as marked frames lend on (they are mapped afresh); with the
 * table full nothing is added, and once there is room lending is back. */
static void test_cap(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    int64_t m0 = dm__bigblock_moved_frames(), cap = m0 + 4; /* the earlier tests' stay */
    dm__bigblock_set_lend_cap(cap);
    int maps0 = mappings(), maps_max = maps0;
    int64_t moved_max = 0;
    uint64_t before = lent_bytes();
    for (unsigned i = 0; i < 400; i++) {
        size_t n = (4 + (i * 5) % 17) * MB + 12345;
        char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        fill(p, n, i);
        int64_t m = dm__bigblock_moved_frames();
        moved_max = m > moved_max ? m : moved_max;
        int maps = mappings();
        maps_max = maps > maps_max ? maps : maps_max;
        EXPECT(filled(p, n, i), "block %u holds its data", i);
        dm_free_hint(p, n);
    }
    uint64_t lent = lent_bytes() - before;
    EXPECT(moved_max <= cap, "moved frames never past the cap: %lld of %lld", (long long)moved_max,
           (long long)cap);
    EXPECT(maps_max - maps0 <= 32, "mappings %d -> at most %d", maps0, maps_max);
    if (moves)
        EXPECT(lent > 64 * FRAME, "lending went on past the cap's 4 frames: %llu bytes",
               (unsigned long long)lent);

    /* Full: a cap of 0 is below any count, so no move may add a marked frame
     * (one from a marked donor, which heals as many, still may): the count
     * never rises, and every block is served and holds its data. */
    dm__bigblock_set_lend_cap(0);
    lend_stats_t s0 = lend_stats();
    EXPECT(s0.max == 0, "stats: the cap in force: %lld", (long long)s0.max);
    int64_t full = dm__bigblock_moved_frames(), top = full;
    for (unsigned i = 0; i < 100; i++) {
        size_t n = (4 + (i * 3) % 19) * MB + 777;
        char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        fill(p, n, i + 7);
        EXPECT(filled(p, n, i + 7), "full: block %u holds its data", i);
        dm_free_hint(p, n);
        int64_t m = dm__bigblock_moved_frames();
        top = m > top ? m : top;
    }
    EXPECT(top <= full, "full: the count never rose: %lld -> %lld", (long long)full, (long long)top);
    if (moves)
        EXPECT(lend_stats().capped > s0.capped, "stats: moves refused at the cap are counted: %llu",
               (unsigned long long)(lend_stats().capped - s0.capped));
    /* Room again: a kept block lends as at the start. */
    dm__bigblock_set_lend_cap(-1);
    EXPECT(dm__arena_give_back_idle(), "the kept blocks go back");
    char *k = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(k, 16 * MB, 3);
    dm_free_hint(k, 16 * MB);
    before = lent_bytes();
    char *q = dm_alloc(root, 24 * MB + 1000, DM_DT_UNKNOWN);
    if (moves)
        EXPECT(lent_bytes() - before == 16 * MB, "back to lending: %llu bytes",
               (unsigned long long)(lent_bytes() - before));
    dm_free_hint(q, 24 * MB + 1000);
    dm__bigblock_set_lend_cap(-1);
}

/* The purge on growth sheds kept blocks for what passed the peak: a block
 * that lent first, and only the frames asked for; then whole blocks. */
static void test_shed(void) {
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *z = dm_alloc(root, 10 * MB, DM_DT_UNKNOWN);
    fill(z, 10 * MB, 13);
    char *zb = dm__block_of(dm__mem_owner_of(z), z);
    char *x = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(x, 16 * MB, 11);
    char *xb = dm__block_of(dm__mem_owner_of(x), x);
    dm_free_hint(x, 16 * MB);
    char *y = dm_alloc(root, 7 * MB, DM_DT_UNKNOWN); /* x lends it its first frames */
    fill(y, 7 * MB, 12);
    dm_free_hint(z, 10 * MB); /* kept after x, lent nothing */
    dm__arena_je_t *ja = dm__mem_owner_of(y);
    size_t xlent = SIZE_MAX; /* y's whole frames (its class's) */
    for (int i = 0; i < ja->reuse.n; i++)
        if (ja->reuse.blocks[i].p == xb)
            xlent = ja->reuse.blocks[i].lent;
    if (!moves) { /* no lending: the miss gave x back, and z goes back whole */
        EXPECT(xlent == SIZE_MAX && ja->reuse.n == 1, "x went back at the miss");
        dm__bigblock_release_some(ja, FRAME);
        EXPECT(ja->reuse.n == 0, "z went back whole");
    } else {
        EXPECT(xlent >= 4 * MB && xlent < 16 * MB, "x kept, lent %zu", xlent);
        EXPECT(resident(xb + xlent, FRAME) == FRAME, "x's next frame resident");
        dm__bigblock_release_some(ja, FRAME);
        EXPECT(resident(xb + xlent, FRAME) == 0, "x's next frame given back: %zu",
               resident(xb + xlent, FRAME));
        EXPECT(resident(xb + xlent + FRAME, FRAME) == FRAME, "and only that frame");
        EXPECT(resident(zb, 10 * MB) == 10 * MB, "z kept whole: %zu", resident(zb, 10 * MB));
    }
    dm__bigblock_release_some(ja, 64 * MB);
    EXPECT(atomic_load(&ja->reuse.bytes) == 0 && ja->reuse.n == 0, "then both went back: %zu",
           (size_t)atomic_load(&ja->reuse.bytes));
    EXPECT(filled(y, 7 * MB, 12), "the live block untouched");
    dm_free_hint(y, 7 * MB);
}

/* A fork child lends as its parent does, on its own copy. (Not under TSan:
 * jemalloc's prefork takes more locks than its deadlock detector holds, as in
 * fork_test.) */
static void test_fork(void) {
#if defined(__SANITIZE_THREAD__)
    printf("SKIP test_fork under TSan: fork holds more locks than its detector tracks\n");
    return;
#endif
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *a = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(a, 16 * MB, 5);
    char *keep = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    fill(keep, 8 * MB, 6);
    dm_free_hint(a, 16 * MB);
    pid_t pid = fork();
    if (pid == 0) {
        uint64_t before = lent_bytes();
        char *b = dm_alloc(root, 26 * MB, DM_DT_UNKNOWN);
        bool ok = b && (!moves || lent_bytes() - before == 16 * MB);
        if (b)
            fill(b, 26 * MB, 7);
        ok = ok && b && filled(b, 26 * MB, 7) && filled(keep, 8 * MB, 6);
        _exit(ok ? 0 : 1);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child lent and kept its data");
    EXPECT(filled(keep, 8 * MB, 6), "the parent's block untouched");
    char *b = dm_alloc(root, 26 * MB, DM_DT_UNKNOWN);
    fill(b, 26 * MB, 8);
    EXPECT(filled(b, 26 * MB, 8), "the parent lends after the child");
    dm_free_hint(b, 26 * MB);
    dm_free_hint(keep, 8 * MB);
}

/* A fork while a miss has kept blocks out on loan (taken, not yet lent): in the
 * child their lender does not exist, and they go back to jemalloc at the
 * child's next big allocation; in the parent the lender finishes as usual. */
static void test_fork_mid_loan(void) {
#if defined(__SANITIZE_THREAD__)
    printf("SKIP test_fork_mid_loan under TSan: fork holds more locks than its detector tracks\n");
    return;
#endif
    load();
    const dm_ctx_t *root = dm_ctx_root();
    char *a = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
    fill(a, 16 * MB, 21);
    dm__arena_je_t *ja = dm__mem_owner_of(a);
    dm_free_hint(a, 16 * MB);
    dm__donors_t d;
    size_t c;
    char *none = dm__bigblock_take(ja, 24 * MB, MALLOCX_LG_ALIGN(21), 0, &c, &d);
    EXPECT(none == NULL && (!moves || d.n == 1), "a miss: the kept block on loan (%d)", d.n);
    EXPECT(ja->reuse.nloaned == d.n, "counted out on loan: %d", ja->reuse.nloaned);
    pid_t pid = fork();
    if (pid == 0) {
        bool ok = ja->reuse.nloaned == d.n && atomic_load(&ja->reuse.orphans) == (d.n > 0);
        char *b = dm_alloc(root, 6 * MB, DM_DT_UNKNOWN); /* the next take gives them back */
        ok = ok && b && ja->reuse.nloaned == 0 && !atomic_load(&ja->reuse.orphans);
        dm_free_hint(b, 6 * MB);
        _exit(ok ? 0 : 1);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child gave the orphans back");
    EXPECT(!atomic_load(&ja->reuse.orphans) && ja->reuse.nloaned == d.n,
           "the parent's loan stands");
    dm__bigblock_lend(ja, NULL, 0, &d); /* the lender's end: back to jemalloc */
    EXPECT(ja->reuse.nloaned == 0 && ja->reuse.n == 0, "returned from loan");
}

/* A fork storm while a thread lends all the time: every child allocates, fills
 * and frees big blocks of changing sizes (taking back whatever loans it
 * inherited) and exits cleanly; the busy thread's blocks hold their data. */
static _Atomic bool storm_done;
static void *busy_lender(void *arg) {
    (void)arg;
    const dm_ctx_t *root = dm_ctx_root();
    uintptr_t bad = 0;
    for (unsigned r = 0; !atomic_load(&storm_done); r++) {
        size_t n = (4 + (r * 7) % 23) * MB + r % 4096;
        char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        if (!p) {
            bad++;
            continue;
        }
        fill(p, n, r);
        bad += !filled(p, n, r);
        dm_free_hint(p, n);
    }
    return (void *)bad;
}

static void test_fork_storm(void) {
#if defined(__SANITIZE_THREAD__)
    printf("SKIP test_fork_storm under TSan: fork holds more locks than its detector tracks\n");
    return;
#endif
    load();
    atomic_store(&storm_done, false);
    pthread_t t;
    pthread_create(&t, NULL, busy_lender, NULL);
    int failed = 0, forks = RUNNING_UNDER_VALGRIND() ? 4 : 40;
    for (int i = 0; i < forks; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            const dm_ctx_t *root = dm_ctx_root();
            bool ok = true;
            for (unsigned r = 0; r < 6; r++) {
                size_t n = (5 + r * 3) * MB;
                char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
                ok = ok && p;
                if (p) {
                    fill(p, n, r + 100);
                    ok = ok && filled(p, n, r + 100);
                    dm_free_hint(p, n);
                }
            }
            _exit(ok ? 0 : 1);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    atomic_store(&storm_done, true);
    void *bad;
    pthread_join(t, &bad);
    EXPECT(failed == 0, "fork storm: %d of %d children failed", failed, forks);
    EXPECT(bad == NULL, "the lending thread's blocks held their data");
}

int main(void) {
    dm_runtime_init();
    moves = kernel_moves();
    fprintf(stderr, "lend_test: the kernel %s pages\n", moves ? "moves" : "does not move");
    test_unbacked();
    test_lends();
    test_calloc();
    test_live_untouched();
    test_threads();
    test_cap();
    test_shed();
    test_fork();
    test_fork_mid_loan();
    test_fork_storm();
    return TEST_EXIT();
}
