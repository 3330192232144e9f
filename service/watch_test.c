/*
 * watch_test.c: the policy file watcher (watch.c) in this process: a forked
 * child's watcher uses descriptors of its own, not the parent's eventfd and
 * inotify instance (a child's watcher on the parent's eventfd could read the
 * parent's wake-ups away), and both still reload. (That installs reach the
 * watcher in install order is the engine's seam: runtime_test.)
 */
#include <dirent.h>
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

static void write_policy(const char *path, const char *arena) {
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    fprintf(f, "version: 1\ndefault: %s\narenas:\n  %s: {}\n"
               "reload: {watch: true, debounce: 10ms}\n", arena, arena);
    fclose(f);
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
    write_policy(path_b, "b1");
    load(path_b);
    write_policy(path_b, "b2"); /* the watcher runs (and has its inotify instance) */
    EXPECT_TRUE(wait_for_arena("b2", 10), "the parent reloads");
    test_a_fork_child_watches_with_its_own_descriptors();
    unlink(path_b);
    rmdir(dir_b);
    return TEST_EXIT();
}
