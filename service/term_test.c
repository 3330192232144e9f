/* term_test: the services' one SIGTERM handler (service/term.h). Signal
 * dispositions belong to the process, so each case runs in a fork child and
 * reports through a pipe what the registered functions saw. */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "runtime/datamem.h"
#include "service/term.h"
#include "testing/test.h"

static int out_fd = -1;

/* Function `c` writes its letter: lower case when the process dies of the
 * signal after it, upper case when a program's handler comes next. */
#define LETTER_FN(c)                                                           \
    static void fn_##c(bool dies) {                                            \
        char b = dies ? #c[0] : (char)(#c[0] - 'a' + 'A');                     \
        (void)!write(out_fd, &b, 1);                                           \
    }
LETTER_FN(a)
LETTER_FN(b)
LETTER_FN(c)
LETTER_FN(d)
LETTER_FN(e)

static void program_handler(int sig) {
    (void)sig;
    (void)!write(out_fd, "P", 1);
    _exit(7);
}

/* Runs `child` in a fork child writing to a pipe; returns its wait status and
 * what it wrote, in `got`. */
static int in_child(void (*child)(void), char *got, size_t cap) {
    int p[2];
    if (pipe(p) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        out_fd = p[1];
        child();
        _exit(99); /* the signal did not end it */
    }
    close(p[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(p[0], got + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    got[n] = 0;
    close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return st;
}

static void full_table_then_sigterm(void) {
    if (dm__term_on(fn_a) || dm__term_on(fn_b) || dm__term_on(fn_c) || dm__term_on(fn_d))
        _exit(10);
    /* full: 100x its size in refusals, each the same, the table unchanged */
    for (int i = 0; i < 100 * DM_TERM_FNS; i++)
        if (dm__term_on(fn_e) != DM_ERANGE)
            _exit(11);
    if (dm__term_on(fn_b) != 0) /* registered already: still fine, once */
        _exit(12);
    kill(getpid(), SIGTERM);
}

static void after_a_program_handler(void) {
    signal(SIGTERM, program_handler);
    if (dm__term_on(fn_a))
        _exit(10);
    kill(getpid(), SIGTERM);
}

static void ignored(void) {
    signal(SIGTERM, SIG_IGN);
    if (dm__term_on(fn_a) != DM_ESYS)
        _exit(10);
    struct sigaction now;
    sigaction(SIGTERM, NULL, &now);
    if (now.sa_handler != SIG_IGN) /* left as the program set it */
        _exit(11);
    kill(getpid(), SIGTERM); /* ignored: returns */
    _exit(0);
}

static void grandchild_raise(void) { kill(getpid(), SIGTERM); }

static void inherited_by_a_fork_child(void) {
    if (dm__term_on(fn_a))
        _exit(10);
    char got[16];
    int st = in_child(grandchild_raise, got, sizeof(got)); /* its own pipe: copy it over */
    if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGTERM || strcmp(got, "a") != 0)
        _exit(11);
    (void)!write(out_fd, "k", 1);
    _exit(0);
}

int main(void) {
    char got[64];
    int st = in_child(full_table_then_sigterm, got, sizeof(got));
    EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "dies of SIGTERM, as by default");
    EXPECT_STR_EQ(got, "abcd", "each registered function ran once, knowing the process dies");

    st = in_child(after_a_program_handler, got, sizeof(got));
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 7, "the program's handler ran after ours");
    EXPECT_STR_EQ(got, "AP", "the function ran first, told that the process may live on");

    st = in_child(ignored, got, sizeof(got));
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0, "SIG_IGN: refused, left ignored");
    EXPECT_STR_EQ(got, "", "nothing ran");

    st = in_child(inherited_by_a_fork_child, got, sizeof(got));
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0, "a fork child's SIGTERM runs them too");
    EXPECT_STR_EQ(got, "k", "the grandchild wrote 'a' to its own pipe");
    return TEST_EXIT();
}
