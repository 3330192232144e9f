/*
 * site.c: the Python call site of an allocation, for call-site rules and for
 * allocation profiles. The call site is the innermost frame outside
 * internal_packages (numpy, pandas, scipy, sklearn, datamem:
 * docs/find-your-policy.md); what is known of a frame's code object (module,
 * function, file, whether it is internal, its call-site rule mask) is cached
 * per code object, up to CODE_MAX entries.
 *
 * Everything here runs with an attached thread state (the GIL held, on a GIL
 * build), since making an entry calls Python (frame objects, code
 * attributes). Without one (NumPy's realloc in fromfile/fromstring, or any
 * call from a C thread) the site is unknown: dm__site_mask_now returns 0 and
 * touches no Python. Many threads may look up at once (free-threaded
 * CPython): lookups take no lock, insertions take code_mu (see below).
 */
#include "pyext/ext.h"
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* 3.10: PyFrame_GetBack and the frame's fields */
#endif

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "runtime/datamem.h"

static PyObject *name_key; /* "__name__", interned: made at import, immutable after */

/* The call-site cache keys on this (made once, at import, before the module
 * and so any other thread can reach this file). */
int dm__site_init(void) {
    if (!name_key && !(name_key = PyUnicode_InternFromString("__name__")))
        return -1;
    return 0;
}

/* ---- the call-site cache -------------------------------------------------------
 * One entry per code object, made on first sight and kept together with a
 * reference to the code object (so its address is never reused by another
 * while the entry lives). The module is the frame's globals' __name__ when
 * the entry is made (code run with other globals, as by exec, keeps the first
 * one). Entries are named to the profile by a serial number, never reused,
 * not by address.
 *
 * Threads: an open-addressing table of atomic slots, published whole with a
 * release store. A lookup (acquire loads, no lock) walks the table it loaded;
 * an entry is filled in before its slot is stored (release), and its names
 * never change. A miss makes the entry outside any lock (that calls Python),
 * then inserts it under code_mu after looking again (another thread may have
 * inserted the same code object meanwhile: the loser's entry is freed). The
 * table grows under code_mu into a new array; the old one is kept while the
 * table lives, since a reader may still be walking it (the arrays retired are,
 * all together, smaller than the one in use). The call-site rule mask and the
 * install it was computed for are a seqlock pair (site_seq).
 *
 * A process that makes code as it runs (exec, namedtuple, dataclasses,
 * code.replace) meets unboundedly many code objects: at CODE_MAX entries the
 * cache starts over. At the start of a walk, the full table is unpublished
 * (code_tab = NULL) and put on `code_dropped`; dropped tables, their entries
 * and their retired arrays are freed only when no walk is in progress in the
 * process (`walkers`, every thread's walks, nested ones included). A walk
 * counts itself before it loads the table, and the trim unpublishes before it
 * reads the count, both sequentially consistent: either the trim sees the walk,
 * or the walk sees the new table. A walk's frames (their strings are the
 * cache's) stay valid until dm__site_capture_done. */
#define CODE_MAX 4096

typedef struct code_entry {
    PyObject *code;
    uint64_t serial;                /* the profile's key for it (dm_prof_frame_t.key) */
    char *module, *function, *file; /* function: module.qualname */
    bool internal;                  /* numpy, pandas, scipy, sklearn, datamem */
    /* call-site rules matching it, for install site_gen: written by one
     * thread at a time (site_seq odd while it writes), read without a lock */
    _Atomic uint64_t site_seq, site_mask, site_gen;
} code_entry_t;

typedef struct code_table {
    struct code_table *retired;     /* the array this one replaced */
    struct code_table *dropped;     /* on code_dropped: the table dropped before it */
    size_t cap;                     /* a power of two */
    _Atomic(code_entry_t *) slot[];
} code_table_t;

static _Atomic(code_table_t *) code_tab;
static _Atomic size_t code_n;            /* written under code_mu */
static _Atomic(code_table_t *) code_dropped; /* written under code_mu */
static _Atomic size_t walkers;           /* walks in progress, every thread's */
static _Atomic uint64_t code_serial;
static dm_pymu_t code_mu = DM_PYMU_INIT; /* insertions and growth */

