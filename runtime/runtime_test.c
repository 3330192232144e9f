/*
 * runtime_test.c: the runtime against real jemalloc arenas, through the public
 * API: routing, alignment, realloc, NUMA and placement, faults, fallback,
 * stats, reloads and the observers of installs.
 */
#define TEST_NAME "runtime_test"
#include "runtime/test_runtime.h"

#include "runtime/install.h"

static void test_routing(void) {
    const dm_ctx_t *root = dm_ctx_root();
    void *a = dm_alloc(root, 100, DM_DT_UNKNOWN);
    void *b = dm_alloc(root, 64 * 1024, DM_DT_UNKNOWN);
    void *c = dm_alloc(root, 8u << 20, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(a), "small");
    CHECK_STR(dm_owner_arena(b), "general");
    CHECK_STR(dm_owner_arena(c), "big");
    const dm_ctx_t *ing = dm_ctx_with_tag(root, "ingest");
    CHECK(ing && ing != root, "tag context");
    CHECK(dm_ctx_with_tag(root, "ingest") == ing, "contexts are interned");
    void *d = dm_alloc(ing, 100, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(d), "tagged");
    dm_free(a), dm_free(b), dm_free(c), dm_free(d);
    dm_free(NULL); /* NumPy does this */
    void *e = dm_alloc(NULL, 100, DM_DT_UNKNOWN); /* NULL context = the root */
    CHECK_STR(dm_owner_arena(e), "small");
    dm_free(e);
}

static void *worker(void *arg) {
    dm_thread_set_name((const char *)arg);
    void *p = dm_alloc(dm_ctx_root(), 1000, DM_DT_UNKNOWN);
    const char *name = dm_owner_arena(p);
    dm_free(p);
    return (void *)name;
}

static void test_thread_names(void) {
    pthread_t t1, t2;
    void *r1, *r2;
    pthread_create(&t1, NULL, worker, "worker-3");
    pthread_create(&t2, NULL, worker, "loader");
    pthread_join(t1, &r1);
    pthread_join(t2, &r2);
    CHECK_STR((const char *)r1, "threads");
    CHECK_STR((const char *)r2, "small");
}

static void test_alignment(void) {
    const dm_ctx_t *root = dm_ctx_root();
    /* general: 64-byte alignment through size rounding, every size to 1 MiB */
    for (size_t n = 4097; n <= (1u << 20); n += (n < 70000 ? 61 : 4093)) {
        void *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        CHECK(p && ((uintptr_t)p % 64) == 0, "size %zu -> %p not 64-aligned", n, p);
        dm_free(p);
    }
    for (size_t n = 1; n <= 4096; n++) {
        void *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        CHECK(p && ((uintptr_t)p % 16) == 0, "size %zu -> %p not 16-aligned", n, p);
        dm_free(p);
    }
    void *p = dm_alloc(root, 5u << 20, DM_DT_UNKNOWN);
    CHECK(((uintptr_t)p % 4096) == 0, "big arena page alignment: %p", p);
    dm_free(p);
    void *z = dm_alloc(root, 0, DM_DT_UNKNOWN); /* never mallocx(0) */
    CHECK(z != NULL, "size 0");
    dm_free(z);
}

static void test_calloc_zeroes_reused(void) {
    const dm_ctx_t *root = dm_ctx_root();
    for (size_t n = 64; n <= (16u << 20); n *= 4) {
        unsigned char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        memset(p, 0xAB, n);
        dm_free(p);
        unsigned char *q = dm_calloc(root, n, DM_DT_UNKNOWN);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            bad += q[i] != 0;
        CHECK(bad == 0, "calloc(%zu): %zu non-zero bytes", n, bad);
        dm_free(q);
    }
}

