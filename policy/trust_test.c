/*
 * trust_test.c: the rule for the policy's path and the services' directories
 * (trust.c). Run as root (as the tests here are), other users are made with
 * chown to uid 65534 ("nobody"); the target runs outside Bazel's sandbox,
 * which maps no other uid. A run as root that cannot chown fails; another
 * user's run prints SKIP.
 *
 * Attacks pinned: a policy file of another user, or one in (or reached
 * through) a directory another user owns or can write, let that user choose
 * what a root job writes where (a textfile over any file). A ConfigMap mount
 * (links into root's `..data`) must keep working.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "policy/policy.h"
#include "policy/trust.h"
#include "testing/test.h"

#define NOBODY 65534

static char root[] = "/tmp/dm_trust_test_XXXXXX";
static char why[1024];
static bool can_chown;

static const char *at(const char *name) {
    static char buf[4][512];
    static int i;
    i = (i + 1) % 4;
    snprintf(buf[i], sizeof buf[i], "%s/%s", root, name);
    return buf[i];
}

static void put(const char *path, const char *text, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    EXPECT_TRUE(fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text), path);
    close(fd);
    chmod(path, mode);
}

/* dm__trust_open(path, FILE): the file's text, or NULL with `why` and *rc. */
static char *read_policy(const char *path, int *rc) {
    static char text[256];
    why[0] = 0;
    int fd = dm__trust_open(path, DM__TRUST_FILE, 0, why, sizeof why);
    *rc = fd < 0 ? fd : 0;
    if (fd < 0)
        return NULL;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    text[n > 0 ? n : 0] = 0;
    return text;
}

static void expect_refused(const char *path, const char *reason, const char *what) {
    int rc;
    EXPECT_TRUE(read_policy(path, &rc) == NULL, what);
    EXPECT_INT_EQ(rc, DM_EUNSAFE, what);
    EXPECT_CONTAINS(why, reason, what);
}

static void expect_read(const char *path, const char *text, const char *what) {
    int rc;
    char *got = read_policy(path, &rc);
    EXPECT_INT_EQ(rc, 0, why);
    EXPECT_STR_EQ(got, text, what);
}

static void test_owned_and_modes(void) {
    mkdir(at("safe"), 0755);
    put(at("safe/p.yaml"), "mine\n", 0644);
    expect_read(at("safe/p.yaml"), "mine\n", "this user's file in this user's directory");

    /* Attack: a directory on the way that others can write (no sticky bit). */
    mkdir(at("open"), 0700);
    chmod(at("open"), 0777);
    put(at("open/p.yaml"), "x\n", 0644);
    char want[600];
    snprintf(want, sizeof want, "%s: directory writable by other users (mode 0777)", at("open"));
    expect_refused(at("open/p.yaml"), want, "world-writable directory");
    chmod(at("open"), 0775);
    expect_refused(at("open/p.yaml"), "(mode 0775)", "group-writable directory");
    /* ... and a link in it, even to a good file: the link is the attacker's word. */
    chmod(at("open"), 0777);
    symlink(at("safe/p.yaml"), at("open/link.yaml"));
    expect_refused(at("open/link.yaml"), "directory writable by other users", "link there");
    /* and below it: every directory on the way counts */
    mkdir(at("open/sub"), 0755);
    put(at("open/sub/p.yaml"), "x\n", 0644);
    expect_refused(at("open/sub/p.yaml"), "directory writable by other users", "below it");

    /* Attack: the file writable by others. */
    put(at("safe/w.yaml"), "x\n", 0666);
    snprintf(want, sizeof want, "%s: writable by other users (mode 0666)", at("safe/w.yaml"));
    expect_refused(at("safe/w.yaml"), want, "world-writable file");

    /* Attack: another user's file, another user's directory. */
    put(at("safe/theirs.yaml"), "x\n", 0644);
    mkdir(at("theirs"), 0755);
    put(at("theirs/p.yaml"), "x\n", 0644);
    can_chown = chown(at("safe/theirs.yaml"), NOBODY, NOBODY) == 0 &&
                chown(at("theirs"), NOBODY, NOBODY) == 0;
    if (!can_chown) {
        TEST_SKIP_UNLESS_ROOT("other users: chown to uid %d: %s", NOBODY, strerror(errno));
        return;
    }
    snprintf(want, sizeof want, "%s: owned by uid 65534, not by this user (uid %u) or root",
             at("safe/theirs.yaml"), (unsigned)geteuid());
    expect_refused(at("safe/theirs.yaml"), want, "another user's file");
    snprintf(want, sizeof want, "%s: directory owned by uid 65534", at("theirs"));
    expect_refused(at("theirs/p.yaml"), want, "another user's directory");
}

/* /tmp: a sticky directory everyone writes. Names of this user's (or root's)
 * there cannot be renamed or removed by others, so they are trusted; names of
 * others are not, nor a second hard link to a file. */
static void test_sticky(void) {
    mkdir(at("tmp"), 0700);
    chmod(at("tmp"), 01777);
    put(at("tmp/p.yaml"), "sticky\n", 0600);
    expect_read(at("tmp/p.yaml"), "sticky\n", "own file in a sticky directory");
    symlink("p.yaml", at("tmp/own-link.yaml"));
    expect_read(at("tmp/own-link.yaml"), "sticky\n", "own link in a sticky directory");
    link(at("tmp/p.yaml"), at("tmp/hard.yaml"));
    expect_refused(at("tmp/hard.yaml"), "2 hard links to it", "a planted hard link");
    unlink(at("tmp/hard.yaml"));
    if (!can_chown)
        return;
    symlink("p.yaml", at("tmp/their-link.yaml"));
    EXPECT_INT_EQ(lchown(at("tmp/their-link.yaml"), NOBODY, NOBODY), 0, "lchown");
    expect_refused(at("tmp/their-link.yaml"), "owned by uid 65534, in a directory other users "
                   "can write (mode 1777)", "another user's link in a sticky directory");
    put(at("tmp/theirs.yaml"), "x\n", 0644);
    EXPECT_INT_EQ(chown(at("tmp/theirs.yaml"), NOBODY, NOBODY), 0, "chown");
    expect_refused(at("tmp/theirs.yaml"), "owned by uid 65534", "their file there");
}

