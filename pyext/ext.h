/*
 * ext.h: what the files of the CPython extension `datamem._ext` share (internal,
 * never installed). pyext/ is the only code that includes Python.h or NumPy
 * headers, and every pyext/ file includes this header first (Python.h must come
 * before any system header).
 *
 *   handler.c  the NEP 49 handlers, dtype discovery, the capsule per tag set
 *   site.c     the call-site cache: call-site rule masks and profile frames
 *   record.c   the recording handlers and the allocation profile's sampler
 *   load.c     load, check, explain: policy files from Python; PolicyError
 *   stats.c    stats() and the stats export wrappers
 *   module.c   the module: its init, constants and small runtime wrappers
 *
 * NumPy's C API is one table of pointers per extension: module.c imports it
 * (import_array, in PyInit__ext) and defines it under PY_ARRAY_UNIQUE_SYMBOL;
 * every other file refers to that one table (NO_IMPORT_ARRAY).
 *
 * Thread rules: the handler functions (handler.c's h_*, record.c's
 * dm__record_*) run with or without the GIL (NumPy calls realloc without it)
 * and never call into Python without it; everything else runs with the GIL.
 */
#ifndef DM_PYEXT_EXT_H
#define DM_PYEXT_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL dm__module_numpy_api
#ifndef DM_PYEXT_IMPORT_ARRAY /* defined by module.c alone */
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "service/datamem_profile.h" /* dm_prof_frame_t */

#define HANDLER_NAME "datamem"

/* Paths are bytes: a path argument is str, bytes or os.PathLike, encoded as
 * the file system does ("O&" with PyUnicode_FSConverter: a str from
 * os.environ or sys.argv gives back the very bytes it came from, undecodable
 * ones included) and held as a bytes object the caller releases. Text that
 * carries a path back (diagnostics) is decoded with undecodable bytes shown
 * as \xNN; a path handed back as a path round-trips (os.fsdecode).
 * fs_path_or_none is PyUnicode_FSConverter that also takes None (-> NULL). */
static inline int fs_path_or_none(PyObject *o, void *out) {
    if (o == Py_None) {
        *(PyObject **)out = NULL;
        return 1;
    }
    return PyUnicode_FSConverter(o, out);
}

/* ---- handler.c ---- */
void dm__handler_init(void);                 /* at import: the capsule name */
int dm__handler_probe_dtype(size_t size);    /* the array being built's dtype, one use */
void dm__handler_dtype_hooks_enable(void);   /* GIL held; for good once on */
void dm__handler_record_all(void);           /* GIL held: every handler records from now on */
extern PyMethodDef dm__handler_methods[];

/* ---- site.c ---- */
int dm__site_init(void);                     /* 0, or -1 with an exception set */
uint64_t dm__site_mask_now(uint64_t *gen);   /* the call site's rule mask; 0 without the GIL */
int dm__site_capture(dm_prof_frame_t *out, int max, bool stacks, int *site); /* GIL held;
                                                 frames valid until the next walk */

/* ---- record.c ---- */
void *dm__record_malloc(void *ctx, size_t size);
void *dm__record_calloc(void *ctx, size_t nelem, size_t elsize);
void *dm__record_realloc(void *ctx, void *ptr, size_t size);
void dm__record_free(void *ctx, void *ptr, size_t size);
void dm__record_init(void);                  /* at import: the sampler's fork handler */
void dm__record_set_thread_name(const char *name); /* this thread's, for its records */
extern PyMethodDef dm__record_methods[];

/* ---- load.c ---- */
int dm__load_init(PyObject *module);         /* adds PolicyError; 0 or -1 */
extern PyMethodDef dm__load_methods[];

/* ---- stats.c ---- */
extern PyMethodDef dm__stats_methods[];

#endif
