/*
 * test_runtime.h: what the engine's tests against real jemalloc arenas share
 * (runtime_test.c, bcache_test.c, arena_test.c, fork_test.c, tables_test.c):
 * CHECK, a policy written to a temporary file and put in force, the policy
 * most of them start from, an arena's counters, and the report at the end.
 * Each includer defines TEST_NAME first. Tests only.
 */
#ifndef DM_RUNTIME_TEST_RUNTIME_H
#define DM_RUNTIME_TEST_RUNTIME_H
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
#include "runtime/alloc.h"
#include "runtime/arena.h"
#include "runtime/bcache.h"
#include "runtime/bigblock.h"
#include "runtime/context.h"
#include "runtime/datamem.h"
#include "runtime/dispatch.h"
#include "runtime/mem.h"
#include "runtime/os.h"
#include "runtime/sizeclass.h"
#include "runtime/test_policy.h"
#include "runtime/thread.h"

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

static inline const char *write_policy(const char *text) {
    return test_write_policy(TEST_NAME, text);
}

static inline void load_ok(const char *text) { test_load_policy(TEST_NAME, text); }

static const char *const POLICY =
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

/* An arena's counter by name: 0 placement errors, 1 allocations, 2 growth
 * purges, 3 dirty bytes. */
static inline uint64_t arena_stat(const char *name, int which) {
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

/* The test's start: the runtime up, POLICY in force. */
static inline void test_begin(void) {
    dm_runtime_init();
    load_ok(POLICY);
}

/* The test's end: its policy file gone, the exit status. */
static inline int test_end(void) {
    unlink(write_policy(""));
    if (failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", TEST_NAME, failures);
        return 1;
    }
    printf("%s: all checks passed\n", TEST_NAME);
    return 0;
}

#endif /* DM_RUNTIME_TEST_RUNTIME_H */
