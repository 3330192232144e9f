/*
 * record.c: allocation profiles from the extension's side: the recording
 * handler functions, their sampler, and the Python functions that start,
 * flush and stop a profile (DATAMEM_PROFILE, `python -m datamem profile`).
 * While a profile is recorded every datamem handler calls the
 * dm__record_* functions instead of handler.c's plain ones, so that the plain
 * handler costs nothing extra; records go to the writer
 * (service/datamem_profile.h), call sites come from site.c.
 *
 * The handler functions run with or without the GIL and touch Python only
 * with an attached thread state (the call site). The sampler's per-thread
 * state is thread-local; its shared rate state is under prof_rate_mu;
 * profile_start is serialised by prof_start_mu (free-threaded CPython runs
 * two at once).
 */
#include "pyext/ext.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "policy/policy.h"
#include "runtime/datamem.h"
#include "service/datamem_profile.h"

/* ---- sampling -----------------------------------------------------------------
 * By bytes, like jemalloc's prof and tcmalloc's sampler: each thread counts
 * down an exponentially distributed number of bytes (mean: the sample
 * interval); the allocation that crosses zero is sampled. Each allocation
 * counts as its size plus extra = asked / PROF_COUNT_SHARE bytes (asked: the
 * mean asked for, --sample; not the mean the rate controller below raises,
 * so that raising it still bounds the samples of a loop of tiny arrays), so an allocation of
 * `size` bytes is sampled with probability p = 1 - exp(-(size + extra) /
 * mean), independently of the others (the exponential is memoryless), and its
 * record carries the weight 1 / p: sums of weight and weight * size are
 * unbiased estimates of the counts and bytes of all allocations. The extra
 * bytes give a tiny array a chance of about 1 / PROF_COUNT_SHARE: by bytes
 * alone an 8-byte array at 512 KiB is sampled once in 65,536, so a job's
 * thousands of 0-d temporaries were almost never seen and its estimated
 * count was the big arrays' alone (107 allocations against 865; a job of
 * 1,000 64 KiB arrays and 3,000 tiny ones read 1,123 against 4,000).
 * Full mode records everything with weight 1. */
#define PROF_COUNT_SHARE 16.0

/* DM_PROF_*: stored by profile_start (under prof_start_mu, before the handlers
 * record), read relaxed by every recording handler */
static _Atomic unsigned prof_flags;
static double prof_mean;     /* sampled mode: mean bytes between samples; under prof_rate_mu */

