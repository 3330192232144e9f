/*
 * arena_test.c: arenas as they grow (arena.c, bigblock.c): the purge on growth
 * (decay.budget), big halves, the trim of a big block's tail and an idle big
 * half's pages given back.
 */
#define TEST_NAME "arena_test"
#include "runtime/test_runtime.h"

/* decay.budget: when the arena grows while holding more dirty pages than the
 * budget (plus active/16), it purges them; a steady loop never grows and never
 * purges; never turns it off. */
static void touch(char *p, size_t n) {
    for (size_t i = 0; i < n; i += 4096)
        p[i] = 1;
}

static void test_purge_on_growth(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const size_t MB = (size_t)1 << 20;
    for (int never = 0; never < 2; never++) {
        const char *arena = never ? "keep" : "tight";
        char text[256];
        snprintf(text, sizeof(text),
                 "version: 1\ndefault: %s\narenas:\n  %s: {decay: {dirty: 10s, budget: %s}}\n",
                 arena, arena, never ? "never" : "0");
        load_ok(text);
        char *a = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN), *b = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
        touch(a, 8 * MB), touch(b, 8 * MB);
        /* a steady loop: same size again and again, no growth, no purge */
        uint64_t p0 = arena_stat(arena, 2);
        for (int i = 0; i < 50; i++) {
            char *t = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
            touch(t, 8 * MB);
            dm_free(t);
        }
        CHECK(arena_stat(arena, 2) == p0, "%s: steady loop purged (%llu -> %llu)", arena,
              (unsigned long long)p0, (unsigned long long)arena_stat(arena, 2));
        dm_free(a), dm_free(b); /* 16 MiB dirty */
        CHECK(arena_stat(arena, 3) >= 16 * MB, "%s: dirty %llu", arena,
              (unsigned long long)arena_stat(arena, 3));
        char *c = dm_alloc(root, 64 * MB, DM_DT_UNKNOWN); /* does not fit: grows */
        touch(c, 64 * MB);
        if (never) {
            CHECK(arena_stat(arena, 2) == 0, "never: no purge");
            CHECK(arena_stat(arena, 3) >= 16 * MB, "never: dirty kept");
        } else {
            CHECK(arena_stat(arena, 2) == p0 + 1, "growth purge counted");
            CHECK(arena_stat(arena, 3) < 16 * MB, "dirty purged: %llu",
                  (unsigned long long)arena_stat(arena, 3));
        }
        dm_free(c);
    }
}

static int njemalloc(const char *name) {
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    int n = -1;
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, name) == 0)
            n = s->arenas[i].njemalloc;
    dm_stats_release(s);
    free(s);
    return n;
}

/* An arena at `hugepages: system` serves blocks of 4 MiB and more from its big
 * half (arena.c, "Big halves"), a jemalloc arena of their own; a block keeps
 * its half through realloc. `on` and `off` arenas have one jemalloc arena for
 * every size, and so does every arena made under an address-space limit
 * (tests/python/engine/test_arenas.py: sanitizers need the address space). */
static void test_big_halves(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const size_t MB = (size_t)1 << 20;
    load_ok("version: 1\ndefault: halves\narenas:\n  halves: {}\n");
    char *small = dm_alloc(root, 64 << 10, DM_DT_UNKNOWN), *big = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    dm__arena_je_t *js = dm__mem_owner_of(small), *jb = dm__mem_owner_of(big);
    CHECK(js && jb && js != jb && js->big == jb && jb->is_big && !js->is_big,
          "small and big blocks in the two halves: %p %p", (void *)js, (void *)jb);
    CHECK_STR(dm_owner_arena(big), "halves");
    CHECK(njemalloc("halves") == 2, "two jemalloc arenas, got %d", njemalloc("halves"));
    char *grown = dm_realloc(root, big, 16 * MB), *shrunk = dm_realloc(root, grown, 1 * MB);
    CHECK(dm__mem_owner_of(shrunk) == jb, "a big block stays in the big half through realloc");
    /* Grown past 4 MiB, a block moves to the big half, where its free is kept
     * for the next big array (pandas' hash-table vectors grow by realloc;
     * kept in the small half, they would wait out their decay unused). */
    memset(small, 0x5a, 64 << 10);
    char *up = dm_realloc(root, small, 6 * MB);
    CHECK(dm__mem_owner_of(up) == jb, "a block grown past 4 MiB moves to the big half");
    CHECK(up[0] == 0x5a && up[(64 << 10) - 1] == 0x5a, "realloc keeps the contents");
    size_t kept = jb->reuse.bytes;
    dm_free_hint(up, 6 * MB);
    CHECK(jb->reuse.bytes > kept, "its free is kept in the big half: %zu -> %zu", kept,
          (size_t)jb->reuse.bytes);
    char *again = dm_alloc(root, 6 * MB, DM_DT_UNKNOWN);
    CHECK(dm__block_of(jb, again) == dm__block_of(jb, up),
          "and serves the next block of its size: %p %p", (void *)again, (void *)up);
    dm_free(shrunk), dm_free(again);
    /* A small half never keeps a big block: only the big half's allocations
     * look for kept blocks. */
    void *odd = dmje_mallocx(6 * MB, MALLOCX_ARENA(js->index) | MALLOCX_TCACHE_NONE);
    CHECK(odd, "a 6 MiB block from the small half");
    if (odd && dm__bigblock_keep(js, odd, 6 * MB, 0))
        CHECK(false, "the small half kept a big block (%zu bytes kept)", (size_t)js->reuse.bytes);
    else if (odd)
        dmje_dallocx(odd, MALLOCX_TCACHE_NONE);

    load_ok("version: 1\ndefault: whole\narenas:\n  whole: {hugepages: off}\n");
    small = dm_alloc(root, 64 << 10, DM_DT_UNKNOWN), big = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    CHECK(dm__mem_owner_of(small) == dm__mem_owner_of(big),
          "hugepages: off: one jemalloc arena");
    CHECK(njemalloc("whole") == 1, "one jemalloc arena, got %d", njemalloc("whole"));
    dm_free(small), dm_free(big);

}

