/*
 * handler.c: datamem's NEP 49 handlers, the plumbing between NumPy's allocator
 * API and the runtime (NumPy keeps its own in one file, alloc.c; so do we).
 *
 *   - the handler functions: one PyDataMem_Handler per datamem context (tag
 *     set); the handler's ctx is the dm_ctx_t, so NumPy's own ContextVar
 *     carries the tag set across await and into asyncio tasks at no cost on
 *     the allocation path. A handler lives as long as its capsule: every
 *     array keeps the capsule it was allocated with (and frees through it,
 *     possibly at shutdown), NumPy's ContextVar holds the current one, and
 *     `recent` holds the last HANDLER_RECENT made, so a tag entered again
 *     finds its capsule. The capsule holds a reference on its context, given
 *     back when it dies (runtime/context.c then recycles the context): a
 *     process may make any number of tag sets. A context the runtime retired
 *     (made while its tally tables were full, replaced by a counted one)
 *     leaves `recent` when the next capsule is made. While a profile is recorded
 *     every handler calls record.c's functions instead
 *     (dm__handler_record_all).
 *   - dtype discovery, only while the policy in force has a dtype rule (or a
 *     profile is recorded): a wrapper around PyArray_Type.tp_alloc remembers
 *     (per thread) the array object being built; malloc checks it really is
 *     that array (no data yet, byte count matches its shape and dtype) before
 *     trusting it, and a tp_dealloc wrapper forgets it, so a remembered pointer
 *     can never be read after it is freed.
 *   - the Python functions over handlers: handler(), handler_tags(),
 *     set_handler(), get_handler().
 *
 * The handler functions run with or without the GIL (NumPy calls realloc
 * without it) and never call into Python (a call site is looked up only with
 * an attached thread state: site.c). Without the GIL (free-threaded CPython)
 * any number of threads run here at once: the handler registry is a list
 * prepended to with a compare-and-swap and read without a lock; the dtype
 * hooks are swapped once, under hooks_mu; function pointers NumPy reads are
 * switched with atomic stores.
 */
#include "pyext/ext.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "policy/policy.h"
#include "runtime/datamem.h"

/* ---- dtype discovery ------------------------------------------------------ */

static __thread PyObject *building; /* array whose data is about to be allocated */
/* NumPy's own slots, saved once under hooks_mu before the wrappers that call
 * them are installed (release stores of the slots) and never changed again.
 * Atomics, loaded relaxed (a plain load): a wrapper is reached through
 * NumPy's and CPython's plain loads of the slots, which give no acquire, so a
 * plain static here would be a data race in C11 terms (ThreadSanitizer
 * reported it, scripts/tsan-ft.sh); its value is the one stored before the
 * wrapper was. */
static _Atomic(allocfunc) orig_tp_alloc;
static _Atomic(destructor) orig_tp_dealloc;
static _Atomic int dtype_hooks_on; /* 0 -> 1 once, under hooks_mu; read relaxed */
/* malloc as resolved, ^ 1 once dtype_hooks_on (h_hooked); set at init, then
 * with dtype_hooks_on under hooks_mu */
static _Atomic uintptr_t hook_key;
static dm_pymu_t hooks_mu = DM_PYMU_INIT;
static dm_pymu_t handlers_mu = DM_PYMU_INIT; /* the live handlers (below) */

static PyObject *alloc_wrapper(PyTypeObject *type, Py_ssize_t nitems) {
    PyObject *obj = atomic_load_explicit(&orig_tp_alloc, memory_order_relaxed)(type, nitems);
    building = obj;
    return obj;
}

