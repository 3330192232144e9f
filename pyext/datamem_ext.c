/*
 * datamem_ext.c: the CPython extension `datamem._ext`, and the only file that
 * includes Python.h or NumPy headers (NumPy keeps its handler plumbing in one
 * file, alloc.c; so do we).
 *
 * It owns three things:
 *   - NEP 49 handlers: one PyDataMem_Handler per datamem context (tag set); the
 *     handler's ctx is the dm_ctx_t, so NumPy's own ContextVar carries the tag set
 *     across await and into asyncio tasks at no cost on the allocation path.
 *     Handlers and their capsules live for the process: every array keeps the
 *     capsule it was allocated with and frees through it, possibly at shutdown.
 *   - dtype discovery, only while the policy in force has a dtype rule: a wrapper
 *     around PyArray_Type.tp_alloc remembers (per thread) the array object being
 *     built; malloc checks it really is that array (no data yet, byte count
 *     matches its shape and dtype) before trusting it, and a tp_dealloc wrapper
 *     forgets it, so a remembered pointer can never be read after it is freed.
 *   - the recording handlers (issue 13), used instead of the plain ones while
 *     an allocation profile is recorded (DATAMEM_PROFILE): they sample by
 *     bytes (or take every allocation), capture the Python call site through a
 *     per-code-object cache, and hand records to the writer
 *     (service/datamem_profile.h). The plain handlers do not change.
 *   - thin wrappers over runtime/datamem.h for Python (load, stats, explain...).
 *
 * The handler functions run with or without the GIL (NumPy calls realloc
 * without it) and never call into Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* 3.10: PyFrame_GetBack and the frame's fields */
#endif

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <jemalloc/jemalloc.h>

#include "dm_build_info.h" /* NumPy and Python versions built against (@local_python) */
#include "policy/policy.h"
#include "runtime/datamem.h"
#include "service/datamem_profile.h"
#include "service/datamem_service.h"

#define HANDLER_NAME "datamem"

/* ---- dtype discovery ------------------------------------------------------ */

static __thread PyObject *building; /* array whose data is about to be allocated */
static allocfunc orig_tp_alloc;
static destructor orig_tp_dealloc;
static int dtype_hooks_on;

static PyObject *alloc_wrapper(PyTypeObject *type, Py_ssize_t nitems) {
    PyObject *obj = orig_tp_alloc(type, nitems);
    building = obj;
    return obj;
}

static void dealloc_wrapper(PyObject *self) {
    if (building == self)
        building = NULL;
    orig_tp_dealloc(self);
}

static int dtype_of_descr(PyArray_Descr *d) {
    npy_intp es = PyDataType_ELSIZE(d);
    switch (d->kind) {
    case 'b': return DM_DT_BOOL;
    case 'i':
        return es == 1 ? DM_DT_INT8 : es == 2 ? DM_DT_INT16 : es == 4 ? DM_DT_INT32
             : es == 8 ? DM_DT_INT64 : DM_DT_OTHER;
    case 'u':
        return es == 1 ? DM_DT_UINT8 : es == 2 ? DM_DT_UINT16 : es == 4 ? DM_DT_UINT32
             : es == 8 ? DM_DT_UINT64 : DM_DT_OTHER;
    case 'f':
        return es == 2 ? DM_DT_FLOAT16 : es == 4 ? DM_DT_FLOAT32 : es == 8 ? DM_DT_FLOAT64
             : DM_DT_LONGDOUBLE;
    case 'c':
        return es == 8 ? DM_DT_COMPLEX64 : es == 16 ? DM_DT_COMPLEX128 : DM_DT_CLONGDOUBLE;
    case 'O': return DM_DT_OBJECT;
    case 'S': return DM_DT_BYTES;
    case 'U': return DM_DT_STR;
    case 'V': return DM_DT_VOID;
    case 'M': return DM_DT_DATETIME;
    case 'm': return DM_DT_TIMEDELTA;
    default: return DM_DT_OTHER;
    }
}

/* The dtype of the array being built, if `size` is its data allocation. */
static int probe_dtype(size_t size) {
    PyObject *obj = building;
    building = NULL; /* one use only */
    if (!obj)
        return DM_DT_UNKNOWN;
    PyArrayObject_fields *fa = (PyArrayObject_fields *)obj;
    if (fa->data != NULL || fa->descr == NULL || fa->nd < 0 || fa->nd > NPY_MAXDIMS)
        return DM_DT_UNKNOWN;
    npy_intp es = PyDataType_ELSIZE(fa->descr);
    size_t n = es > 0 ? (size_t)es : 1;
    for (int i = 0; i < fa->nd; i++) {
        npy_intp dim = fa->dimensions[i];
        if (dim < 0 || (dim && n > SIZE_MAX / (size_t)dim))
            return DM_DT_UNKNOWN;
        n *= (size_t)dim;
    }
    if ((n ? n : 1) != size)
        return DM_DT_UNKNOWN;
    return dtype_of_descr(fa->descr);
}

/* Called with the GIL when a policy with dtype rules is installed. */
static void dtype_hooks_enable(void) {
    if (dtype_hooks_on)
        return;
    orig_tp_alloc = PyArray_Type.tp_alloc;
    orig_tp_dealloc = PyArray_Type.tp_dealloc;
    PyArray_Type.tp_dealloc = dealloc_wrapper; /* first: never leave a dangling `building` */
    PyArray_Type.tp_alloc = alloc_wrapper;
    dtype_hooks_on = 1;
}