static size_t resident_bytes(char *p, size_t n) {
    static unsigned char vec[1024];
    size_t page = dm__os_page_size(), np = n / page, r = 0;
    if (np > sizeof(vec) || mincore(p, n, vec) != 0)
        return SIZE_MAX;
    for (size_t i = 0; i < np; i++)
        r += (vec[i] & 1) * page;
    return r;
}

/* jemalloc serves a big block from a size class: a 20 MiB + 4 KiB request
 * gets 24 MiB. The pages past the request go back to the kernel as the block
 * is handed out (bigblock.c, "Trimming"), here those a 24 MiB array wrote
 * into the same block before. */
static void test_big_tail_trimmed(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const size_t MB = (size_t)1 << 20;
    load_ok("version: 1\ndefault: trim\narenas:\n  trim: {}\n");
    char *a = dm_alloc(root, 24 * MB, DM_DT_UNKNOWN);
    touch(a, 24 * MB);
    dm_free_hint(a, 24 * MB);
    char *b = dm_alloc(root, 20 * MB + 4096, DM_DT_UNKNOWN);
    char *blk = b ? dm__block_of(dm__mem_owner_of(b), b) : NULL; /* under its colour */
    CHECK(b && dmje_sallocx(blk, 0) == 24 * MB, "a 24 MiB size class: %zu",
          b ? dmje_sallocx(blk, 0) : 0);
    touch(b, 20 * MB + 4096);
    size_t tail = resident_bytes(blk + 21 * MB, 3 * MB);
    CHECK(tail == 0, "the last 3 MiB of the class, past the request, are not resident: %zu "
          "bytes are (%s block)", tail, b == a ? "the same" : "another");
    dm_free(b);
}

/* The small half growing past the peak gives back what it passed the peak by
 * from the dirty pages of a big half that served nothing since the last check
 * first (arena.c): in one jemalloc arena they would have served that growth. */
static void test_idle_big_half_purged(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const size_t MB = (size_t)1 << 20;
    load_ok("version: 1\ndefault: idle\narenas:\n  idle: {decay: {dirty: 10s}}\n");
    char *big[4];
    for (int i = 0; i < 4; i++) {
        big[i] = dm_alloc(root, 16 * MB, DM_DT_UNKNOWN);
        touch(big[i], 16 * MB);
    }
    for (int i = 0; i < 4; i++)
        dm_free(big[i]);
    CHECK(arena_stat("idle", 3) >= 64 * MB, "64 MiB dirty in the big half: %llu",
          (unsigned long long)arena_stat("idle", 3));
    uint64_t purges = arena_stat("idle", 2);
    enum { NSMALL = 512 }; /* at most 1.5 GiB: past whatever peak earlier tests set */
    char **small = calloc(NSMALL, sizeof(*small));
    int n = 0;
    while (n < NSMALL && arena_stat("idle", 2) == purges) {
        small[n] = dm_alloc(root, 3 * MB, DM_DT_UNKNOWN);
        touch(small[n++], 3 * MB);
    }
    CHECK(arena_stat("idle", 2) > purges, "a growth purge after %d blocks of 3 MiB", n);
    /* a 16 MiB extent at least (the overshoot is under 3 MiB; the small
     * half's few dirty pages count too); the others stay */
    CHECK(arena_stat("idle", 3) <= 49 * MB, "the idle big half's dirty pages purged: %llu",
          (unsigned long long)arena_stat("idle", 3));
    for (int i = 0; i < n; i++)
        dm_free(small[i]);
    free(small);
}

int main(void) {
    test_begin();
    test_purge_on_growth();
    test_big_halves();
    test_idle_big_half_purged();
    test_big_tail_trimmed();
    return test_end();
}
