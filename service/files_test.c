/*
 * files_test.c: the services' file rules (files.h): which existing
 * directories are refused, with which one-line reason, and that a file is
 * never created through a planted symbolic link.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/files.h"
#include "testing/test.h"

static char root[] = "/tmp/dm_files_test_XXXXXX";

static void path_of(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", root, name);
}

/* Opens `name` under root; returns the code (fd closed) and the reason. */
static int try_dir(const char *name, bool create, char *why, size_t cap) {
    char p[256];
    path_of(p, sizeof(p), name);
    why[0] = 0;
    int fd = dm__files_dir_open_owned(p, create, 0700, why, cap);
    if (fd >= 0) {
        close(fd);
        return 0;
    }
    return fd;
}

static void test_dirs(void) {
    char why[512], p[256], q[256];
    EXPECT_INT_EQ(try_dir("fresh", true, why, sizeof(why)), 0, "created here");
    EXPECT_INT_EQ(try_dir("fresh", false, why, sizeof(why)), 0, "ours, 0700");

    /* Attack: a directory others can write to (they plant links or files). */
    path_of(p, sizeof(p), "open");
    mkdir(p, 0700);
    chmod(p, 0777);
    EXPECT_INT_EQ(try_dir("open", true, why, sizeof(why)), DM_EUNSAFE, "mode 0777");
    EXPECT_CONTAINS(why, "/open: directory writable by other users (mode 0777)", why);
    chmod(p, 0775);
    EXPECT_INT_EQ(try_dir("open", true, why, sizeof(why)), DM_EUNSAFE, "group-writable");
    chmod(p, 01777); /* sticky, like /tmp: still others' to write in */
    EXPECT_INT_EQ(try_dir("open", true, why, sizeof(why)), DM_EUNSAFE, "mode 1777");

    /* Attack: a symbolic link to a directory (checked on the fd, never followed). */
    path_of(q, sizeof(q), "link");
    path_of(p, sizeof(p), "fresh");
    EXPECT_INT_EQ(symlink(p, q), 0, "symlink");
    EXPECT_INT_EQ(try_dir("link", true, why, sizeof(why)), DM_EUNSAFE, "a symbolic link");
    EXPECT_CONTAINS(why, "/link: a symbolic link, not a directory", why);

    /* Attack: another user's directory (root can make one, outside a sandbox
     * that maps no other uid). */
    path_of(p, sizeof(p), "theirs");
    mkdir(p, 0755);
    if (chown(p, 65534, 65534) == 0) {
        char want[128];
        snprintf(want, sizeof(want), "/theirs: directory owned by uid 65534, not by this user "
                 "(uid %u)", (unsigned)geteuid());
        EXPECT_INT_EQ(try_dir("theirs", true, why, sizeof(why)), DM_EUNSAFE, "uid 65534");
        EXPECT_CONTAINS(why, want, why);
    } else {
        TEST_SKIP_UNLESS_ROOT("another user's directory: chown to uid 65534: %s",
                              strerror(errno));
    }

    /* Not a directory, or cannot be made: an error, not a refusal. */
    path_of(p, sizeof(p), "file");
    close(open(p, O_WRONLY | O_CREAT | O_EXCL, 0600));
    EXPECT_INT_EQ(try_dir("file", true, why, sizeof(why)), DM_EIO, "a file");
    EXPECT_CONTAINS(why, "/file: not a directory", why);
    EXPECT_INT_EQ(try_dir("file/sub", true, why, sizeof(why)), DM_EIO, "under a file");
    EXPECT_CONTAINS(why, "/file: Not a directory", why); /* the walk stops at it */
}

static void test_create(void) {
    char why[512], victim[256], link[256];
    int dirfd = dm__files_dir_open_owned(root, false, 0700, why, sizeof(why));
    EXPECT_TRUE(dirfd >= 0, why);
    /* Attack: the name is planted as a symbolic link to a victim file. */
    path_of(victim, sizeof(victim), "victim");
    int v = open(victim, O_WRONLY | O_CREAT | O_EXCL, 0600);
    EXPECT_INT_EQ(write(v, "precious", 8), 8, "victim written");
    close(v);
    path_of(link, sizeof(link), "123.dmprof");
    EXPECT_INT_EQ(symlink(victim, link), 0, "symlink");
    errno = 0;
    EXPECT_INT_EQ(dm__files_create(dirfd, "123.dmprof", 0644), -1, "refused");
    EXPECT_INT_EQ(errno, EEXIST, "EEXIST, not followed");
    struct stat st;
    EXPECT_INT_EQ(stat(victim, &st), 0, "victim");
    EXPECT_INT_EQ(st.st_size, 8, "victim untouched");
    /* A dangling link too: O_CREAT alone would create its target. */
    path_of(victim, sizeof(victim), "not-there");
    path_of(link, sizeof(link), "124.dmprof");
    EXPECT_INT_EQ(symlink(victim, link), 0, "dangling symlink");
    EXPECT_INT_EQ(dm__files_create(dirfd, "124.dmprof", 0644), -1, "refused");
    EXPECT_TRUE(access(victim, F_OK) != 0, "no file made at the link's target");
    int fd = dm__files_create(dirfd, "125.dmprof", 0644);
    EXPECT_TRUE(fd >= 0, "a new name");
    close(fd);
    close(dirfd);
}

int main(void) {
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    test_dirs();
    test_create();
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    if (system(cmd) != 0)
        printf("could not remove %s\n", root);
    return TEST_EXIT();
}
