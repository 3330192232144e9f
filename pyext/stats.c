/*
 * stats.c: the numbers from Python: stats() (a snapshot as a dict, the shape
 * of /stats.json), last_failure() and refusals(), and thin wrappers over the
 * stats export (service/datamem_service.h: metrics text, the HTTP endpoint and
 * unix socket, textfiles and what the exporter reports about the process).
 * Runs with the GIL, released around snapshots, renders and file writes.
 */
#include "pyext/ext.h"

#include <stdio.h>
#include <stdlib.h>

#include "runtime/datamem.h"
#include "service/datamem_service.h"

/* ---- stats() ---------------------------------------------------------------------- */

static const char *thp_name(int m) {
    return m == DM_THP_ON ? "on" : m == DM_THP_OFF ? "off" : "system";
}

static const char *numa_name(int m) {
    static const char *const names[] = {"none", "local", "bind", "interleave", "preferred"};
    return m >= 0 && m < 5 ? names[m] : "?";
}

/* d[k] = expr (a new reference, or NULL on error: then goto fail). */
#define SET_OBJ(d, k, expr)                                                    \
    do {                                                                       \
        PyObject *_o = (expr);                                                 \
        if (!_o || PyDict_SetItemString(d, k, _o) < 0) {                       \
            Py_XDECREF(_o);                                                    \
            goto fail;                                                         \
        }                                                                      \
        Py_DECREF(_o);                                                         \
    } while (0)
#define SET_U64(d, k, v) SET_OBJ(d, k, PyLong_FromUnsignedLongLong((unsigned long long)(v)))

static PyObject *nodes_list(uint64_t nodes) {
    PyObject *l = PyList_New(0);
    for (int i = 0; l && i < 64; i++) {
        if (!(nodes & (UINT64_C(1) << i)))
            continue;
        PyObject *n = PyLong_FromLong(i);
        if (!n || PyList_Append(l, n) < 0) {
            Py_XDECREF(n);
            Py_CLEAR(l);
            break;
        }
        Py_DECREF(n);
    }
    return l;
}

/* The counters of an arena (with frees) or a rule (without) into `d`. */
static int set_counts(PyObject *d, const dm_counts_t *c, bool frees) {
    SET_U64(d, "allocations", c->nalloc);
    if (frees)
        SET_U64(d, "frees", c->nfree);
    SET_U64(d, "reallocs", c->nrealloc);
    SET_U64(d, "failures", c->nfail);
    SET_U64(d, "fallbacks", c->nfallback);
    SET_U64(d, "dtype_known", c->ndtype_known);
    SET_U64(d, "bytes_requested", c->bytes_requested);
    SET_U64(d, "limit_hits", c->nlimit);
    return 0;
fail:
    return -1;
}

static PyObject *u64_or_none(uint64_t v) {
    return v == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(v);
}

