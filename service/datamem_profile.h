/*
 * datamem_profile.h: the allocation profile writer.
 *
 * The NEP 49 recording handler (pyext/) decides what to record — every
 * allocation (full mode) or a byte-sampled subset — and captures the Python
 * call site; this writer owns everything else: interning strings, call sites
 * and stacks, the set of sampled blocks still live (so that their frees are
 * recorded and nothing else is), a 1 MiB record buffer flushed with plain
 * write(2) when full, at exit, on SIGTERM (where it has its default action:
 * the handler flushes, then dies of the signal) and every second by a flusher
 * thread, so a killed process loses at most its last second; and one file per
 * process, DIR/<pid>.dmprof (a forked child opens its own). It never allocates
 * through NumPy (libc only) and never calls Python.
 *
 * File format (little-endian, see python/datamem/_profile/recording.py, the reader):
 *   "DMPROF1\n", then records, each a type byte and fixed fields:
 *   'H' u32 len, JSON text     process metadata (pid, ppid, mode, clock origin)
 *   'S' u32 id, u32 len, bytes  a string
 *   'C' u32 id, u32 module, u32 function, u32 file, u32 line   a call site
 *   'K' u32 id, u32 n, n x u32 site   a stack, innermost frame first
 *   'A' u64 t_ns, u64 ptr, u64 size, f64 weight, u32 thread, u32 tags,
 *       u32 rule, u32 arena, u32 site, u32 stack, u8 dtype, u8 flags
 *   'F' u64 t_ns, u64 ptr       the block at ptr was freed (or reallocated)
 *   'P' u64 t_ns, u64 max_rss_bytes, u64 samples   written at every flush
 *   'X' u64 t_ns                the interpreter began to exit: frees after this
 *                               are of arrays that lived to the end
 *   'T' u64 t_ns, u64 limit_bytes, u64 records
 *                               the file reached its size limit at t_ns, after
 *                               `records` allocation records: nothing of this
 *                               process after t_ns is in it (a 'P' follows, then
 *                               the file ends)
 * Ids start at 1; 0 means unknown. Times are CLOCK_MONOTONIC nanoseconds, so
 * files of processes on one machine share a time axis.
 *
 * Thread safety: every function may be called from any thread, with or
 * without the GIL; records are appended under one mutex, so the file's order
 * is a valid order of the process's allocations and frees.
 */
#ifndef DATAMEM_PROFILE_H
#define DATAMEM_PROFILE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runtime/datamem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DM_PROF_FULL 1u   /* every allocation and free (else sampled) */
#define DM_PROF_STACKS 2u /* record each allocation's whole Python stack */

#define DM_PROF_FRAMES_MAX 64 /* deepest stack recorded */

/* A profile file's size limit (per process). 256 MiB holds about 3.5 million
 * allocations with their frees in full mode (59 + 17 bytes each): a few
 * seconds of a loop making small arrays (25M of them wrote 1.9 GB in 20 s);
 * a sampled profile (512 KiB) reaches it only after some 1.8 TB allocated.
 * It bounds the disk a profiled job can fill (this much per process) and what
 * `report` must read. */
#define DM_PROF_MAX_BYTES_DEFAULT ((uint64_t)256 << 20)
#define DM_PROF_MAX_BYTES_MIN ((uint64_t)1 << 20) /* smaller limits are raised to this */

/* Record flags ('A' records). */
enum { DM_PROF_CALLOC = 1, DM_PROF_REALLOC = 2, DM_PROF_NOGIL = 4 };

/* One Python frame. `key` names (module, function, file): equal keys, equal
 * names, for the process (the recorder uses its per-code-object cache entry's
 * serial number, never reused); the strings are valid for the call. */
typedef struct dm_prof_frame {
    const void *key;
    uint32_t line;
    const char *module, *function, *file;
} dm_prof_frame_t;

typedef struct dm_prof_alloc {
    uint64_t t_ns;                /* dm_prof_now() */
    const void *ptr;
    uint64_t size;
    double weight;                /* allocations this sample stands for (1 in full mode) */
    const char *thread, *tags, *rule, *arena; /* NULL: unknown */
    const dm_prof_frame_t *frames; /* innermost first; NULL when nframes == 0 */
    int nframes;
    int site;                     /* index in frames of the call site; -1 = unknown */
    uint8_t dtype;                /* dm_dtype_t */
    uint8_t flags;                /* DM_PROF_CALLOC | DM_PROF_REALLOC | DM_PROF_NOGIL */
} dm_prof_alloc_t;

/* Starts recording into DIR/<pid>.dmprof (created with O_EXCL|O_NOFOLLOW;
 * DIR/<pid>-<n>.dmprof when that name is taken). DIR is created (0755) if
 * missing; an existing DIR must be a directory owned by this user (euid) and
 * not writable by group or others. Each process's file stops at `max_bytes`
 * (0: DM_PROF_MAX_BYTES_DEFAULT; at least DM_PROF_MAX_BYTES_MIN). `meta_json`
 * is the members of a JSON object (the text between its braces), copied into
 * the file's 'H' record (argv, policy...).
 * Returns 0, DM_ESTATE when already recording, DM_EUNSAFE when DIR is refused
 * (logged: a symbolic link, another user's, writable by others), DM_EIO when
 * DIR cannot be created or the file created (logged), or DM_ENOMEM. */
DM_API int dm_prof_start(const char *dir, uint64_t sample_bytes, unsigned flags,
                         uint64_t max_bytes, const char *meta_json);
/* Marks the start of interpreter exit ('X'), for the reader's "live at exit". */
DM_API void dm_prof_mark_exit(void);
/* Writes what is buffered; the file stays open. */
DM_API void dm_prof_flush(void);
/* Flushes and closes (also registered with atexit by dm_prof_start). */
DM_API void dm_prof_stop(void);
DM_API bool dm_prof_active(void);
/* The file being written ("" when not recording). */
DM_API void dm_prof_path(char *out, size_t cap);
/* Samples recorded and bytes written so far by this process. */
DM_API void dm_prof_counts(uint64_t *samples, uint64_t *bytes);

DM_API uint64_t dm_prof_now(void);
DM_API void dm_prof_record_alloc(const dm_prof_alloc_t *a);
/* A block is released (before it really is, so that no other thread can be
 * handed the address first). In sampled mode only blocks recorded by
 * dm_prof_record_alloc are written. */
DM_API void dm_prof_record_free(const void *p, uint64_t t_ns);

/* Sampled mode: a counting filter over the addresses of live sampled blocks;
 * zero means `p` is certainly not one (one relaxed load on every free). */
#define DM_PROF_FILTER_BITS 16
extern _Atomic uint32_t dm__profile_filter[1u << DM_PROF_FILTER_BITS];
static inline uint32_t dm__prof_filter_index(const void *p) {
    return (uint32_t)(((uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull) >>
                      (64 - DM_PROF_FILTER_BITS));
}
static inline bool dm_prof_maybe_live(const void *p) {
    return atomic_load_explicit(&dm__profile_filter[dm__prof_filter_index(p)],
                                memory_order_relaxed) != 0;
}

#ifdef __cplusplus
}
#endif
#endif /* DATAMEM_PROFILE_H */
