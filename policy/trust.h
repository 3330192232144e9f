/*
 * trust.h: the one rule for the paths datamem reads its policy from and
 * writes into (trust.c). Internal: used by policy.c (the policy file) and
 * service/files.c (the directories the services write into); never installed.
 *
 * Thread safety: none needed (no state).
 */
#ifndef DM_POLICY_TRUST_H
#define DM_POLICY_TRUST_H

#include <stddef.h>
#include <sys/types.h>

typedef enum {
    DM__TRUST_FILE,       /* a policy to read: a regular file, links followed */
    DM__TRUST_DIR,        /* a directory to write into, its last name no link */
    DM__TRUST_DIR_CREATE, /* the same, made (with `mode`) when absent */
} dm__trust_want_t;

/* Resolves `path` one name at a time on descriptors, checking every directory
 * before looking a name up in it (trust.c says the rule), and opens what it
 * names: a file O_RDONLY (blocking reads), a directory O_RDONLY|O_DIRECTORY,
 * both close-on-exec. Returns the descriptor, or with one line in `why`:
 *  - DM_EUNSAFE: the rule refuses it; why = "PATH: what is wrong", PATH the
 *    offending directory, link or file as resolved;
 *  - DM_EINVALID: not the kind wanted; why = the file's kind ("a FIFO") for
 *    DM__TRUST_FILE, "PATH: not a directory" for the others;
 *  - DM_EIO: absent or a system call failed (errno says which); why =
 *    "PATH: strerror". */
int dm__trust_open(const char *path, dm__trust_want_t want, mode_t mode, char *why, size_t cap);

#endif /* DM_POLICY_TRUST_H */