typedef struct prof_tls {
    int64_t left;            /* bytes to the next sample */
    int64_t extra;           /* bytes each allocation counts beyond its size (the gap's) */
    double mean;             /* the mean `left` was drawn with (the sample's weight) */
    uint64_t rng;            /* xorshift64* state; 0 = not seeded */
    bool busy;               /* capturing a sample on this thread */
    char thread[DM_NAME_MAX]; /* set with the runtime's (dm__record_set_thread_name) */
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
 * allocates (tests/python/profile/test_profile.py: 3 s at ~2 TB/s, 11,700 samples,
 * 890 KB, estimate within 3%). The burst is large enough that a short job
 * (a few thousand samples) is sampled exactly as asked. Sampled mode
 * only; full mode records everything by definition. */
#define PROF_RATE 10.0
#define PROF_BURST 10000.0
static pthread_mutex_t prof_rate_mu = PTHREAD_MUTEX_INITIALIZER;
static double prof_asked;     /* the mean asked for (--sample) */
static double prof_tokens = PROF_BURST, prof_tokens_at; /* under prof_rate_mu */
static double prof_seen;      /* estimated bytes allocated so far (sum of weights x sizes) */

/* One profile_start at a time: a second one (refused: already recording)
 * must not change the running profile's settings first. */
static dm_pymu_t prof_start_mu = DM_PYMU_INIT;

/* A thread that held a lock at fork() does not exist in the child: the
 * rate lock and every pyext mutex start unlocked there. */
static void prof_rate_atfork_child(void) {
    pthread_mutex_init(&prof_rate_mu, NULL);
    dm_pymu_reset(&prof_start_mu);
    dm__handler_after_fork_child();
    dm__site_after_fork_child();
    dm__shadow_after_fork_child();
}

static void prof_rate_register_atfork(void) {
    pthread_atfork(NULL, NULL, prof_rate_atfork_child);
}

void dm__record_init(void) {
    static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
    pthread_once(&atfork_once, prof_rate_register_atfork);
}

void dm__record_set_thread_name(const char *name) {
    snprintf(ptls.thread, sizeof(ptls.thread), "%s", name);
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
static double prof_rate_take(double bytes, int64_t *extra) {
    pthread_mutex_lock(&prof_rate_mu);
    *extra = (int64_t)(prof_asked / PROF_COUNT_SHARE);
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

static int64_t prof_gap(prof_tls_t *s, double mean, int64_t extra) {
    s->mean = mean;
    s->extra = extra;
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
        int64_t extra = (int64_t)(prof_asked / PROF_COUNT_SHARE);
        pthread_mutex_unlock(&prof_rate_mu);
        s->left = prof_gap(s, mean, extra) - (int64_t)size - extra;
        if (s->left > 0)
            return false;
    }
    /* The block crossed a gap drawn with s->mean: sampled with probability
     * 1 - exp(-(size + extra) / s->mean) (the countdown is memoryless). The
     * rate controller sees what the sample stands for in the bytes counted
     * down (size + extra), so a loop of tiny arrays is held to the same
     * sample rate as one of big arrays. */
    double counted = (double)size + (double)s->extra;
    double p = -expm1(-counted / s->mean);
    *w = p > 0 ? 1.0 / p : 1.0;
    int64_t extra;
    double mean = prof_rate_take(*w * counted, &extra);
    s->left = prof_gap(s, mean, extra);
    return true;
}

static inline bool prof_sample(size_t size, double *w) {
    if (atomic_load_explicit(&prof_flags, memory_order_relaxed) & DM_PROF_FULL) {
        *w = 1.0;
        return true;
    }
    prof_tls_t *s = &ptls;
    if (__builtin_expect((s->left -= (int64_t)size + s->extra) > 0, 1))
        return false;
    return prof_sample_slow(s, size, w);
}

/* ---- recording handlers --------------------------------------------------------
 * The call site is captured only with the GIL held (PyGILState_Check): NumPy
 * reallocs without it in fromfile/fromstring, and those records say "no GIL"
 * and have no site. Capturing calls Python (frame objects, code attributes),
 * which can allocate arrays (a finalizer run by the cyclic GC): such nested
 * allocations are not sampled (`busy`). Frees are recorded before the block is
 * released, so that no other thread can be handed the address first. */

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
        bool stacks = atomic_load_explicit(&prof_flags, memory_order_relaxed) & DM_PROF_STACKS;
        a.nframes = dm__site_capture(frames, DM_PROF_FRAMES_MAX, stacks, &a.site);
        a.frames = frames;
        PyErr_Restore(et, ev, tb);
    } else {
        a.flags |= DM_PROF_NOGIL;
    }
    dm_prof_record_alloc(&a); /* copies the frames' strings */
    if (a.frames)
        dm__site_capture_done();
    s->busy = false;
}

static inline int prof_route_dt(int dt) {
    return dt != DM_DT_UNKNOWN && dm_runtime_wants_dtype() ? dt : DM_DT_UNKNOWN;
}

void *dm__record_malloc(void *ctx, size_t size) {
    int dt = dm__handler_probe_dtype(size), rdt = prof_route_dt(dt);
    void *p = dm__handler_alloc_site(ctx, size, rdt, 0); /* call-site rules apply too */
    double w;
    if (p && prof_sample(size, &w))
        prof_record(ctx, p, size, dt, rdt, w, 0);
    return p;
}

void *dm__record_calloc(void *ctx, size_t nelem, size_t elsize) {
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    size_t size = nelem * elsize;
    int dt = dm__handler_probe_dtype(size), rdt = prof_route_dt(dt);
    void *p = dm__handler_alloc_site(ctx, size, rdt, 1);
    double w;
    if (p && prof_sample(size, &w))
        prof_record(ctx, p, size, dt, rdt, w, DM_PROF_CALLOC);
    return p;
}

static inline void prof_free(void *ptr) {
    if (ptr && ((atomic_load_explicit(&prof_flags, memory_order_relaxed) & DM_PROF_FULL) ||
                dm_prof_maybe_live(ptr)))
        dm_prof_record_free(ptr, dm_prof_now());
}

/* A realloc ends the old block's record and starts a new one, flagged. */
void *dm__record_realloc(void *ctx, void *ptr, size_t size) {
    prof_free(ptr);
    void *q = dm_realloc(ctx, ptr, size);
    double w;
    if (q && prof_sample(size, &w))
        prof_record(ctx, q, size, DM_DT_UNKNOWN, DM_DT_UNKNOWN, w, DM_PROF_REALLOC);
    return q;
}

