/*
 * ext.h: what the files of the CPython extension `datamem._ext` share (internal,
 * never installed). pyext/ is the only code that includes Python.h or NumPy
 * headers, and every pyext/ file includes this header first (Python.h must come
 * before any system header).
 *
 *   handler.c  the NEP 49 handlers, dtype discovery, the capsule per tag set
 *   site.c     the call-site cache: call-site rule masks and profile frames
 *   record.c   the recording handlers and the allocation profile's sampler
 *   load.c     load, check, explain: policy files from Python; PolicyError; after
 *              every install, the main thread's settings (reload.signal)
 *   shadow.c   arrays shown to a profiler that hooks this library's malloc (memray)
 *   stats.c    stats() and the stats export wrappers
 *   module.c   the module: its init, constants and small runtime wrappers
 *
 * NumPy's C API is one table of pointers per extension: module.c imports it
 * (import_array, in PyInit__ext) and defines it under PY_ARRAY_UNIQUE_SYMBOL;
 * every other file refers to that one table (NO_IMPORT_ARRAY).
 *
 * Thread rules: the handler functions (handler.c's h_*, record.c's
 * dm__record_*) run with or without an attached thread state (NumPy calls
 * realloc without the GIL) and never call into Python without one; everything
 * else runs attached. On a free-threaded CPython (Py_GIL_DISABLED) "attached"
 * no longer means "alone": every piece of shared state here has its own guard,
 * named where it is declared and in docs/design.md's concurrency table. The
 * module declares Py_MOD_GIL_NOT_USED.
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

/* A mutex for the extension's shared state, held only around plain C (never
 * while calling Python, so it cannot deadlock against the GIL or a
 * stop-the-world pause). PyMutex on a free-threaded build (it detaches the
 * thread state while it waits); a pthread mutex on a GIL build (PyMutex is
 * 3.13+). Fork: dm_pymu_reset in the child (record.c's fork handler). */
#ifdef Py_GIL_DISABLED
typedef PyMutex dm_pymu_t;
#define DM_PYMU_INIT {0}
static inline void dm_pymu_lock(dm_pymu_t *m) { PyMutex_Lock(m); }
static inline void dm_pymu_unlock(dm_pymu_t *m) { PyMutex_Unlock(m); }
static inline void dm_pymu_reset(dm_pymu_t *m) { *m = (PyMutex){0}; }
#else
#include <pthread.h>
typedef pthread_mutex_t dm_pymu_t;
#define DM_PYMU_INIT PTHREAD_MUTEX_INITIALIZER
static inline void dm_pymu_lock(dm_pymu_t *m) { pthread_mutex_lock(m); }
static inline void dm_pymu_unlock(dm_pymu_t *m) { pthread_mutex_unlock(m); }
static inline void dm_pymu_reset(dm_pymu_t *m) { pthread_mutex_init(m, NULL); }
#endif

/* PyDict_GetItemRef (3.13+): a strong reference, so that another thread
 * changing the dict cannot free the value under the caller. 1 found, 0 not,
 * -1 with an exception set. */
#if PY_VERSION_HEX < 0x030D0000
static inline int dm_dict_get_item_ref(PyObject *d, PyObject *k, PyObject **out) {
    PyObject *v = PyDict_GetItemWithError(d, k);
    *out = Py_XNewRef(v);
    return v ? 1 : PyErr_Occurred() ? -1 : 0;
}
#define PyDict_GetItemRef dm_dict_get_item_ref
#endif

/* A caller's sequence as a tuple of its own: a list another thread resizes
 * meanwhile is copied whole (PyList_AsTuple takes the list's lock on a
 * free-threaded build), so items stay owned while they are used. A tuple is
 * returned as is. TypeError `msg` for anything that is not iterable. */
static inline PyObject *dm_seq_tuple(PyObject *o, const char *msg) {
    if (PyTuple_CheckExact(o))
        return Py_NewRef(o);
    if (PyList_CheckExact(o))
        return PyList_AsTuple(o);
    PyObject *it = PyObject_GetIter(o);
    if (!it) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            PyErr_SetString(PyExc_TypeError, msg);
        return NULL;
    }
    PyObject *t = PySequence_Tuple(it);
    Py_DECREF(it);
    return t;
}

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
void dm__handler_init(void);                 /* at import: the capsule name, install hook */
int dm__handler_probe_dtype(size_t size);    /* the array being built's dtype, one use */
void dm__handler_dtype_hooks_enable(void);   /* any thread; for good once on */
void dm__handler_record_all(void);           /* any thread: every handler records from now on */
void dm__handler_shadow_all(void);           /* any thread: every handler mirrors arrays (shadow.c) */
void dm__handler_after_fork_child(void);     /* the hooks' mutex, in a fork child */
void *dm__handler_alloc_site(void *ctx, size_t size, int dt, int zero); /* by call site too */
extern PyMethodDef dm__handler_methods[];

/* ---- shadow.c: arrays shown to a profiler that hooks this library's malloc ---- */
extern uintptr_t dm__shadow_resolved_malloc; /* malloc as the dynamic linker resolved it */
void dm__shadow_init(void);                  /* at import, before any handler exists */
/* malloc's address in this library's GOT, where a hooking profiler writes its own. */
static inline uintptr_t dm__shadow_got_malloc(void) { return (uintptr_t)&malloc; }
/* Non-zero while a profiler hooks this library's malloc (memray): one load and a compare. */
static inline uintptr_t dm__shadow_hooked(void) {
    return dm__shadow_got_malloc() ^ dm__shadow_resolved_malloc;
}
void dm__shadow_add(void *array, size_t n);  /* a shadow of n bytes for a new array */
void dm__shadow_keep(void *array, void *shadow); /* puts back what dm__shadow_take took */
void *dm__shadow_take(void *array);          /* its shadow, out of the table (NULL if none) */
void dm__shadow_drop(void *array);           /* frees its shadow, if any */
size_t dm__shadow_live(void);                /* shadows in the table */
void dm__shadow_after_fork_child(void);      /* the table's mutex, in a fork child */

/* ---- site.c ---- */
int dm__site_init(void);                     /* at import: 0, or -1 with an exception set */
uint64_t dm__site_mask_now(uint64_t *gen);   /* the call site's rule mask; 0 when detached */
int dm__site_capture(dm_prof_frame_t *out, int max, bool stacks, int *site); /* attached;
                                                 frames valid until dm__site_capture_done */
void dm__site_capture_done(void);            /* once after each dm__site_capture */
void dm__site_after_fork_child(void);        /* the cache's mutex and walks, in a fork child */

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
void dm__load_on_install(void);              /* any thread: main-thread settings follow */
extern PyMethodDef dm__load_methods[];

/* ---- stats.c ---- */
extern PyMethodDef dm__stats_methods[];

#endif
