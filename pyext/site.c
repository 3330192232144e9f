/*
 * site.c: the Python call site of an allocation, for call-site rules and for
 * allocation profiles. The call site is the innermost frame outside
 * internal_packages (numpy, pandas, scipy, sklearn, datamem:
 * docs/find-your-policy.md); what is known of a frame's code object (module,
 * function, file, whether it is internal, its call-site rule mask) is cached
 * per code object, up to CODE_MAX entries.
 *
 * Everything here runs with the GIL held: the cache is guarded by it, and
 * making an entry calls Python (frame objects, code attributes). Without the
 * GIL (NumPy's realloc in fromfile/fromstring, or any call from a C thread)
 * the site is unknown: dm__site_mask_now returns 0 and touches no Python.
 */
#include "pyext/ext.h"
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* 3.10: PyFrame_GetBack and the frame's fields */
#endif

#include <stdio.h>
#include <string.h>

#include "runtime/datamem.h"

static PyObject *name_key;   /* "__name__", interned */

/* The call-site cache keys on this (made at import). */
int dm__site_init(void) {
    if (!name_key && !(name_key = PyUnicode_InternFromString("__name__")))
        return -1;
    return 0;
}

/* ---- the call-site cache -------------------------------------------------------
 * One entry per code object, made on first sight and kept together with a
 * reference to the code object (so its address is never reused by another
 * while the entry lives). Guarded by the GIL. The module is the frame's
 * globals' __name__ when the entry is made (code run with other globals, as
 * by exec, keeps the first one).
 *
 * A process that makes code as it runs (exec, namedtuple, dataclasses,
 * code.replace) meets unboundedly many code objects: at CODE_MAX entries the
 * cache starts over (every entry and its code reference dropped), at the start
 * of a walk that no other walk encloses (an allocation inside a walk walks
 * again), so no walk ever holds a dropped entry. Entries are named to the
 * profile by a serial number, never reused, not by address. */
#define CODE_MAX 4096

typedef struct code_entry {
    PyObject *code;
    uint64_t serial;                /* the profile's key for it (dm_prof_frame_t.key) */
    char *module, *function, *file; /* function: module.qualname */
    bool internal;                  /* numpy, pandas, scipy, sklearn, datamem */
    uint64_t site_mask, site_gen;   /* call-site rules matching it, for install site_gen */
} code_entry_t;

static code_entry_t **code_tab;
static size_t code_cap, code_n;
static uint64_t code_serial;
static int walking; /* walks in progress on this interpreter (nested ones included) */

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

static size_t code_slot(PyObject *co) {
    return (size_t)(((uint64_t)(uintptr_t)co * 0x9E3779B97F4A7C15ull) >> 20) & (code_cap - 1);
}

static code_entry_t *code_entry_new(PyObject *co, PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *globals = PyFrame_GetGlobals(f);
#else
    PyObject *globals = Py_XNewRef(f->f_globals);
#endif
    PyObject *name = globals && PyDict_Check(globals)
                         ? PyDict_GetItemWithError(globals, name_key) : NULL;
    PyErr_Clear();
    char *module = str_of(name, "?");
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
    e->serial = ++code_serial;
    return e;
}

/* Before a walk that no other encloses: a full cache starts over. The table
 * is replaced first and the entries freed after, since dropping a code object
 * can run Python (a weakref callback) that allocates and walks again. */
static void code_cache_trim(void) {
    if (walking || code_n < CODE_MAX)
        return;
    code_entry_t **fresh = PyMem_RawCalloc(code_cap, sizeof(*fresh));
    if (!fresh)
        return;
    code_entry_t **old = code_tab;
    size_t cap = code_cap;
    code_tab = fresh;
    code_n = 0;
    for (size_t i = 0; i < cap; i++) {
        code_entry_t *e = old[i];
        if (!e)
            continue;
        PyMem_RawFree(e->module);
        PyMem_RawFree(e->function);
        PyMem_RawFree(e->file);
        Py_DECREF(e->code);
        PyMem_RawFree(e);
    }
    PyMem_RawFree(old);
}

static code_entry_t *code_lookup(PyObject *co, PyFrameObject *f) {
    if ((code_n + 1) * 2 > code_cap) {
        size_t cap = code_cap ? code_cap * 2 : 1024;
        code_entry_t **t = PyMem_RawCalloc(cap, sizeof(*t));
        if (!t)
            return NULL;
        size_t old_cap = code_cap;
        code_entry_t **old = code_tab;
        code_tab = t;
        code_cap = cap;
        for (size_t i = 0; i < old_cap; i++) {
            if (!old[i])
                continue;
            size_t j = code_slot(old[i]->code);
            while (code_tab[j])
                j = (j + 1) & (code_cap - 1);
            code_tab[j] = old[i];
        }
        PyMem_RawFree(old);
    }
    size_t j = code_slot(co);
    for (; code_tab[j]; j = (j + 1) & (code_cap - 1))
        if (code_tab[j]->code == co)
            return code_tab[j];
    code_entry_t *e = code_entry_new(co, f);
    if (!e)
        return NULL;
    j = code_slot(co); /* code_entry_new ran Python: the table may have grown */
    while (code_tab[j])
        j = (j + 1) & (code_cap - 1);
    code_tab[j] = e;
    code_n++;
    return e;
}

/* ---- call-site rules ---------------------------------------------------------
 * The call site is the innermost frame outside internal_packages (the same
 * frame the profile records). Its mask over the policy's site rules is cached
 * in the code object's entry with the install number it was computed for, so a
 * warm site costs a frame walk and two compares; a reload makes every entry
 * recompute once. Without the GIL (NumPy's realloc in fromfile/fromstring, or
 * any call from a C thread) the site is unknown: mask 0, no Python touched. */

uint64_t dm__site_mask_now(uint64_t *gen) {
    if (!PyGILState_Check())
        return 0;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    bool had_error = PyErr_Occurred() != NULL; /* an allocation may happen while one is set */
    if (had_error)
        PyErr_Fetch(&et, &ev, &tb);
    uint64_t mask = 0, want = dm_runtime_site_gen();
    code_cache_trim();
    walking++;
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f) {
        PyCodeObject *co = PyFrame_GetCode(f);
        code_entry_t *e = co ? code_lookup((PyObject *)co, f) : NULL;
        Py_XDECREF(co);
        if (e && !e->internal) {
            if (e->site_gen != want || e->site_gen == 0)
                e->site_mask = dm_runtime_site_mask(e->module, e->function, &e->site_gen);
            mask = e->site_mask;
            *gen = e->site_gen;
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    walking--;
    if (had_error)
        PyErr_Restore(et, ev, tb);
    else
        PyErr_Clear();
    return mask;
}

/* ---- profile frames ----------------------------------------------------------
 * Walks the Python stack (GIL held): frames innermost first, up to the call
 * site (the innermost frame outside internal_packages) or, with `stacks`, all
 * of them. Returns the number of frames; *site is the call site's index (the
 * innermost frame when every frame is internal), -1 when there is none. The
 * frames' strings are the cache's: valid until the next walk starts. */
int dm__site_capture(dm_prof_frame_t *out, int max, bool stacks, int *site) {
    code_cache_trim();
    walking++;
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
    walking--;
    if (*site < 0 && n > 0)
        *site = 0;
    return n;
}

