/*
 * stats.c: the numbers from Python: stats() (a snapshot as /stats.json's
 * text, every tag's row in it), last_failure() and refusals(), and thin wrappers over the
 * stats export (service/datamem_service.h: metrics text, the HTTP endpoint and
 * unix socket, textfiles and what the exporter reports about the process).
 * Runs with the GIL, released around snapshots, renders and file writes.
 */
#include "pyext/ext.h"

#include <stdio.h>
#include <stdlib.h>

#include "runtime/datamem.h"
#include "service/datamem_service.h"

/* ---- stats() and metrics() ------------------------------------------------------- */

/* A fresh snapshot rendered in `format` (datamem_service.h), as str. */
static PyObject *render(int format) {
    char *text = NULL;
    size_t len = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_stats_render_current(format, &text, &len);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyErr_NoMemory();
    PyObject *res = PyUnicode_DecodeUTF8(text, (Py_ssize_t)len, "replace");
    free(text);
    return res;
}

/* stats() -> /stats.json's text with every tag's row, which datamem.stats()
 * parses: one renderer (service/metrics.c), so the dict and the endpoint's
 * JSON have one shape. */
static PyObject *py_stats(PyObject *self, PyObject *unused) { return render(DM_STATS_JSON_ALL); }

/* last_failure() -> dict of the calling thread's last allocation refused by an
 * arena's limit, or None */
static PyObject *py_last_failure(PyObject *self, PyObject *unused) {
    dm_failure_t f;
    dm_runtime_last_failure(&f);
    if (!f.seq)
        Py_RETURN_NONE;
    static const char *const kinds[] = {"arena", "tag", "worker"};
    const char *kind = f.kind >= 0 && f.kind <= DM_REFUSED_WORKER ? kinds[f.kind] : "arena";
    return Py_BuildValue("{s:s,s:s,s:s,s:s,s:K,s:K,s:K,s:O,s:K}", "kind", kind, "tag", f.tag,
                         "arena", f.arena, "rule", f.rule,
                         "request", (unsigned long long)f.request, "limit",
                         (unsigned long long)f.limit, "live", (unsigned long long)f.live,
                         "fallback_tried", f.fallback_tried ? Py_True : Py_False, "count",
                         (unsigned long long)f.seq);
}

/* refusals(tag or None) -> (count, request, limit, live) of the tag's (the
 * worker limit's) refusals so far and the last one, or None (never counted) */
static PyObject *py_refusals(PyObject *self, PyObject *arg) {
    const char *name = NULL;
    if (arg != Py_None && !(name = PyUnicode_AsUTF8(arg)))
        return NULL;
    dm_refusals_t r;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_runtime_refusals(name, &r);
    Py_END_ALLOW_THREADS
    if (rc)
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKK)", (unsigned long long)r.count, (unsigned long long)r.request,
                         (unsigned long long)r.limit, (unsigned long long)r.live);
}

/* ---- stats export: thin wrappers over dm_stats_render_current / dm_stats_serve */

/* metrics(json=False) -> Prometheus text (or the JSON of /stats.json) */
static PyObject *py_metrics(PyObject *self, PyObject *args) {
    int json = 0;
    if (!PyArg_ParseTuple(args, "|p", &json))
        return NULL;
    return render(json ? DM_STATS_JSON : DM_STATS_PROMETHEUS);
}

/* stats_serve(http, unix_socket) -> 0 or a negative code (logged); None keeps
 * the policy's setting, "" turns it off */
static PyObject *py_stats_serve(PyObject *self, PyObject *args) {
    const char *http = NULL;
    PyObject *unix_obj = NULL;
    if (!PyArg_ParseTuple(args, "zO&", &http, fs_path_or_none, &unix_obj))
        return NULL;
    const char *unix_socket = unix_obj ? PyBytes_AS_STRING(unix_obj) : NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_stats_serve(http, unix_socket);
    Py_END_ALLOW_THREADS
    Py_XDECREF(unix_obj);
    return PyLong_FromLong(rc);
}