static void dealloc_wrapper(PyObject *self) {
    if (building == self)
        building = NULL;
    atomic_load_explicit(&orig_tp_dealloc, memory_order_relaxed)(self);
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

/* The wrappers go into NumPy's slots once for the process, under hooks_mu:
 * two threads enabling the hooks at once must not both save the other's
 * wrapper as NumPy's slot. Each slot is one aligned pointer, stored
 * atomically, and a wrapper only ever calls the slot saved before it was
 * stored. CPython and NumPy read the slots with plain loads, so a store while
 * other threads make and free arrays is still a data race in C11 terms: on a
 * free-threaded build, where threads really run at once, the wrappers go in at
 * import (dm__handler_init; start-up activation imports datamem before the job
 * starts a thread) and only the probing waits for a dtype rule. With the GIL
 * they go in with the first dtype rule, so that jobs without one never pay
 * for them. */
static void install_slot_wrappers(void) {
    if (atomic_load_explicit(&orig_tp_dealloc, memory_order_relaxed))
        return; /* only hooks_mu's holder stores it */
    atomic_store_explicit(&orig_tp_alloc, PyArray_Type.tp_alloc, memory_order_relaxed);
    atomic_store_explicit(&orig_tp_dealloc, PyArray_Type.tp_dealloc, memory_order_relaxed);
    /* tp_dealloc first: never leave a dangling `building` */
    __atomic_store_n(&PyArray_Type.tp_dealloc, dealloc_wrapper, __ATOMIC_RELEASE);
    __atomic_store_n(&PyArray_Type.tp_alloc, alloc_wrapper, __ATOMIC_RELEASE);
}

/* Called when a policy with dtype rules is installed (from any thread, the
 * file watcher's too, which has no Python thread state) or a profile starts:
 * from then on the handler asks which array it is allocating for. */
void dm__handler_dtype_hooks_enable(void) {
    if (atomic_load_explicit(&dtype_hooks_on, memory_order_acquire))
        return;
    dm_pymu_lock(&hooks_mu);
    if (!atomic_load_explicit(&dtype_hooks_on, memory_order_relaxed)) {
        install_slot_wrappers();
        atomic_store_explicit(&dtype_hooks_on, 1, memory_order_release);
        atomic_store_explicit(&hook_key, dm__shadow_resolved_malloc ^ 1, memory_order_release);
    }
    dm_pymu_unlock(&hooks_mu);
}

void dm__handler_after_fork_child(void) {
    dm_pymu_reset(&hooks_mu);
    dm_pymu_reset(&handlers_mu);
}

int dm__handler_probe_dtype(size_t size) { return probe_dtype(size); }

/* ---- NEP 49 handler functions ------------------------------------------------ */

/* The dtype of the array being built, when a rule needs it; out of line, so
 * that the common case below is a test and a tail call. */
static __attribute__((noinline)) int h_dtype(size_t size) {
    return dm_runtime_wants_dtype() ? probe_dtype(size) : DM_DT_UNKNOWN;
}

static void *h_alloc_hooked(void *ctx, size_t size, int zero);

/* Whether this allocation needs its dtype or its call site, or a profiler
 * hooks this library's malloc (shadow.c): zero, almost always. hook_key is
 * malloc as the dynamic linker resolved it, with its lowest bit flipped once
 * the dtype hooks are on, so one word carries two of the three conditions (a
 * hook would have to sit one byte from malloc to hide): two instructions more
 * than the dtype and site check alone (bench/net.py). h_alloc_hooked tells
 * the three apart. */
static inline uintptr_t h_hooked(void) {
    return (dm__shadow_got_malloc() ^ atomic_load_explicit(&hook_key, memory_order_relaxed)) |
           (unsigned)atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed);
}

static void *h_malloc(void *ctx, size_t size) {
    if (__builtin_expect(h_hooked() != 0, 0))
        return h_alloc_hooked(ctx, size, 0);
    return dm_alloc(ctx, size, DM_DT_UNKNOWN);
}

static void *h_calloc(void *ctx, size_t nelem, size_t elsize) {
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    size_t size = nelem * elsize;
    if (__builtin_expect(h_hooked() != 0, 0))
        return h_alloc_hooked(ctx, size, 1);
    return dm_calloc(ctx, size, DM_DT_UNKNOWN);
}

static void *h_realloc(void *ctx, void *ptr, size_t size) {
    return dm_realloc(ctx, ptr, size);
}

/* NumPy's size here is a guess (NEP 49): a hint that the block may be big
 * (kept for reuse), never trusted for anything else. */
