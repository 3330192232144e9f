/*
 * watch_test.c: the policy file watcher (watch.c) in this process: a forked
 * child's watcher uses descriptors of its own, not the parent's eventfd and
 * inotify instance (a child's watcher on the parent's eventfd could read the
 * parent's wake-ups away), and both still reload; and a reload the watcher
 * decided on yields to an install that lands before it reads the file; and a
 * file written in place is not read half-way through its write. (That
 * installs reach the watcher in install order is the engine's seam:
 * runtime_test.)
 */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/watch.h"
#include "testing/test.h"

static char dir_b[] = "/tmp/dm_watch_test_XXXXXX";
static char path_b[256];

/* Writes by temp + rename, as an editor does: the watcher never reads half a file. */
static void write_policy_debounced(const char *path, const char *arena, const char *debounce) {
    char tmp[300];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        perror(tmp);
        exit(1);
    }
    fprintf(f, "version: 1\ndefault: %s\narenas:\n  %s: {}\n"
               "reload: {watch: true, debounce: %s}\n", arena, arena, debounce);
    fclose(f);
    if (rename(tmp, path) != 0) {
        perror(path);
        exit(1);
    }
}

static void write_policy(const char *path, const char *arena) {
    write_policy_debounced(path, arena, "10ms");
}

static const char *arena_of_new(void) {
    void *p = dm_alloc(dm_ctx_root(), 100, DM_DT_UNKNOWN);
    const char *a = dm_owner_arena(p);
    dm_free(p);
    return a;
}

/* Polls (bounded) until new blocks go to `arena`. */
static bool wait_for_arena(const char *arena, double seconds) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    for (int i = 0; i < (int)(seconds * 100); i++) {
        if (strcmp(arena_of_new(), arena) == 0)
            return true;
        nanosleep(&pause, NULL);
    }
    return false;
}

static void load(const char *path) {
    static dm_diags_t d;
    dm_diags_init(&d, path);
    int rc = dm_runtime_load(path, &d);
    if (rc) {
        fprintf(stderr, "%s: %s\n", path, dm_strerror(rc));
        exit(1);
    }
}

/* The watcher's seam (watch.c): once armed, the next reload the watcher decides
 * on is held before it reads the file until the test lets it go. */
static pthread_mutex_t seam_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t seam_cv = PTHREAD_COND_INITIALIZER;
typedef enum { SEAM_OFF, SEAM_ARMED, SEAM_HELD, SEAM_GO, SEAM_DONE } seam_state_t;
static seam_state_t seam_state;

static void seam(bool before) {
    pthread_mutex_lock(&seam_mu);
    if (before && seam_state == SEAM_ARMED) {
        seam_state = SEAM_HELD;
        pthread_cond_broadcast(&seam_cv);
        while (seam_state != SEAM_GO)
            pthread_cond_wait(&seam_cv, &seam_mu);
    } else if (!before && seam_state == SEAM_GO) {
        seam_state = SEAM_DONE;
        pthread_cond_broadcast(&seam_cv);
    }
    pthread_mutex_unlock(&seam_mu);
}

static void seam_set(seam_state_t state) {
    pthread_mutex_lock(&seam_mu);
    seam_state = state;
    pthread_cond_broadcast(&seam_cv);
    pthread_mutex_unlock(&seam_mu);
}

/* Waits (at most `seconds`) for the seam to reach `state`. */
static bool seam_reached(seam_state_t state, int seconds) {
    struct timespec end;
    clock_gettime(CLOCK_REALTIME, &end);
    end.tv_sec += seconds;
    pthread_mutex_lock(&seam_mu);
    int rc = 0;
    while (seam_state != state && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&seam_cv, &seam_mu, &end);
    bool ok = seam_state == state;
    pthread_mutex_unlock(&seam_mu);
    return ok;
}

/* The watcher wakes for a write, decides to reload, and before it reads the file
 * datamem.reload() (an install of the same file) puts in a policy that watches
 * with a 60 s debounce, and the file is written once more. The watcher's reload
 * must yield to that install: it read the later write, and put it in force under
 * the debounce the install had replaced (tests/python/engine/test_reload.py's
 * reload.debounce probe saw this under load). */