/* stats_endpoint() -> (url, unix socket path); "" when not serving */
static PyObject *py_stats_endpoint(PyObject *self, PyObject *unused) {
    char url[256], path[256];
    dm_stats_endpoint(url, sizeof(url), path, sizeof(path));
    return Py_BuildValue("(sN)", url, PyUnicode_DecodeFSDefault(path));
}

static PyObject *py_stats_stop(PyObject *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    dm_stats_export_stop();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* stats_textfile_write(path) -> 0 or a negative code */
static PyObject *py_stats_textfile_write(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_stats_textfile_write(path);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_obj);
    return PyLong_FromLong(rc);
}

/* set_threads_not_covered(names): for /metrics and /stats.json */
static PyObject *py_set_threads_not_covered(PyObject *self, PyObject *arg) {
    PyObject *seq = dm_seq_tuple(arg, "set_threads_not_covered: expected a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq); /* our own tuple: its items live while used */
    if (n > 4096)
        n = 4096;
    const char **names = PyMem_RawCalloc((size_t)n + 1, sizeof(char *));
    if (!names) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(seq, i);
        names[i] = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
        if (!names[i]) {
            PyErr_Clear();
            names[i] = "?";
        }
    }
    dm_stats_set_threads_not_covered(names, (int)n);
    PyMem_RawFree(names);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* set_pyarrow_bytes(n): pyarrow's pool for /metrics and /stats.json; n < 0: not loaded */
static PyObject *py_set_pyarrow_bytes(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    dm_stats_set_pyarrow_bytes((int64_t)n);
    Py_RETURN_NONE;
}

/* stats_textfile_sweep(template, min_age_ms) -> files removed, or a negative code */
static PyObject *py_stats_textfile_sweep(PyObject *self, PyObject *args) {
    PyObject *tmpl_obj;
    long long min_age_ms;
    if (!PyArg_ParseTuple(args, "O&L", PyUnicode_FSConverter, &tmpl_obj, &min_age_ms))
        return NULL;
    const char *tmpl = PyBytes_AS_STRING(tmpl_obj);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_stats_textfile_sweep(tmpl, (int64_t)min_age_ms);
    Py_END_ALLOW_THREADS
    Py_DECREF(tmpl_obj);
    return PyLong_FromLong(rc);
}


PyMethodDef dm__stats_methods[] = {
    {"stats", py_stats, METH_NOARGS, "stats() -> JSON text of every number (all tags)"},
    {"last_failure", py_last_failure, METH_NOARGS, "last_failure() -> the thread's last limit refusal, or None"},
    {"refusals", py_refusals, METH_O, "refusals(tag or None) -> (count, request, limit, live) or None"},
    {"metrics", py_metrics, METH_VARARGS, "metrics(json=False) -> Prometheus text (or JSON)"},
    {"stats_serve", py_stats_serve, METH_VARARGS, "stats_serve(http, unix_socket) -> 0 or error code"},
    {"stats_endpoint", py_stats_endpoint, METH_NOARGS, "stats_endpoint() -> (url, unix_socket)"},
    {"stats_stop", py_stats_stop, METH_NOARGS, "stop serving stats; last textfile write"},
    {"stats_textfile_write", py_stats_textfile_write, METH_VARARGS, "stats_textfile_write(path) -> 0 or error code"},
    {"stats_textfile_sweep", py_stats_textfile_sweep, METH_VARARGS, "stats_textfile_sweep(template, min_age_ms) -> files removed"},
    {"set_threads_not_covered", py_set_threads_not_covered, METH_O, "set_threads_not_covered(names)"},
    {"set_pyarrow_bytes", py_set_pyarrow_bytes, METH_O, "set_pyarrow_bytes(n): pyarrow's pool for the exporter"},
    {NULL, NULL, 0, NULL},
};
