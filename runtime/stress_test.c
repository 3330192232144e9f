/*
 * stress_test.c: allocation from several threads, in several contexts, while the
 * policy is reloaded hundreds of times, alternating valid and broken versions.
 * The policy asks for the file watcher, so reloads come both from the watcher
 * thread (every rewrite) and from direct dm_runtime_load calls.
 * Checks: no crash, every block freed through the arena that owns it, datamem's
 * live count back to zero, and no per-reload leak (glibc heap growth bounded:
 * tables and views are freed once no thread uses them). Also built under TSan
 * and ASan by the test command.
 */
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/datamem_service.h"

#define NTHREADS 4
#define NRELOADS 300
#define LIVE 64

static atomic_bool stop;
static _Atomic long saw_dtype; /* worker iterations with a dtype rule in force */
static char dir[256], path[300];

static const char *const GOOD[2] = {
    "version: 1\ndefault: a\narenas:\n  a: {alignment: 64}\n  b: {alignment: 16}\n"
    "  c: {alignment: 4096}\nrules:\n"
    "  - {name: small, match: {size: {max: 1KiB}}, arena: b}\n"
    "  - {name: tagged, match: {tag: x}, arena: c}\n"
    "reload: {watch: true, debounce: 0ms}\n",
    "version: 1\ndefault: b\narenas:\n  b: {alignment: 16}\n  d: {alignment: 128}\n"
    "rules:\n  - {name: big, match: {size: {min: 64KiB}}, arena: d}\n"
    "  - {name: threads, match: {thread: 'w1'}, arena: d}\n"
    "  - {name: f32, match: {dtype: float32}, arena: d}\n"
    "reload: {watch: true, debounce: 0ms}\n",
};
static const char *const BAD =
    "version: 1\ndefault: a\narenas:\n  a: {alignment: 48}\n";

static void write_file(const char *text) {
    char tmp[320];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
}

