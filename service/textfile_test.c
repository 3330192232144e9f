/*
 * textfile_test.c: the node_exporter textfile (textfile.c) in this process:
 * written through a temporary file and a rename with mode 0644 whatever the
 * umask, never through a symbolic link planted at its path, no temporary left
 * behind; "{pid}" in the path names the file and labels every sample; the
 * sweep removes only the stale "{pid}" files of dead processes that this user
 * owns (not live processes', not fresh ones, not links, directories or other
 * names); the textfile thread writes every interval, a shared file gets a last
 * write at stop and a "{pid}" file goes with its process; a directory of
 * another user's, one others can write, or a link at its name is refused.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/textfile.h"
#include "testing/test.h"

static char dir[] = "/tmp/dm_textfile_test_XXXXXX";

static char *slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t cap = 1 << 20;
    char *buf = malloc(cap);
    size_t n = buf ? fread(buf, 1, cap - 1, f) : 0;
    fclose(f);
    if (buf)
        buf[n] = 0;
    return buf;
}

/* No "*.tmp.*" left in the test directory. */
static void expect_no_temporary(void) {
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        EXPECT_TRUE(!strstr(e->d_name, ".tmp."), e->d_name);
    if (d)
        closedir(d);
}

/* A pid no process has: a child that has exited and been reaped. */
static pid_t dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0)
        _exit(0);
    waitpid(pid, NULL, 0);
    return pid;
}

static void set_age(const char *path, int seconds) {
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= seconds;
    t[1] = t[0];
    if (utimensat(AT_FDCWD, path, t, AT_SYMLINK_NOFOLLOW) != 0)
        TEST_FAIL_("utimensat %s: %s", path, strerror(errno));
}

static void test_write(void) {
    char path[256], victim[256];
    snprintf(path, sizeof(path), "%s/datamem.prom", dir);
    mode_t old = umask(077);
    EXPECT_INT_EQ(dm_stats_textfile_write(path), 0, "write");
    umask(old);
    struct stat st;
    EXPECT_INT_EQ(lstat(path, &st), 0, "the file is there");
    EXPECT_TRUE(S_ISREG(st.st_mode), "a regular file");
    EXPECT_INT_EQ(st.st_mode & 0777, 0644, "0644 whatever the umask: node_exporter reads it");
    char *t = slurp(path);
    EXPECT_TRUE(t && strncmp(t, "# HELP datamem_build_info ", 26) == 0, "Prometheus text");
    EXPECT_TRUE(t && t[0] && t[strlen(t) - 1] == '\n', "complete");
    EXPECT_TRUE(t && !strstr(t, "pid=\""), "a shared file has no pid label");
    free(t);
    expect_no_temporary();

    /* A symbolic link planted at the path is replaced, not written through. */
    snprintf(victim, sizeof(victim), "%s/victim", dir);
    test_put_file(victim, "precious\n");
    unlink(path);
    EXPECT_INT_EQ(symlink(victim, path), 0, "plant a link");
    EXPECT_INT_EQ(dm_stats_textfile_write(path), 0, "write over the link");
    EXPECT_INT_EQ(lstat(path, &st), 0, "the file is there");
    EXPECT_TRUE(S_ISREG(st.st_mode), "the link was replaced by the file");
    t = slurp(victim);
    EXPECT_STR_EQ(t, "precious\n", "the link's target is untouched");
    free(t);
    unlink(victim);
    unlink(path);

    /* "{pid}": the file is this process's and every sample says so. */
    char tmpl[256], mine[256], label[32];
    snprintf(tmpl, sizeof(tmpl), "%s/w-{pid}.prom", dir);
    snprintf(mine, sizeof(mine), "%s/w-%d.prom", dir, (int)getpid());
    snprintf(label, sizeof(label), "pid=\"%d\"}", (int)getpid());
    EXPECT_INT_EQ(dm_stats_textfile_write(tmpl), 0, "write a {pid} file");
    t = slurp(mine);
    EXPECT_TRUE(t != NULL, mine);
    EXPECT_CONTAINS(t, label, "the pid label");
    EXPECT_CONTAINS(t, "\ndatamem_reloads_total{pid=\"", "on a sample without other labels");
    free(t);
    unlink(mine);

    char missing[256];
    snprintf(missing, sizeof(missing), "%s/no/such/dir.prom", dir);
    EXPECT_INT_EQ(dm_stats_textfile_write(missing), DM_ESYS, "a directory that is not there");
    expect_no_temporary();
}

