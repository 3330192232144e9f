/*
 * datamem_service.h: the services around the engine — stats rendering, the
 * stats endpoint and its page, the node_exporter textfile, the policy file
 * watcher. They use only the engine's public header (runtime/datamem.h) and
 * learn about installs and forks through dm_runtime_observe; linking this
 * library registers them (a constructor), so a program that links only the
 * engine gets none of their threads or files.
 *
 * Thread safety: every function may be called from any thread.
 */
#ifndef DATAMEM_SERVICE_H
#define DATAMEM_SERVICE_H

#include "runtime/datamem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- stats export (metrics.c, render.c, export.c, http.c, textfile.c) ------ */

/* DM_STATS_JSON: /stats.json, its "tags" the DM_STATS_JSON_TAGS biggest plus
 * "(other)"; DM_STATS_JSON_ALL: the same with every tag (datamem.stats(), in
 * the process). */
enum { DM_STATS_PROMETHEUS = 0, DM_STATS_JSON = 1, DM_STATS_JSON_ALL = 2 };
#define DM_STATS_JSON_TAGS 50

/* Renders `s` as Prometheus text exposition 0.0.4 or as JSON (the keys of
 * datamem.stats(), which is this JSON) into a malloc'ed, NUL-terminated
 * buffer: free(*out). */
DM_API int dm_stats_render(const dm_stats_t *s, int format, char **out, size_t *len);
/* A fresh snapshot, with hugepage bytes, rendered. */
DM_API int dm_stats_render_current(int format, char **out, size_t *len);
/* Fills arenas[].hugepage_bytes from /proc/self/smaps (AnonHugePages in each
 * arena's address ranges). The walk costs more as the process maps more, so
 * results are reused for up to DM_HUGEPAGE_MAX_AGE_MS. */
#define DM_HUGEPAGE_MAX_AGE_MS 2000
DM_API int dm_stats_hugepages(dm_stats_t *s);

/* Serves /metrics and /stats.json from a C thread. `http` is "host:port" (port 0:
 * any free port), `unix_socket` a path ("{pid}" is replaced by the pid); NULL
 * leaves the policy's `stats:` setting in force, "" turns it off. The policy's
 * settings apply on every install; these override them. A failure to listen is
 * logged and returned; nothing else changes. */
DM_API int dm_stats_serve(const char *http, const char *unix_socket);
/* The endpoint's URL ("http://127.0.0.1:PORT/metrics") and Unix socket path,
 * "" when not serving. */
DM_API void dm_stats_endpoint(char *url, size_t url_cap, char *unix_path, size_t unix_cap);
/* Writes the Prometheus text to `path` atomically (a temporary file created
 * with O_EXCL under an unpredictable name, then rename, both relative to the
 * directory's descriptor). The directory must be this user's and writable by
 * no one else (DM_EUNSAFE otherwise, logged in one line); DM_ESYS when it
 * cannot be written. */
DM_API int dm_stats_textfile_write(const char *path);
/* Removes the textfiles of dead processes for a template with "{pid}" in its
 * file name: files whose pid does not exist here, owned by this user and not
 * modified for `min_age_ms`, in a directory that passes the same rule. Returns
 * how many were removed, DM_ERANGE for a bad template, or DM_EUNSAFE /
 * DM_ESYS for the directory (logged). */
DM_API int dm_stats_textfile_sweep(const char *tmpl, int64_t min_age_ms);
/* Stops serving: a last textfile write, the discovery file and Unix socket
 * removed. Also runs at exit (atexit) in the process that started serving. */
DM_API void dm_stats_export_stop(void);

/* Reloads done by the file watcher, and file events skipped because the
 * content hash had not changed. */
DM_API void dm_watch_counts(uint64_t *reloads, uint64_t *skipped);
/* Whether policy warnings `text` (dm_diags_format_all's) are to be reported:
 * true when they differ from the set this process reported last, which they
 * then become. The watcher and datamem.install/reload report a set once, not on
 * every reload (2000 reloads printed 6003 lines); "" (a load without
 * warnings) forgets the last set, so warnings that come back are reported. */
DM_API bool dm_watch_warnings_changed(const char *text);

/* The Python threads that do not allocate through datamem, as the Python layer
 * last counted them (at install, when a threading thread starts or ends, on
 * datamem.stats()): datamem_threads_not_covered and /stats.json's
 * "threads_not_covered" (names, cut at 1 KiB; the count stays exact). */
DM_API void dm_stats_set_threads_not_covered(const char *const *names, int n);

/* The process around the arenas (process.c; docs/what-a-policy-governs.md). */
typedef struct dm_process_stats {
    uint64_t resident;          /* the process's resident set (/proc/self/statm); 0: unreadable */
    uint64_t arenas_resident;   /* every arena's resident_bytes, summed */
    uint64_t outside_arenas;    /* resident - arenas_resident, at least 0 */
    int64_t pyarrow_allocated;  /* pyarrow's default pool as the Python layer last set it;
                                   -1: pyarrow not loaded */
} dm_process_stats_t;
/* Fills `out` for snapshot `s` (after dm_stats_hugepages, which raises an
 * arena's resident to its THP-backed bytes). DM_ESYS when /proc cannot be read
 * (resident and outside_arenas are 0 then). Cheap: one pread. */
DM_API int dm_stats_process(const dm_stats_t *s, dm_process_stats_t *out);
/* pyarrow.total_allocated_bytes(), from the Python layer (the exporter's
 * threads never call Python); negative: pyarrow is not loaded. */
DM_API void dm_stats_set_pyarrow_bytes(int64_t bytes);

#ifdef __cplusplus
}
#endif
#endif /* DATAMEM_SERVICE_H */