static PyObject *arena_dict(const dm_arena_stats_t *a) {
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    SET_OBJ(d, "in_policy", PyBool_FromLong(a->in_policy));
    SET_U64(d, "alignment", a->alignment);
    SET_OBJ(d, "hugepages", PyUnicode_FromString(thp_name(a->hugepages)));
    SET_OBJ(d, "numa", PyUnicode_FromString(numa_name(a->numa)));
    SET_OBJ(d, "numa_nodes", nodes_list(a->numa_nodes));
    SET_OBJ(d, "per_node", PyBool_FromLong(a->per_node));
    SET_U64(d, "jemalloc_arenas", a->njemalloc);
    if (set_counts(d, &a->counts, true) < 0)
        goto fail;
    SET_U64(d, "placement_errors", a->nplacement_errors);
    SET_U64(d, "growth_purges", a->ngrowth_purges);
    SET_U64(d, "reuse_bytes", a->reuse_bytes);
    SET_U64(d, "allocated_bytes", a->allocated);
    SET_U64(d, "active_bytes", a->active);
    SET_U64(d, "resident_bytes", a->resident);
    SET_U64(d, "mapped_bytes", a->mapped);
    SET_U64(d, "retained_bytes", a->retained);
    SET_U64(d, "dirty_bytes", a->dirty);
    SET_U64(d, "muzzy_bytes", a->muzzy);
    SET_U64(d, "jemalloc_allocations", a->je_nmalloc);
    SET_U64(d, "jemalloc_frees", a->je_ndalloc);
    SET_U64(d, "reserved_bytes", a->reserved);
    SET_U64(d, "hugepage_bytes", a->hugepage_bytes);
    if (a->limit == UINT64_MAX) {
        Py_INCREF(Py_None);
        SET_OBJ(d, "limit_bytes", Py_None);
    } else {
        SET_U64(d, "limit_bytes", a->limit);
    }
    SET_U64(d, "live_bytes", a->live);
    SET_OBJ(d, "decay_dirty_ms", PyLong_FromLongLong(a->dirty_decay_ms));
    SET_OBJ(d, "decay_muzzy_ms", PyLong_FromLongLong(a->muzzy_decay_ms));
    SET_OBJ(d, "lock", PyBool_FromLong(a->lock));
    SET_OBJ(d, "pinned", PyUnicode_FromString(a->pinned == DM_PIN_CUDA ? "cuda" : "none"));
    SET_U64(d, "locked_bytes", a->locked_bytes);
    SET_U64(d, "pinned_bytes", a->pinned_bytes);
    SET_OBJ(d, "backed", PyBool_FromLong(a->backed));
    SET_OBJ(d, "backing_max", u64_or_none(a->backed ? a->backing_max : UINT64_MAX));
    SET_U64(d, "backing_reserved_bytes", a->backing_reserved_bytes);
    SET_U64(d, "backing_disk_bytes", a->backing_disk_bytes);
    SET_U64(d, "backing_full", a->backing_full);
    SET_OBJ(d, "backing_resident_max", u64_or_none(a->backed ? a->backing_resident_max : UINT64_MAX));
    SET_U64(d, "backing_resident_bytes", a->backing_resident_bytes);
    SET_U64(d, "backing_paged_out_bytes", a->backing_paged_out_bytes);
    SET_U64(d, "backing_fork_copies", a->backing_fork_copies);
    SET_U64(d, "backing_fork_failures", a->backing_fork_failures);
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* stats()["tags"] (biggest live first) and stats()["tag_bytes"]. */
static int set_tags(PyObject *d, const dm_stats_t *s) {
    PyObject *tags = PyDict_New(), *tb = PyDict_New();
    if (!tags || !tb)
        goto fail;
    for (int i = 0; i < s->ntags; i++) {
        const dm_tag_stats_t *t = &s->tags[i];
        PyObject *r = PyDict_New();
        if (!r || PyDict_SetItemString(tags, t->name, r) < 0) {
            Py_XDECREF(r);
            goto fail;
        }
        Py_DECREF(r);
        SET_U64(r, "live", t->live);
        SET_U64(r, "peak", t->peak);
        SET_OBJ(r, "limit", u64_or_none(t->limit));
        SET_U64(r, "refused", t->refused);
    }
    SET_OBJ(tb, "on", PyBool_FromLong(s->tally_on));
    SET_U64(tb, "live", s->tally_live);
    SET_U64(tb, "peak", s->tally_peak);
    SET_OBJ(tb, "worker_limit", u64_or_none(s->worker_limit));
    SET_OBJ(tb, "worker_limit_source", PyUnicode_FromString(s->worker_limit_source));
    SET_U64(tb, "worker_refused", s->worker_refused);
    SET_U64(tb, "worker_spilled", s->worker_spilled);
    SET_U64(tb, "worker_beside", s->worker_beside);
    SET_U64(tb, "overflowed", s->tags_overflowed);
    SET_U64(tb, "unenforced", s->tags_unenforced);
    PyObject *names = PyList_New(s->nunenforced);
    if (!names)
        goto fail;
    for (int i = 0; i < s->nunenforced; i++) {
        PyObject *u = PyUnicode_FromString(s->unenforced[i]);
        if (!u) {
            Py_DECREF(names);
            goto fail;
        }
        PyList_SET_ITEM(names, i, u);
    }
    SET_OBJ(tb, "unenforced_tags", names);
    SET_OBJ(d, "tags", Py_NewRef(tags));
    SET_OBJ(d, "tag_bytes", Py_NewRef(tb));
    Py_DECREF(tags);
    Py_DECREF(tb);
    return 0;
fail:
    Py_XDECREF(tags);
    Py_XDECREF(tb);
    return -1;
}

/* stats()["arenas"]: one dict per arena, by name. */
static PyObject *arenas_dict(const dm_stats_t *s) {
    PyObject *arenas = PyDict_New();
    for (int i = 0; arenas && i < s->narenas; i++) {
        PyObject *a = arena_dict(&s->arenas[i]);
        if (!a || PyDict_SetItemString(arenas, s->arenas[i].name, a) < 0) {
            Py_XDECREF(a);
            Py_CLEAR(arenas);
            break;
        }
        Py_DECREF(a);
    }
    return arenas;
}

/* stats()["rules"]: one dict per rule, by name. */
static PyObject *rules_dict(const dm_stats_t *s) {
    PyObject *rules = PyDict_New();
    if (!rules)
        return NULL;
    for (int i = 0; i < s->nrules && s->rules; i++) {
        PyObject *r = PyDict_New();
        if (!r)
            goto fail;
        if (PyDict_SetItemString(rules, s->rules[i].name, r) < 0) {
            Py_DECREF(r);
            goto fail;
        }
        Py_DECREF(r);
        SET_OBJ(r, "arena", PyUnicode_FromString(s->rules[i].arena));
        if (set_counts(r, &s->rules[i].counts, false) < 0)
            goto fail;
    }
    return rules;
fail:
    Py_DECREF(rules);
    return NULL;
}

/* The dict stats() returns, from a snapshot (the shape of /stats.json). */
static PyObject *stats_dict(const dm_stats_t *s, const dm_process_stats_t *proc) {
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    SET_OBJ(d, "arenas", arenas_dict(s));
    SET_OBJ(d, "rules", rules_dict(s));
    SET_OBJ(d, "policy_path", PyUnicode_DecodeFSDefault(s->policy_path));
    char hash[17];
    snprintf(hash, sizeof(hash), "%016llx", (unsigned long long)s->policy_hash);
    SET_OBJ(d, "policy_hash", PyUnicode_FromString(hash));
    SET_U64(d, "reloads", s->reloads);
    SET_U64(d, "reload_failures", s->reload_failures);
    SET_OBJ(d, "last_reload_time", PyFloat_FromDouble(s->last_reload_time));
    SET_U64(d, "foreign_frees", s->foreign_frees);
    SET_U64(d, "thread_cache_bytes", s->cached_bytes);
    SET_U64(d, "threads", (uint64_t)s->nthreads);
    SET_U64(d, "contexts", (uint64_t)s->ncontexts);
    SET_U64(d, "tables_live", (uint64_t)s->tables_live);
    SET_OBJ(d, "version", PyUnicode_FromString(DM_VERSION_STRING));
    SET_OBJ(d, "last_reload_successful", PyBool_FromLong(!s->last_reload_failed));
    SET_OBJ(d, "time", PyFloat_FromDouble(s->snapshot_time));
    uint64_t wr, ws;
    dm_watch_counts(&wr, &ws);
    SET_U64(d, "watch_reloads", wr);
    SET_U64(d, "watch_unchanged", ws);
    if (proc->resident) { /* pyarrow_allocated_bytes: datamem.stats() reads it live */
        SET_U64(d, "process_resident_bytes", proc->resident);
        SET_U64(d, "outside_arenas_resident_bytes", proc->outside_arenas);
    }
    if (set_tags(d, s) < 0)
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *py_stats(PyObject *self, PyObject *unused) {
    dm_stats_t *s = PyMem_RawMalloc(sizeof(*s));
    if (!s)
        return PyErr_NoMemory();
    dm_process_stats_t proc;
    Py_BEGIN_ALLOW_THREADS
    dm_stats_snapshot(s);
    dm_stats_hugepages(s);
    dm_stats_process(s, &proc);
    Py_END_ALLOW_THREADS
    PyObject *d = stats_dict(s, &proc);
    dm_stats_release(s);
    PyMem_RawFree(s);
    return d;
}

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
    char *text = NULL;
    size_t len = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_stats_render_current(json ? DM_STATS_JSON : DM_STATS_PROMETHEUS, &text, &len);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyErr_NoMemory();
    PyObject *res = PyUnicode_DecodeUTF8(text, (Py_ssize_t)len, "replace");
    free(text);
    return res;
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
    {"stats", py_stats, METH_NOARGS, "stats() -> dict of per-arena and per-rule numbers"},
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
