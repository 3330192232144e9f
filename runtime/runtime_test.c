/*
 * runtime_test.c: the runtime against real jemalloc arenas, through the public
 * API, with policies written to temporary files.
 */
#include <numaif.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <valgrind/valgrind.h>

#include "jemalloc/jemalloc.h"
#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/datamem.h"
#include "runtime/internal.h"
#include "runtime/os.h"
#include "runtime/sizeclass.h"
#include "runtime/test_policy.h"

static int failures;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fputc('\n', stderr);                                               \
            failures++;                                                        \
        }                                                                      \
    } while (0)

#define CHECK_STR(a, b)                                                        \
    CHECK((a) && (b) && strcmp((a), (b)) == 0, "'%s' != '%s'", (a) ? (a) : "(null)", \
          (b) ? (b) : "(null)")

static const char *write_policy(const char *text) { return test_write_policy("runtime_test", text); }

static void load_ok(const char *text) { test_load_policy("runtime_test", text); }

static const char *POLICY =
    "version: 1\n"
    "default: general\n"
    "arenas:\n"
    "  general: {alignment: 64}\n"
    "  small: {alignment: 16}\n"
    "  big: {alignment: 4096, hugepages: on, numa: local}\n"
    "  tagged: {alignment: 64}\n"
    "  threads: {alignment: 64}\n"
    "rules:\n"
    "  - {name: huge, match: {size: {min: 4MiB}}, arena: big}\n"
    "  - {name: t, match: {tag: ingest}, arena: tagged}\n"
    "  - {name: w, match: {thread: 'worker-*'}, arena: threads}\n"
    "  - {name: tiny, match: {size: {max: 4KiB}}, arena: small}\n";

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