static void test_a_decided_reload_yields_to_an_install_before_its_read(void) {
    write_policy_debounced(path_b, "c1", "0ms");
    load(path_b);
    seam_set(SEAM_ARMED);
    write_policy_debounced(path_b, "c2", "0ms");
    EXPECT_TRUE(seam_reached(SEAM_HELD, 10), "the watcher decides to reload c2");
    write_policy_debounced(path_b, "c3", "60s");
    load(path_b);
    write_policy_debounced(path_b, "c4", "0ms");
    seam_set(SEAM_GO);
    EXPECT_TRUE(seam_reached(SEAM_DONE, 10), "the watcher's reload returns");
    EXPECT_STR_EQ(arena_of_new(), "c3", "the install stays in force, not the later write");
    seam_set(SEAM_OFF);
    write_policy(path_b, "c5"); /* back to a 10 ms debounce for what follows */
    load(path_b);
}

static uint64_t reload_failures(void) {
    dm_stats_t s;
    if (dm_stats_snapshot(&s) != 0)
        return UINT64_MAX;
    uint64_t n = s.reload_failures;
    dm_stats_release(&s);
    return n;
}

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

/* A writer that writes the file in place (truncate, write, pause, write, close,
 * as a script or `cat > policy.yaml` does) while a debounce from an earlier
 * event is running. The pause passes that debounce's end: a watcher that counted
 * only close-after-write read the half-written file then, failed the reload and
 * logged it (test_reload.py's DATAMEM_QUIET test saw it once under load). Every
 * write restarts the debounce, so the watcher reads the whole file once the
 * writer has paused for a debounce. Debounce D = 1.6 s; the half write comes at
 * D/2 after the earlier event and the pause is 3D/4: 400 ms of slack each way. */
static void test_a_file_written_in_place_is_read_whole(void) {
    write_policy_debounced(path_b, "w1", "1600ms");
    load(path_b);
    uint64_t failures = reload_failures();
    FILE *f = fopen(path_b, "a"); /* an event: the debounce starts */
    EXPECT_TRUE(f != NULL, "open the policy to append");
    if (!f)
        return;
    fclose(f);
    sleep_ms(800);
    f = fopen(path_b, "w");
    fputs("version: 1\ndefault: w2\narenas:\n", f);
    fflush(f); /* half a policy: no arena named w2 yet */
    sleep_ms(1200);
    fputs("  w2: {}\nreload: {watch: true, debounce: 10ms}\n", f);
    fclose(f);
    EXPECT_TRUE(wait_for_arena("w2", 10), "the whole file is put in force");
    EXPECT_INT_EQ((long long)(reload_failures() - failures), 0,
                  "no reload read the half-written file");
}

static int count_fds(const char *link) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[300], target[128];
        snprintf(p, sizeof(p), "/proc/self/fd/%s", e->d_name);
        ssize_t len = readlink(p, target, sizeof(target) - 1);
        if (len > 0) {
            target[len] = 0;
            n += strcmp(target, link) == 0;
        }
    }
    if (d)
        closedir(d);
    return n;
}

static void test_a_fork_child_watches_with_its_own_descriptors(void) {
    EXPECT_INT_EQ(count_fds("anon_inode:inotify"), 1, "the parent's watcher: one instance");
    pid_t pid = fork();
    if (pid == 0) {
        dm_runtime_after_fork_child(); /* the child's watcher starts */
        write_policy(path_b, "b3");
        bool reloaded = wait_for_arena("b3", 10);
        /* The parent's inotify instance was closed, the child made its own. */
        _exit(!reloaded ? 2 : count_fds("anon_inode:inotify") != 1 ? 3 : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_INT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0,
                  "child: 2 = no reload, 3 = the parent's inotify instance kept");
    write_policy(path_b, "b4"); /* and the parent's watcher still works */
    EXPECT_TRUE(wait_for_arena("b4", 10), "the parent reloads after the child is gone");
}

int main(void) {
    if (!mkdtemp(dir_b)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(path_b, sizeof(path_b), "%s/policy.yaml", dir_b);
    dm_runtime_init();
    dm__watch_seam = seam; /* before the watcher thread exists */
    write_policy(path_b, "b1");
    load(path_b);
    write_policy(path_b, "b2"); /* the watcher runs (and has its inotify instance) */
    EXPECT_TRUE(wait_for_arena("b2", 10), "the parent reloads");
    test_a_decided_reload_yields_to_an_install_before_its_read();
    test_a_file_written_in_place_is_read_whole();
    test_a_fork_child_watches_with_its_own_descriptors();
    unlink(path_b);
    rmdir(dir_b);
    return TEST_EXIT();
}