/* ---- NEP 49 handler functions ------------------------------------------------ */

/* The dtype of the array being built, when a rule needs it; out of line, so
 * that the common case below is a test and a tail call. */
static __attribute__((noinline)) int h_dtype(size_t size) {
    return dm_runtime_wants_dtype() ? probe_dtype(size) : DM_DT_UNKNOWN;
}

static void *h_alloc_hooked(void *ctx, size_t size, int zero);

/* Whether this allocation needs its dtype or its call site: one load each,
 * both almost always zero. */
static inline int h_hooked(void) {
    return dtype_hooks_on | atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed);
}

static void *h_malloc(void *ctx, size_t size) {
    if (__builtin_expect(h_hooked(), 0))
        return h_alloc_hooked(ctx, size, 0);
    return dm_alloc(ctx, size, DM_DT_UNKNOWN);
}

static void *h_calloc(void *ctx, size_t nelem, size_t elsize) {
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    size_t size = nelem * elsize;
    if (__builtin_expect(h_hooked(), 0))
        return h_alloc_hooked(ctx, size, 1);
    return dm_calloc(ctx, size, DM_DT_UNKNOWN);
}

static void *h_realloc(void *ctx, void *ptr, size_t size) {
    return dm_realloc(ctx, ptr, size);
}

/* NumPy's size here is a guess (NEP 49): a hint that the block may be big
 * (kept for reuse), never trusted for anything else. */
static void h_free(void *ctx, void *ptr, size_t size) { dm_free_hint(ptr, size); }

/* ---- recording handlers (allocation profiles, issue 13) ----------------------
 *
 * Used instead of the functions above while a profile is recorded, so that
 * the plain handler costs nothing extra. Sampling is by bytes, like jemalloc's
 * prof and tcmalloc's sampler: each thread counts down an exponentially
 * distributed number of bytes (mean: the sample interval); the allocation
 * that crosses zero is sampled. An allocation of `size` bytes is then sampled
 * with probability p = 1 - exp(-size / mean), independently of the others
 * (the exponential is memoryless), and its record carries the weight 1 / p:
 * sums of weight and weight * size are unbiased estimates of the counts and
 * bytes of all allocations. Full mode records everything with weight 1.
 *
 * The call site is captured only with the GIL held (PyGILState_Check): NumPy
 * reallocs without it in fromfile/fromstring, and those records say "no GIL"
 * and have no site. Capturing calls Python (frame objects, code attributes),
 * which can allocate arrays (a finalizer run by the cyclic GC): such nested
 * allocations are not sampled (`busy`). Frees are recorded before the block is
 * released, so that no other thread can be handed the address first. */

static bool prof_on;         /* new handlers record (set with the GIL) */
static unsigned prof_flags;  /* DM_PROF_*; set before the handlers are used */
static PyObject *name_key;   /* "__name__", interned */
static double prof_mean;     /* sampled mode: mean bytes between samples */

typedef struct prof_tls {
    int64_t left;            /* bytes to the next sample */
    double mean;             /* the mean `left` was drawn with (the sample's weight) */
    uint64_t rng;            /* xorshift64* state; 0 = not seeded */
    bool busy;               /* capturing a sample on this thread */
    char thread[DM_NAME_MAX]; /* set with the runtime's (py_set_thread_name) */
} prof_tls_t;

static __thread prof_tls_t ptls;

static double prof_uniform(prof_tls_t *s) { /* (0, 1] */
    s->rng ^= s->rng >> 12;
    s->rng ^= s->rng << 25;
    s->rng ^= s->rng >> 27;
    return (double)(((s->rng * 0x2545F4914F6CDD1Dull) >> 11) + 1) * 0x1.0p-53;
}

/* Bounded files: a sampled profile keeps to about PROF_RATE samples a second
 * on average (a token bucket: bursts of up to PROF_BURST, so short jobs keep
 * their detail). Once the bucket is less than half full, each sample rescales
 * the mean interval by (1 / PROF_RATE) / (time since the previous sample),
 * clamped to [1/2, 4] per step and never below the asked-for mean: the mean
 * follows the job's allocation rate smoothly, without the overshoot of a
 * doubling controller (whose huge late samples made estimates swing 3x).
 * Each gap is drawn with the mean in force and the sample's weight uses that
 * same mean, so the estimates stay unbiased (the mean only decides how many
 * samples there are). 10 samples/s of ~100 bytes (allocation and free
 * records) is about 3.6 MB an hour, plus ~1000 x ln(duration) samples from the
 * resolution floor below (about 1.5 MB over the first hour), whatever the job
 * allocates (tests/python/test_profile.py: 3 s at ~2 TB/s, 11,700 samples,
 * 890 KB, estimate within 3%). The burst is large enough that a short job
 * (a few thousand samples) is sampled exactly as asked. Sampled mode
 * only; full mode records everything by definition. */
#define PROF_RATE 10.0
#define PROF_BURST 10000.0
static pthread_mutex_t prof_rate_mu = PTHREAD_MUTEX_INITIALIZER;
static double prof_asked;     /* the mean asked for (--sample) */
static double prof_tokens = PROF_BURST, prof_tokens_at; /* under prof_rate_mu */
static double prof_seen;      /* estimated bytes allocated so far (sum of weights x sizes) */