static void test_realloc(void) {
    const dm_ctx_t *root = dm_ctx_root();
    unsigned char *p = dm_alloc(root, 1000, DM_DT_UNKNOWN);
    for (int i = 0; i < 1000; i++)
        p[i] = (unsigned char)i;
    p = dm_realloc(root, p, 3000); /* small -> small */
    CHECK_STR(dm_owner_arena(p), "small");
    p = dm_realloc(root, p, 6u << 20); /* moves to "big" */
    CHECK_STR(dm_owner_arena(p), "big");
    int bad = 0;
    for (int i = 0; i < 1000; i++)
        bad += p[i] != (unsigned char)i;
    CHECK(bad == 0, "realloc lost %d bytes", bad);
    p = dm_realloc(root, p, 10); /* and back */
    CHECK_STR(dm_owner_arena(p), "small");
    CHECK(p[9] == 9, "shrink keeps the prefix");
    dm_free(p);
    void *q = dm_realloc(root, NULL, 50); /* realloc(NULL) = malloc */
    CHECK(q && dm_owner_arena(q), "realloc(NULL)");
    dm_free(q);
}

/* jemalloc's thread caches ignore arenas: a block freed from arena A must never
 * come back from arena B. */
static void test_no_cross_arena_reuse(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const dm_ctx_t *ing = dm_ctx_with_tag(root, "ingest");
    for (int round = 0; round < 1000; round++) {
        void *a = dm_alloc(ing, 4000 + (size_t)round % 64, DM_DT_UNKNOWN); /* tagged */
        dm_free(a);
        void *b = dm_alloc(root, 4000 + (size_t)round % 64, DM_DT_UNKNOWN); /* small */
        CHECK_STR(dm_owner_arena(b), "small");
        dm_free(b);
        if (failures)
            break;
    }
}

static void test_foreign_free(void) {
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    uint64_t before = s->foreign_frees;
    dm_stats_release(s);
    void *g = malloc(100);
    dm_free(g); /* not ours: counted, never handed to jemalloc */
    free(g);
    dm_stats_snapshot(s);
    CHECK(s->foreign_frees == before + 1, "foreign free counted");
    dm_stats_release(s);
    free(s);
}

static void test_numa_policy(void) {
    void *p = dm_alloc(dm_ctx_root(), 8u << 20, DM_DT_UNKNOWN);
    int mode = -1;
    long rc = get_mempolicy(&mode, NULL, 0, p, MPOL_F_ADDR);
    CHECK(rc == 0 && mode == 4 /* MPOL_LOCAL */, "big arena: mempolicy %d (rc %ld)", mode, rc);
    void *q = dm_alloc(dm_ctx_root(), 100000, DM_DT_UNKNOWN);
    rc = get_mempolicy(&mode, NULL, 0, q, MPOL_F_ADDR);
    CHECK(rc == 0 && mode == MPOL_DEFAULT, "general arena: mempolicy %d", mode);
    dm_free(p);
    dm_free(q);
}

/* The VmFlags line of the mapping holding p ("hg" = MADV_HUGEPAGE, "nh" =
 * MADV_NOHUGEPAGE) and its AnonHugePages, from /proc/self/smaps. */
static bool smaps_of(const void *p, char *flags, size_t cap, long *anon_huge_kb) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    bool in = false, found = false;
    *anon_huge_kb = 0;
    flags[0] = 0;
    while (f && fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
            continue;
        }
        if (!in)
            continue;
        if (strncmp(line, "AnonHugePages:", 14) == 0)
            *anon_huge_kb = atol(line + 14);
        if (strncmp(line, "VmFlags:", 8) == 0) {
            snprintf(flags, cap, "%s", line + 8);
            found = true;
        }
    }
    if (f)
        fclose(f);
    return found;
}

