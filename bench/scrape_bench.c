/*
 * scrape_bench.c: what the stats endpoint costs (docs/monitoring.md, "Stats and
 * scraping").
 *
 *   bazel run -c opt //bench:scrape_bench -- [--arenas 16] [--scrapes 2000] [--rounds 20]
 *       [--phase 0.5] [--threads NCPU]
 *
 * 1. One scrape with N arenas that all hold memory: dm_stats_snapshot alone,
 *    snapshot + Prometheus rendering, and a whole HTTP GET /metrics over
 *    loopback (connect, request, MHD's thread renders, read to EOF), as
 *    median / p99 / max over --scrapes runs.
 * 2. Allocation throughput (dm_alloc/dm_free, sizes spread over every arena, one
 *    thread per core) with a 10 Hz scraper and without, in alternating phases
 *    (--phase 0.5 s, --rounds 20 each way) so drift hits both alike; the ratio
 *    of medians is printed.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/datamem_service.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void report(const char *what, double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    printf("%-34s median %7.1f us   p99 %7.1f us   max %7.1f us\n", what, v[n / 2] * 1e6,
           v[(int)(n * 0.99)] * 1e6, v[n - 1] * 1e6);
}

static int port;

/* GET /metrics; returns the bytes read (headers + body), -1 on error. */
static long scrape(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if (write(fd, req, sizeof(req) - 1) != (ssize_t)sizeof(req) - 1) {
        close(fd);
        return -1;
    }
    char buf[65536];
    long total = 0;
    ssize_t r;
    while ((r = read(fd, buf, sizeof(buf))) > 0)
        total += r;
    close(fd);
    return total;
}

static int narenas = 16;

static void write_policy(const char *path) {
    FILE *f = fopen(path, "w");
    fprintf(f, "version: 1\ndefault: a0\narenas:\n");
    for (int i = 0; i < narenas; i++)
        fprintf(f, "  a%d: {alignment: 64}\n", i);
    fprintf(f, "rules:\n");
    for (int i = 1; i < narenas; i++)
        fprintf(f, "  - name: r%d\n    match: {size: {min: %d, max: %d}}\n    arena: a%d\n", i,
                i * 1024 + 1, (i + 1) * 1024, i);
    fclose(f);
}

/* ---- throughput ------------------------------------------------------------- */

static _Atomic int scraper_on, all_stop;
static _Atomic uint64_t ops;

static void *alloc_loop(void *arg) {
    enum { LIVE = 256 };
    void *live[LIVE] = {0};
    uint64_t x = (uint64_t)(uintptr_t)arg * 0x9e3779b97f4a7c15u + 1;
    while (!atomic_load_explicit(&all_stop, memory_order_relaxed)) {
        for (int k = 0; k < 1024; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size_t size = 64 + (size_t)(x % (uint64_t)narenas) * 1024 + (x >> 40) % 960;
            int slot = (int)((x >> 20) % LIVE);
            dm_free(live[slot]);
            live[slot] = dm_alloc(dm_ctx_root(), size, DM_DT_UNKNOWN);
        }
        atomic_fetch_add_explicit(&ops, 1024, memory_order_relaxed);
    }
    for (int i = 0; i < LIVE; i++)
        dm_free(live[i]);
    return NULL;
}

