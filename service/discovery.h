/*
 * discovery.h: this process's discovery file (discovery.c), <pid>.json in the
 * stats directory, naming its endpoints so `python -m datamem ls` lists the
 * processes of a job; the files of dead processes pruned. Internal: never
 * installed.
 *
 * Thread safety: none of its own; the caller serialises (export.c's lock).
 */
#ifndef DM_SERVICE_DISCOVERY_H
#define DM_SERVICE_DISCOVERY_H

#include <stddef.h>

/* The stats directory: $DATAMEM_STATS_DIR if set and not empty, otherwise
 * /tmp/datamem-<uid>. python/datamem/_stats/discovery.py's stats_dir() is the
 * same rule (tests/python/stats/test_stats_export.py pins the two equal). */
const char *dm__discovery_dir(char *buf, size_t cap);
/* Writes (or rewrites) the file for endpoints `url` and `unix_path` (NULL:
 * none), the process having served since `started` (Unix time). The first
 * write of a process resolves the directory (made 0700 if missing) and prunes
 * the files of dead processes; a directory that is not safe is logged and the
 * process is not listed. */
void dm__discovery_write(const char *url, const char *unix_path, double started);
/* Removes this process's file, if it wrote one. */
void dm__discovery_remove(void);
/* Fork child: the parent's file is the parent's. */
void dm__discovery_forget_in_child(void);
/* Our discovery file's path, "" when none (under export.c's mu). */
const char *dm__discovery_path(void);

#endif /* DM_SERVICE_DISCOVERY_H */