static void test_placement_kinds(void) {
    load_ok("version: 1\ndefault: plain\narenas:\n"
            "  plain: {alignment: 64}\n"
            "  bound: {numa: {bind: [0]}, hugepages: off}\n"
            "  inter: {numa: {interleave: all}}\n"
            "  pref: {numa: {preferred: 0}}\n"
            "  huge: {hugepages: on, alignment: 2MiB}\n"
            "rules:\n"
            "  - {name: b, match: {tag: b}, arena: bound}\n"
            "  - {name: i, match: {tag: i}, arena: inter}\n"
            "  - {name: p, match: {tag: p}, arena: pref}\n"
            "  - {name: h, match: {tag: h}, arena: huge}\n");
    const dm_ctx_t *root = dm_ctx_root();
    struct { const char *tag; int mode; const char *vmflag; } k[] = {
        {"b", MPOL_BIND, " nh"}, {"i", MPOL_INTERLEAVE, NULL}, {"p", MPOL_PREFERRED, NULL},
        {"h", MPOL_DEFAULT, " hg"},
    };
    for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++) {
        void *p = dm_alloc(dm_ctx_with_tag(root, k[i].tag), 8u << 20, DM_DT_UNKNOWN);
        memset(p, 1, 8u << 20);
        int mode = -1;
        unsigned long mask = 0;
        long rc = get_mempolicy(&mode, &mask, 64, p, MPOL_F_ADDR);
        CHECK(rc == 0 && mode == k[i].mode, "tag %s: mode %d, want %d", k[i].tag, mode, k[i].mode);
        if (k[i].mode != MPOL_DEFAULT)
            CHECK(mask == 1, "tag %s: nodes 0x%lx", k[i].tag, mask);
        char flags[512];
        long huge_kb;
        CHECK(smaps_of(p, flags, sizeof(flags), &huge_kb), "mapping of %p in smaps", p);
        if (k[i].vmflag)
            CHECK(strstr(flags, k[i].vmflag) != NULL, "tag %s: VmFlags%s lacks%s", k[i].tag,
                  flags, k[i].vmflag);
        if (strcmp(k[i].tag, "h") == 0) {
            CHECK(((uintptr_t)p % (2u << 20)) == 0, "2 MiB alignment: %p", p);
            /* THP is best effort (the kernel may lack free huge pages): report. */
            printf("hugepage arena: AnonHugePages %ld kB in the mapping\n", huge_kb);
        }
        dm_free(p);
    }
}

/* per_node with a topology this machine lacks (injected): one jemalloc arena per
 * node, allocations served on the caller's node (0 here), bound to it. */
static void test_per_node_injected_topology(void) {
    dm__os_set_topology(0x3); /* nodes 0 and 1 */
    load_ok("version: 1\ndefault: pn\narenas:\n  pn: {per_node: true}\n");
    void *p = dm_alloc(dm_ctx_root(), 3u << 20, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(p), "pn");
    int mode = -1;
    unsigned long mask = 0;
    get_mempolicy(&mode, &mask, 64, p, MPOL_F_ADDR);
    CHECK(mode == MPOL_BIND && mask == 1, "per-node arena for node 0: mode %d mask 0x%lx", mode, mask);
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, "pn") == 0)
            CHECK(s->arenas[i].njemalloc == 4, "two jemalloc arenas per node (each with its "
                  "big half), got %d", s->arenas[i].njemalloc);
    dm_stats_release(s);
    free(s);
    dm_free(p);
    dm__os_set_topology(0);
}

static void test_fault_injection(void) {
    /* 300 MiB needs a new extent: with extent allocation failing, NULL. */
    dm_fault_extent_alloc(-1);
    void *p = dm_alloc(dm_ctx_root(), 300u << 20, DM_DT_UNKNOWN);
    dm_fault_extent_alloc(0);
    CHECK(p == NULL, "allocation under injected OOM must fail");
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    uint64_t fails = 0;
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, "big") == 0)
            fails = s->arenas[i].counts.nfail;
    CHECK(fails >= 1, "failure counted (%llu)", (unsigned long long)fails);
    dm_stats_release(s);
    free(s);
    p = dm_alloc(dm_ctx_root(), 300u << 20, DM_DT_UNKNOWN);
    CHECK(p != NULL, "recovers after the fault");
    dm_free(p);
}


/* mbind/madvise failing: the allocation is still served, the failure counted. */
static void test_placement_failure_is_served(void) {
    uint64_t before = arena_stat("big", 0);
    dm_fault_placement(-1);
    unsigned char *p = dm_alloc(dm_ctx_root(), 700u << 20, DM_DT_UNKNOWN); /* new extent */
    dm_fault_placement(0);
    CHECK(p != NULL, "served despite the placement failure");
    if (p) {
        p[0] = p[(700u << 20) - 1] = 1;
        CHECK_STR(dm_owner_arena(p), "big");
    }
    CHECK(arena_stat("big", 0) > before, "placement error counted (%llu -> %llu)",
          (unsigned long long)before, (unsigned long long)arena_stat("big", 0));
    dm_free(p);
}

/* An arena that cannot get memory: the policy's fallback arena serves instead,
 * and both the failure and the fallback are counted. */