static void *scraper(void *arg) {
    long *scrapes = arg;
    double next = now_s();
    while (!atomic_load(&all_stop)) {
        if (atomic_load(&scraper_on) && now_s() >= next) {
            if (scrape() > 0)
                (*scrapes)++;
            next += 0.1; /* 10 Hz */
            if (next < now_s())
                next = now_s() + 0.1;
        }
        usleep(2000);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int nscrapes = 2000, rounds = 20, threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    double phase = 0.5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--arenas"))
            narenas = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--scrapes"))
            nscrapes = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--phase"))
            phase = atof(argv[i + 1]);
    }
    char path[64];
    snprintf(path, sizeof(path), "/tmp/dm_scrape_bench_%d.yaml", (int)getpid());
    write_policy(path);
    dm_diags_t *d = malloc(sizeof(*d));
    dm_diags_init(d, path);
    if (dm_runtime_load(path, d) != 0) {
        char buf[4096];
        dm_diags_format_all(d, buf, sizeof(buf));
        fprintf(stderr, "%s", buf);
        return 1;
    }
    unlink(path);
    /* Memory in every arena, so no stat is trivially zero. */
    void *keep[64];
    for (int i = 0; i < 64; i++)
        keep[i] = dm_alloc(dm_ctx_root(), 64 + (size_t)(i % narenas) * 1024 + 100, DM_DT_UNKNOWN);
    if (dm_stats_serve("127.0.0.1:0", NULL) != 0)
        return 1;
    char url[200];
    dm_stats_endpoint(url, sizeof(url), NULL, 0);
    sscanf(url, "http://127.0.0.1:%d/", &port);

    printf("scrape cost, %d arenas, %d runs each (%ld bytes of /metrics)\n", narenas, nscrapes,
           scrape());
    double *t = malloc(sizeof(double) * (size_t)nscrapes);
    dm_stats_t *s = malloc(sizeof(*s));
    for (int i = 0; i < nscrapes; i++) {
        double t0 = now_s();
        dm_stats_snapshot(s);
        t[i] = now_s() - t0;
        dm_stats_release(s);
    }
    report("dm_stats_snapshot", t, nscrapes);
    for (int i = 0; i < nscrapes; i++) {
        double t0 = now_s();
        dm_stats_snapshot(s);
        dm_stats_hugepages(s); /* cached for DM_HUGEPAGE_MAX_AGE_MS */
        char *text;
        size_t len;
        dm_stats_render(s, DM_STATS_PROMETHEUS, &text, &len);
        t[i] = now_s() - t0;
        free(text);
        dm_stats_release(s);
    }
    report("snapshot + hugepages + render", t, nscrapes);
    /* Fresh hugepage walks: wait out the cache each time. */
    dm_stats_snapshot(s);
    for (int i = 0; i < 3; i++) {
        struct timespec wait = {.tv_sec = DM_HUGEPAGE_MAX_AGE_MS / 1000,
                                .tv_nsec = (DM_HUGEPAGE_MAX_AGE_MS % 1000 + 100) * 1000000L};
        nanosleep(&wait, NULL);
        double hp0 = now_s();
        dm_stats_hugepages(s);
        t[i] = now_s() - hp0;
    }
    qsort(t, 3, sizeof(double), cmp_d);
    printf("%-34s median %7.1f us of 3 (uncached: at most once per %d ms)\n", "hugepage walk",
           t[1] * 1e6, DM_HUGEPAGE_MAX_AGE_MS);
    dm_stats_release(s);
    for (int i = 0; i < nscrapes; i++) {
        double t0 = now_s();
        if (scrape() <= 0) {
            fprintf(stderr, "scrape failed\n");
            return 1;
        }
        t[i] = now_s() - t0;
    }
    report("HTTP GET /metrics (loopback)", t, nscrapes);

    printf("\nallocation throughput, %d thread(s), %d x (%.1f s without + %.1f s with a 10 Hz "
           "scraper)\n", threads, rounds, phase, phase);
    long scrapes = 0;
    pthread_t th[64], sc;
    for (int i = 0; i < threads && i < 64; i++)
        pthread_create(&th[i], NULL, alloc_loop, (void *)(uintptr_t)(i + 1));
    pthread_create(&sc, NULL, scraper, &scrapes);
    usleep(300000); /* warm up */
    double *off = malloc(sizeof(double) * (size_t)rounds);
    double *on = malloc(sizeof(double) * (size_t)rounds);
    for (int r = 0; r < 2 * rounds; r++) {
        bool scraping = r % 2 == 1;
        atomic_store(&scraper_on, scraping);
        uint64_t o0 = atomic_load(&ops);
        double t0 = now_s();
        usleep((useconds_t)(phase * 1e6));
        double rate = (double)(atomic_load(&ops) - o0) / (now_s() - t0);
        (scraping ? on : off)[r / 2] = rate;
    }
    atomic_store(&all_stop, 1);
    for (int i = 0; i < threads && i < 64; i++)
        pthread_join(th[i], NULL);
    pthread_join(sc, NULL);
    qsort(off, (size_t)rounds, sizeof(double), cmp_d);
    qsort(on, (size_t)rounds, sizeof(double), cmp_d);
    printf("without scraper: median %.2f M ops/s (min %.2f, max %.2f)\n", off[rounds / 2] / 1e6,
           off[0] / 1e6, off[rounds - 1] / 1e6);
    printf("with 10 Hz:      median %.2f M ops/s (min %.2f, max %.2f), %ld scrapes\n",
           on[rounds / 2] / 1e6, on[0] / 1e6, on[rounds - 1] / 1e6, scrapes);
    printf("ratio with/without: %.3f\n", on[rounds / 2] / off[rounds / 2]);
    for (int i = 0; i < 64; i++)
        dm_free(keep[i]);
    dm_stats_export_stop();
    return 0;
}