/* A thread that held the rate lock at fork() does not exist in the child. */
static void prof_rate_atfork_child(void) { pthread_mutex_init(&prof_rate_mu, NULL); }

static void prof_rate_register_atfork(void) {
    pthread_atfork(NULL, NULL, prof_rate_atfork_child);
}

static double prof_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One sample taken (`bytes`: what it stands for, weight x size): spend a
 * token, adapt the mean (rare path, any thread). The mean also stays below
 * 1/1000 of the bytes seen so far, so a short job keeps about a thousand
 * samples' resolution (this adds only ~1000 x ln(duration) samples over a
 * job's life). */
static double prof_rate_take(double bytes) {
    pthread_mutex_lock(&prof_rate_mu);
    prof_seen += bytes;
    double now = prof_now_s();
    if (prof_tokens_at > 0) {
        prof_tokens += (now - prof_tokens_at) * PROF_RATE;
        if (prof_tokens > PROF_BURST)
            prof_tokens = PROF_BURST;
    }
    double dt = prof_tokens_at > 0 ? now - prof_tokens_at : 1.0 / PROF_RATE;
    prof_tokens_at = now;
    prof_tokens -= 1.0;
    double mean = prof_mean;
    if (prof_tokens < PROF_BURST / 2) {
        double f = dt > 0 ? (1.0 / PROF_RATE) / dt : 4.0;
        f = f < 0.5 ? 0.5 : f > 4.0 ? 4.0 : f;
        mean *= f;
        if (mean > prof_seen / 1000)
            mean = prof_seen / 1000;
        if (mean < prof_asked)
            mean = prof_asked;
        if (mean > 1e15)
            mean = 1e15;
    }
    prof_mean = mean;
    pthread_mutex_unlock(&prof_rate_mu);
    return mean;
}

static int64_t prof_gap(prof_tls_t *s, double mean) {
    s->mean = mean;
    double g = -log(prof_uniform(s)) * mean;
    return g >= 9.0e18 ? INT64_MAX : (int64_t)g + 1;
}

static __attribute__((noinline)) bool prof_sample_slow(prof_tls_t *s, size_t size, double *w) {
    if (!s->rng) { /* first allocation on this thread: start the count-down */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        s->rng = ((uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull) ^ (uint64_t)(uintptr_t)s ^
                 ((uint64_t)ts.tv_sec << 32) ^ 1;
        pthread_mutex_lock(&prof_rate_mu);
        double mean = prof_mean;
        pthread_mutex_unlock(&prof_rate_mu);
        s->left = prof_gap(s, mean) - (int64_t)size;
        if (s->left > 0)
            return false;
    }
    /* The block crossed a gap drawn with s->mean: sampled with probability
     * 1 - exp(-size / s->mean) (the countdown is memoryless). */
    double p = -expm1(-(double)size / s->mean);
    *w = p > 0 ? 1.0 / p : 1.0;
    s->left = prof_gap(s, prof_rate_take(*w * (double)size));
    return true;
}

static inline bool prof_sample(size_t size, double *w) {
    if (prof_flags & DM_PROF_FULL) {
        *w = 1.0;
        return true;
    }
    prof_tls_t *s = &ptls;
    if (__builtin_expect((s->left -= (int64_t)size) > 0, 1))
        return false;
    return prof_sample_slow(s, size, w);
}

/* Call sites: one entry per code object, made on first sight and kept for the
 * process together with a reference to the code object (so its address is
 * never reused by another). Guarded by the GIL. The module is the frame's
 * globals' __name__ when the entry is made (code run with other globals, as
 * by exec, keeps the first one). */
typedef struct code_entry {
    PyObject *code;
    char *module, *function, *file; /* function: module.qualname */
    bool internal;                  /* numpy, pandas, scipy, sklearn, datamem */
    uint64_t site_mask, site_gen;   /* call-site rules matching it, for install site_gen */
} code_entry_t;

static code_entry_t **code_tab;
static size_t code_cap, code_n;

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
    return e;
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

static uint64_t site_mask_now(uint64_t *gen) {
    if (!PyGILState_Check())
        return 0;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    bool had_error = PyErr_Occurred() != NULL; /* an allocation may happen while one is set */
    if (had_error)
        PyErr_Fetch(&et, &ev, &tb);
    uint64_t mask = 0, want = dm_runtime_site_gen();
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
    if (had_error)
        PyErr_Restore(et, ev, tb);
    else
        PyErr_Clear();
    return mask;
}

static __attribute__((noinline)) void *h_alloc_hooked(void *ctx, size_t size, int zero) {
    int dt = dtype_hooks_on ? h_dtype(size) : DM_DT_UNKNOWN;
    uint64_t gen = 0, mask = 0;
    if (atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed))
        mask = site_mask_now(&gen);
    return zero ? dm_calloc_site(ctx, size, dt, mask, gen) : dm_alloc_site(ctx, size, dt, mask, gen);
}

/* Walks the Python stack (GIL held): frames innermost first, up to the call
 * site (the innermost frame outside internal_packages) or, with stacks, all
 * of them. Returns the number of frames; *site is the call site's index (the
 * innermost frame when every frame is internal), -1 when there is none. */
