/*
 * module.c: the module datamem._ext: PyInit__ext (NumPy's C API, the runtime,
 * each file's functions and the module's constants) and the small wrappers
 * over the runtime that belong to no other file: active(),
 * site_rules_active(), jemalloc_version(), owner_arena(), process settings
 * (thread name, NumPy's hugepage setting, the CUDA runtime), the fork-child
 * restart and the fault switches for tests.
 * Runs attached (with the GIL on a GIL build); nothing here keeps state of
 * its own.
 */
#define DM_PYEXT_IMPORT_ARRAY /* this file imports NumPy's C API for all of pyext/ */
#include "pyext/ext.h"

#include <stdatomic.h>

#include <jemalloc/jemalloc.h>

#include "dm_build_info.h" /* NumPy and Python versions built against (@local_python) */
#include "policy/policy.h"
#include "runtime/datamem.h"
#include "service/datamem_profile.h"

/* set_numpy_hugepages(on): NumPy's own hugepage setting, read at install */
static PyObject *py_set_numpy_hugepages(PyObject *self, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    dm_runtime_set_numpy_hugepages(v != 0);
    Py_RETURN_NONE;
}

static PyObject *py_set_thread_name(PyObject *self, PyObject *name) {
    const char *s = PyUnicode_AsUTF8(name);
    if (!s)
        return NULL;
    dm_thread_set_name(s);
    dm__record_set_thread_name(s);
    Py_RETURN_NONE;
}

static PyObject *py_active(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(dm_runtime_active());
}

/* `python -m datamem --version`: the jemalloc linked in, from its own "version"
 * mallctl (what runs, not what a header said). */
static PyObject *py_jemalloc_version(PyObject *self, PyObject *unused) {
    const char *v = NULL;
    size_t n = sizeof v;
    if (dmje_mallctl("version", (void *)&v, &n, NULL, 0) != 0 || !v)
        Py_RETURN_NONE;
    return PyUnicode_FromString(v);
}

static PyObject *py_owner_arena(PyObject *self, PyObject *arr) {
    if (!PyArray_Check(arr)) {
        PyErr_SetString(PyExc_TypeError, "expected a numpy.ndarray");
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)arr;
    while (PyArray_BASE(a) && PyArray_Check(PyArray_BASE(a)) &&
           !PyArray_CHKFLAGS(a, NPY_ARRAY_OWNDATA))
        a = (PyArrayObject *)PyArray_BASE(a);
    const char *name = dm_owner_arena(PyArray_DATA(a));
    if (!name)
        Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

static PyObject *py_fault_extent_alloc(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    dm_fault_extent_alloc(n);
    Py_RETURN_NONE;
}

static PyObject *py_after_fork_child(PyObject *self, PyObject *unused) {
    dm_runtime_after_fork_child();
    Py_RETURN_NONE;
}

/* site_rules_active() -> whether the handler looks up call sites */
static PyObject *py_site_rules_active(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed));
}

/* set_cudart(path): where libcudart is, for `pinned: cuda` (DATAMEM_CUDART) */
static PyObject *py_set_cudart(PyObject *self, PyObject *args) {
    PyObject *path_obj = NULL;
    if (!PyArg_ParseTuple(args, "O&", fs_path_or_none, &path_obj))
        return NULL;
    dm_runtime_set_cudart(path_obj ? PyBytes_AS_STRING(path_obj) : NULL);
    Py_XDECREF(path_obj);
    Py_RETURN_NONE;
}

/* fault_lock(n): the next n page-locks fail (tests) */
static PyObject *py_fault_lock(PyObject *self, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n))
        return NULL;
    dm_fault_lock((int64_t)n);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"active", py_active, METH_NOARGS, "active() -> True once a policy is in force"},
    {"site_rules_active", py_site_rules_active, METH_NOARGS, "whether call-site rules are in force"},
    {"jemalloc_version", py_jemalloc_version, METH_NOARGS, "jemalloc_version() -> version of the jemalloc linked in"},
    {"owner_arena", py_owner_arena, METH_O, "owner_arena(arr) -> name of the arena holding arr's data"},
    {"set_thread_name", py_set_thread_name, METH_O, "set_thread_name(name): for thread rules"},
    {"set_numpy_hugepages", py_set_numpy_hugepages, METH_O, "set_numpy_hugepages(on): NumPy's madvise-hugepage setting, for arenas at hugepages: system"},
    {"set_cudart", py_set_cudart, METH_VARARGS, "set_cudart(path): the CUDA runtime for pinned: cuda"},
    {"after_fork_child", py_after_fork_child, METH_NOARGS, "restart runtime threads in a forked child"},
    {"fault_lock", py_fault_lock, METH_VARARGS, "fault_lock(n): the next n page-locks fail (tests)"},
    {"fault_extent_alloc", py_fault_extent_alloc, METH_O, "testing: fail the next n extent allocations"},
    {NULL, NULL, 0, NULL},
};

/* The other files' functions: each keeps its table next to its functions. */
static PyMethodDef *const file_methods[] = {
    dm__handler_methods, dm__load_methods, dm__stats_methods, dm__record_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "datamem._ext", "datamem's C core", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* The module's constants; 0 or -1 with an exception set. */
static int add_constants(PyObject *m) {
    if (PyModule_AddStringConstant(m, "HANDLER_NAME", HANDLER_NAME) < 0 ||
        PyModule_AddStringConstant(m, "VERSION", DM_VERSION_STRING) < 0 ||
        PyModule_AddIntConstant(m, "PROFILE_MAX_BYTES_MIN", (long)DM_PROF_MAX_BYTES_MIN) < 0 ||
        PyModule_AddStringConstant(m, "BUILD_NUMPY_VERSION", DM_BUILD_NUMPY_VERSION) < 0 ||
        PyModule_AddStringConstant(m, "BUILD_PYTHON_VERSION", DM_BUILD_PYTHON_VERSION) < 0)
        return -1;
    /* The dtype names explain() accepts (policy.h's DM_DTYPE_LIST), so that
     * the command line can list them without keeping a copy. */
    PyObject *dtypes = PyTuple_New(DM_DT_COUNT);
    for (int i = 0; dtypes && i < DM_DT_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(dm_dtype_name(i));
        if (!name)
            Py_CLEAR(dtypes);
        else
            PyTuple_SET_ITEM(dtypes, i, name);
    }
    if (!dtypes || PyModule_AddObject(m, "DTYPES", dtypes) < 0) {
        Py_XDECREF(dtypes);
        return -1;
    }
    return 0;
}

__attribute__((visibility("default"))) PyMODINIT_FUNC PyInit__ext(void);

PyMODINIT_FUNC PyInit__ext(void) {
    import_array();
    dm__handler_init();
    if (dm_runtime_init() != 0) {
        PyErr_SetString(PyExc_RuntimeError, "datamem: runtime initialisation failed");
        return NULL;
    }
    dm__record_init();
    /* The call-site cache (profiles and call-site rules) keys on this. */
    if (dm__site_init() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
#ifdef Py_GIL_DISABLED
    /* Every piece of shared state in pyext/ has its own guard (docs/design.md,
     * "Free-threaded CPython"): importing datamem leaves the GIL off. */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0)
        goto fail;
#endif
    for (size_t i = 0; i < sizeof(file_methods) / sizeof(file_methods[0]); i++)
        if (PyModule_AddFunctions(m, file_methods[i]) < 0)
            goto fail;
    if (dm__load_init(m) < 0 || add_constants(m) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
