/*
 * libcheap.c: what NumPy's frees would have told glibc's malloc.
 *
 * Under NumPy's default allocator every array goes through glibc's malloc, and
 * glibc's free of a block it had mapped (one at or above its mmap threshold,
 * 128 KiB at start) raises that threshold to the block's size, up to 32 MiB,
 * and its trim threshold to twice that (malloc.c, "dynamic mmap threshold").
 * From then on the process's other mallocs of those sizes (pandas' hash
 * tables and sort buffers, Arrow's, BLAS workspaces) come from the heap, where
 * freed pages are reused, instead of fresh mappings the kernel zeroes on every
 * touch. Under datamem glibc never sees an array, its thresholds stay at
 * 128 KiB, and those mallocs fault in and zero their pages anew each time:
 * pandas3_arrow at half scale took 87.0k small faults against the default's
 * 61.7k, 69.4k with glibc's thresholds set as the default's end up
 * (docs/performance.md, "glibc's thresholds").
 *
 * So the free of an array larger than any before (up to 32 MiB) shows glibc a
 * block of the same size, allocated and freed at once, and glibc's own rule
 * moves its thresholds as the array's free would have. Through __libc_malloc
 * and __libc_free, glibc's own entry points, found in libc.so.6 itself: a
 * profiler that hooks `malloc` (memray, in every library's GOT; Fil,
 * preloaded) does not see it as the job's memory, and an allocator preloaded
 * in glibc's place (tcmalloc, jemalloc, mimalloc; a sanitizer's) is not
 * called: glibc's thresholds then move for a heap nobody uses, at the cost of
 * a mapping made and unmapped. (Whether `malloc` is glibc's cannot be asked of
 * the dynamic linker: in a non-PIE executable such as Debian's python3.14,
 * `malloc` resolves to the executable's PLT entry.) A threshold the user set
 * (mallopt, GLIBC_TUNABLES' mmap_threshold) turns glibc's rule off, and with
 * it this: glibc keeps the user's value.
 *
 * Cost: one load and compare per free of a block the block cache did not
 * take; a showing (a mapping, its header's page, the unmapping: ~5 us) only
 * for a size 1/16 above the largest shown yet, so at most 92 between 128 KiB
 * and 32 MiB over the process's life, whatever sizes it frees (an array grown
 * a byte at a time included). glibc's threshold may so lag the default's by
 * up to 1/16: a block in that gap is mapped where the default would reuse the
 * heap, never the other way round.
 * fork: the child keeps dm__libcheap_shown, as it keeps glibc's thresholds,
 * which it mirrors.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>

#include "runtime/libcheap.h"

_Atomic size_t dm__libcheap_shown = DM_LIBC_MMAP_THRESHOLD_MIN - 1;
_Atomic uint64_t dm__libcheap_showings;

static void *(*libc_malloc)(size_t); /* glibc's, set once (found_once) */
static void (*libc_free)(void *);
static pthread_once_t found_once = PTHREAD_ONCE_INIT;

static void find_glibc(void) {
    void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    if (!libc)
        return; /* not glibc */
    void *m = dlsym(libc, "__libc_malloc"), *f = dlsym(libc, "__libc_free");
    if (m && f) {
        libc_malloc = (void *(*)(size_t))m;
        libc_free = (void (*)(void *))f;
    }
    dlclose(libc); /* RTLD_NOLOAD: a reference more, given back; libc stays */
}

void dm__libcheap_show(size_t size) {
    size_t seen = atomic_load_explicit(&dm__libcheap_shown, memory_order_relaxed);
    do {
        if (size <= seen)
            return; /* another thread showed as much */
    } while (!atomic_compare_exchange_weak_explicit(&dm__libcheap_shown, &seen, size + size / 16,
                                                    memory_order_relaxed, memory_order_relaxed));
    pthread_once(&found_once, find_glibc);
    if (!libc_malloc) {
        atomic_store_explicit(&dm__libcheap_shown, SIZE_MAX, memory_order_relaxed);
        return;
    }
    void *p = libc_malloc(size);
    if (p)
        libc_free(p);
    atomic_fetch_add_explicit(&dm__libcheap_showings, 1, memory_order_relaxed);
}
