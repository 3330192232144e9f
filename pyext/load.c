/*
 * load.c: policy files from Python: load() (parse, compile and publish),
 * check() and explain() (read a file aside, never installed),
 * policy_settings() (the policy in force), warnings_changed(), and the
 * datamem.PolicyError they raise. Runs with the GIL, released around file
 * reads and installs.
 */
#include "pyext/ext.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "policy/policy.h"
#include "policy/trust.h"
#include "runtime/datamem.h"
#include "service/datamem_service.h"

static PyObject *PolicyError;

static PyObject *text_of(const char *s) {
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "backslashreplace");
}

static PyObject *raise_diags(const dm_diags_t *d, int rc) {
    char buf[16384];
    if (d->n == 0)
        snprintf(buf, sizeof(buf), "%s: %s", d->file, dm_strerror(rc));
    else
        dm_diags_format_all(d, buf, sizeof(buf));
    PyObject *text = text_of(buf);
    if (text) {
        PyErr_SetObject(PolicyError, text);
        Py_DECREF(text);
    }
    return NULL;
}

/* Diagnostics for `path` (too big for the stack), or NULL with MemoryError set. */
static dm_diags_t *diags_new(const char *path) {
    dm_diags_t *d = PyMem_RawMalloc(sizeof(*d));
    if (!d) {
        PyErr_NoMemory();
        return NULL;
    }
    dm_diags_init(d, path);
    return d;
}

static PyObject *py_load(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    dm_diags_t *d = diags_new(path);
    if (!d) {
        Py_DECREF(path_obj);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_runtime_load(path, d);
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (rc)
        raise_diags(d, rc);
    else {
        if (dm_runtime_wants_dtype())
            dm__handler_dtype_hooks_enable();
        char buf[8192] = "";
        if (d->nwarnings)
            dm_diags_format_all(d, buf, sizeof(buf));
        res = text_of(buf); /* warnings, "" if none */
    }
    PyMem_RawFree(d);
    Py_DECREF(path_obj);
    return res;
}

/* warnings_changed(text) -> whether to print these policy warnings: they differ
 * from the set this process reported last (shared with the file watcher). */
static PyObject *py_warnings_changed(PyObject *self, PyObject *text) {
    const char *t = PyUnicode_AsUTF8(text);
    if (!t)
        return NULL;
    return PyBool_FromLong(dm_watch_warnings_changed(t));
}

/* ---- policy files read aside (check, explain) -------------------------------- */

/* A policy file read and never installed, with a text buffer for its report. */
typedef struct aside {
    dm_diags_t *diags;   /* its diagnostics */
    dm_policy_t *policy; /* NULL unless it loaded */
    int rc;              /* dm_policy_load_ex's */
    char *text;          /* "" to begin with */
    size_t cap;          /* bytes at text */
} aside_t;

/* Reads `path` with `flags` (DM_PARSE_*), the GIL released. 0, or -1 with
 * MemoryError set; aside_free() in both cases. */
static int aside_read(aside_t *a, const char *path, unsigned flags, size_t cap) {
    *a = (aside_t){.cap = cap};
    a->text = PyMem_RawMalloc(cap);
    if (!a->text) {
        PyErr_NoMemory();
        return -1;
    }
    a->text[0] = 0;
    if (!(a->diags = diags_new(path)))
        return -1;
    dm_topology_t topo;
    dm_runtime_topology(&topo);
    Py_BEGIN_ALLOW_THREADS
    a->rc = dm_policy_load_ex(path, &topo, flags, &a->policy, a->diags);
    Py_END_ALLOW_THREADS
    return 0;
}

static void aside_free(aside_t *a) {
    dm_policy_free(a->policy);
    PyMem_RawFree(a->diags);
    PyMem_RawFree(a->text);
}

/* check(path) -> (ok, diagnostics text, summary) without installing anything */
static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    aside_t a;
    PyObject *res = NULL;
    if (aside_read(&a, path, DM_PARSE_LINT, 16384) == 0) { /* check lints */
        if (a.diags->n) /* the user named this file: each diagnostic quotes its line */
            dm_diags_format_quoted(a.diags, a.text, a.cap);
        else if (a.rc)
            snprintf(a.text, a.cap, "%s: error: %s\n", path, dm_strerror(a.rc));
        char summary[256] = "";
        const dm_policy_t *p = a.policy;
        if (p)
            snprintf(summary, sizeof(summary), "%d arena%s, %d rule%s, default '%s'",
                     p->narenas, p->narenas == 1 ? "" : "s", p->nrules,
                     p->nrules == 1 ? "" : "s", p->arenas[p->default_arena].name);
        PyObject *text = text_of(a.text);
        res = text ? Py_BuildValue("(ONs)", a.rc == 0 ? Py_True : Py_False, text, summary)
                   : NULL;
    }
    aside_free(&a);
    Py_DECREF(path_obj);
    return res;
}