static void h_free(void *ctx, void *ptr, size_t size) { dm_free_hint(ptr, size); }

/* The shadowing handlers (shadow.c), every handler's once a profiler was seen
 * hooking this library's malloc: each array gets a shadow while the hook is
 * there, and gives back the one it has when it goes. */
static void *h_alloc_routed(void *ctx, size_t size, int zero);

static void *sh_alloc(void *ctx, size_t size, int zero) {
    void *p = atomic_load_explicit(&dtype_hooks_on, memory_order_relaxed) |
                      atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed)
                  ? h_alloc_routed(ctx, size, zero)
              : zero ? dm_calloc(ctx, size, DM_DT_UNKNOWN)
                     : dm_alloc(ctx, size, DM_DT_UNKNOWN);
    if (p && dm__shadow_hooked())
        dm__shadow_add(p, size);
    return p;
}

static void *sh_malloc(void *ctx, size_t size) { return sh_alloc(ctx, size, 0); }

static void *sh_calloc(void *ctx, size_t nelem, size_t elsize) {
    if (elsize && nelem > SIZE_MAX / elsize)
        return NULL;
    return sh_alloc(ctx, nelem * elsize, 1);
}

static void *sh_realloc(void *ctx, void *ptr, size_t size) {
    void *shadow = dm__shadow_take(ptr);
    void *q = dm_realloc(ctx, ptr, size);
    if (!q) {
        if (shadow)
            dm__shadow_keep(ptr, shadow); /* the array stays as it was */
        return NULL;
    }
    free(shadow);
    if (dm__shadow_hooked())
        dm__shadow_add(q, size);
    return q;
}

static void sh_free(void *ctx, void *ptr, size_t size) {
    dm__shadow_drop(ptr); /* first: the block's address may be handed out again after */
    dm_free_hint(ptr, size);
}

/* An allocation routed by its call site too, when call-site rules are in force
 * (the recording handlers come here as well). The site's mask is for the
 * install it was computed under; the runtime ignores a mask from an older
 * install (the site counts as unknown), so an install that lands between the
 * two would route the block by neither policy's site rules. Then the block,
 * never handed out, is freed and the allocation made again: a block follows
 * the policy in force at one instant of the call. Installs are rare; two
 * tries more at most. */
void *dm__handler_alloc_site(void *ctx, size_t size, int dt, int zero) {
    for (int tries = 0;; tries++) {
        uint64_t gen = 0, mask = 0;
        if (atomic_load_explicit(&dm_runtime_site_rules, memory_order_relaxed))
            mask = dm__site_mask_now(&gen);
        void *p = zero ? dm_calloc_site(ctx, size, dt, mask, gen)
                       : dm_alloc_site(ctx, size, dt, mask, gen);
        if (!p || gen == 0 || tries == 2 || dm_runtime_site_gen() == gen)
            return p;
        dm_free(p);
    }
}

/* A dtype rule or call-site rules are in force. */
static void *h_alloc_routed(void *ctx, size_t size, int zero) {
    int dt = atomic_load_explicit(&dtype_hooks_on, memory_order_relaxed) ? h_dtype(size)
                                                                         : DM_DT_UNKNOWN;
    return dm__handler_alloc_site(ctx, size, dt, zero);
}

/* The rare path: a dtype rule or call-site rules are in force, or a profiler
 * hooks this library's malloc, seen here first: every handler shadows from
 * now on. */
static __attribute__((noinline)) void *h_alloc_hooked(void *ctx, size_t size, int zero) {
    if (dm__shadow_hooked()) {
        dm__handler_shadow_all();
        return sh_alloc(ctx, size, zero);
    }
    return h_alloc_routed(ctx, size, zero);
}

/* ---- capsules: one handler per context ------------------------------------ */

/* NumPy strcmp()s the capsule's name with its own "mem_handler" on every
 * allocation and free. glibc's vector strcmp costs least when both strings sit
 * at the same offset in a vector, as they do for NumPy's default handler, whose
 * capsule carries NumPy's own string: so ours carries it too (NumPy is never
 * unloaded). 40 instead of 62 instructions per np.empty malloc+free pair
 * (bench/callgrind.sh). Our own copy when NumPy's name is not the expected one. */