static void test_fallback_arena(void) {
    load_ok("version: 1\ndefault: main\nfallback: spare\narenas:\n"
            "  main: {alignment: 64}\n  spare: {alignment: 64, decay: {dirty: never}}\n"
            "rules:\n  - {name: s, match: {tag: s}, arena: spare}\n");
    /* spare keeps 900 MiB of freed memory; then no arena can map more. */
    dm_free(dm_alloc(dm_ctx_with_tag(dm_ctx_root(), "s"), 900u << 20, DM_DT_UNKNOWN));
    dm_fault_extent_alloc(-1);
    void *p = dm_alloc(dm_ctx_root(), 900u << 20, DM_DT_UNKNOWN);
    dm_fault_extent_alloc(0);
    CHECK(p != NULL, "served by the fallback");
    CHECK_STR(dm_owner_arena(p), "spare");
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    for (int i = 0; i < s->narenas; i++) {
        if (strcmp(s->arenas[i].name, "main") == 0)
            CHECK(s->arenas[i].counts.nfail >= 1, "main failure counted");
        if (strcmp(s->arenas[i].name, "spare") == 0)
            CHECK(s->arenas[i].counts.nfallback == 1, "fallback counted: %llu",
                  (unsigned long long)s->arenas[i].counts.nfallback);
    }
    CHECK(s->nrules == 2 && s->rules[1].counts.nfallback == 1, "per-rule fallback (default rule)");
    dm_stats_release(s);
    free(s);
    dm_free(p);
}

static void test_stats(void) {
    dm_stats_t *s = malloc(sizeof(*s));
    void *keep = dm_alloc(dm_ctx_root(), 100000, DM_DT_UNKNOWN);
    dm_stats_snapshot(s);
    const dm_arena_stats_t *g = NULL;
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, "general") == 0)
            g = &s->arenas[i];
    CHECK(g != NULL, "general arena in stats");
    if (g) {
        CHECK(g->counts.nalloc >= 1 && g->counts.nalloc >= g->counts.nfree + 1, "nalloc %llu nfree %llu",
              (unsigned long long)g->counts.nalloc, (unsigned long long)g->counts.nfree);
        CHECK(g->allocated >= 100000, "jemalloc allocated %llu", (unsigned long long)g->allocated);
        CHECK(g->alignment == 64 && g->in_policy, "settings");
    }
    CHECK(s->nrules == 5, "4 rules + default, got %d", s->nrules);
    dm_stats_release(s);
    free(s);
    dm_free(keep);
}

static void test_reload_keeps_live_blocks(void) {
    void *live = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(live), "small");
    load_ok("version: 1\ndefault: other\narenas:\n  other: {alignment: 32}\n");
    void *n = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(n), "other");
    CHECK_STR(dm_owner_arena(live), "small"); /* never moved */
    dm_free(live);
    dm_free(n);
    /* a broken policy changes nothing */
    static dm_diags_t d;
    const char *path = write_policy("version: 1\ndefault: nowhere\narenas:\n  a: {}\n");
    dm_diags_init(&d, path);
    CHECK(dm_runtime_load(path, &d) != 0 && d.nerrors > 0, "bad policy refused");
    void *m = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
    CHECK_STR(dm_owner_arena(m), "other");
    dm_free(m);
}

static uint64_t reload_failures(void) {
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    uint64_t n = s->reload_failures;
    dm_stats_release(s);
    free(s);
    return n;
}

static const char *owner_of_new(void) {
    void *p = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
    const char *a = dm_owner_arena(p);
    dm_free(p);
    return a;
}

/* The file watcher's reload must never undo an install of another policy that
 * landed while it read its file (a watcher reloading the previous file put that
 * policy back over datamem.install(), and then watched the old file), nor one of
 * other bytes of its own file when it names the bytes it reloads over. */