static int prof_capture(dm_prof_frame_t *out, int max, int *site) {
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    bool stacks = (prof_flags & DM_PROF_STACKS) != 0;
    int n = 0;
    *site = -1;
    while (f && n < max) {
        PyCodeObject *co = PyFrame_GetCode(f);
        code_entry_t *e = co ? code_lookup((PyObject *)co, f) : NULL;
        Py_XDECREF(co);
        if (e) {
            int line = PyFrame_GetLineNumber(f);
            out[n] = (dm_prof_frame_t){e, line > 0 ? (uint32_t)line : 0, e->module,
                                       e->function, e->file};
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

static __attribute__((noinline)) void prof_record(const dm_ctx_t *ctx, void *p, size_t size,
                                                  int dt, int route_dt, double w,
                                                  uint8_t flags) {
    prof_tls_t *s = &ptls;
    if (s->busy || !dm_prof_active())
        return;
    s->busy = true;
    dm_prof_alloc_t a = {.t_ns = dm_prof_now(), .ptr = p, .size = size, .weight = w,
                         .site = -1, .dtype = (uint8_t)dt, .flags = flags};
    a.thread = s->thread[0] ? s->thread : NULL;
    const char *tagv[64];
    char tags[1024] = "";
    int ntags = dm_ctx_tags(ctx, tagv, 64);
    for (int i = 0, off = 0; i < ntags && i < 64 && off < (int)sizeof(tags); i++)
        off += snprintf(tags + off, sizeof(tags) - (size_t)off, "%s%s", i ? "," : "", tagv[i]);
    a.tags = tags[0] ? tags : NULL;
    char rule[DM_NAME_MAX] = "";
    const char *r = dm_runtime_rule_of(ctx, size, route_dt);
    if (r) {
        snprintf(rule, sizeof(rule), "%s", r);
        a.rule = rule;
    }
    a.arena = dm_owner_arena(p); /* arenas live for the process */
    dm_prof_frame_t frames[DM_PROF_FRAMES_MAX];
    if (PyGILState_Check()) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb); /* an allocation may happen while one is set */
        a.nframes = prof_capture(frames, DM_PROF_FRAMES_MAX, &a.site);
        a.frames = frames;
        PyErr_Restore(et, ev, tb);
    } else {
        a.flags |= DM_PROF_NOGIL;
    }
    dm_prof_record_alloc(&a);
    s->busy = false;
}

static inline int prof_route_dt(int dt) {
    return dt != DM_DT_UNKNOWN && dm_runtime_wants_dtype() ? dt : DM_DT_UNKNOWN;
}

static void *h_malloc_prof(void *ctx, size_t size) {
    int dt = probe_dtype(size), rdt = prof_route_dt(dt);
    void *p = dm_alloc(ctx, size, rdt);
    double w;
    if (p && prof_sample(size, &w))
        prof_record(ctx, p, size, dt, rdt, w, 0);
    return p;
}

static void *h_calloc_prof(void *ctx, size_t nelem, size_t elsize) {
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    size_t size = nelem * elsize;
    int dt = probe_dtype(size), rdt = prof_route_dt(dt);
    void *p = dm_calloc(ctx, size, rdt);
    double w;
    if (p && prof_sample(size, &w))
        prof_record(ctx, p, size, dt, rdt, w, DM_PROF_CALLOC);
    return p;
}

static inline void prof_free(void *ptr) {
    if (ptr && ((prof_flags & DM_PROF_FULL) || dm_prof_maybe_live(ptr)))
        dm_prof_record_free(ptr, dm_prof_now());
}

/* A realloc ends the old block's record and starts a new one, flagged. */
static void *h_realloc_prof(void *ctx, void *ptr, size_t size) {
    prof_free(ptr);
    void *q = dm_realloc(ctx, ptr, size);
    double w;
    if (q && prof_sample(size, &w))
        prof_record(ctx, q, size, DM_DT_UNKNOWN, DM_DT_UNKNOWN, w, DM_PROF_REALLOC);
    return q;
}

static void h_free_prof(void *ctx, void *ptr, size_t size) {
    prof_free(ptr);
    dm_free_hint(ptr, size);
}

/* NumPy strcmp()s the capsule's name with its own "mem_handler" on every
 * allocation and free. glibc's vector strcmp costs least when both strings sit
 * at the same offset in a vector, as they do for NumPy's default handler, whose
 * capsule carries NumPy's own string: so ours carries it too (NumPy is never
 * unloaded). 40 instead of 62 instructions per np.empty malloc+free pair
 * (bench/callgrind.sh). Our own copy when NumPy's name is not the expected one. */
static const char *capsule_name = "mem_handler";

static void capsule_name_init(void) {
    const char *numpy_name = PyCapsule_GetName(PyDataMem_DefaultHandler);
    if (numpy_name && strcmp(numpy_name, "mem_handler") == 0)
        capsule_name = numpy_name;
    PyErr_Clear();
}

/* One handler + capsule per context, kept forever (arrays hold the capsule). */
typedef struct handler_entry {
    struct handler_entry *next;
    const dm_ctx_t *ctx;
    PyDataMem_Handler handler;
    PyObject *capsule;
} handler_entry_t;

static handler_entry_t *handlers; /* guarded by the GIL */

static void handler_set_functions(PyDataMem_Handler *h, bool recording) {
    h->allocator.malloc = recording ? h_malloc_prof : h_malloc;
    h->allocator.calloc = recording ? h_calloc_prof : h_calloc;
    h->allocator.realloc = recording ? h_realloc_prof : h_realloc;
    h->allocator.free = recording ? h_free_prof : h_free;
}

static PyObject *capsule_for(const dm_ctx_t *ctx) {
    for (handler_entry_t *e = handlers; e; e = e->next)
        if (e->ctx == ctx)
            return Py_NewRef(e->capsule);
    handler_entry_t *e = PyMem_RawCalloc(1, sizeof(*e));
    if (!e)
        return PyErr_NoMemory();
    snprintf(e->handler.name, sizeof(e->handler.name), "%s", HANDLER_NAME);
    e->handler.version = 1;
    e->handler.allocator.ctx = (void *)ctx;
    handler_set_functions(&e->handler, prof_on);
    e->ctx = ctx;
    e->capsule = PyCapsule_New(&e->handler, capsule_name, NULL);
    if (!e->capsule) {
        PyMem_RawFree(e);
        return NULL;
    }
    e->next = handlers;
    handlers = e;
    return Py_NewRef(e->capsule);
}

/* ---- Python API ---------------------------------------------------------------- */

static PyObject *PolicyError;

/* Paths are bytes (issue 24): a path argument is str, bytes or os.PathLike,
 * encoded as the file system does ("O&" with PyUnicode_FSConverter: a str from
 * os.environ or sys.argv gives back the very bytes it came from, undecodable
 * ones included) and held as a bytes object the caller releases. Text that
 * carries a path back (diagnostics) is decoded with undecodable bytes shown
 * as \xNN; a path handed back as a path round-trips (os.fsdecode). */
static int fs_path_or_none(PyObject *o, void *out) {
    if (o == Py_None) {
        *(PyObject **)out = NULL;
        return 1;
    }
    return PyUnicode_FSConverter(o, out);
}

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

static PyObject *py_load(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    dm_diags_t *d = PyMem_RawMalloc(sizeof(*d));
    if (!d) {
        Py_DECREF(path_obj);
        return PyErr_NoMemory();
    }
    dm_diags_init(d, path);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_runtime_load(path, d);
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (rc)
        raise_diags(d, rc);
    else {
        if (dm_runtime_wants_dtype())
            dtype_hooks_enable();
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

static const dm_ctx_t *ctx_from_tags(PyObject *tags) {
    const dm_ctx_t *c = dm_ctx_root();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tags);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *t = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(tags, i));
        if (!t)
            return NULL;
        if (!(c = dm_ctx_with_tag(c, t))) {
            PyErr_Format(PyExc_ValueError, "tag '%s': too many tags or contexts", t);
            return NULL;
        }
    }
    return c;
}