static const char *capsule_name = "mem_handler";

static void on_install(const dm_policy_t *p, uint64_t seq, void *arg);

static void observe_installs(void) { dm_runtime_observe(on_install, NULL, NULL); }

/* Every install, from Python or the file watcher's thread (no Python thread
 * state there), turns the dtype hooks on once a policy wants them: a watcher
 * reload that brings the first dtype rule is routed by dtype too. And it asks
 * the main thread to apply reload.signal (load.c). */
static void on_install(const dm_policy_t *p, uint64_t seq, void *arg) {
    if (dm_runtime_wants_dtype())
        dm__handler_dtype_hooks_enable();
    dm__load_on_install(); /* reload.signal, applied by the main thread */
}

void dm__handler_init(void) {
    dm__shadow_init();
    atomic_store_explicit(&hook_key, dm__shadow_resolved_malloc, memory_order_release);
    if (dm__shadow_hooked()) /* hooked already (memray run): before any arena maps */
        dm__handler_shadow_all();
    const char *numpy_name = PyCapsule_GetName(PyDataMem_DefaultHandler);
    if (numpy_name && strcmp(numpy_name, "mem_handler") == 0)
        capsule_name = numpy_name; /* before the module exists: immutable after */
    PyErr_Clear();
    static pthread_once_t observed = PTHREAD_ONCE_INIT;
    pthread_once(&observed, observe_installs);
#ifdef Py_GIL_DISABLED
    dm_pymu_lock(&hooks_mu);
    install_slot_wrappers();
    dm_pymu_unlock(&hooks_mu);
#endif
}

/* One handler per live capsule: the capsule's destructor unlinks and frees it.
 * The list of live handlers (for dm__handler_record_all), `recent` and
 * `root_capsule` are guarded by handlers_mu, never held while a capsule can be
 * destroyed (a destructor takes it). NumPy reads the four function pointers
 * with no lock: they are stored atomically (handler_set_functions). */
typedef struct handler_entry {
    struct handler_entry *next, *prev; /* every live one (dm__handler_record_all) */
    const dm_ctx_t *ctx;               /* one reference, given back with the capsule */
    PyDataMem_Handler handler;
} handler_entry_t;

/* Capsules of recently used contexts, by the context's address (direct-mapped;
 * each holds its context, so an address here is never another context's).
 * Small next to the runtime's DM_CTX_MAX context ids: what it holds stays
 * counted under its own tags. */
#define HANDLER_RECENT 128

static handler_entry_t *handlers;   /* under handlers_mu */
static PyObject *recent[HANDLER_RECENT]; /* under handlers_mu */
static PyObject *root_capsule;      /* the root context's, for the process (handlers_mu) */
static uint64_t retirements_seen;   /* dm_ctx_retirements() at the last scan (handlers_mu) */
static _Atomic bool recording;      /* new handlers record (set under handlers_mu) */
static _Atomic bool shadowing;      /* new handlers shadow, unless recording (handlers_mu) */

/* NumPy reads each pointer with one plain load when it allocates: each is
 * stored atomically, so a call goes to the plain or the recording function,
 * never to a torn pointer. A block allocated by one and freed by the other is
 * fine: the recording free ignores blocks it never recorded. */
static void handler_set_functions(PyDataMem_Handler *h, bool on) {
    bool sh = !on && atomic_load_explicit(&shadowing, memory_order_relaxed);
    __atomic_store_n(&h->allocator.malloc, on ? dm__record_malloc : sh ? sh_malloc : h_malloc,
                     __ATOMIC_RELEASE);
    __atomic_store_n(&h->allocator.calloc, on ? dm__record_calloc : sh ? sh_calloc : h_calloc,
                     __ATOMIC_RELEASE);
    __atomic_store_n(&h->allocator.realloc,
                     on ? dm__record_realloc : sh ? sh_realloc : h_realloc, __ATOMIC_RELEASE);
    __atomic_store_n(&h->allocator.free, on ? dm__record_free : sh ? sh_free : h_free,
                     __ATOMIC_RELEASE);
}

