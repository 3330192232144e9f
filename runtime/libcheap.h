/*
 * libcheap.h: what NumPy's frees would have told glibc's malloc (libcheap.c).
 */
#ifndef DM_RUNTIME_LIBCHEAP_H
#define DM_RUNTIME_LIBCHEAP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* glibc's bounds on its dynamic mmap threshold (malloc.c,
 * DEFAULT_MMAP_THRESHOLD_MIN and _MAX on a 64-bit target) */
#define DM_LIBC_MMAP_THRESHOLD_MIN ((size_t)128 << 10)
#define DM_LIBC_MMAP_THRESHOLD_MAX ((size_t)32 << 20)

/* The largest array size glibc has been shown, plus 1/16 (libcheap.c, "Cost"),
 * starting just below its first mmap threshold; SIZE_MAX where there is
 * nothing to show to (no glibc). */
extern _Atomic size_t dm__libcheap_shown;

/* Blocks shown to glibc so far (tests, and the bound libcheap.c states). */
extern _Atomic uint64_t dm__libcheap_showings;

/* glibc is shown a free of a block of `size` bytes (libcheap.c). */
void dm__libcheap_show(size_t size);

/* An array of `size` bytes was freed (NumPy's size): if glibc, had it served
 * the array, would have raised its thresholds, it is shown a block of that
 * size. One load and compare unless the size is the largest yet. */
static inline void dm__libcheap_note_free(size_t size) {
    if (__builtin_expect(size > atomic_load_explicit(&dm__libcheap_shown, memory_order_relaxed),
                         0) &&
        size <= DM_LIBC_MMAP_THRESHOLD_MAX)
        dm__libcheap_show(size);
}

#pragma GCC visibility pop

#endif /* DM_RUNTIME_LIBCHEAP_H */