static uint64_t arena_stat(const char *name, int which) {
    dm_stats_t *s = malloc(sizeof(*s));
    dm_stats_snapshot(s);
    uint64_t v = 0;
    for (int i = 0; i < s->narenas; i++)
        if (strcmp(s->arenas[i].name, name) == 0)
            v = which == 0   ? s->arenas[i].nplacement_errors
                : which == 1 ? s->arenas[i].counts.nalloc
                : which == 2 ? s->arenas[i].ngrowth_purges
                             : s->arenas[i].dirty;
    dm_stats_release(s);
    free(s);
    return v;
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

/* Installs notify outside dm__runtime_mu, so two racing installs can reach the
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

/* ---- the block cache (bcache.c) ----------------------------------------- */

/* The cache computes jemalloc's size classes itself: they must be jemalloc's. */
static void test_size_classes(void) {
    unsigned prev = 0;
    for (size_t n = 1; n <= DM_SC_MAX; n++) {
        unsigned k = dm_sc_index(n);
        size_t want = dmje_nallocx(n, 0);
        if (k >= DM_SC_COUNT || dm_sc_size(k) != want || k < prev) {
            CHECK(0, "size %zu: class %u size %zu, jemalloc %zu", n, k,
                  k < DM_SC_COUNT ? dm_sc_size(k) : 0, want);
            return;
        }
        prev = k;
    }
    CHECK(dm_sc_index(DM_SC_MAX) == DM_SC_COUNT - 1, "last class");
}

/* A rule boundary inside a size class (100 B in the 97-112 B class) must not
 * let the cache serve one side's requests from the other's arena. */
static void test_cache_rule_split_class(void) {
    load_ok("version: 1\ndefault: b\narenas:\n  a: {alignment: 16}\n  b: {alignment: 16}\n"
            "rules:\n  - {name: upto100, match: {size: {max: 100}}, arena: a}\n");
    const dm_ctx_t *root = dm_ctx_root();
    for (int i = 0; i < 200 && !failures; i++) {
        size_t n = 97 + (size_t)i % 16; /* 97..112 */
        void *p = dm_alloc(root, n, DM_DT_UNKNOWN);
        CHECK_STR(dm_owner_arena(p), n <= 100 ? "a" : "b");
        dm_free(p);
        void *q = dm_alloc(root, 64, DM_DT_UNKNOWN);
        CHECK_STR(dm_owner_arena(q), "a");
        dm_free(q);
    }
}

/* Blocks cached for one arena never come out after a reload or a thread rename
 * that sends the same sizes elsewhere. */
static void test_cache_rebind(void) {
    load_ok("version: 1\ndefault: a\narenas:\n  a: {alignment: 64}\n  b: {alignment: 64}\n"
            "rules:\n  - {name: w, match: {thread: 'renamed'}, arena: b}\n");
    const dm_ctx_t *root = dm_ctx_root();
    void *warm[8];
    for (int i = 0; i < 8; i++)
        warm[i] = dm_alloc(root, 64, DM_DT_UNKNOWN);
    for (int i = 0; i < 8; i++)
        dm_free(warm[i]); /* now cached for a */
    dm_thread_set_name("renamed");
    for (int i = 0; i < 16; i++) {
        void *p = dm_alloc(root, 64, DM_DT_UNKNOWN);
        CHECK_STR(dm_owner_arena(p), "b");
        warm[i % 8] = p;
        if (i % 8 == 7)
            for (int j = 0; j < 8; j++)
                dm_free(warm[j]); /* cached for b */
    }
    load_ok("version: 1\ndefault: a\narenas:\n  a: {alignment: 64}\n");
    for (int i = 0; i < 16; i++) {
        void *p = dm_alloc(root, 64, DM_DT_UNKNOWN);
        CHECK_STR(dm_owner_arena(p), "a");
        dm_free(p);
    }
    dm_thread_set_name("");
}

/* A tag describes a live block only: every way a block is released other than
 * the cached free drops it, or the address could come back in another class
 * (a recycled slab) and be cached under the old one. */
static void *tag_free_other_thread(void *p) {
    dm_thread_set_name("tb");
    dm_free(p);
    return NULL;
}

static void test_cache_tags_die_with_blocks(void) {
    load_ok("version: 1\ndefault: a\narenas:\n  a: {alignment: 64}\n  b: {alignment: 16}\n"
            "rules:\n  - {name: tb, match: {thread: 'tb'}, arena: b}\n");
    const dm_ctx_t *root = dm_ctx_root();
    dm_free(dm_alloc(root, 64, DM_DT_UNKNOWN)); /* binds, learns the class */
    dm_free(dm_alloc(root, 200, DM_DT_UNKNOWN));
    void *p = dm_alloc(root, 64, DM_DT_UNKNOWN);
    CHECK(dm__bcache_tag_class(p) == (int)dm_sc_index(64), "64 B tagged: %d",
          dm__bcache_tag_class(p));
    void *q = dm_realloc(root, p, 3000); /* moves to another class */
    CHECK(q != p && dm__bcache_tag_class(p) == -1, "realloc drops the old tag");
    dm_free(q);
    CHECK(dm__bcache_tag_class(q) == -1, "free consumes the tag");
    void *r = dm_alloc(root, 200, DM_DT_UNKNOWN);
    pthread_t th;
    pthread_create(&th, NULL, tag_free_other_thread, r); /* another arena's thread */
    pthread_join(th, NULL);
    CHECK(dm__bcache_tag_class(r) == -1, "a free by a thread bound elsewhere drops the tag");
}

/* Two arenas with different alignments both served from the cache: every
 * block from the right arena, aligned, and cached (tagged) on reuse. */
static void test_cache_two_arenas(void) {
    load_ok("version: 1\ndefault: big\narenas:\n  small: {alignment: 16}\n"
            "  big: {alignment: 64}\n"
            "rules:\n  - {name: s, match: {size: {max: 1KiB}}, arena: small}\n");
    const dm_ctx_t *root = dm_ctx_root();
    for (int pass = 0; pass < 3; pass++) {
        for (size_t n = 1; n <= 20000; n += n < 2048 ? 1 : 97) {
            void *p = dm_alloc(root, n, DM_DT_UNKNOWN);
            size_t align = n <= 1024 ? 16 : 64;
            CHECK(p && (uintptr_t)p % align == 0, "size %zu: %p not %zu-aligned", n, p, align);
            CHECK_STR(dm_owner_arena(p), n <= 1024 ? "small" : "big");
            if (pass == 2) /* learnt and warm: the cached path */
                CHECK(dm__bcache_tag_class(p) >= 0, "size %zu not on the cached path", n);
            dm_free(p);
            if (failures)
                return;
        }
    }
}

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
 * (tests/python/test_arenas.py: sanitizers need the address space). */
static void test_big_halves(void) {
    const dm_ctx_t *root = dm_ctx_root();
    const size_t MB = (size_t)1 << 20;
    load_ok("version: 1\ndefault: halves\narenas:\n  halves: {}\n");
    char *small = dm_alloc(root, 64 << 10, DM_DT_UNKNOWN), *big = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    dm__arena_je_t *js = dm__arena_owner_of(small), *jb = dm__arena_owner_of(big);
    CHECK(js && jb && js != jb && js->big == jb && jb->is_big && !js->is_big,
          "small and big blocks in the two halves: %p %p", (void *)js, (void *)jb);
    CHECK_STR(dm_owner_arena(big), "halves");
    CHECK(njemalloc("halves") == 2, "two jemalloc arenas, got %d", njemalloc("halves"));
    char *grown = dm_realloc(root, big, 16 * MB), *shrunk = dm_realloc(root, grown, 1 * MB);
    CHECK(dm__arena_owner_of(shrunk) == jb, "a big block stays in the big half through realloc");
    /* Grown past 4 MiB, a block moves to the big half, where its free is kept
     * for the next big array (pandas' hash-table vectors grow by realloc;
     * kept in the small half, they would wait out their decay unused). */
    memset(small, 0x5a, 64 << 10);
    char *up = dm_realloc(root, small, 6 * MB);
    CHECK(dm__arena_owner_of(up) == jb, "a block grown past 4 MiB moves to the big half");
    CHECK(up[0] == 0x5a && up[(64 << 10) - 1] == 0x5a, "realloc keeps the contents");
    size_t kept = jb->reuse_bytes;
    dm_free_hint(up, 6 * MB);
    CHECK(jb->reuse_bytes > kept, "its free is kept in the big half: %zu -> %zu", kept,
          (size_t)jb->reuse_bytes);
    char *again = dm_alloc(root, 6 * MB, DM_DT_UNKNOWN);
    CHECK(dm__block_of(jb, again) == dm__block_of(jb, up),
          "and serves the next block of its size: %p %p", (void *)again, (void *)up);
    dm_free(shrunk), dm_free(again);
    /* A small half never keeps a big block: only the big half's allocations
     * look for kept blocks. */
    void *odd = dmje_mallocx(6 * MB, MALLOCX_ARENA(js->index) | MALLOCX_TCACHE_NONE);
    CHECK(odd, "a 6 MiB block from the small half");
    if (odd && dm__bigblock_keep(js, odd, 6 * MB, 0))
        CHECK(false, "the small half kept a big block (%zu bytes kept)", (size_t)js->reuse_bytes);
    else if (odd)
        dmje_dallocx(odd, MALLOCX_TCACHE_NONE);

    load_ok("version: 1\ndefault: whole\narenas:\n  whole: {hugepages: off}\n");
    small = dm_alloc(root, 64 << 10, DM_DT_UNKNOWN), big = dm_alloc(root, 8 * MB, DM_DT_UNKNOWN);
    CHECK(dm__arena_owner_of(small) == dm__arena_owner_of(big),
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
    char *blk = b ? dm__block_of(dm__arena_owner_of(b), b) : NULL; /* under its colour */
    CHECK(b && dmje_sallocx(blk, 0) == 24 * MB, "a 24 MiB size class: %zu",
          b ? dmje_sallocx(blk, 0) : 0);
    touch(b, 20 * MB + 4096);
    size_t tail = resident_bytes(blk + 21 * MB, 3 * MB);
    CHECK(tail == 0, "the last 3 MiB of the class, past the request, are not resident: %zu "
          "bytes are (%s block)", tail, b == a ? "the same" : "another");
    dm_free(b);
}

/* The small half growing past the peak purges the dirty pages of a big half
 * that served nothing since the last check (arena.c): in one jemalloc arena
 * they would have served that growth. */
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
    CHECK(arena_stat("idle", 3) < 16 * MB, "the idle big half's dirty pages purged: %llu",
          (unsigned long long)arena_stat("idle", 3));
    for (int i = 0; i < n; i++)
        dm_free(small[i]);
    free(small);
}

/* Two threads with different arenas allocate, hand blocks over, realloc and
 * free at random, with more live blocks than the tag table has words (so
 * tags collide). Every block must be at least as big as asked, from the
 * arena its allocating thread's rules name, and never handed out twice. */
#define XT_LIVE 40000
typedef struct {
    const char *name, *arena;
    void **shared;         /* blocks the other thread frees */
    pthread_mutex_t *mu;
    unsigned seed;
    int errors;
} xt_arg_t;

static void *xt_worker(void *argp) {
    xt_arg_t *a = argp;
    dm_thread_set_name(a->name);
    const dm_ctx_t *root = dm_ctx_root();
    void **mine = calloc(XT_LIVE, sizeof(void *));
    size_t *len = calloc(XT_LIVE, sizeof(size_t));
    unsigned x = a->seed;
    for (int step = 0; step < 400000 && a->errors < 5; step++) {
        x = x * 1103515245u + 12345u;
        unsigned i = (x >> 8) % XT_LIVE;
        unsigned r = x >> 28;
        if (mine[i]) {
            unsigned char *p = mine[i];
            if (p[0] != (unsigned char)i || p[len[i] - 1] != (unsigned char)i)
                a->errors++; /* someone else got this block */
            if (r == 0) { /* realloc */
                size_t n = 1 + (x >> 4) % 3000;
                unsigned char *q = dm_realloc(root, p, n);
                if (q) {
                    mine[i] = q, len[i] = n;
                    memset(q, (int)(unsigned char)i, n);
                }
                continue;
            }
            if (r < 3) { /* hand it to the other thread */
                pthread_mutex_lock(a->mu);
                for (int k = 0; k < 64; k++)
                    if (!a->shared[k]) {
                        a->shared[k] = p, p = NULL;
                        break;
                    }
                pthread_mutex_unlock(a->mu);
            }
            if (p)
                dm_free(p);
            mine[i] = NULL;
        } else {
            size_t n = r < 12 ? 1 + (x >> 5) % 512 : 1 + (x >> 5) % DM_SC_MAX;
            unsigned char *p = dm_alloc(root, n, DM_DT_UNKNOWN);
            if (!p || dmje_sallocx(p, 0) < n || !dm_owner_arena(p) ||
                strcmp(dm_owner_arena(p), a->arena) != 0) {
                a->errors++;
                continue;
            }
            memset(p, (int)(unsigned char)i, n);
            mine[i] = p, len[i] = n;
        }
        if ((step & 255) == 0) { /* free what the other thread handed over */
            pthread_mutex_lock(a->mu);
            for (int k = 0; k < 64; k++)
                if (a->shared[k]) {
                    dm_free(a->shared[k]);
                    a->shared[k] = NULL;
                }
            pthread_mutex_unlock(a->mu);
        }
    }
    for (int i = 0; i < XT_LIVE; i++)
        dm_free(mine[i]);
    free(mine);
    free(len);
    return NULL;
}

static void test_cache_cross_thread(void) {
    load_ok("version: 1\ndefault: a\narenas:\n  a: {alignment: 64}\n  b: {alignment: 16}\n"
            "rules:\n  - {name: tb, match: {thread: 'tb'}, arena: b}\n");
    void *shared[64] = {0};
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    xt_arg_t args[2] = {{"ta", "a", shared, &mu, 1, 0}, {"tb", "b", shared, &mu, 7, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, xt_worker, &args[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int k = 0; k < 64; k++)
        dm_free(shared[k]);
    CHECK(args[0].errors == 0 && args[1].errors == 0, "cross-thread: %d and %d bad blocks",
          args[0].errors, args[1].errors);
}

/* A thread's jemalloc caches hold freed blocks until it exits. Stats must not
 * count the thread gone before those blocks are back in their arenas: a test
 * (or an operator) that waits for the thread count to drop and then reads the
 * arenas' live blocks could see a cache's worth (the suspected cause of the
 * ASan Python stage's flaky test_reloads_under_load_hand_memory_back, 96
 * blocks; not reproduced on demand). Six arenas: the exiting
 * thread destroys six caches, one jemalloc call each, and a stats reader can
 * come in between. */
#define EXIT_ARENAS 6

static void *exit_worker(void *arg) {
    _Atomic int *done = arg;
    void *p[EXIT_ARENAS * 16];
    int n = 0;
    for (int a = 0; a < EXIT_ARENAS; a++) /* arena a serves [300 + 100a, 400 + 100a) KiB */
        for (int k = 0; k < 16; k++)
            p[n++] = dm_alloc(dm_ctx_root(), ((size_t)300 + 100 * a + 6 * k) << 10, DM_DT_UNKNOWN);
    for (int i = 0; i < n; i++)
        dm_free(p[i]); /* into the thread's jemalloc caches (tcache_max 1 MiB) */
    atomic_store(done, 1);
    return NULL;
}

static void exit_counts(dm_stats_t *s, int *nthreads, uint64_t *live) {
    dm_stats_snapshot(s);
    *nthreads = s->nthreads;
    *live = 0;
    for (int i = 0; i < s->narenas; i++)
        *live += s->arenas[i].je_nmalloc - s->arenas[i].je_ndalloc;
    dm_stats_release(s);
}

static void test_exit_hands_caches_back_before_count(void) {
    char policy[1024];
    int len = snprintf(policy, sizeof(policy), "version: 1\ndefault: a0\narenas:\n");
    for (int a = 0; a < EXIT_ARENAS; a++)
        len += snprintf(policy + len, sizeof(policy) - (size_t)len, "  a%d: {alignment: 64}\n", a);
    len += snprintf(policy + len, sizeof(policy) - (size_t)len, "rules:\n");
    for (int a = 1; a < EXIT_ARENAS; a++)
        len += snprintf(policy + len, sizeof(policy) - (size_t)len,
                        "  - {name: r%d, match: {size: {min: %dKiB}}, arena: a%d}\n", a,
                        300 + 100 * (EXIT_ARENAS - a), EXIT_ARENAS - a);
    load_ok(policy);
    dm_stats_t *s = malloc(sizeof(*s));
    int n0, n;
    uint64_t live0, live;
    exit_counts(s, &n0, &live0);
    int early = 0;
    for (int round = 0; round < 8; round++) {
        pthread_t th;
        _Atomic int done = 0;
        pthread_create(&th, NULL, exit_worker, &done);
        while (!atomic_load(&done))
            sched_yield(); /* valgrind runs one thread at a time: let the worker run */
        do { /* as a poller would: no join, the thread is gone when the count says so */
            exit_counts(s, &n, &live);
        } while (n > n0 && sched_yield() == 0);
        if (live != live0)
            early++;
        pthread_join(th, NULL);
    }
    CHECK(early == 0, "%d of 8 exits counted before the cached blocks went back", early);
    free(s);
    load_ok(POLICY);
}

/* fork() from a process whose other threads allocate: the child must retire
 * those threads (otherwise their per-thread blocks stay in the registry; a
 * new thread in the child reuses one's address, the registry becomes a cycle,
 * and the next stats snapshot spins forever holding the runtime mutex). Each
 * child starts a thread, joins it, takes a snapshot, and does that again; the
 * parent waits for each child with a bound and kills a hung one. */
#define FORK_BUSY 3
#define FORK_ROUNDS 40

/* GCC 12's ASan does not hold its allocator's locks across fork(): a child
 * whose parent had a thread inside ASan's malloc deadlocks in its own first
 * malloc (seen: the child's pthread_create, in ASan's calloc). Under ASan the
 * busy threads therefore park, registered and holding cached blocks, around
 * each fork; the retiring of threads is what is checked there. */
#if defined(__SANITIZE_ADDRESS__)
#define FORK_PARK 1
#else
#define FORK_PARK 0
#endif
static _Atomic int fork_park, fork_parked;

static void *fork_busy(void *arg) {
    _Atomic int *stop = arg;
    void *keep[32] = {0};
    for (unsigned i = 0; !atomic_load(stop); i++) {
        if (atomic_load(&fork_park)) {
            atomic_fetch_add(&fork_parked, 1);
            while (atomic_load(&fork_park))
                sched_yield();
            atomic_fetch_sub(&fork_parked, 1);
        }
        if (RUNNING_ON_VALGRIND)
            sched_yield(); /* one thread at a time there: the forking thread gets its turns */
        unsigned k = i % 32;
        dm_free(keep[k]);
        keep[k] = dm_alloc(dm_ctx_root(), 8 + (size_t)(i * 2654435761u) % (300u << 10),
                           DM_DT_UNKNOWN);
    }
    for (int k = 0; k < 32; k++)
        dm_free(keep[k]);
    return NULL;
}

static void *fork_child_thread(void *arg) {
    (void)arg;
    for (int i = 0; i < 100; i++)
        dm_free(dm_alloc(dm_ctx_root(), 64 + (size_t)i * 1000, DM_DT_UNKNOWN));
    return NULL;
}

/* In the child: 0 when all went well, else what went wrong. */
static int fork_child_checks(void) {
    alarm(20); /* a hang ends the child by SIGALRM; the parent reports it */
    dm_stats_t *s = malloc(sizeof(*s));
    for (int round = 0; round < 2; round++) {
        pthread_t th;
        pthread_create(&th, NULL, fork_child_thread, NULL);
        pthread_join(th, NULL);
        dm_stats_snapshot(s);
        int n = s->nthreads;
        dm_stats_release(s);
        if (n > 1) /* the forking thread at most: the parent's others are gone */
            return 10 + n;
    }
    free(s);
    return 0;
}

static void test_fork_child_retires_threads(void) {
#if defined(__SANITIZE_THREAD__)
    /* TSan kills a fork child of a threaded process that starts a thread
     * (die_after_fork), and its deadlock detector tracks at most 64 locks held
     * at once, fewer than fork takes here (every arena's two). */
    printf("SKIP test_fork_child_retires_threads under TSan: threads in a fork child of a "
           "threaded process are not supported by TSan\n");
    return;
#endif
    _Atomic int stop = 0;
    pthread_t th[FORK_BUSY];
    for (int i = 0; i < FORK_BUSY; i++)
        pthread_create(&th[i], NULL, fork_busy, &stop);
    /* valgrind runs each child's threads one at a time: a few rounds there. */
    int rounds = RUNNING_ON_VALGRIND ? 3 : FORK_ROUNDS;
    int hung = 0, bad = 0;
    for (int i = 0; i < rounds; i++) {
        dm_free(dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN));
        fflush(NULL); /* a child must not write the parent's buffered output again */
        if (FORK_PARK) {
            atomic_store(&fork_park, 1);
            while (atomic_load(&fork_parked) < FORK_BUSY)
                sched_yield();
        }
        pid_t pid = fork();
        if (pid == 0)
            _exit(fork_child_checks());
        atomic_store(&fork_park, 0);
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFSIGNALED(status))
            hung++;
        else if (WEXITSTATUS(status) != 0)
            bad++;
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < FORK_BUSY; i++)
        pthread_join(th[i], NULL);
    CHECK(hung == 0 && bad == 0, "of %d fork children, %d were killed by a signal (SIGALRM: "
          "hung for 20 s) and %d saw the parent's threads", rounds, hung, bad);
}

/* fork() while other threads grow arenas: jemalloc calls an arena's extent
 * hook holding its grow lock, and the hook takes the arena's bump lock. The
 * forking thread must take them in that order too (jemalloc's prefork before
 * the bump locks), or a thread inside jemalloc waiting for the bump lock and
 * the forking thread waiting for jemalloc's lock deadlock in fork(). Each round
 * runs in a process of its own, waited for with a bound: a deadlock is a
 * failure, not a hung test.
 * The busy threads also use explicit jemalloc caches (64 KiB blocks of
 * "general"), and each child rebinds its thread to another arena ("threads",
 * by its name), which unlinks its automatic cache from the old arena's list
 * (thread.c, dm__thread_fork_unlink, says why the child leaves the explicit
 * caches made before the fork alone; test_processes.py's
 * test_fork_while_threads_grow_arenas is the case that crashed). */
#define GROW_BUSY 2
#define GROW_FORKS 100

static void *grow_busy(void *arg) {
    _Atomic int *stop = arg;
    for (size_t i = 0; !atomic_load(stop); i++) {
        /* ever-new sizes past what jemalloc retains: most take a fresh extent */
        size_t n = ((size_t)64 << 20) + (i % 97) * ((size_t)3 << 20);
        dm_free(dm_alloc(dm_ctx_root(), n, DM_DT_UNKNOWN));
        dm_free(dm_alloc(dm_ctx_root(), 64 << 10, DM_DT_UNKNOWN));
    }
    return NULL;
}

static int fork_while_growing(void) {
    _Atomic int stop = 0;
    pthread_t th[GROW_BUSY];
    for (int i = 0; i < GROW_BUSY; i++)
        pthread_create(&th[i], NULL, grow_busy, &stop);
    int bad = 0;
    for (int i = 0; i < GROW_FORKS; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            dm_thread_set_name("worker-1");
            void *p = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
            void *q = dm_alloc(dm_ctx_root(), 64 << 10, DM_DT_UNKNOWN);
            void *r = dm_alloc(dm_ctx_root(), (size_t)80 << 20, DM_DT_UNKNOWN);
            bool ok = p && q && r && strcmp(dm_owner_arena(p), "threads") == 0 &&
                      strcmp(dm_owner_arena(r), "big") == 0;
            dm_free(p), dm_free(q), dm_free(r);
            _exit(ok ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        bad += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < GROW_BUSY; i++)
        pthread_join(th[i], NULL);
    if (bad)
        fprintf(stderr, "%d of %d children failed\n", bad, GROW_FORKS);
    return bad ? 2 : 0;
}

static void test_fork_while_arenas_grow(void) {
#if defined(__SANITIZE_THREAD__)
    printf("SKIP test_fork_while_arenas_grow under TSan: fork holds more locks than its "
           "deadlock detector tracks\n");
    return;
#endif
    if (RUNNING_ON_VALGRIND) { /* each child's exit is a leak check: seconds */
        printf("SKIP test_fork_while_arenas_grow under valgrind: too slow to fork often\n");
        return;
    }
    for (int r = 0; r < 3; r++) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(60); /* a deadlock ends the round with SIGALRM */
            _exit(fork_while_growing());
        }
        int status = 0;
        waitpid(pid, &status, 0);
        CHECK(!WIFSIGNALED(status), "round %d: killed by signal %d (SIGALRM: fork deadlocked "
              "with threads growing arenas)", r, WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        CHECK(!WIFEXITED(status) || WEXITSTATUS(status) == 0, "round %d: exit status %d", r,
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
}

/* Views are kept per context key (which context rules a context matches): a
 * policy with 15 tag rules meets up to 32,768 keys over a process's life. A
 * table keeps DM_VIEWS_MAX before freeing those no thread is bound to, and
 * every context still routes as its tags say: 100 x DM_VIEWS_MAX keys, each
 * context made, used and given back (contexts are recycled too). */
static void test_views_and_contexts_bounded(void) {
    char policy[4096] = "version: 1\ndefault: general\narenas:\n  general: {}\nrules:\n";
    for (int i = 0; i < 15; i++)
        snprintf(policy + strlen(policy), sizeof(policy) - strlen(policy),
                 "  - {name: r%d, match: {tag: b%d}, arena: general}\n", i, i);
    load_ok(policy);
    int most = 0, wrong = 0;
    for (int k = 1; k <= 100 * DM_VIEWS_MAX; k++) {
        const dm_ctx_t *c = dm_ctx_root();
        for (int i = 0; i < 15; i++) {
            if (!(k & (1 << i)))
                continue;
            char t[8];
            snprintf(t, sizeof(t), "b%d", i);
            const dm_ctx_t *next = dm_ctx_with_tag(c, t);
            dm_ctx_release(c);
            c = next;
        }
        void *p = dm_alloc(c, 64, DM_DT_UNKNOWN);
        char want[8];
        snprintf(want, sizeof(want), "r%d", __builtin_ctz((unsigned)k));
        const char *got = dm_runtime_rule_of(c, 64, DM_DT_UNKNOWN);
        if (!p || !got || strcmp(got, want) != 0) {
            if (wrong++ < 3)
                fprintf(stderr, "key %d: rule %s, want %s\n", k, got ? got : "(null)", want);
        }
        dm_free(p);
        dm_ctx_release(c);
        pthread_mutex_lock(&dm__runtime_mu);
        dm__dispatch_t *tab = atomic_load(&dm__dispatch_current);
        if (tab->nviews > most)
            most = tab->nviews;
        pthread_mutex_unlock(&dm__runtime_mu);
    }
    CHECK(wrong == 0, "%d contexts routed by another rule than their tags say", wrong);
    CHECK(most <= 2 * DM_VIEWS_MAX, "views kept: %d for %d keys (at most %d)", most,
          100 * DM_VIEWS_MAX, 2 * DM_VIEWS_MAX);
    dm_free(dm_alloc(NULL, 64, DM_DT_UNKNOWN)); /* the thread lets its last context go */
    dm_stats_t s;
    dm_stats_snapshot(&s);
    CHECK(s.ncontexts <= DM_CTX_MAX + 1, "contexts interned: %d (at most %d)", s.ncontexts,
          DM_CTX_MAX + 1);
    dm_stats_release(&s);
    load_ok(POLICY);
}

/* Arenas live for the process, so their names fill a table (DM_RT_ARENAS_MAX):
 * policies that keep naming new arenas, 100 x that many, are refused past it
 * with a line that says why, the policy in force stays, and allocation goes
 * on. Runs last: the process has every arena name afterwards. */
static void test_arena_names_fill(void) {
    int before = dm__arena_count(), refused = 0, clear = 0, last = -1, wrong = 0;
    char policy[256], want[32] = "";
    for (int i = 0; i < 100 * DM_RT_ARENAS_MAX; i++) {
        snprintf(policy, sizeof(policy), "version: 1\ndefault: fill%d\narenas:\n  fill%d: {}\n", i, i);
        static dm_diags_t d;
        dm_diags_init(&d, "fill.yaml");
        dm_topology_t topo;
        dm_runtime_topology(&topo);
        dm_policy_t *pol = NULL;
        CHECK(dm_policy_parse(policy, strlen(policy), "fill.yaml", &topo, &pol, &d) == 0, "%s",
              policy);
        if (dm_runtime_install(pol, &d) == 0) {
            last = i;
            continue;
        }
        refused++;
        char buf[2048];
        dm_diags_format_all(&d, buf, sizeof(buf));
        clear += strstr(buf, "can name at most 256 arenas over its life") != NULL;
        snprintf(want, sizeof(want), "fill%d", last);
        void *p = dm_alloc(NULL, 1000, DM_DT_UNKNOWN);
        const char *got = dm_owner_arena(p);
        wrong += !p || !got || strcmp(got, want) != 0; /* the policy in force serves it */
        dm_free(p);
    }
    CHECK(refused == 100 * DM_RT_ARENAS_MAX - (DM_RT_ARENAS_MAX - before),
          "refused %d of %d", refused, 100 * DM_RT_ARENAS_MAX);
    CHECK(clear == refused, "%d of %d refusals say why", clear, refused);
    CHECK(wrong == 0, "%d allocations after a refusal not served by the policy in force", wrong);
}

int main(void) {
    dm_runtime_init();
    load_ok(POLICY);
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
    test_size_classes();
    test_cache_rule_split_class();
    test_cache_rebind();
    test_cache_cross_thread();
    test_cache_tags_die_with_blocks();
    test_cache_two_arenas();
    test_purge_on_growth();
    test_big_halves();
    test_idle_big_half_purged();
    test_big_tail_trimmed();
    test_exit_hands_caches_back_before_count();
    test_fork_child_retires_threads();
    test_fork_while_arenas_grow();
    test_views_and_contexts_bounded();
    test_arena_names_fill();
    unlink(write_policy(""));
    if (failures) {
        fprintf(stderr, "runtime_test: %d check(s) failed\n", failures);
        return 1;
    }
    printf("runtime_test: all checks passed\n");
    return 0;
}