/* The capsule's destructor (attached): nothing can allocate or free through
 * the handler any more (arrays hold their capsule until after their free). */
static void capsule_gone(PyObject *cap) {
    handler_entry_t *e = PyCapsule_GetContext(cap);
    if (!e)
        return;
    dm_pymu_lock(&handlers_mu);
    if (e->prev)
        e->prev->next = e->next;
    else
        handlers = e->next;
    if (e->next)
        e->next->prev = e->prev;
    dm_pymu_unlock(&handlers_mu);
    dm_ctx_release(e->ctx);
    PyMem_RawFree(e);
}

static size_t recent_slot(const dm_ctx_t *ctx) {
    return (size_t)(((uint64_t)(uintptr_t)ctx * 0x9E3779B97F4A7C15ull) >> 57) &
           (HANDLER_RECENT - 1);
}

/* A capsule for `ctx` already made and still alive, a new reference, or NULL
 * (under handlers_mu). */
static PyObject *capsule_known(const dm_ctx_t *ctx) {
    if (ctx == dm_ctx_root())
        return root_capsule ? Py_NewRef(root_capsule) : NULL;
    PyObject *cap = recent[recent_slot(ctx)];
    if (cap && ((handler_entry_t *)PyCapsule_GetContext(cap))->ctx == ctx)
        return Py_NewRef(cap);
    return NULL;
}

/* Under handlers_mu, when contexts were retired since the last scan (made
 * while the runtime's tally tables were full, then replaced by counted ones:
 * dm_ctx_with_tag): their capsules leave `recent` into `stale` (at most
 * HANDLER_RECENT, released by the caller unlocked), so the cache does not keep
 * a retired context, still listed in tag_bytes.unenforced, alive. */
static int recent_drop_retired(PyObject **stale) {
    uint64_t r = dm_ctx_retirements();
    int n = 0;
    if (r == retirements_seen)
        return 0;
    retirements_seen = r;
    for (int i = 0; i < HANDLER_RECENT; i++)
        if (recent[i] && dm_ctx_retired(((handler_entry_t *)PyCapsule_GetContext(recent[i]))->ctx)) {
            stale[n++] = recent[i];
            recent[i] = NULL;
        }
    return n;
}

/* The capsule for `ctx`, whose reference the caller passes on (to the
 * capsule, or given back when a capsule for it exists). Another thread may
 * make one for the same context meanwhile: the second look, under the mutex,
 * keeps the first and drops this one. Making one also drops retired contexts'
 * capsules from `recent` (recent_drop_retired). */
static PyObject *capsule_for(const dm_ctx_t *ctx) {
    dm_pymu_lock(&handlers_mu);
    PyObject *known = capsule_known(ctx);
    dm_pymu_unlock(&handlers_mu);
    if (known) {
        dm_ctx_release(ctx);
        return known;
    }
    handler_entry_t *e = PyMem_RawCalloc(1, sizeof(*e));
    if (!e) {
        dm_ctx_release(ctx);
        return PyErr_NoMemory();
    }
    snprintf(e->handler.name, sizeof(e->handler.name), "%s", HANDLER_NAME);
    e->handler.version = 1;
    e->handler.allocator.ctx = (void *)ctx;
    handler_set_functions(&e->handler, false);
    e->ctx = ctx;
    PyObject *cap = PyCapsule_New(&e->handler, capsule_name, NULL);
    if (!cap || PyCapsule_SetContext(cap, e) < 0) {
        Py_XDECREF(cap);
        dm_ctx_release(ctx);
        PyMem_RawFree(e);
        return NULL;
    }
    PyObject *old = NULL, *stale[HANDLER_RECENT];
    dm_pymu_lock(&handlers_mu);
    if ((known = capsule_known(ctx))) {
        dm_pymu_unlock(&handlers_mu);
        Py_DECREF(cap); /* never handed out, never linked: no destructor yet */
        dm_ctx_release(ctx);
        PyMem_RawFree(e);
        return known;
    }
    (void)PyCapsule_SetDestructor(cap, capsule_gone);
    handler_set_functions(&e->handler, atomic_load(&recording));
    e->next = handlers;
    if (handlers)
        handlers->prev = e;
    handlers = e;
    if (ctx == dm_ctx_root()) {
        root_capsule = Py_NewRef(cap);
    } else {
        PyObject **slot = &recent[recent_slot(ctx)];
        old = *slot;
        *slot = Py_NewRef(cap);
    }
    int nstale = recent_drop_retired(stale);
    dm_pymu_unlock(&handlers_mu);
    Py_XDECREF(old); /* unlocked: its destructor may run here */
    for (int i = 0; i < nstale; i++)
        Py_DECREF(stale[i]);
    return cap;
}