/* A Kubernetes ConfigMap volume: every name root's; the policy is two links
 * deep, and an update swaps `..data` to a new timestamped directory. */
static void test_configmap(void) {
    mkdir(at("cm"), 0755);
    mkdir(at("cm/..2026_11_27_10_00_00.1"), 0755);
    put(at("cm/..2026_11_27_10_00_00.1/policy.yaml"), "first\n", 0644);
    symlink("..2026_11_27_10_00_00.1", at("cm/..data"));
    symlink("..data/policy.yaml", at("cm/policy.yaml"));
    expect_read(at("cm/policy.yaml"), "first\n", "ConfigMap layout");
    mkdir(at("cm/..2026_11_27_10_05_00.2"), 0755);
    put(at("cm/..2026_11_27_10_05_00.2/policy.yaml"), "second\n", 0644);
    symlink("..2026_11_27_10_05_00.2", at("cm/..data_tmp"));
    rename(at("cm/..data_tmp"), at("cm/..data"));
    expect_read(at("cm/policy.yaml"), "second\n", "after the ConfigMap's update");
    /* relative, with "." and "..", and an absolute link */
    char cwd[512];
    EXPECT_TRUE(getcwd(cwd, sizeof cwd) != NULL, "getcwd");
    EXPECT_INT_EQ(chdir(at("cm")), 0, "chdir");
    expect_read("./..data/../policy.yaml", "second\n", "relative path with . and ..");
    EXPECT_INT_EQ(chdir(cwd), 0, "chdir back");
    symlink(at("cm/policy.yaml"), at("safe/abs.yaml"));
    expect_read(at("safe/abs.yaml"), "second\n", "absolute link");
    /* a loop ends in ELOOP, an absent file in ENOENT: errors, not refusals */
    symlink("loop.yaml", at("safe/loop.yaml"));
    int rc;
    EXPECT_TRUE(read_policy(at("safe/loop.yaml"), &rc) == NULL, "a loop");
    EXPECT_INT_EQ(rc, DM_EIO, "a loop is an error");
    EXPECT_CONTAINS(why, "Too many levels of symbolic links", why);
    EXPECT_TRUE(read_policy(at("safe/none.yaml"), &rc) == NULL && rc == DM_EIO, "absent");
    EXPECT_CONTAINS(why, "No such file or directory", why);
}

/* dm_policy_load: one line saying why and how to fix it, no content read. */
static void test_policy_message(void) {
    static dm_diags_t d;
    static char text[8192];
    dm_policy_t *p = NULL;
    chmod(at("open"), 0777);
    put(at("open/bad.yaml"), "version: 1\nsecret line one\nsecret line two\n", 0644);
    EXPECT_INT_EQ(dm_policy_load(at("open/bad.yaml"), NULL, &p, &d), DM_EUNSAFE, "refused");
    dm_diags_format_all(&d, text, sizeof text);
    EXPECT_CONTAINS(text, "bad.yaml: error: refused: ", text);
    EXPECT_CONTAINS(text, "directory writable by other users (mode 0777); a policy and each "
                    "directory on its way must be owned by this user or root", text);
    EXPECT_CONTAINS(text, "chown or chmod go-w, or move the policy", text);
    EXPECT_TRUE(strchr(text, '\n') == text + strlen(text) - 1, "one line");
    EXPECT_TRUE(!strstr(text, "secret"), "nothing of the file quoted");
}

/* The services' directories: their own name never a link, this user's only. */
static void test_dirs(void) {
    int fd = dm__trust_open(at("safe"), DM__TRUST_DIR, 0, why, sizeof why);
    EXPECT_TRUE(fd >= 0, why);
    if (fd >= 0)
        close(fd);
    symlink(at("safe"), at("safe-link"));
    EXPECT_INT_EQ(dm__trust_open(at("safe-link"), DM__TRUST_DIR, 0, why, sizeof why),
                  DM_EUNSAFE, "a link as the directory's own name");
    EXPECT_CONTAINS(why, "a symbolic link, not a directory", why);
    fd = dm__trust_open(at("safe/new"), DM__TRUST_DIR_CREATE, 0700, why, sizeof why);
    EXPECT_TRUE(fd >= 0, why);
    if (fd >= 0)
        close(fd);
    struct stat st;
    EXPECT_TRUE(lstat(at("safe/new"), &st) == 0 && S_ISDIR(st.st_mode), "created");
    /* Attack: a link on the way planted in a directory others can write: the
     * write would land in any directory of this user's named like the last one. */
    symlink(at("safe"), at("open/via"));
    EXPECT_INT_EQ(dm__trust_open(at("open/via/new"), DM__TRUST_DIR, 0, why, sizeof why),
                  DM_EUNSAFE, "through a directory others can write");
    EXPECT_CONTAINS(why, "directory writable by other users", why);
}

int main(void) {
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    test_owned_and_modes();
    test_sticky();
    test_configmap();
    test_policy_message();
    test_dirs();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd) != 0)
        printf("could not remove %s\n", root);
    return TEST_EXIT();
}
