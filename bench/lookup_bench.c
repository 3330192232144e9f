/*
 * lookup_bench.c: the cost of dm_view_lookup, the allocation fast path's
 * policy step, at 1, 8 and 64 rules.
 *
 *   lookup_bench                      ns per lookup, best of 5 timed runs
 *   lookup_bench --rules 64 --iters N exactly N lookups, no timing: for
 *       valgrind --tool=callgrind "--toggle-collect=run_lookups*" lookup_bench ...
 *       (instructions per lookup = Ir of run_lookups / N)
 *
 * Each policy has `rules` rules over disjoint size ranges, every other one with
 * a dtype part, so the view has rules + 1 intervals of 32 dtype slots; sizes
 * and dtypes come from a fixed pseudo-random table of 4096 entries that spans
 * every interval. Single-threaded: views are immutable, so threads do not
 * change the per-lookup cost.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "policy/policy.h"

#define NSAMPLES 4096 /* power of two */

typedef struct bench {
    dm_table_t *table;
    dm_view_t *view;
    size_t sizes[NSAMPLES];
    int dts[NSAMPLES];
} bench_t;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void) {
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1Dull;
}

/* rules i = [i * 64KiB, (i + 1) * 64KiB); odd ones only for float64. */
static int bench_init(bench_t *b, int nrules) {
    dm_policy_t p;
    memset(&p, 0, sizeof p);
    p.version = 1;
    p.narenas = 2;
    snprintf(p.arenas[0].name, DM_NAME_MAX, "general");
    snprintf(p.arenas[1].name, DM_NAME_MAX, "other");
    p.fallback_arena = -1;
    p.nrules = nrules;
    p.rules = calloc((size_t)nrules, sizeof *p.rules);
    if (!p.rules)
        return -1;
    for (int i = 0; i < nrules; i++) {
        dm_rule_spec_t *r = &p.rules[i];
        snprintf(r->name, DM_NAME_MAX, "r%d", i);
        r->size_min = (size_t)i << 16;
        r->size_max = ((size_t)(i + 1) << 16) - 1;
        r->dtypes = (i & 1) ? 1u << DM_DT_FLOAT64 : 0;
        r->arena = i & 1;
    }
    int rc = dm_table_compile(&p, &b->table);
    free(p.rules);
    if (rc || !(b->view = dm_table_view_build(b->table, NULL)))
        return -1;
    for (int i = 0; i < NSAMPLES; i++) {
        b->sizes[i] = (size_t)(next_rand() % ((uint64_t)(nrules + 1) << 16));
        b->dts[i] = (int)(next_rand() % DM_DT_COUNT);
    }
    return 0;
}

/* The measured loop; noinline so that callgrind can count it alone. */
__attribute__((noinline)) static unsigned run_lookups(const bench_t *b, long iters) {
    unsigned sum = 0;
    for (long i = 0; i < iters; i++) {
        unsigned k = (unsigned)i & (NSAMPLES - 1);
        sum += (unsigned)dm_view_lookup(b->view, b->sizes[k], b->dts[k]);
    }
    return sum;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static volatile unsigned sink;

static double time_lookups(const bench_t *b, long iters) {
    double best = 1e30;
    for (int run = 0; run < 5; run++) {
        double t0 = now_ns();
        sink += run_lookups(b, iters);
        double ns = (now_ns() - t0) / (double)iters;
        best = ns < best ? ns : best;
    }
    return best;
}

int main(int argc, char **argv) {
    static const int counts[] = {1, 8, 64};
    long iters = 0;
    int only = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--iters") == 0)
            iters = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--rules") == 0)
            only = atoi(argv[i + 1]);
    }
    if (argc % 2 == 0) {
        fprintf(stderr, "usage: lookup_bench [--rules N] [--iters N]\n");
        return 2;
    }
    if (!iters)
        printf("| Rules | Intervals | Row width | ns per lookup |\n|---|---|---|---|\n");
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        static bench_t b;
        if (only && counts[c] != only)
            continue;
        if (bench_init(&b, counts[c])) {
            fprintf(stderr, "setup failed\n");
            return 1;
        }
        if (iters) {
            sink += run_lookups(&b, iters);
            printf("rules %d: %ld lookups, checksum %u\n", counts[c], iters, sink);
        } else {
            printf("| %d | %u | %u | %.2f |\n", counts[c], b.view->nbounds,
                   b.view->row_width, time_lookups(&b, 20000000));
        }
        dm_view_free(b.view);
        dm_table_free(b.table);
    }
    return 0;
}
