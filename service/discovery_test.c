/*
 * discovery_test.c: this process's discovery file (discovery.c): where the
 * stats directory is (every branch of the rule), the file's mark, fields and
 * mode, the directory made 0700, the first write pruning only the files
 * datamem wrote for dead processes, removal, and a directory others can write
 * to refused (the process is not listed).
 */
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/discovery.h"
#include "testing/test.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *buf = calloc(1, 8192);
    size_t n = buf ? fread(buf, 1, 8191, f) : 0;
    fclose(f);
    (void)n;
    return buf;
}

static pid_t dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0)
        _exit(0);
    waitpid(pid, NULL, 0);
    return pid;
}

/* The rule python/datamem/_stats/discovery.py's stats_dir() also follows
 * (tests/python/stats/test_stats_export.py pins the two equal). */
static void test_dir_rule(void) {
    char buf[256], want[64];
    setenv("DATAMEM_STATS_DIR", "/some/where", 1);
    EXPECT_STR_EQ(dm__discovery_dir(buf, sizeof(buf)), "/some/where", "the variable");
    snprintf(want, sizeof(want), "/tmp/datamem-%u", (unsigned)getuid());
    setenv("DATAMEM_STATS_DIR", "", 1);
    EXPECT_STR_EQ(dm__discovery_dir(buf, sizeof(buf)), want, "empty: the default");
    unsetenv("DATAMEM_STATS_DIR");
    EXPECT_STR_EQ(dm__discovery_dir(buf, sizeof(buf)), want, "unset: the default");
}

static void test_write_prune_remove(const char *base) {
    char dir[256], mine[300], p[8][300];
    snprintf(dir, sizeof(dir), "%s/made", base); /* not there yet */
    setenv("DATAMEM_STATS_DIR", dir, 1);
    EXPECT_INT_EQ(mkdir(dir, 0700), 0, "a directory to prune");
    pid_t dead = dead_pid(), dead2 = dead_pid(), dead3 = dead_pid();
    snprintf(p[0], sizeof(p[0]), "%s/%d.json", dir, (int)dead);  /* ours: goes */
    snprintf(p[1], sizeof(p[1]), "%s/%d.json", dir, (int)dead2); /* not ours: stays */
    snprintf(p[2], sizeof(p[2]), "%s/%d.json", dir, (int)dead3); /* another pid's mark */
    snprintf(p[3], sizeof(p[3]), "%s/%d.json", dir, (int)getppid()); /* alive */
    snprintf(p[4], sizeof(p[4]), "%s/notes.json", dir);
    char text[128];
    snprintf(text, sizeof(text), "{\"datamem\": 1, \"pid\": %d, \"url\": null}\n", (int)dead);
    test_put_file(p[0], text);
    test_put_file(p[1], "{\"pid\": 1}\n");
    snprintf(text, sizeof(text), "{\"datamem\": 1, \"pid\": %d, \"url\": null}\n", (int)dead);
    test_put_file(p[2], text);
    snprintf(text, sizeof(text), "{\"datamem\": 1, \"pid\": %d, \"url\": null}\n",
             (int)getppid());
    test_put_file(p[3], text);
    test_put_file(p[4], "{\"datamem\": 1, \"pid\": 1, \"url\": null}\n");

    dm__discovery_write("http://127.0.0.1:9/metrics", NULL, 1700000000.5);
    snprintf(mine, sizeof(mine), "%s/%d.json", dir, (int)getpid());
    char *t = slurp(mine);
    char head[64];
    snprintf(head, sizeof(head), "{\"datamem\": 1, \"pid\": %d, \"url\": ", (int)getpid());
    EXPECT_TRUE(t && strncmp(t, head, strlen(head)) == 0, t ? t : mine);
    EXPECT_CONTAINS(t, "\"url\": \"http://127.0.0.1:9/metrics\", \"unix_socket\": null, "
                       "\"argv0\": \"", "endpoints");
    EXPECT_CONTAINS(t, "\"started\": 1700000000.500, \"version\": \"" DM_VERSION_STRING "\"}\n",
                    "started, version");
    free(t);
    struct stat st;
    EXPECT_INT_EQ(stat(mine, &st), 0, "written");
    EXPECT_INT_EQ(st.st_mode & 0777, 0600, "this user only");
    EXPECT_TRUE(access(p[0], F_OK) != 0, "a dead process's file, with its mark: pruned");
    for (int i = 1; i <= 4; i++)
        EXPECT_TRUE(access(p[i], F_OK) == 0, p[i]);

    /* A rewrite (another endpoint) keeps the file and changes it. */
    dm__discovery_write(NULL, "/tmp/x.sock", 1700000000.5);
    t = slurp(mine);
    EXPECT_CONTAINS(t, "\"url\": null, \"unix_socket\": \"/tmp/x.sock\"", "rewritten");
    free(t);
    dm__discovery_remove();
    EXPECT_TRUE(access(mine, F_OK) != 0, "removed");
    for (int i = 1; i <= 4; i++)
        unlink(p[i]);
    rmdir(dir);

    /* Absent: made 0700. */
    dm__discovery_write("http://127.0.0.1:9/metrics", NULL, 1.0);
    EXPECT_INT_EQ(stat(dir, &st), 0, "made");
    EXPECT_INT_EQ(st.st_mode & 0777, 0700, "0700");
    EXPECT_INT_EQ(access(mine, F_OK), 0, "and written");
    dm__discovery_remove();
    rmdir(dir);

    /* Writable by others: refused, nothing written, the process runs on. */
    EXPECT_INT_EQ(mkdir(dir, 0700), 0, "mkdir");
    chmod(dir, 0777);
    dm__discovery_write("http://127.0.0.1:9/metrics", NULL, 1.0);
    EXPECT_TRUE(access(mine, F_OK) != 0, "not listed in a directory others can write");
    dm__discovery_remove();
    rmdir(dir);
    unsetenv("DATAMEM_STATS_DIR");
}

int main(void) {
    test_dir_rule();
    char base[] = "/tmp/dm_discovery_test_XXXXXX";
    if (!mkdtemp(base)) {
        TEST_FAIL_("mkdtemp: %s", base);
        return TEST_EXIT();
    }
    test_write_prune_remove(base);
    rmdir(base);
    return TEST_EXIT();
}
