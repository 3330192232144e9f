/*
 * libcheap_test.c: glibc's malloc is shown what NumPy's frees would have
 * shown it (libcheap.c): after a datamem block of 16 MiB is freed with NumPy's
 * size, glibc serves a 12 MiB malloc from its heap, as it does after NumPy's
 * default allocator frees a 16 MiB array, where before it mapped it. Under a
 * sanitizer, whose malloc replaces glibc's, glibc is shown all the same (its
 * own entry points), but `malloc` cannot ask it. The showings stay bounded
 * whatever sizes are freed, and threads racing to show keep the largest.
 */
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime/datamem.h"
#include "runtime/libcheap.h"
#include "runtime/test_policy.h"
#include "testing/test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define REPLACED_MALLOC 1 /* the sanitizer's malloc is the process's */
#else
#define REPLACED_MALLOC 0
#endif

#if !REPLACED_MALLOC
/* Whether glibc maps a 12 MiB malloc (above its mmap threshold) rather than
 * serving it from its heap. Asking moves the threshold itself (the free of a
 * mapped block raises it), so a test asks once. */
static int glibc_maps_12mib(void) {
    size_t before = mallinfo2().hblkhd;
    void *volatile p = malloc(12 << 20); /* volatile: GCC drops an unused malloc + free */
    int mapped = mallinfo2().hblkhd >= before + (12 << 20);
    free(p);
    return mapped;
}
#endif

static void test_glibc_sees_what_numpy_would_have_freed(void) {
    void *a = dm_alloc(NULL, 16 << 20, DM_DT_UNKNOWN);
    EXPECT_TRUE(a != NULL, "16 MiB from datamem");
    dm_free_hint(a, 16 << 20);
    EXPECT_UINT_EQ(atomic_load(&dm__libcheap_showings), 1, "the free was shown to glibc");
#if !REPLACED_MALLOC /* there `malloc` is the sanitizer's: glibc's heap cannot be asked */
    EXPECT_TRUE(!glibc_maps_12mib(),
                "glibc's threshold rose past 12 MiB, as NumPy's free of 16 MiB raises it "
                "(from 128 KiB: without the showing it maps 12 MiB)");
#endif
    /* the same size again shows nothing */
    a = dm_alloc(NULL, 16 << 20, DM_DT_UNKNOWN);
    dm_free_hint(a, 16 << 20);
    EXPECT_UINT_EQ(atomic_load(&dm__libcheap_showings), 1, "a size shown once");
}

/* Every size from 128 KiB to 32 MiB freed in turn, 64 bytes apart (an array
 * grown in steps): the showings stay at most 92 (one per 1/16 of growth). */
static void test_showings_are_bounded(void) {
    uint64_t before = atomic_load(&dm__libcheap_showings);
    for (size_t n = DM_LIBC_MMAP_THRESHOLD_MIN; n <= DM_LIBC_MMAP_THRESHOLD_MAX; n += 64)
        dm__libcheap_note_free(n);
    uint64_t shown = atomic_load(&dm__libcheap_showings) - before;
    EXPECT(shown <= 92, "%llu showings for 511,000 growing sizes", (unsigned long long)shown);
    EXPECT(shown >= 10, "%llu showings: the growth was shown", (unsigned long long)shown);
}

enum { THREADS = 4 };

static void *racer(void *arg) {
    size_t base = (size_t)(uintptr_t)arg;
    for (size_t n = base; n <= DM_LIBC_MMAP_THRESHOLD_MAX; n += 4096 * THREADS)
        dm__libcheap_note_free(n);
    return NULL;
}

/* Threads freeing interleaved sizes: the largest size is covered at the end. */
static void test_racing_threads_keep_the_largest(void) {
    atomic_store(&dm__libcheap_shown, DM_LIBC_MMAP_THRESHOLD_MIN - 1); /* a fresh start */
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, racer,
                       (void *)(uintptr_t)(DM_LIBC_MMAP_THRESHOLD_MIN + 4096 * (size_t)i));
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    size_t shown = atomic_load(&dm__libcheap_shown);
    EXPECT(shown >= DM_LIBC_MMAP_THRESHOLD_MAX - 4096 * THREADS,
           "shown %zu: the largest sizes freed are covered", shown);
}

int main(void) {
    dm_runtime_init();
    test_load_policy("libcheap_test", "version: 1\ndefault: general\narenas:\n  general: {}\n");
    test_glibc_sees_what_numpy_would_have_freed();
    test_showings_are_bounded();
    test_racing_threads_keep_the_largest();
    return TEST_EXIT();
}