/* A profiler hooks this library's malloc: every handler, existing or made
 * later, shadows arrays (shadow.c) unless it records, and the arenas' own
 * mappings go unseen. For good: a profiler that lets go later only stops new
 * shadows. */
void dm__handler_shadow_all(void) {
    dm_runtime_hide_mappings();
    dm_pymu_lock(&handlers_mu);
    if (!atomic_load_explicit(&shadowing, memory_order_relaxed)) {
        atomic_store(&shadowing, true);
        for (handler_entry_t *e = handlers; e; e = e->next)
            handler_set_functions(&e->handler, atomic_load(&recording));
    }
    dm_pymu_unlock(&handlers_mu);
}

/* profile_start: every handler, existing or made later, records. */
void dm__handler_record_all(void) {
    dm_pymu_lock(&handlers_mu);
    atomic_store(&recording, true);
    for (handler_entry_t *e = handlers; e; e = e->next)
        handler_set_functions(&e->handler, true);
    dm_pymu_unlock(&handlers_mu);
}

/* ---- Python API ---------------------------------------------------------------- */

/* The context of a sequence of tags, one reference held; NULL with an
 * exception set (a bad name or too many tags: ValueError; no memory). */
static const dm_ctx_t *ctx_from_tags(PyObject *tags) {
    const dm_ctx_t *c = dm_ctx_root();
    Py_ssize_t n = PyTuple_GET_SIZE(tags);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *t = PyUnicode_AsUTF8(PyTuple_GET_ITEM(tags, i));
        const dm_ctx_t *next = t ? dm_ctx_with_tag(c, t) : NULL;
        if (!next && t) {
            if (strlen(t) >= DM_NAME_MAX)
                PyErr_Format(PyExc_ValueError, "tag '%.80s': longer than %d bytes", t,
                             DM_NAME_MAX - 1);
            else if (dm_ctx_tags(c, NULL, 0) >= DM_CTX_TAGS_MAX)
                PyErr_Format(PyExc_ValueError, "tag '%s': a context holds at most %d tags",
                             t, DM_CTX_TAGS_MAX);
            else
                PyErr_NoMemory();
        }
        dm_ctx_release(c);
        if (!(c = next))
            return NULL;
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
    PyObject *seq = dm_seq_tuple(tags, "tags must be a sequence of str");
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
    void *(*f)(void *, size_t) = NULL;
    if (h)
        f = __atomic_load_n(&h->allocator.malloc, __ATOMIC_RELAXED);
    if (f != h_malloc && f != sh_malloc && f != dm__record_malloc)
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

PyMethodDef dm__handler_methods[] = {
    {"handler", py_handler, METH_VARARGS, "handler(tags=()) -> NEP 49 capsule for a tag set"},
    {"handler_tags", py_handler_tags, METH_O, "handler_tags(capsule) -> tags, or None if not datamem's"},
    {"set_handler", py_set_handler, METH_O, "set_handler(capsule) -> previous handler (this context)"},
    {"get_handler", py_get_handler, METH_NOARGS, "get_handler() -> the current context's handler"},
    {NULL, NULL, 0, NULL},
};
