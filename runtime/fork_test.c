/*
 * fork_test.c: fork() while other threads allocate and arenas grow: the child
 * retires the parent's threads and serves, the parent goes on.
 */
#define TEST_NAME "fork_test"
#include "runtime/test_runtime.h"

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

int main(void) {
    test_begin();
    test_fork_child_retires_threads();
    test_fork_while_arenas_grow();
    return test_end();
}
