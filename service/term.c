/*
 * term.c: the services' one SIGTERM handler (term.h says what it does).
 *
 * Thread safety: `mu` serialises registration and the install (fork takes
 * it, so a child never starts with it held); `fns` slots are atomics, set
 * once (release) and read by the handler in whichever thread the signal lands
 * on; `prev` is written once, before the install.
 */
#include "service/term.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "runtime/datamem.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(dm__term_fn) fns[DM_TERM_FNS];
static struct sigaction prev; /* what SIGTERM did before ours */
static bool installed;        /* under mu */

static bool prev_is_default(void) {
    return !(prev.sa_flags & SA_SIGINFO) && prev.sa_handler == SIG_DFL;
}

static void on_sigterm(int sig, siginfo_t *si, void *uc) {
    int saved = errno;
    bool dies = prev_is_default();
    for (int i = 0; i < DM_TERM_FNS; i++) {
        dm__term_fn fn = atomic_load_explicit(&fns[i], memory_order_acquire);
        if (fn)
            fn(dies);
    }
    if (prev.sa_flags & SA_SIGINFO) {
        if (prev.sa_sigaction)
            prev.sa_sigaction(sig, si, uc);
    } else if (!dies) {
        if (prev.sa_handler != SIG_IGN)
            prev.sa_handler(sig);
    } else {
        /* The default action, as if no handler had been installed. The signal
         * is blocked while its handler runs: it is delivered at the unblock. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        raise(sig);
        sigset_t s;
        sigemptyset(&s);
        sigaddset(&s, sig);
        pthread_sigmask(SIG_UNBLOCK, &s, NULL);
    }
    errno = saved;
}

/* Called with mu held. */
static int install(void) {
    struct sigaction now, ours;
    if (sigaction(SIGTERM, NULL, &now) != 0 ||
        (!(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN))
        return DM_ESYS; /* ignored: nothing ends the process here */
    memset(&ours, 0, sizeof(ours));
    ours.sa_sigaction = on_sigterm;
    ours.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    prev = now;
    if (sigaction(SIGTERM, &ours, NULL) != 0)
        return DM_ESYS;
    installed = true;
    return 0;
}

static void atfork_prepare(void) { pthread_mutex_lock(&mu); }
static void atfork_after(void) { pthread_mutex_unlock(&mu); }
static void atfork_register(void) { pthread_atfork(atfork_prepare, atfork_after, atfork_after); }

int dm__term_on(dm__term_fn fn) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    int rc = 0, free_slot = -1;
    pthread_once(&once, atfork_register);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < DM_TERM_FNS; i++) {
        dm__term_fn f = atomic_load_explicit(&fns[i], memory_order_relaxed);
        if (f == fn)
            goto out; /* registered before */
        if (!f && free_slot < 0)
            free_slot = i;
    }
    if (free_slot < 0) {
        rc = DM_ERANGE;
        goto out;
    }
    if (!installed && (rc = install()) != 0)
        goto out;
    atomic_store_explicit(&fns[free_slot], fn, memory_order_release);
out:
    pthread_mutex_unlock(&mu);
    return rc;
}
