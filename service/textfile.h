/*
 * textfile.h: the node_exporter textfile (textfile.c): the Prometheus text
 * written atomically to a path ("{pid}" in it becomes the process id, and adds
 * a pid="<pid>" label), rewritten by a thread every interval; "{pid}" files of
 * dead processes swept. Internal: never installed; dm_stats_textfile_write and
 * dm_stats_textfile_sweep are the public forms (datamem_service.h).
 *
 * Thread safety: a dm_textfile_t is started, re-armed, stopped and joined by
 * one owner (export.c, under its lock except for the join); its thread reads
 * the settings under the handle's own lock.
 */
#ifndef DM_SERVICE_TEXTFILE_H
#define DM_SERVICE_TEXTFILE_H

#include <stdbool.h>
#include <stdint.h>

typedef struct dm_textfile dm_textfile_t;

/* A thread that writes the textfile at `path` now and then every
 * `interval_ms` (10 s if 0 or less); NULL (logged) if it cannot start. */
dm_textfile_t *dm__textfile_start(const char *path, int64_t interval_ms);
/* A new period: the thread re-arms its wait with it. */
void dm__textfile_set_interval(dm_textfile_t *t, int64_t interval_ms);
/* Asks the thread to stop; it finishes what it is writing. */
void dm__textfile_signal_stop(dm_textfile_t *t);
/* After dm__textfile_signal_stop: joins the thread, then removes a "{pid}"
 * file (it is this process's alone) or, with `final_write`, writes a shared
 * one a last time; frees `t`. Never call it holding a lock the thread's
 * snapshot may wait for (export.c's retired_t). */
void dm__textfile_join(dm_textfile_t *t, bool final_write);

#endif /* DM_SERVICE_TEXTFILE_H */
