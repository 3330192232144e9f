/*
 * sock.h: the stats endpoint's Unix socket file (sock.c): bound with its mode
 * set and its directory checked, removed only while it is still the one this
 * process bound. Internal: never installed.
 *
 * Thread safety: none needed (no state).
 */
#ifndef DM_SERVICE_SOCK_H
#define DM_SERVICE_SOCK_H

#include <sys/types.h>

/* A Unix stream socket listening (`backlog`) (close-on-exec, non-blocking) at `path`,
 * mode 0600, replacing a stale socket of this user's (nobody accepts on it)
 * but never a live one or anything else. *dev / *ino identify the socket file
 * for dm__sock_remove. -1 when it cannot, with one line logged. */
int dm__sock_listen(const char *path, int backlog, dev_t *dev, ino_t *ino);

/* Removes `path` if it is still the socket file dm__sock_listen made
 * (same device and inode), relative to its checked directory. */
void dm__sock_remove(const char *path, dev_t dev, ino_t ino);

#endif /* DM_SERVICE_SOCK_H */