static uint64_t rng(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* 3-9 MiB: on both sides of the big halves' 4 MiB (runtime/arena.c). */
static size_t big_size(uint64_t *s) { return ((size_t)3 << 20) + rng(s) % ((size_t)6 << 20); }

static void *worker(void *arg) {
    intptr_t id = (intptr_t)arg;
    char name[16];
    snprintf(name, sizeof(name), "w%d", (int)id);
    dm_thread_set_name(name);
    const dm_ctx_t *ctxs[2] = {dm_ctx_root(), dm_ctx_with_tag(dm_ctx_root(), "x")};
    void *live[LIVE] = {0};
    size_t sizes[LIVE] = {0};
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(id + 1);
    long bad = 0;
    while (!atomic_load(&stop)) {
        /* as the NumPy handler asks before each allocation, while tables are
         * retired and freed (under TSan: the flag is not read through a table) */
        if (dm_runtime_wants_dtype())
            atomic_fetch_add_explicit(&saw_dtype, 1, memory_order_relaxed);
        int i = (int)(rng(&s) % LIVE);
        if (live[i]) {
            unsigned char *p = live[i];
            if (p[0] != (unsigned char)i || p[sizes[i] - 1] != (unsigned char)i)
                bad++;
            if (rng(&s) % 4 == 0) {
                size_t n = rng(&s) % 32 == 0 ? big_size(&s) : 1 + rng(&s) % 200000;
                void *q = dm_realloc(ctxs[rng(&s) % 2], p, n);
                if (q) {
                    p = q;
                    sizes[i] = n;
                    p[0] = p[n - 1] = (unsigned char)i;
                    live[i] = p;
                    continue;
                }
            }
            dm_free(p);
            live[i] = NULL;
        } else {
            size_t n = rng(&s) % 64 == 0 ? big_size(&s)
                                         : 1 + rng(&s) % (rng(&s) % 8 == 0 ? 300000 : 2000);
            unsigned char *p = rng(&s) % 2 ? dm_alloc(ctxs[rng(&s) % 2], n, DM_DT_UNKNOWN)
                                           : dm_calloc(ctxs[rng(&s) % 2], n, DM_DT_UNKNOWN);
            if (!p) {
                bad++;
                continue;
            }
            p[0] = p[n - 1] = (unsigned char)i;
            live[i] = p;
            sizes[i] = n;
        }
    }
    for (int i = 0; i < LIVE; i++)
        dm_free(live[i]);
    return (void *)bad;
}

int main(void) {
    /* A directory of its own: two runs of this test at once (two checkouts'
     * CI on one machine) must not rewrite each other's policy, and in Bazel's
     * sandbox each run's pid is the same. */
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(dir, sizeof(dir), "%s/dm_stress_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(path, sizeof(path), "%s/policy.yaml", dir);
    write_file(GOOD[0]);
    static dm_diags_t d;
    dm_diags_init(&d, path);
    if (dm_runtime_load(path, &d) != 0) {
        fprintf(stderr, "initial load failed\n");
        return 1;
    }
    pthread_t th[NTHREADS];
    for (intptr_t i = 0; i < NTHREADS; i++)
        pthread_create(&th[i], NULL, worker, (void *)i);
    size_t heap_mid = 0;
    int failed_loads = 0, ok_loads = 0;
    for (int r = 0; r < NRELOADS; r++) {
        bool good = r % 2 == 0;
        write_file(good ? GOOD[(r / 2) % 2] : BAD);
        if (r % 3 == 0) { /* and a direct reload racing the watcher's */
            dm_diags_init(&d, path);
            int rc = dm_runtime_load(path, &d);
            if ((rc == 0) != good) {
                fprintf(stderr, "reload %d: expected %s, got rc %d\n", r,
                        good ? "success" : "failure", rc);
                return 1;
            }
            rc == 0 ? ok_loads++ : failed_loads++;
        }
        if (r == NRELOADS / 3)
            heap_mid = mallinfo2().uordblks;
        usleep(200);
    }
    size_t heap_end = mallinfo2().uordblks;
    write_file(GOOD[1]); /* the one with a dtype rule */
    dm_diags_init(&d, path);
    if (dm_runtime_load(path, &d) != 0 || !dm_runtime_wants_dtype()) {
        fprintf(stderr, "FAIL: the last policy has a dtype rule; dm_runtime_wants_dtype() says no\n");
        return 1;
    }
    atomic_store(&stop, true);
    long bad = 0;
    for (int i = 0; i < NTHREADS; i++) {
        void *res;
        pthread_join(th[i], &res);
        bad += (long)res;
    }
    dm_stats_t *st = malloc(sizeof(*st));
    dm_stats_snapshot(st);
    uint64_t nalloc = 0, nfree = 0;
    for (int i = 0; i < st->narenas; i++) {
        nalloc += st->arenas[i].counts.nalloc;
        nfree += st->arenas[i].counts.nfree;
    }
    int rc = 0;
    if (bad) {
        fprintf(stderr, "FAIL: %ld corrupted blocks or failed allocations\n", bad);
        rc = 1;
    }
    if (nalloc != nfree) {
        fprintf(stderr, "FAIL: %llu allocations but %llu frees\n",
                (unsigned long long)nalloc, (unsigned long long)nfree);
        rc = 1;
    }
    uint64_t watched, unchanged;
    dm_watch_counts(&watched, &unchanged);
    if (atomic_load(&saw_dtype) == 0) {
        fprintf(stderr, "FAIL: no worker saw the policy with a dtype rule in force\n");
        rc = 1;
    }
    if (st->reload_failures < (uint64_t)failed_loads || watched == 0) {
        fprintf(stderr, "FAIL: %llu reload failures counted (>= %d expected), %llu by the watcher\n",
                (unsigned long long)st->reload_failures, failed_loads,
                (unsigned long long)watched);
        rc = 1;
    }
    /* Every retired table must be freed once no thread holds it: the workers
     * have exited, so only the table in force may be left. One leaked table per
     * reload would leave hundreds. (The glibc heap is sampled for the log only:
     * the watcher's transient 1 MiB read buffers make it too noisy to judge.) */
    if (st->tables_live != 1) {
        fprintf(stderr, "FAIL: %d dispatch tables alive after %d reloads, 1 expected\n",
                st->tables_live, NRELOADS);
        rc = 1;
    }
    printf("stress_test: %d threads, %d rewrites, direct reloads %d good + %d bad, "
           "watcher reloads %llu, failures %llu, %llu allocations, tables alive %d, heap %zu -> %zu: %s\n",
           NTHREADS, NRELOADS, ok_loads, failed_loads, (unsigned long long)watched,
           (unsigned long long)st->reload_failures, (unsigned long long)nalloc,
           st->tables_live, heap_mid, heap_end, rc ? "FAILED" : "ok");
    dm_stats_release(st);
    free(st);
    unlink(path);
    rmdir(dir);
    return rc;
}