/* handler(tags=()) -> the NEP 49 capsule for that tag set */
static PyObject *py_handler(PyObject *self, PyObject *args) {
    PyObject *tags = NULL;
    if (!PyArg_ParseTuple(args, "|O", &tags))
        return NULL;
    if (!tags)
        return capsule_for(dm_ctx_root());
    PyObject *seq = PySequence_Fast(tags, "tags must be a sequence of str");
    if (!seq)
        return NULL;
    const dm_ctx_t *c = ctx_from_tags(seq);
    Py_DECREF(seq);
    return c ? capsule_for(c) : NULL;
}

/* handler_tags(capsule) -> tuple of tags, or None if not a datamem handler */
static PyObject *py_handler_tags(PyObject *self, PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "mem_handler"))
        Py_RETURN_NONE;
    PyDataMem_Handler *h = PyCapsule_GetPointer(cap, "mem_handler");
    if (!h || (h->allocator.malloc != h_malloc && h->allocator.malloc != h_malloc_prof))
        Py_RETURN_NONE;
    const char *tags[256];
    int n = dm_ctx_tags(h->allocator.ctx, tags, 256);
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++)
        PyTuple_SET_ITEM(t, i, PyUnicode_FromString(tags[i]));
    return t;
}

static PyObject *py_set_handler(PyObject *self, PyObject *cap) {
    return PyDataMem_SetHandler(cap == Py_None ? NULL : cap);
}

static PyObject *py_get_handler(PyObject *self, PyObject *unused) {
    return PyDataMem_GetHandler();
}

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
    snprintf(ptls.thread, sizeof(ptls.thread), "%s", s);
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

static const char *thp_name(int m) {
    return m == DM_THP_ON ? "on" : m == DM_THP_OFF ? "off" : "system";
}

static const char *numa_name(int m) {
    static const char *const names[] = {"none", "local", "bind", "interleave", "preferred"};
    return m >= 0 && m < 5 ? names[m] : "?";
}

#define SET_U64(d, k, v)                                                       \
    do {                                                                       \
        PyObject *_o = PyLong_FromUnsignedLongLong((unsigned long long)(v));   \
        if (!_o || PyDict_SetItemString(d, k, _o) < 0) {                       \
            Py_XDECREF(_o);                                                    \
            goto fail;                                                         \
        }                                                                      \
        Py_DECREF(_o);                                                         \
    } while (0)