/* explain's text for the policy at `path`: its table (ctx NULL) or the route
 * of one allocation. */
static PyObject *explain_text(const char *path, const dm_context_t *ctx, size_t size, int dt) {
    aside_t a;
    dm_table_t *t = NULL;
    PyObject *res = NULL;
    if (aside_read(&a, path, 0, 1 << 16) < 0)
        goto done;
    if (a.rc) {
        raise_diags(a.diags, a.rc);
        goto done;
    }
    if (dm_table_compile(a.policy, &t) != 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (!ctx)
        dm_table_dump(t, a.text, a.cap);
    else
        dm_table_explain(t, ctx, size, dt, a.text, a.cap);
    res = text_of(a.text);
done:
    dm_table_free(t);
    aside_free(&a);
    return res;
}

/* The dtype code of a name explain() accepts (policy.h's DM_DTYPE_LIST), or
 * -1 with ValueError set. */
static int dtype_code(const char *name) {
    for (int i = 0; i < DM_DT_COUNT; i++)
        if (strcmp(dm_dtype_name(i), name) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "unknown dtype '%s'", name);
    return -1;
}

/* explain(path, size, dtype_name, thread, tags, table) -> text */
static PyObject *py_explain(PyObject *self, PyObject *args) {
    const char *dtype, *thread, *module = NULL, *function = NULL;
    PyObject *path_obj;
    unsigned long long size;
    PyObject *tags;
    int table;
    if (!PyArg_ParseTuple(args, "O&KssOp|zz", PyUnicode_FSConverter, &path_obj, &size, &dtype,
                          &thread, &tags, &table, &module, &function))
        return NULL;
    PyObject *res = NULL, *seq = NULL;
    int dt = dtype_code(dtype);
    if (dt < 0 || !(seq = dm_seq_tuple(tags, "tags must be a sequence of str")))
        goto done;
    Py_ssize_t ntags = PyTuple_GET_SIZE(seq); /* our own tuple: its items live while used */
    const char *tagv[64];
    if (ntags > 64)
        ntags = 64;
    for (Py_ssize_t i = 0; i < ntags; i++)
        if (!(tagv[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(seq, i))))
            goto done;
    dm_context_t ctx = {thread, tagv, (int)ntags, module, function};
    res = explain_text(PyBytes_AS_STRING(path_obj), table ? NULL : &ctx, (size_t)size, dt);
done:
    Py_XDECREF(seq);
    Py_DECREF(path_obj);
    return res;
}

/* budget(path) -> None when the policy at `path` sets no worker_limit, else
 * {limit, base, source, group, held} as dm_runtime_budget reads them now
 * (held None: per process, or unreadable) and spill, the worker_spill arena's
 * name or None; ValueError when a share's limit
 * cannot be read here. */
static PyObject *py_budget(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    aside_t a;
    PyObject *res = NULL;
    dm_budget_t *b = PyMem_RawMalloc(sizeof(*b)); /* 4 KiB of path: not on the stack */
    if (!b) {
        PyErr_NoMemory();
        goto done;
    }
    if (aside_read(&a, PyBytes_AS_STRING(path_obj), 0, 512) == 0 && a.rc) {
        raise_diags(a.diags, a.rc);
    } else if (a.policy) { /* NULL: aside_read failed, MemoryError set */
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = dm_runtime_budget(a.policy, b, a.text, a.cap);
        Py_END_ALLOW_THREADS
        if (rc)
            PyErr_SetString(PyExc_ValueError, a.text);
        else if (b->limit == UINT64_MAX)
            res = Py_NewRef(Py_None);
        else
            res = Py_BuildValue(
                "{sKsKsssNsNsz}", "limit", (unsigned long long)b->limit, "base",
                (unsigned long long)b->base, "source", b->source, "group",
                PyUnicode_DecodeFSDefault(b->group), "held",
                b->held == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(b->held),
                "spill", a.policy->worker_spill >= 0 ? a.policy->arenas[a.policy->worker_spill].name
                                                     : NULL);
    }
    aside_free(&a);
done:
    PyMem_RawFree(b);
    Py_DECREF(path_obj);
    return res;
}

/* trust_open(path, want, mode) -> (fd, code, why, errno): policy/trust.c's rule for
 * python/datamem/_files.py, so the Python side resolves and checks paths by
 * the very code the C side uses. `want`: 0 a policy file to read, 1 a
 * directory to write into, 2 the same, made with `mode` when absent. fd is
 * -1 unless code is 0; why is one line; errno says what an IO failure was. */
static PyObject *py_trust_open(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    int want, mode, err = 0;
    if (!PyArg_ParseTuple(args, "O&ii", PyUnicode_FSConverter, &path_obj, &want, &mode))
        return NULL;
    if (want < DM__TRUST_FILE || want > DM__TRUST_DIR_CREATE) {
        Py_DECREF(path_obj);
        return PyErr_Format(PyExc_ValueError, "trust_open: want %d", want);
    }
    char why[PATH_MAX + 256];
    int fd;
    Py_BEGIN_ALLOW_THREADS
    fd = dm__trust_open(PyBytes_AS_STRING(path_obj), (dm__trust_want_t)want, (mode_t)mode, why,
                        sizeof(why));
    err = errno;
    Py_END_ALLOW_THREADS
    Py_DECREF(path_obj);
    return Py_BuildValue("(iiNi)", fd >= 0 ? fd : -1, fd >= 0 ? 0 : fd, text_of(why), err);
}

/* policy_settings() -> dict of the policy in force's process-level settings */
static PyObject *py_policy_settings(PyObject *self, PyObject *unused) {
    dm_policy_t *p = dm_runtime_policy_copy();
    if (!p)
        Py_RETURN_NONE;
    PyObject *d = Py_BuildValue(
        "{s:N,s:O,s:O,s:L,s:s,s:s,s:s,s:L}", "path", PyUnicode_DecodeFSDefault(p->path),
        "reload_watch", p->reload.watch ? Py_True : Py_False,
        "reload_signal", p->reload.signal ? Py_True : Py_False,
        "reload_debounce_ms", (long long)p->reload.debounce_ms,
        "stats_http", p->stats.http, "stats_unix_socket", p->stats.unix_socket,
        "stats_textfile", p->stats.textfile, "stats_interval_ms", (long long)p->stats.interval_ms);
    dm_policy_free(p);
    return d;
}

/* In the main thread, attached, between bytecodes (Py_AddPendingCall): the
 * Python layer brings what only the main thread may change (the SIGHUP
 * handler, reload.signal) in line with the policy in force. Never raises: an
 * error there is reported as unraisable, not thrown into the job's code. */
static int sync_main_thread_settings(void *unused) {
    (void)unused;
    PyObject *mod = PyImport_ImportModule("datamem"), *fn = NULL, *r = NULL;
    if (mod && !(fn = PyObject_GetAttrString(mod, "_sync_main_thread"))) {
        PyErr_Clear(); /* datamem is still being imported: its install() applies them */
        Py_DECREF(mod);
        return 0;
    }
    if (fn && !(r = PyObject_CallNoArgs(fn)))
        PyErr_WriteUnraisable(fn);
    if (!mod)
        PyErr_WriteUnraisable(NULL);
    Py_XDECREF(r);
    Py_XDECREF(fn);
    Py_XDECREF(mod);
    return 0;
}

/* From every install, on whichever thread made it: the file watcher's C thread
 * included, where no Python code can run. An install from datamem.install()
 * or reload() in the main thread applies the settings itself; this covers the
 * others. Py_AddPendingCall needs neither the GIL nor a thread state; with its
 * queue full the call is dropped, and the next install schedules another. */
void dm__load_on_install(void) {
    if (Py_IsInitialized())
        (void)Py_AddPendingCall(sync_main_thread_settings, NULL);
}

int dm__load_init(PyObject *m) {
    PolicyError = PyErr_NewExceptionWithDoc(
        "datamem.PolicyError", "A policy file could not be loaded.", PyExc_ValueError, NULL);
    if (!PolicyError || PyModule_AddObject(m, "PolicyError", Py_NewRef(PolicyError)) < 0)
        return -1;
    return 0;
}

PyMethodDef dm__load_methods[] = {
    {"load", py_load, METH_VARARGS, "load(path) -> warnings: parse, compile and publish a policy"},
    {"check", py_check, METH_VARARGS, "check(path) -> (ok, diagnostics, summary)"},
    {"explain", py_explain, METH_VARARGS, "explain(path, size, dtype, thread, tags, table) -> text"},
    {"budget", py_budget, METH_VARARGS, "budget(path) -> what the policy's worker_limit comes to here and now, or None"},
    {"policy_settings", py_policy_settings, METH_NOARGS, "process-level settings of the policy in force"},
    {"trust_open", py_trust_open, METH_VARARGS, "trust_open(path, want, mode) -> (fd, code, why, errno): the path rule of policy/trust.c"},
    {"warnings_changed", py_warnings_changed, METH_O, "warnings_changed(text) -> whether these policy warnings are new to this process"},
    {NULL, NULL, 0, NULL},
};
