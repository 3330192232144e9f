/*
 * term.h: one SIGTERM handler for the services that must act before the
 * process dies of it (export.c removes its socket, discovery file and "{pid}"
 * textfile; profile.c flushes the profile). Internal: never installed.
 *
 * SIGTERM's default action skips atexit. The first dm__term_on() installs the
 * handler over whatever SIGTERM did then (the default action or a program's
 * handler; never over SIG_IGN: nothing ends the process there). The handler
 * runs every registered function, then hands the signal on: to the previous
 * handler, or, for the default action, restores it and raises the signal
 * again, so the process dies by SIGTERM as before (same wait status). A
 * Python handler set later (signal.signal) replaces it; that exit runs atexit.
 *
 * Thread safety: dm__term_on may be called from any thread; the functions it
 * registers run in the signal handler and may call async-signal-safe
 * functions only. Fork children inherit the handler and the functions; each
 * function decides what applies to a child (export.c checks the pid).
 */
#ifndef DM_SERVICE_TERM_H
#define DM_SERVICE_TERM_H

#include <stdbool.h>

/* `dies`: the process dies of this signal when the function returns (the
 * action after it is the default one); false where a program's handler
 * comes next and may keep the process running. */
typedef void (*dm__term_fn)(bool dies);

#define DM_TERM_FNS 4 /* export.c and profile.c register one each */

/* Registers `fn` to run at SIGTERM, once however often it is called, and
 * installs the handler the first time. Returns 0; DM_ESYS when SIGTERM is
 * ignored (nothing would run) or the handler cannot be installed; DM_ERANGE
 * when DM_TERM_FNS functions are registered already. */
int dm__term_on(dm__term_fn fn);

#endif
