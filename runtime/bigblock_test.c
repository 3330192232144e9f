/* bigblock_test: the colour of big blocks (bigblock.c, "Colour"). A big half
 * serves each block from a 2 MiB frame and hands it out at an offset of a few
 * cache lines that varies from block to block, so that the arrays of a sparse
 * matvec do not all start at 0 mod 2 MiB; free, realloc, reuse and live-byte
 * counting find the block under the pointer. Run under ASan and valgrind as
 * well: a free of the wrong address would be jemalloc's undefined behaviour. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jemalloc/jemalloc.h"
#include "runtime/arena.h"
#include "runtime/bigblock.h"
#include "runtime/datamem.h"
#include "runtime/mem.h"
#include "runtime/test_policy.h"
#include "runtime/thread.h"
#include "testing/test.h"

#define MB ((size_t)1 << 20)
#define N 16

static uintptr_t colour(const void *p) { return (uintptr_t)p & (DM_BIG_FRAME - 1); }

static void fill(char *p, size_t n, int seed) {
    for (size_t i = 0; i < n; i += 4093)
        p[i] = (char)(seed + (int)(i >> 12));
    p[n - 1] = (char)seed;
}

/* fill's pattern in p[0, n) (its last byte aside) */
static bool filled(const char *p, size_t n, int seed) {
    for (size_t i = 0; i < n - 1; i += 4093)
        if (p[i] != (char)(seed + (int)(i >> 12)))
            return false;
    return true;
}

static int distinct(char **p, int n) {
    int d = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < i; j++)
            seen = seen || colour(p[j]) == colour(p[i]);
        d += !seen;
    }
    return d;
}

/* Blocks of 5 MiB + 1000 bytes (a 6 MiB class: slack for every colour) from
 * an arena of the given alignment: each on a frame of the big half, at a
 * multiple of the alignment below 64 of them, 8 or more colours among 16;
 * realloc keeps the contents (and the colour, in place); every free goes to
 * the block. */
static void test_colours(const char *arena, size_t unit) {
    char text[256];
    snprintf(text, sizeof(text), "version: 1\ndefault: c\narenas:\n  c: %s\n", arena);
    test_load_policy("bigblock_test", text);
    const dm_ctx_t *root = dm_ctx_root();
    char *p[N];
    size_t n = 5 * MB + 1000;
    for (int i = 0; i < N; i++) {
        p[i] = dm_alloc(root, n, DM_DT_UNKNOWN);
        dm__arena_je_t *ja = dm__mem_owner_of(p[i]);
        EXPECT(ja && ja->is_big, "%s: block %d in the big half", arena, i);
        EXPECT(colour(p[i]) % unit == 0 && colour(p[i]) < 64 * unit,
              "%s: colour %#lx a multiple of %zu below %zu", arena, (unsigned long)colour(p[i]),
              unit, 64 * unit);
        EXPECT(dmje_sallocx(dm__block_of(ja, p[i]), 0) >= n + colour(p[i]),
              "%s: the block holds its colour and the request", arena);
        fill(p[i], n, i);
    }
    EXPECT(distinct(p, N) >= 8, "%s: %d colours among %d blocks", arena, distinct(p, N), N);
    for (int i = 0; i < N; i += 2) {
        /* grown: to a new block (its own colour), the data copied */
        char *q = dm_realloc(root, p[i], 23 * MB + 77);
        EXPECT(q && colour(q) % unit == 0 && filled(q, n, i) && q[n - 1] == (char)i,
              "%s: realloc up keeps the data", arena);
        fill(q, 23 * MB + 77, i);
        /* shrunk under 4 MiB: in place in the big half, data and colour stay */
        uintptr_t c = colour(q);
        char *r = dm_realloc(root, q, MB + 3);
        EXPECT(r && colour(r) == c && filled(r, MB, i), "%s: realloc down keeps data and colour "
              "%#lx -> %#lx", arena, (unsigned long)c, r ? (unsigned long)colour(r) : 0ul);
        EXPECT(dm__mem_owner_of(r)->is_big, "%s: still in the big half", arena);
        p[i] = r;
    }
    for (int i = 0; i < N; i++)
        dm_free_hint(p[i], i % 2 ? n : MB + 3);
    /* a request that is its class exactly has no slack: no colour */
    char *whole = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    EXPECT(whole && colour(whole) == 0, "8 MiB: on its frame, %#lx",
          whole ? (unsigned long)colour(whole) : 0ul);
    dm_free(whole);
}