static void test_sweep(void) {
    char tmpl[256], p[64][256];
    int np = 0;
    snprintf(tmpl, sizeof(tmpl), "%s/w-{pid}.prom", dir);
    pid_t dead = dead_pid(), dead2 = dead_pid(), dead3 = dead_pid();
#define FILE_(...) (snprintf(p[np], sizeof(p[np]), __VA_ARGS__), p[np++])
    const char *stale = FILE_("%s/w-%d.prom", dir, (int)dead);
    const char *fresh = FILE_("%s/w-%d.prom", dir, (int)dead2);
    const char *live = FILE_("%s/w-%d.prom", dir, (int)getppid());
    const char *own = FILE_("%s/w-%d.prom", dir, (int)getpid());
    const char *other = FILE_("%s/other-%d.prom", dir, (int)dead);
    const char *suffix = FILE_("%s/w-%d.prom.bak", dir, (int)dead);
    const char *notnum = FILE_("%s/w-%dx.prom", dir, (int)dead);
    const char *link = FILE_("%s/w-%d.prom", dir, (int)dead3);
    const char *target = FILE_("%s/target", dir);
#undef FILE_
    const char *old_files[] = {stale, live, own, other, suffix, notnum, target};
    for (size_t i = 0; i < sizeof(old_files) / sizeof(old_files[0]); i++) {
        test_put_file(old_files[i], "x 1\n");
        set_age(old_files[i], 3600);
    }
    test_put_file(fresh, "x 1\n"); /* a dead pid, but written a moment ago */
    EXPECT_INT_EQ(symlink(target, link), 0, "a link named like a stale file");
    set_age(link, 3600);
    char subdir[256];
    snprintf(subdir, sizeof(subdir), "%s/w-%d.prom", dir, (int)dead_pid());
    EXPECT_INT_EQ(mkdir(subdir, 0700), 0, "a directory named like a stale file");
    set_age(subdir, 3600);

    EXPECT_INT_EQ(dm_stats_textfile_sweep(tmpl, 60 * 1000), 1, "one file removed");
    EXPECT_TRUE(access(stale, F_OK) != 0, "the stale file of a dead process went");
    const char *kept[] = {fresh, live, own, other, suffix, notnum, target};
    for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]); i++)
        EXPECT_TRUE(access(kept[i], F_OK) == 0, kept[i]);
    struct stat st;
    EXPECT_INT_EQ(lstat(link, &st), 0, "the link stays");
    EXPECT_INT_EQ(lstat(subdir, &st), 0, "the directory stays");

    /* min_age 0: the fresh file of a dead process goes too; nothing else. */
    EXPECT_INT_EQ(dm_stats_textfile_sweep(tmpl, 0), 1, "the fresh dead file");
    EXPECT_TRUE(access(fresh, F_OK) != 0, "gone");
    EXPECT_TRUE(access(live, F_OK) == 0 && access(own, F_OK) == 0, "live ones stay");

    /* "{pid}" must be in the file name, once. */
    char bad[256];
    snprintf(bad, sizeof(bad), "%s/{pid}/w.prom", dir);
    EXPECT_INT_EQ(dm_stats_textfile_sweep(bad, 0), DM_ERANGE, "in the directory");
    snprintf(bad, sizeof(bad), "%s/w-{pid}-{pid}.prom", dir);
    EXPECT_INT_EQ(dm_stats_textfile_sweep(bad, 0), DM_ERANGE, "twice");
    snprintf(bad, sizeof(bad), "%s/w.prom", dir);
    EXPECT_INT_EQ(dm_stats_textfile_sweep(bad, 0), DM_ERANGE, "absent");

    for (int i = 0; i < np; i++)
        unlink(p[i]);
    rmdir(subdir);
}