static void test_reload_yields_to_another_install(void) {
    char pa[512], pb[512];
    static dm_diags_t d;
    snprintf(pa, sizeof(pa), "%s", write_policy("version: 1\ndefault: ra\narenas:\n  ra: {}\n"));
    snprintf(pb, sizeof(pb), "%s",
             test_write_policy("runtime_test_b", "version: 1\ndefault: rb\narenas:\n  rb: {}\n"));
    dm_diags_init(&d, pa);
    CHECK(dm_runtime_load(pa, &d) == 0, "load A");
    write_policy("version: 1\ndefault: ra2\narenas:\n  ra2: {}\n");
    dm_diags_init(&d, pa);
    CHECK(dm_runtime_reload(pa, 0, &d) == 0, "A reloads over itself");
    CHECK_STR(owner_of_new(), "ra2");
    dm_diags_init(&d, pb);
    CHECK(dm_runtime_load(pb, &d) == 0, "B installed");
    uint64_t failures_before = reload_failures();
    write_policy("version: 1\ndefault: ra\narenas:\n  ra: {}\n");
    dm_diags_init(&d, pa);
    int rc = dm_runtime_reload(pa, 0, &d);
    CHECK(rc == DM_ESUPERSEDED, "a reload of A over B: %s", dm_strerror(rc));
    CHECK_STR(owner_of_new(), "rb");
    CHECK(reload_failures() == failures_before, "not a failed reload");
    dm_diags_init(&d, pb);
    CHECK(dm_runtime_reload(pb, 0, &d) == 0, "B reloads over itself");
    /* Over a named version of B: yields once other bytes of B are in force. */
    dm_policy_t *b = dm_runtime_policy_copy();
    uint64_t b_hash = b->hash;
    dm_policy_free(b);
    test_write_policy("runtime_test_b", "version: 1\ndefault: rb2\narenas:\n  rb2: {}\n");
    dm_diags_init(&d, pb);
    CHECK(dm_runtime_load(pb, &d) == 0, "B's new bytes installed");
    test_write_policy("runtime_test_b", "version: 1\ndefault: rb3\narenas:\n  rb3: {}\n");
    dm_diags_init(&d, pb);
    rc = dm_runtime_reload(pb, b_hash, &d);
    CHECK(rc == DM_ESUPERSEDED, "a reload over B's old bytes: %s", dm_strerror(rc));
    CHECK_STR(owner_of_new(), "rb2");
    b = dm_runtime_policy_copy();
    b_hash = b->hash;
    dm_policy_free(b);
    dm_diags_init(&d, pb);
    CHECK(dm_runtime_reload(pb, b_hash, &d) == 0, "a reload over the bytes in force");
    CHECK_STR(owner_of_new(), "rb3");
    unlink(pb);
    load_ok(POLICY);
}

/* Installs notify outside dm__mem_mu, so two racing installs can reach the
 * seam out of order: the observers must see them in install order, and not an
 * older one after a newer (a file watcher then followed a replaced policy). */
static uint64_t observed_seq;
static int observed_calls;
static void observe_install(const dm_policy_t *p, uint64_t seq, void *arg) {
    (void)p;
    (void)arg;
    observed_seq = seq;
    observed_calls++;
}

static void test_observers_see_installs_in_order(void) {
    static bool registered;
    if (!registered)
        CHECK(dm_runtime_observe(observe_install, NULL, NULL) == 0, "observer registered");
    registered = true;
    load_ok(POLICY);
    uint64_t newest = observed_seq;
    int calls = observed_calls;
    CHECK(calls > 0 && newest > 1, "an install is observed (seq %llu)", (unsigned long long)newest);
    dm_policy_t *p = dm_runtime_policy_copy();
    dm__runtime_notify_install(p, newest - 1); /* an older install, late */
    CHECK(observed_calls == calls && observed_seq == newest,
          "an overtaken install is not observed: calls %d -> %d", calls, observed_calls);
    dm_policy_free(p);
    load_ok(POLICY);
    CHECK(observed_calls == calls + 1 && observed_seq > newest, "the next install is");
}

int main(void) {
    test_begin();
    test_routing();
    test_thread_names();
    test_alignment();
    test_calloc_zeroes_reused();
    test_realloc();
    test_no_cross_arena_reuse();
    test_foreign_free();
    test_numa_policy();
    test_fault_injection();
    test_placement_failure_is_served();
    test_stats();
    test_reload_keeps_live_blocks();
    test_reload_yields_to_another_install();
    test_observers_see_installs_in_order();
    test_placement_kinds();
    test_per_node_injected_topology();
    test_fallback_arena();
    return test_end();
}