#define SET_OBJ(d, k, expr)                                                    \
    do {                                                                       \
        PyObject *_o = (expr);                                                 \
        if (!_o || PyDict_SetItemString(d, k, _o) < 0) {                       \
            Py_XDECREF(_o);                                                    \
            goto fail;                                                         \
        }                                                                      \
        Py_DECREF(_o);                                                         \
    } while (0)

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
    SET_OBJ(d, "lock", PyBool_FromLong(a->lock));
    SET_OBJ(d, "pinned", PyUnicode_FromString(a->pinned == DM_PIN_CUDA ? "cuda" : "none"));
    SET_U64(d, "locked_bytes", a->locked_bytes);
    SET_U64(d, "pinned_bytes", a->pinned_bytes);
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *u64_or_none(uint64_t v) {
    return v == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(v);
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
    PyObject *arenas = NULL, *rules = NULL, *d = PyDict_New();
    if (!d)
        goto fail;
    if (!(arenas = PyDict_New()) || !(rules = PyDict_New()))
        goto fail;
    for (int i = 0; i < s->narenas; i++) {
        PyObject *a = arena_dict(&s->arenas[i]);
        if (!a || PyDict_SetItemString(arenas, s->arenas[i].name, a) < 0) {
            Py_XDECREF(a);
            goto fail;
        }
        Py_DECREF(a);
    }
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
    SET_OBJ(d, "arenas", Py_NewRef(arenas));
    SET_OBJ(d, "rules", Py_NewRef(rules));
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
    if (proc.resident) { /* pyarrow_allocated_bytes: datamem.stats() reads it live */
        SET_U64(d, "process_resident_bytes", proc.resident);
        SET_U64(d, "outside_arenas_resident_bytes", proc.outside_arenas);
    }
    if (set_tags(d, s) < 0)
        goto fail;
    Py_DECREF(arenas);
    Py_DECREF(rules);
    dm_stats_release(s);
    PyMem_RawFree(s);
    return d;
fail:
    Py_XDECREF(arenas);
    Py_XDECREF(rules);
    Py_XDECREF(d);
    dm_stats_release(s);
    PyMem_RawFree(s);
    return NULL;
}

/* check(path) -> (ok, diagnostics text, summary) without installing anything */
static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    dm_diags_t *d = PyMem_RawMalloc(sizeof(*d));
    char *buf = PyMem_RawMalloc(16384);
    if (!d || !buf) {
        PyMem_RawFree(d), PyMem_RawFree(buf);
        Py_DECREF(path_obj);
        return PyErr_NoMemory();
    }
    dm_diags_init(d, path);
    dm_topology_t topo;
    dm_runtime_topology(&topo);
    dm_policy_t *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dm_policy_load_ex(path, &topo, DM_PARSE_LINT, &p, d); /* check lints */
    Py_END_ALLOW_THREADS
    buf[0] = 0;
    if (d->n)
        dm_diags_format_all(d, buf, 16384);
    else if (rc)
        snprintf(buf, 16384, "%s: error: %s\n", path, dm_strerror(rc));
    char summary[256] = "";
    if (p)
        snprintf(summary, sizeof(summary), "%d arena%s, %d rule%s, default '%s'",
                 p->narenas, p->narenas == 1 ? "" : "s", p->nrules,
                 p->nrules == 1 ? "" : "s", p->arenas[p->default_arena].name);
    PyObject *text = text_of(buf);
    PyObject *res = text ? Py_BuildValue("(ONs)", rc == 0 ? Py_True : Py_False, text, summary)
                         : NULL;
    dm_policy_free(p);
    PyMem_RawFree(d);
    PyMem_RawFree(buf);
    Py_DECREF(path_obj);
    return res;
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
    const char *path = PyBytes_AS_STRING(path_obj);
    int dt = -1;
    for (int i = 0; i < DM_DT_COUNT; i++)
        if (strcmp(dm_dtype_name(i), dtype) == 0)
            dt = i;
    if (dt < 0) {
        PyErr_Format(PyExc_ValueError, "unknown dtype '%s'", dtype);
        Py_DECREF(path_obj);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(tags, "tags must be a sequence of str");
    if (!seq) {
        Py_DECREF(path_obj);
        return NULL;
    }
    Py_ssize_t ntags = PySequence_Fast_GET_SIZE(seq);
    const char *tagv[64];
    if (ntags > 64)
        ntags = 64;
    for (Py_ssize_t i = 0; i < ntags; i++)
        if (!(tagv[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i)))) {
            Py_DECREF(seq);
            Py_DECREF(path_obj);
            return NULL;
        }
    dm_diags_t *d = PyMem_RawMalloc(sizeof(*d));
    size_t cap = 1 << 16;
    char *buf = PyMem_RawMalloc(cap);
    PyObject *res = NULL;
    dm_policy_t *p = NULL;
    dm_table_t *t = NULL;
    if (!d || !buf) {
        PyErr_NoMemory();
        goto done;
    }
    dm_diags_init(d, path);
    dm_topology_t topo;
    dm_runtime_topology(&topo);
    int rc = dm_policy_load(path, &topo, &p, d);
    if (rc) {
        raise_diags(d, rc);
        goto done;
    }
    if (dm_table_compile(p, &t) != 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (table)
        dm_table_dump(t, buf, cap);
    else {
        dm_context_t ctx = {thread, tagv, (int)ntags, module, function};
        dm_table_explain(t, &ctx, (size_t)size, dt, buf, cap);
    }
    res = text_of(buf);
done:
    Py_DECREF(seq);
    Py_DECREF(path_obj);
    dm_table_free(t);
    dm_policy_free(p);
    PyMem_RawFree(d);
    PyMem_RawFree(buf);
    return res;
}

