/*
 * shadow.c: arrays shown to a memory profiler that hooks this library's
 * allocation calls (memray), as NumPy's default allocator shows them.
 *
 * memray overwrites the GOT entries of malloc ... munmap in every loaded
 * library, this extension included, and counts what those calls return.
 * Under NumPy's default handler each array is one malloc of its size, freed
 * when the array goes. Under a policy an array comes from a jemalloc extent,
 * and all such a profiler would see is the extents' mmaps, charged to
 * whichever array grew an arena and never given back (jemalloc keeps extents
 * and returns pages with madvise): its peak would be what the arenas ever took
 * from the kernel (an fft job: 611 MiB against 326 MiB without a policy), and
 * datamem's start-up would look like the job's allocations (docs/operations.md,
 * "Profilers").
 *
 * So while such hooks are in place:
 *   - datamem's own mappings are made with syscall(2), which no GOT hook sees
 *     (dm_runtime_hide_mappings: the extents' commits and spill files;
 *     jemalloc's metadata always is, third_party/jemalloc);
 *   - each array the handler serves is mirrored by a shadow: a malloc of the
 *     array's size, called through the hooked GOT entry while NumPy's call is
 *     on the stack, and freed with the array. The profiler records it exactly
 *     as it records the array under NumPy's default (size, Python stack).
 *     A shadow is never written: glibc maps a big one and hands out a small
 *     one from its heap, so it costs address space and a chunk header, not
 *     the array's pages.
 *
 * Telling hooks are in place: the address of malloc in this library's GOT is
 * no longer the one the dynamic linker resolved (dlsym(RTLD_DEFAULT)). A
 * malloc interposed for the whole process with LD_PRELOAD is both; such a
 * malloc is a profiler's only when it comes from one of the libraries named
 * in PRELOADED_PROFILERS (Fil's, Scalene's), and then the process shadows
 * from its start: an allocator preloaded the same way (tcmalloc, jemalloc,
 * mimalloc) must not pay a shadow per array. 
 *
 * The table of shadows: open addressing by the array's address, linear
 * probing with backward-shift deletion, doubled at half full; its memory is
 * mapped with syscall(2) too (unseen). Full (a mapping refused), or a shadow
 * refused by malloc: the array is not mirrored, the profiler reads that much
 * less, and stderr says so once; the array itself is served as always, and the
 * next one tries again. One mutex guards the table; only a process whose
 * library was hooked ever takes it.
 */
#include "pyext/ext.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "runtime/datamem.h"

uintptr_t dm__shadow_resolved_malloc; /* set once at import, before any handler exists */

typedef struct {
    uintptr_t array; /* 0: empty */
    void *shadow;
} slot_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static slot_t *slots;  /* under mu */
static size_t cap;     /* a power of two, or 0 */
static size_t used;    /* under mu */
static _Atomic size_t live; /* = used, read without mu */
static _Atomic bool said_missed;

/* An array the profiler will not see: said once per process. */
static void missed(void) {
    if (!atomic_exchange_explicit(&said_missed, true, memory_order_relaxed))
        dm_log("a memory profiler hooks malloc, and an array could not be shown to it (out "
               "of memory): its figures read low from here on");
}

/* Profilers that interpose malloc with LD_PRELOAD, by their library's file
 * name: Fil's preload module and Scalene's. */
static const char *const PRELOADED_PROFILERS[] = {"_filpreload", "libscalene"};

static bool preloaded_profiler(void *m) {
    Dl_info info;
    if (!m || !dladdr(m, &info) || !info.dli_fname)
        return false;
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    for (size_t i = 0; i < sizeof PRELOADED_PROFILERS / sizeof *PRELOADED_PROFILERS; i++)
        if (strncmp(base, PRELOADED_PROFILERS[i], strlen(PRELOADED_PROFILERS[i])) == 0)
            return true;
    return false;
}

void dm__shadow_init(void) {
    void *m = dlsym(RTLD_DEFAULT, "malloc");
    /* 0 matches no GOT entry: a preloaded profiler is seen as a hook, for good */
    dm__shadow_resolved_malloc = preloaded_profiler(m) ? 0
                                 : m                   ? (uintptr_t)m
                                                       : dm__shadow_got_malloc();
}

static void *unseen_map(size_t n) {
    long p = syscall(SYS_mmap, NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    return p == -1 ? NULL : (void *)p;
}

static size_t home(uintptr_t a, size_t c) {
    return (size_t)(((uint64_t)a * 0x9E3779B97F4A7C15ull) >> 20) & (c - 1);
}

static void put(slot_t *t, size_t c, uintptr_t a, void *s) {
    size_t i = home(a, c);
    while (t[i].array)
        i = (i + 1) & (c - 1);
    t[i] = (slot_t){a, s};
}

/* Under mu: room for one more at under half full; false when refused. */
static bool room(void) {
    if (2 * (used + 1) <= cap)
        return true;
    size_t c = cap ? 2 * cap : 1024;
    slot_t *t = unseen_map(c * sizeof(slot_t));
    if (!t)
        return false;
    for (size_t i = 0; i < cap; i++)
        if (slots[i].array)
            put(t, c, slots[i].array, slots[i].shadow);
    if (slots)
        syscall(SYS_munmap, slots, cap * sizeof(slot_t));
    slots = t;
    cap = c;
    return true;
}

/* Under mu: the shadow of `a`, removed; NULL if none. */
static void *take(uintptr_t a) {
    if (!cap)
        return NULL;
    size_t i = home(a, cap);
    while (slots[i].array != a) {
        if (!slots[i].array)
            return NULL;
        i = (i + 1) & (cap - 1);
    }
    void *s = slots[i].shadow;
    /* backward shift: pull later entries of the run into the hole */
    for (size_t j = (i + 1) & (cap - 1); slots[j].array; j = (j + 1) & (cap - 1)) {
        size_t h = home(slots[j].array, cap);
        if (((j - h) & (cap - 1)) >= ((j - i) & (cap - 1))) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i] = (slot_t){0, NULL};
    used--;
    atomic_store_explicit(&live, used, memory_order_relaxed);
    return s;
}

void dm__shadow_add(void *array, size_t n) {
    if (!array)
        return;
    void *s = malloc(n ? n : 1); /* through the hooked entry: the profiler sees it */
    if (!s)
        missed();
    else
        dm__shadow_keep(array, s);
}

void dm__shadow_keep(void *array, void *s) {
    void *old = NULL;
    pthread_mutex_lock(&mu);
    bool ok = room();
    if (ok) {
        old = take((uintptr_t)array); /* a block freed unseen (before the hooks) and reused */
        put(slots, cap, (uintptr_t)array, s);
        used++;
        atomic_store_explicit(&live, used, memory_order_relaxed);
    }
    pthread_mutex_unlock(&mu);
    free(old);
    if (!ok) {
        free(s);
        missed();
    }
}

void *dm__shadow_take(void *array) {
    if (!array || !atomic_load_explicit(&live, memory_order_relaxed))
        return NULL;
    pthread_mutex_lock(&mu);
    void *s = take((uintptr_t)array);
    pthread_mutex_unlock(&mu);
    return s;
}

void dm__shadow_drop(void *array) { free(dm__shadow_take(array)); }

/* In a fork child (record.c's handler): the child keeps the shadows (their
 * blocks were copied with it), and the mutex starts unlocked. */
void dm__shadow_after_fork_child(void) { pthread_mutex_init(&mu, NULL); }

size_t dm__shadow_live(void) { return atomic_load_explicit(&live, memory_order_relaxed); }