void dm__record_free(void *ctx, void *ptr, size_t size) {
    prof_free(ptr);
    dm_free_hint(ptr, size);
}

/* ---- Python API ------------------------------------------------------------------ */

/* Starts the profile, under prof_start_mu, in plain C (no Python object is
 * made while the mutex is held: on a GIL build that could run the cyclic GC,
 * finalizers and a GIL switch to a thread waiting here). 0, DM_ESTATE when
 * one is already recording (the running one's settings untouched), or
 * dm_prof_start's code. `path` gets the file's. */
static int profile_start_locked(const char *dir, unsigned long long sample, unsigned flags,
                                unsigned long long max_bytes, const char *meta, char *path,
                                size_t cap) {
    dm_prof_path(path, cap);
    if (path[0])
        return DM_ESTATE;
    pthread_mutex_lock(&prof_rate_mu);
    prof_mean = prof_asked = (double)sample;
    prof_tokens = PROF_BURST;
    prof_tokens_at = 0;
    prof_seen = 0;
    pthread_mutex_unlock(&prof_rate_mu);
    /* before the file opens: a fork child sees both */
    atomic_store_explicit(&prof_flags, flags, memory_order_relaxed);
    int rc = dm_prof_start(dir, sample, flags, max_bytes, meta);
    if (rc)
        return rc;
    dm__handler_dtype_hooks_enable(); /* the records carry the dtype */
    dm__handler_record_all();
    dm_prof_path(path, cap);
    return 0;
}

/* profile_start(dir, sample_bytes, full, stacks, meta, max_bytes=0) -> path of
 * this process's file, or "" when DIR is refused (another user's, writable by
 * others: logged, and the job runs on without a profile). max_bytes: each
 * process's file stops there (0: DM_PROF_MAX_BYTES_DEFAULT, 256 MiB).
 * Every datamem handler, existing or made later, records from now on. */
static PyObject *py_profile_start(PyObject *self, PyObject *args) {
    const char *meta;
    PyObject *dir_obj;
    unsigned long long sample, max_bytes = 0;
    int full, stacks;
    if (!PyArg_ParseTuple(args, "O&Kpps|K", PyUnicode_FSConverter, &dir_obj, &sample, &full,
                          &stacks, &meta, &max_bytes))
        return NULL;
    const char *dir = PyBytes_AS_STRING(dir_obj);
    PyObject *res = NULL;
    char path[4200];
    int rc;
    if (!full && sample == 0)
        PyErr_SetString(PyExc_ValueError, "sample interval must be at least 1 byte");
    else if (max_bytes != 0 && max_bytes < DM_PROF_MAX_BYTES_MIN)
        PyErr_Format(PyExc_ValueError, "profile size limit must be at least %llu bytes (1MiB)",
                     (unsigned long long)DM_PROF_MAX_BYTES_MIN);
    else if (dm__site_init() == 0) {
        unsigned flags = (full ? DM_PROF_FULL : 0) | (stacks ? DM_PROF_STACKS : 0);
        dm_pymu_lock(&prof_start_mu);
        rc = profile_start_locked(dir, sample, flags, max_bytes, meta, path, sizeof(path));
        dm_pymu_unlock(&prof_start_mu);
        if (rc == DM_ESTATE)
            PyErr_SetString(PyExc_RuntimeError, "datamem: already recording a profile");
        else if (rc == DM_EUNSAFE) /* logged; no handler records */
            res = PyUnicode_FromString("");
        else if (rc)
            PyErr_Format(PyExc_OSError, "datamem: cannot record a profile in %s: %s", dir,
                         dm_strerror(rc));
        else
            res = PyUnicode_DecodeFSDefault(path);
    }
    Py_DECREF(dir_obj);
    return res;
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
PyMethodDef dm__record_methods[] = {
    {"profile_start", py_profile_start, METH_VARARGS, "profile_start(dir, sample_bytes, full, stacks, meta, max_bytes=0) -> file, or '' when dir is refused"},
    {"profile_flush", py_profile_flush, METH_NOARGS, "write the profile's buffered records"},
    {"profile_mark_exit", py_profile_mark_exit, METH_NOARGS, "mark the start of interpreter exit in the profile"},
    {"profile_stop", py_profile_stop, METH_NOARGS, "flush and close the profile"},
    {"profile_info", py_profile_info, METH_NOARGS, "profile_info() -> (file, samples, bytes)"},
    {NULL, NULL, 0, NULL},
};