static PyObject *py_after_fork_child(PyObject *self, PyObject *unused) {
    dm_runtime_after_fork_child();
    Py_RETURN_NONE;
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

/* site_rules_active() -> whether the handler looks up call sites */
static PyObject *py_site_rules_active(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed));
}

/* set_threads_not_covered(names): for /metrics and /stats.json */
static PyObject *py_set_threads_not_covered(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "set_threads_not_covered: expected a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 4096)
        n = 4096;
    const char **names = PyMem_RawCalloc((size_t)n + 1, sizeof(char *));
    if (!names) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
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

/* ---- allocation profiles ---------------------------------------------------- */

/* profile_start(dir, sample_bytes, full, stacks, meta, max_bytes=0) -> path of
 * this process's file, or "" when DIR is refused (another user's, writable by
 * others: logged, and the job runs on without a profile). max_bytes: each
 * process's file stops there (0: DM_PROF_MAX_BYTES_DEFAULT, 256 MiB).
 * Every datamem handler, existing or made later, records from now on. */
static PyObject *profile_start(const char *dir, unsigned long long sample, int full, int stacks,
                               const char *meta, unsigned long long max_bytes);

static PyObject *py_profile_start(PyObject *self, PyObject *args) {
    const char *meta;
    PyObject *dir_obj;
    unsigned long long sample, max_bytes = 0;
    int full, stacks;
    if (!PyArg_ParseTuple(args, "O&Kpps|K", PyUnicode_FSConverter, &dir_obj, &sample, &full,
                          &stacks, &meta, &max_bytes))
        return NULL;
    PyObject *res = profile_start(PyBytes_AS_STRING(dir_obj), sample, full, stacks, meta,
                                  max_bytes);
    Py_DECREF(dir_obj);
    return res;
}

static PyObject *profile_start(const char *dir, unsigned long long sample, int full, int stacks,
                               const char *meta, unsigned long long max_bytes) {
    if (!full && sample == 0) {
        PyErr_SetString(PyExc_ValueError, "sample interval must be at least 1 byte");
        return NULL;
    }
    if (max_bytes != 0 && max_bytes < DM_PROF_MAX_BYTES_MIN) {
        PyErr_Format(PyExc_ValueError, "profile size limit must be at least %llu bytes (1MiB)",
                     (unsigned long long)DM_PROF_MAX_BYTES_MIN);
        return NULL;
    }
    unsigned flags = (full ? DM_PROF_FULL : 0) | (stacks ? DM_PROF_STACKS : 0);
    if (!name_key && !(name_key = PyUnicode_InternFromString("__name__")))
        return NULL;
    pthread_mutex_lock(&prof_rate_mu);
    prof_mean = prof_asked = (double)sample;
    prof_tokens = PROF_BURST;
    prof_tokens_at = 0;
    prof_seen = 0;
    pthread_mutex_unlock(&prof_rate_mu);
    prof_flags = flags; /* before the file opens: a fork child sees both */
    int rc = dm_prof_start(dir, sample, flags, max_bytes, meta);
    if (rc == DM_ESTATE) {
        PyErr_SetString(PyExc_RuntimeError, "datamem: already recording a profile");
        return NULL;
    }
    if (rc == DM_EUNSAFE) /* logged; no handler records */
        return PyUnicode_FromString("");
    if (rc) {
        PyErr_Format(PyExc_OSError, "datamem: cannot record a profile in %s: %s", dir,
                     dm_strerror(rc));
        return NULL;
    }
    prof_on = true;
    dtype_hooks_enable();       /* the records carry the dtype */
    for (handler_entry_t *e = handlers; e; e = e->next)
        handler_set_functions(&e->handler, true);
    char path[4200];
    dm_prof_path(path, sizeof(path));
    return PyUnicode_DecodeFSDefault(path);
}

static PyObject *py_profile_flush(PyObject *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    dm_prof_flush();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_profile_mark_exit(PyObject *self, PyObject *unused) {
    dm_prof_mark_exit();
    Py_RETURN_NONE;
}

static PyObject *py_profile_stop(PyObject *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    dm_prof_stop();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* profile_info() -> (path or "", samples, bytes written) */
static PyObject *py_profile_info(PyObject *self, PyObject *unused) {
    char path[4200];
    uint64_t samples, bytes;
    dm_prof_path(path, sizeof(path));
    dm_prof_counts(&samples, &bytes);
    return Py_BuildValue("(NKK)", PyUnicode_DecodeFSDefault(path), (unsigned long long)samples,
                         (unsigned long long)bytes);
}

static PyMethodDef methods[] = {
    {"refusals", py_refusals, METH_O, "refusals(tag or None) -> (count, request, limit, live) or None"},
    {"last_failure", py_last_failure, METH_NOARGS, "last_failure() -> the thread's last limit refusal, or None"},
    {"site_rules_active", py_site_rules_active, METH_NOARGS, "whether call-site rules are in force"},
    {"set_threads_not_covered", py_set_threads_not_covered, METH_O, "set_threads_not_covered(names)"},
    {"set_pyarrow_bytes", py_set_pyarrow_bytes, METH_O, "set_pyarrow_bytes(n): pyarrow's pool for the exporter"},
    {"set_cudart", py_set_cudart, METH_VARARGS, "set_cudart(path): the CUDA runtime for pinned: cuda"},
    {"fault_lock", py_fault_lock, METH_VARARGS, "fault_lock(n): the next n page-locks fail (tests)"},
    {"warnings_changed", py_warnings_changed, METH_O, "warnings_changed(text) -> whether these policy warnings are new to this process"},
    {"profile_start", py_profile_start, METH_VARARGS, "profile_start(dir, sample_bytes, full, stacks, meta, max_bytes=0) -> file, or '' when dir is refused"},
    {"profile_flush", py_profile_flush, METH_NOARGS, "write the profile's buffered records"},
    {"profile_mark_exit", py_profile_mark_exit, METH_NOARGS, "mark the start of interpreter exit in the profile"},
    {"profile_stop", py_profile_stop, METH_NOARGS, "flush and close the profile"},
    {"profile_info", py_profile_info, METH_NOARGS, "profile_info() -> (file, samples, bytes)"},
    {"stats_textfile_sweep", py_stats_textfile_sweep, METH_VARARGS, "stats_textfile_sweep(template, min_age_ms) -> files removed"},
    {"metrics", py_metrics, METH_VARARGS, "metrics(json=False) -> Prometheus text (or JSON)"},
    {"stats_serve", py_stats_serve, METH_VARARGS, "stats_serve(http, unix_socket) -> 0 or error code"},
    {"stats_endpoint", py_stats_endpoint, METH_NOARGS, "stats_endpoint() -> (url, unix_socket)"},
    {"stats_stop", py_stats_stop, METH_NOARGS, "stop serving stats; last textfile write"},
    {"stats_textfile_write", py_stats_textfile_write, METH_VARARGS, "stats_textfile_write(path) -> 0 or error code"},
    {"after_fork_child", py_after_fork_child, METH_NOARGS, "restart runtime threads in a forked child"},
    {"policy_settings", py_policy_settings, METH_NOARGS, "process-level settings of the policy in force"},
    {"check", py_check, METH_VARARGS, "check(path) -> (ok, diagnostics, summary)"},
    {"explain", py_explain, METH_VARARGS, "explain(path, size, dtype, thread, tags, table) -> text"},
    {"load", py_load, METH_VARARGS, "load(path) -> warnings: parse, compile and publish a policy"},
    {"handler", py_handler, METH_VARARGS, "handler(tags=()) -> NEP 49 capsule for a tag set"},
    {"handler_tags", py_handler_tags, METH_O, "handler_tags(capsule) -> tags, or None if not datamem's"},
    {"set_handler", py_set_handler, METH_O, "set_handler(capsule) -> previous handler (this context)"},
    {"get_handler", py_get_handler, METH_NOARGS, "get_handler() -> the current context's handler"},
    {"set_thread_name", py_set_thread_name, METH_O, "set_thread_name(name): for thread rules"},
    {"active", py_active, METH_NOARGS, "active() -> True once a policy is in force"},
    {"set_numpy_hugepages", py_set_numpy_hugepages, METH_O, "set_numpy_hugepages(on): NumPy's madvise-hugepage setting, for arenas at hugepages: system"},
    {"jemalloc_version", py_jemalloc_version, METH_NOARGS, "jemalloc_version() -> version of the jemalloc linked in"},
    {"owner_arena", py_owner_arena, METH_O, "owner_arena(arr) -> name of the arena holding arr's data"},
    {"stats", py_stats, METH_NOARGS, "stats() -> dict of per-arena and per-rule numbers"},
    {"fault_extent_alloc", py_fault_extent_alloc, METH_O, "testing: fail the next n extent allocations"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "datamem._ext", "datamem's C core", -1, methods,
    NULL, NULL, NULL, NULL,
};

__attribute__((visibility("default"))) PyMODINIT_FUNC PyInit__ext(void);

PyMODINIT_FUNC PyInit__ext(void) {
    import_array();
    capsule_name_init();
    if (dm_runtime_init() != 0) {
        PyErr_SetString(PyExc_RuntimeError, "datamem: runtime initialisation failed");
        return NULL;
    }
    static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
    pthread_once(&atfork_once, prof_rate_register_atfork);
    /* The call-site cache (profiles and call-site rules) keys on this. */
    if (!name_key && !(name_key = PyUnicode_InternFromString("__name__")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PolicyError = PyErr_NewExceptionWithDoc(
        "datamem.PolicyError", "A policy file could not be loaded.", PyExc_ValueError, NULL);
    if (!PolicyError || PyModule_AddObject(m, "PolicyError", Py_NewRef(PolicyError)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddStringConstant(m, "HANDLER_NAME", HANDLER_NAME);
    PyModule_AddStringConstant(m, "VERSION", DM_VERSION_STRING);
    PyModule_AddIntConstant(m, "PROFILE_MAX_BYTES_MIN", (long)DM_PROF_MAX_BYTES_MIN);
    PyModule_AddStringConstant(m, "BUILD_NUMPY_VERSION", DM_BUILD_NUMPY_VERSION);
    PyModule_AddStringConstant(m, "BUILD_PYTHON_VERSION", DM_BUILD_PYTHON_VERSION);
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
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