/* In a fork child only the forking thread is left, and it is in no walk. */
void dm__site_after_fork_child(void) {
    dm_pymu_reset(&code_mu);
    atomic_store(&walkers, 0);
}

/* Packages whose frames are not "the user's code": the call site is the
 * innermost frame outside them (docs/find-your-policy.md). */
static const char *const internal_packages[] = {"numpy", "pandas", "scipy", "sklearn",
                                                "datamem"};

static bool module_internal(const char *m) {
    for (size_t i = 0; i < sizeof(internal_packages) / sizeof(internal_packages[0]); i++) {
        size_t n = strlen(internal_packages[i]);
        if (strncmp(m, internal_packages[i], n) == 0 && (m[n] == 0 || m[n] == '.'))
            return true;
    }
    return false;
}

static char *str_of(PyObject *o, const char *dflt) {
    const char *s = o && PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    if (!s) {
        PyErr_Clear();
        s = dflt;
    }
    size_t n = strlen(s);
    char *c = PyMem_RawMalloc(n + 1);
    if (c)
        memcpy(c, s, n + 1);
    return c;
}

static size_t code_slot(PyObject *co, size_t cap) {
    return (size_t)(((uint64_t)(uintptr_t)co * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
}

static code_entry_t *code_entry_new(PyObject *co, PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *globals = PyFrame_GetGlobals(f);
#else
    PyObject *globals = Py_XNewRef(f->f_globals);
#endif
    PyObject *name = NULL; /* a strong reference: another thread may change globals */
    if (globals && PyDict_Check(globals) && PyDict_GetItemRef(globals, name_key, &name) < 0)
        PyErr_Clear();
    char *module = str_of(name, "?");
    Py_XDECREF(name);
    Py_XDECREF(globals);
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *qual = PyObject_GetAttrString(co, "co_qualname");
#else
    PyObject *qual = PyObject_GetAttrString(co, "co_name");
#endif
    PyErr_Clear();
    PyObject *file = PyObject_GetAttrString(co, "co_filename");
    PyErr_Clear();
    char *q = str_of(qual, "?");
    code_entry_t *e = PyMem_RawCalloc(1, sizeof(*e));
    if (e && module && q) {
        size_t n = strlen(module) + strlen(q) + 2;
        if ((e->function = PyMem_RawMalloc(n)))
            snprintf(e->function, n, "%s.%s", module, q);
        e->file = str_of(file, "?");
    }
    Py_XDECREF(qual);
    Py_XDECREF(file);
    PyMem_RawFree(q);
    if (!e || !module || !e->function || !e->file) {
        if (e) {
            PyMem_RawFree(e->function);
            PyMem_RawFree(e->file);
        }
        PyMem_RawFree(e);
        PyMem_RawFree(module);
        return NULL;
    }
    e->module = module;
    e->internal = module_internal(module);
    e->code = Py_NewRef(co);
    e->serial = atomic_fetch_add_explicit(&code_serial, 1, memory_order_relaxed) + 1;
    return e;
}

static void code_entry_free(code_entry_t *e) {
    Py_DECREF(e->code);
    PyMem_RawFree(e->module);
    PyMem_RawFree(e->function);
    PyMem_RawFree(e->file);
    PyMem_RawFree(e);
}

static code_entry_t *code_find(code_table_t *t, PyObject *co) {
    if (!t)
        return NULL;
    for (size_t j = code_slot(co, t->cap);; j = (j + 1) & (t->cap - 1)) {
        code_entry_t *e = atomic_load_explicit(&t->slot[j], memory_order_acquire);
        if (!e || e->code == co)
            return e;
    }
}

static void code_put(code_table_t *t, code_entry_t *e) {
    size_t j = code_slot(e->code, t->cap);
    while (atomic_load_explicit(&t->slot[j], memory_order_relaxed))
        j = (j + 1) & (t->cap - 1);
    atomic_store_explicit(&t->slot[j], e, memory_order_release);
}

/* The table with room for one more entry (under code_mu), or NULL. */
static code_table_t *code_room(void) {
    code_table_t *t = atomic_load_explicit(&code_tab, memory_order_relaxed);
    if (t && (code_n + 1) * 2 <= t->cap)
        return t;
    size_t cap = t ? t->cap * 2 : 1024;
    code_table_t *n = PyMem_RawCalloc(1, sizeof(*n) + cap * sizeof(n->slot[0]));
    if (!n)
        return NULL;
    n->cap = cap;
    n->retired = t;
    for (size_t i = 0; t && i < t->cap; i++) {
        code_entry_t *e = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
        if (e)
            code_put(n, e);
    }
    atomic_store_explicit(&code_tab, n, memory_order_release);
    return n;
}

/* Frees dropped tables: every entry of each (a table holds every entry made
 * since the one before it was dropped) and its retired arrays. Attached:
 * dropping a code object can run Python, which may allocate and walk again. */
static void code_free_dropped(code_table_t *t) {
    while (t) {
        code_table_t *next = t->dropped;
        for (size_t i = 0; i < t->cap; i++) {
            code_entry_t *e = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
            if (e)
                code_entry_free(e);
        }
        for (code_table_t *r = t; r;) {
            code_table_t *older = r->retired;
            PyMem_RawFree(r);
            r = older;
        }
        t = next;
    }
}

/* Before a walk starts: a full cache starts over, and dropped tables are
 * freed once no walk is in progress (see the cache's comment). */
static void code_cache_trim(void) {
    if (atomic_load_explicit(&code_n, memory_order_relaxed) < CODE_MAX &&
        !atomic_load_explicit(&code_dropped, memory_order_relaxed))
        return;
    code_table_t *freeing = NULL;
    dm_pymu_lock(&code_mu);
    code_table_t *t = atomic_load_explicit(&code_tab, memory_order_relaxed);
    if (t && atomic_load_explicit(&code_n, memory_order_relaxed) >= CODE_MAX) {
        t->dropped = atomic_load_explicit(&code_dropped, memory_order_relaxed);
        atomic_store_explicit(&code_dropped, t, memory_order_relaxed);
        atomic_store(&code_tab, NULL); /* seq_cst: before the count is read */
        atomic_store_explicit(&code_n, 0, memory_order_relaxed);
    }
    if (atomic_load(&walkers) == 0) {
        freeing = atomic_load_explicit(&code_dropped, memory_order_relaxed);
        atomic_store_explicit(&code_dropped, NULL, memory_order_relaxed);
    }
    dm_pymu_unlock(&code_mu);
    code_free_dropped(freeing);
}

static void walk_begin(void) {
    code_cache_trim();
    atomic_fetch_add(&walkers, 1); /* seq_cst: before the table is loaded */
}

static void walk_end(void) { atomic_fetch_sub_explicit(&walkers, 1, memory_order_release); }

void dm__site_capture_done(void) { walk_end(); }

static code_entry_t *code_lookup(PyObject *co, PyFrameObject *f) {
    code_entry_t *e = code_find(atomic_load(&code_tab), co); /* seq_cst: after walk_begin */
    if (e)
        return e;
    code_entry_t *made = code_entry_new(co, f); /* calls Python: no lock held */
    if (!made)
        return NULL;
    dm_pymu_lock(&code_mu);
    code_table_t *t = atomic_load_explicit(&code_tab, memory_order_relaxed);
    if (!(e = code_find(t, co)) && (t = code_room())) {
        code_put(t, made);
        atomic_fetch_add_explicit(&code_n, 1, memory_order_relaxed);
        e = made;
        made = NULL;
    }
    dm_pymu_unlock(&code_mu);
    if (made) /* another thread's entry won (or no memory to grow) */
        code_entry_free(made);
    return e;
}

/* The site mask of `e` for install `want`: its cached pair when that is
 * current, else computed (and cached unless another thread is caching). */
static uint64_t code_site_mask(code_entry_t *e, uint64_t want, uint64_t *gen) {
    /* The seqlock without fences: the pair is stored with release after the
     * compare-and-swap that makes site_seq odd, and loaded with acquire, so a
     * reader that sees a new value sees the odd count too, and its second
     * site_seq load cannot move above the pair's. The same cost as the fences
     * (a plain load or store on x86-64), and ThreadSanitizer, which does not
     * model fences (gcc refuses them under -fsanitize=thread), checks it
     * (scripts/tsan-ft.sh). */
    uint64_t s = atomic_load_explicit(&e->site_seq, memory_order_acquire);
    if (!(s & 1)) {
        uint64_t m = atomic_load_explicit(&e->site_mask, memory_order_acquire);
        uint64_t g = atomic_load_explicit(&e->site_gen, memory_order_acquire);
        if (atomic_load_explicit(&e->site_seq, memory_order_relaxed) == s && g == want && g) {
            *gen = g;
            return m;
        }
    }
    uint64_t m = dm_runtime_site_mask(e->module, e->function, gen);
    s = atomic_load_explicit(&e->site_seq, memory_order_relaxed);
    if (!(s & 1) && atomic_compare_exchange_strong_explicit(&e->site_seq, &s, s + 1,
                                                            memory_order_acquire,
                                                            memory_order_relaxed)) {
        atomic_store_explicit(&e->site_mask, m, memory_order_release);
        atomic_store_explicit(&e->site_gen, *gen, memory_order_release);
        atomic_store_explicit(&e->site_seq, s + 2, memory_order_release);
    }
    return m;
}

/* ---- call-site rules ---------------------------------------------------------
 * The call site is the innermost frame outside internal_packages (the same
 * frame the profile records). Its mask over the policy's site rules is cached
 * in the code object's entry with the install number it was computed for, so a
 * warm site costs a frame walk and two compares; a reload makes every entry
 * recompute once. Without an attached thread state (NumPy's realloc in fromfile/fromstring, or
 * any call from a C thread) the site is unknown: mask 0, no Python touched. */

uint64_t dm__site_mask_now(uint64_t *gen) {
    if (!PyGILState_Check())
        return 0;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    bool had_error = PyErr_Occurred() != NULL; /* an allocation may happen while one is set */
    if (had_error)
        PyErr_Fetch(&et, &ev, &tb);
    uint64_t mask = 0, want = dm_runtime_site_gen();
    walk_begin();
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f) {
        PyCodeObject *co = PyFrame_GetCode(f);
        code_entry_t *e = co ? code_lookup((PyObject *)co, f) : NULL;
        Py_XDECREF(co);
        if (e && !e->internal) {
            mask = code_site_mask(e, want, gen);
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    walk_end();
    if (had_error)
        PyErr_Restore(et, ev, tb);
    else
        PyErr_Clear();
    return mask;
}

/* ---- profile frames ----------------------------------------------------------
 * Walks this thread's Python stack (attached): frames innermost first, up to the call
 * site (the innermost frame outside internal_packages) or, with `stacks`, all
 * of them. Returns the number of frames; *site is the call site's index (the
 * innermost frame when every frame is internal), -1 when there is none. The
 * frames' strings are the cache's: valid until the caller's
 * dm__site_capture_done, which it must call once whatever this returns. */
int dm__site_capture(dm_prof_frame_t *out, int max, bool stacks, int *site) {
    walk_begin();
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    int n = 0;
    *site = -1;
    while (f && n < max) {
        PyCodeObject *co = PyFrame_GetCode(f);
        code_entry_t *e = co ? code_lookup((PyObject *)co, f) : NULL;
        Py_XDECREF(co);
        if (e) {
            int line = PyFrame_GetLineNumber(f);
            out[n] = (dm_prof_frame_t){(const void *)(uintptr_t)e->serial,
                                       line > 0 ? (uint32_t)line : 0, e->module, e->function,
                                       e->file};
            if (*site < 0 && !e->internal)
                *site = n;
            n++;
            if (*site >= 0 && !stacks)
                break;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    if (*site < 0 && n > 0)
        *site = 0;
    return n;
}