/* A kept block (bigblock.c, "Reuse") comes back at a new colour, zeroed for
 * calloc from that colour on. */
static void test_reuse(void) {
    test_load_policy("bigblock_test", "version: 1\ndefault: c\narenas:\n  c: {}\n");
    const dm_ctx_t *root = dm_ctx_root();
    size_t n = 5 * MB + 1000;
    char *a = dm_alloc(root, n, DM_DT_UNKNOWN);
    memset(a, 0x7f, n);
    char *blk = dm__block_of(dm__mem_owner_of(a), a);
    dm_free_hint(a, n);
    char *b = dm_calloc(root, n, DM_DT_UNKNOWN);
    EXPECT(b && dm__block_of(dm__mem_owner_of(b), b) == blk, "the kept block serves again");
    bool zero = b != NULL;
    for (size_t i = 0; b && i < n; i += 512)
        zero = zero && b[i] == 0;
    EXPECT(zero && b[n - 1] == 0, "calloc of a kept block: zeros from its colour on");
    dm_free_hint(b, n);
}

/* A kept block's colour serves again only where the arena's alignment holds
 * it: a block kept at a colour of 64-byte steps, reused after a reload asks for
 * 4096-byte alignment, comes back at a multiple of 4096. */
static void test_reuse_after_realign(void) {
    const dm_ctx_t *root = dm_ctx_root();
    size_t n = 5 * MB + 1000;
    test_load_policy("bigblock_test", "version: 1\ndefault: c\narenas:\n  c: {}\n");
    char *p[N], *a = NULL;
    for (int i = 0; i < N; i++) { /* one at a colour 4096 does not divide */
        p[i] = dm_alloc(root, n, DM_DT_UNKNOWN);
        if (p[i] && !a && colour(p[i]) % 4096 != 0)
            a = p[i];
    }
    for (int i = 0; i < N; i++) /* that one last: the newest kept block */
        if (p[i] != a)
            dm_free_hint(p[i], n);
    EXPECT(a != NULL, "a block at a colour of 64-byte steps");
    char *blk = dm__block_of(dm__mem_owner_of(a), a);
    dm_free_hint(a, n);
    test_load_policy("bigblock_test", "version: 1\ndefault: c\narenas:\n  c: {alignment: 4096}\n");
    char *b = dm_alloc(root, n, DM_DT_UNKNOWN);
    EXPECT(b && dm__block_of(dm__mem_owner_of(b), b) == blk, "the kept block serves again");
    EXPECT(b && (uintptr_t)b % 4096 == 0, "at the new alignment: %p", (void *)b);
    dm_free_hint(b, n);
}

/* An arena with a limit counts each block's usable size from its start; every
 * byte comes back at the frees. */
static uint64_t live(void) { /* arena t's */
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    uint64_t v = UINT64_MAX;
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, "t") == 0)
            v = s->arenas[i].live;
    dm_stats_release(s);
    free(s);
    return v;
}

static void test_tracked(void) {
    test_load_policy("bigblock_test",
                     "version: 1\ndefault: t\narenas:\n  t: {limit: 64MiB}\n");
    const dm_ctx_t *root = dm_ctx_root();
    char *p[N];
    int got = 0;
    for (int i = 0; i < N; i++) {
        if ((p[got] = dm_alloc(root, 5 * MB + 1000, DM_DT_UNKNOWN)) != NULL)
            got++;
        if (getenv("DBG"))
            fprintf(stderr, "i=%d got=%d p=%p live=%llu\n", i, got, got ? (void *)p[got - 1] : NULL, (unsigned long long)live());
    }
    EXPECT(got == 10, "ten 6 MiB classes fit 64 MiB: %d", got);
    EXPECT(distinct(p, got) >= 5, "%d colours among %d counted blocks", distinct(p, got), got);
    EXPECT(live() == (uint64_t)got * 6 * MB, "live %llu", (unsigned long long)live());
    dm_free(p[--got]); /* room for realloc's new block before the old one goes */
    char *moved = dm_realloc(root, p[0], 4 * MB + 5);
    EXPECT(moved, "realloc within the limit");
    p[0] = moved ? moved : p[0];
    for (int i = 0; i < got; i++)
        dm_free(p[i]);
    EXPECT(live() == 0, "every byte back: %llu", (unsigned long long)live());
}

int main(void) {
    dm_runtime_init();
    test_colours("{}", 64);
    test_colours("{alignment: 4096}", 4096);
    test_reuse();
    test_reuse_after_realign();
    test_tracked();
    return TEST_EXIT();
}