/* Polls for `path` to exist, at most 10 s. */
static bool appears(const char *path) {
    for (int i = 0; i < 1000; i++) {
        if (access(path, F_OK) == 0)
            return true;
        usleep(10 * 1000);
    }
    TEST_FAIL_("%s did not appear within 10 s", path);
    return false;
}

static void test_thread(void) {
    char path[256];
    snprintf(path, sizeof(path), "%s/shared.prom", dir);
    dm_textfile_t *t = dm__textfile_start(path, 50);
    EXPECT_TRUE(t != NULL, "start");
    if (!t)
        return;
    EXPECT_TRUE(appears(path), "written at start");
    unlink(path);
    EXPECT_TRUE(appears(path), "written again within the interval");
    dm__textfile_set_interval(t, 3600 * 1000);
    dm__textfile_signal_stop(t);
    unlink(path);
    dm__textfile_join(t, true);
    EXPECT_TRUE(access(path, F_OK) == 0, "a shared file: a last write at stop");
    unlink(path);

    char tmpl[256], mine[256];
    snprintf(tmpl, sizeof(tmpl), "%s/t-{pid}.prom", dir);
    snprintf(mine, sizeof(mine), "%s/t-%d.prom", dir, (int)getpid());
    t = dm__textfile_start(tmpl, 3600 * 1000);
    EXPECT_TRUE(t != NULL, "start {pid}");
    if (!t)
        return;
    EXPECT_TRUE(appears(mine), "the {pid} file, at start");
    dm__textfile_signal_stop(t);
    dm__textfile_join(t, true);
    EXPECT_TRUE(access(mine, F_OK) != 0, "a {pid} file goes with its process");
    expect_no_temporary();
}

/* Attack pinned: a textfile directory another user owns (or can write) is
 * swapped for a symbolic link to a root-only directory, and the root job
 * replaced job.prom there. The directory rule refuses both the foreign
 * directory and a link at its name; nothing is written at the link's target. */
static void test_untrusted_dir(void) {
    char theirs[128], guarded[128], victim[200], path[200], swapped[128];
    snprintf(guarded, sizeof(guarded), "%s/root-only", dir);
    mkdir(guarded, 0700);
    snprintf(victim, sizeof(victim), "%s/job.prom", guarded);
    test_put_file(victim, "precious\n");

    /* the directory's own name is a link (the owner swapped it) */
    snprintf(swapped, sizeof(swapped), "%s/swapped", dir);
    EXPECT_INT_EQ(symlink(guarded, swapped), 0, "plant the link");
    snprintf(path, sizeof(path), "%s/job.prom", swapped);
    EXPECT_INT_EQ(dm_stats_textfile_write(path), DM_EUNSAFE, "a link as the directory");
    char *t = slurp(victim);
    EXPECT_STR_EQ(t, "precious\n", "the root-only file is untouched");
    free(t);

    /* a world-writable directory, and one owned by another user */
    snprintf(theirs, sizeof(theirs), "%s/shared", dir);
    mkdir(theirs, 0700);
    chmod(theirs, 01777);
    snprintf(path, sizeof(path), "%s/job.prom", theirs);
    EXPECT_INT_EQ(dm_stats_textfile_write(path), DM_EUNSAFE, "writable by others");
    EXPECT_TRUE(access(path, F_OK) != 0, "nothing written there");
    chmod(theirs, 0755);
    if (chown(theirs, 65534, 65534) == 0) {
        EXPECT_INT_EQ(dm_stats_textfile_write(path), DM_EUNSAFE, "another user's directory");
        EXPECT_TRUE(access(path, F_OK) != 0, "nothing written there");
    } else {
        TEST_SKIP_UNLESS_ROOT("another user's directory: chown to uid 65534: %s",
                              strerror(errno));
    }
    unlink(swapped), unlink(victim), rmdir(guarded), rmdir(theirs);
}

int main(void) {
    if (!mkdtemp(dir)) {
        TEST_FAIL_("mkdtemp: %s", dir);
        return TEST_EXIT();
    }
    test_write();
    test_sweep();
    test_thread();
    test_untrusted_dir();
    rmdir(dir);
    return TEST_EXIT();
}
