/*
 * sock_test.c: the Unix socket file of the stats endpoint (sock.c) under
 * attack. The attack pinned: bind() then chmod(path) by name, in a directory
 * another user can write. Swapping a symbolic link in between made a root job
 * chmod any file (a root-owned 0644 file became 0600 after 1.4k-26.5k endpoint
 * restarts). Here a racing thread swaps a link to a victim file over the socket
 * the moment it appears at its name, while the endpoint restarts over and over
 * (bounded in count and time); the victim's mode must never change (bind then
 * chmod by name changed it 15 and 23 times in two runs of 3000 restarts).
 *
 *  - in a world-writable directory the endpoint is refused outright (the one
 *    directory rule), every time, with one line;
 *  - in a directory of this user's, where the racer stands for anyone who
 *    could write there, the mode is still set without the name (inside a
 *    private directory), and the socket that does start is 0600.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/http.h"
#include "testing/test.h"

#define RESTARTS 3000  /* endpoint restarts per directory, at most */
#define SECONDS 4      /* ... and at most this long */

static char root[] = "/tmp/dm_sock_test_XXXXXX";
static char victim[256], sock_path[256], tmp_link[256];
static volatile bool racing, watching;
static long swaps, loops;

static int render(int format, char **out, size_t *len) {
    *out = strdup("x 1\n");
    *len = 4;
    return *out ? 0 : DM_ENOMEM;
}

/* Waits (inotify) for a socket at the name and swaps a link to the victim
 * over it at once: exactly between a bind() and a chmod() by name. A link
 * left there is removed, so the next start finds the name free. */
static void *racer(void *arg) {
    const char *dir = arg;
    int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    inotify_add_watch(in, dir, IN_CREATE | IN_MOVED_TO);
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    unlink(tmp_link);
    symlink(victim, tmp_link);
    /* Watching: the link's own creation is the first event (bounded wait);
     * the restarts begin only once it is read. */
    struct pollfd first = {.fd = in, .events = POLLIN};
    if (poll(&first, 1, 10000) > 0 && read(in, buf, sizeof(buf)) > 0)
        loops++;
    __atomic_store_n(&watching, true, __ATOMIC_RELEASE);
    while (__atomic_load_n(&racing, __ATOMIC_RELAXED)) {
        struct pollfd p = {.fd = in, .events = POLLIN};
        if (poll(&p, 1, 10) <= 0 || read(in, buf, sizeof(buf)) <= 0)
            continue;
        struct stat st;
        loops++;
        if (lstat(sock_path, &st) != 0)
            continue;
        if (S_ISSOCK(st.st_mode) && rename(tmp_link, sock_path) == 0) {
            swaps++;
            symlink(victim, tmp_link);
        } else if (S_ISLNK(st.st_mode)) {
            unlink(sock_path);
        }
    }
    unlink(tmp_link);
    close(in);
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Restarts the endpoint at dir/stats.sock while the racer runs; returns how
 * many starts succeeded. The victim's mode is checked after every one. */
static int attack(const char *dir, mode_t dir_mode) {
    snprintf(sock_path, sizeof(sock_path), "%s/stats.sock", dir);
    snprintf(tmp_link, sizeof(tmp_link), "%s/link.tmp", dir);
    mkdir(dir, 0700);
    chmod(dir, dir_mode);
    swaps = loops = 0;
    racing = true;
    watching = false;
    pthread_t t;
    pthread_create(&t, NULL, racer, (void *)dir);
    /* the racer watches before the first restart (at most 10 s: its poll's bound) */
    while (!__atomic_load_n(&watching, __ATOMIC_ACQUIRE))
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    int started = 0, i = 0, changed = 0;
    double end = now_s() + SECONDS;
    for (; i < RESTARTS && now_s() < end; i++) {
        dm_http_t *h = NULL;
        if (dm__http_start_unix(sock_path, render, &h) == 0) {
            started++;
            struct stat st;
            /* what this process bound is 0600, or the racer has replaced it */
            if (lstat(sock_path, &st) == 0 && S_ISSOCK(st.st_mode))
                EXPECT_INT_EQ(st.st_mode & 0777, 0600, "the socket is 0600");
            dm__http_stop(h);
        }
        struct stat vst;
        if (stat(victim, &vst) != 0 || (vst.st_mode & 07777) != 0644) {
            changed++;
            chmod(victim, 0644);
        }
    }
    __atomic_store_n(&racing, false, __ATOMIC_RELAXED);
    pthread_join(t, NULL);
    printf("%s (mode %04o): %d restarts, %d started, %ld swaps in %ld looks\n", dir,
           (unsigned)dir_mode, i, started, swaps, loops);
    EXPECT_INT_EQ(changed, 0, "the victim's mode never changed");
    EXPECT_TRUE(loops > 0, "the racer watched from the first restart on");
    EXPECT_TRUE(started == 0 || swaps > 0, "the racer swapped a link over a started socket");
    return started;
}

int main(void) {
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    /* The victim: a root-only directory's 0644 file (here: this user's). */
    char vdir[128], open_dir[128], own_dir[128];
    snprintf(vdir, sizeof(vdir), "%s/victim-dir", root);
    mkdir(vdir, 0700);
    snprintf(victim, sizeof(victim), "%s/victim", vdir);
    int fd = open(victim, O_WRONLY | O_CREAT | O_EXCL, 0644);
    close(fd);
    chmod(victim, 0644);

    snprintf(open_dir, sizeof(open_dir), "%s/shared", root);
    EXPECT_INT_EQ(attack(open_dir, 01777), 0, "a directory others can write is refused");
    snprintf(own_dir, sizeof(own_dir), "%s/own", root);
    EXPECT_TRUE(attack(own_dir, 0700) > 0, "in this user's directory the endpoint starts");

    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    if (system(cmd) != 0)
        printf("could not remove %s\n", root);
    return TEST_EXIT();
}
