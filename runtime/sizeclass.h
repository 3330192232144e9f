/*
 * sizeclass.h: jemalloc's size classes up to 256 KiB, computed without calling
 * jemalloc, for the per-thread block cache (bcache.h).
 *
 * jemalloc 5.3 on x86-64 (LG_QUANTUM 4, 4 classes per doubling): 8, then 16..64
 * by 16, then each doubling (2^g, 2^(g+1)] split into 4 equal steps: 80, 96, 112,
 * 128, 160, ..., 224 KiB, 256 KiB. A request of n bytes gets the first class
 * >= n. runtime_test checks dm_sc_index/dm_sc_size against dmje_nallocx for
 * every n up to DM_SC_MAX, so a jemalloc with other classes fails there, not in
 * production.
 */
#ifndef DM_RUNTIME_SIZECLASS_H
#define DM_RUNTIME_SIZECLASS_H

#include <stddef.h>
#include <stdint.h>

#define DM_SC_MAX ((size_t)256 << 10) /* the largest cached size */
#define DM_SC_COUNT 53                /* classes 8 B .. 256 KiB */

/* The class of a request of n bytes, 1 <= n <= DM_SC_MAX. */
static inline unsigned dm_sc_index(size_t n) {
    if (n <= 64)
        return n <= 8 ? 0u : (unsigned)((n + 15) >> 4);
    unsigned lg = 63u - (unsigned)__builtin_clzll((unsigned long long)(n - 1));
    return 1u + (lg - 6u) * 4u + (unsigned)((n - 1) >> (lg - 2u));
}

/* The usable size of class k (runtime_test checks the table against the rule
 * above and against jemalloc). */
static const uint32_t dm_sc_sizes[DM_SC_COUNT] = {
    8, 16, 32, 48, 64, 80, 96, 112,
    128, 160, 192, 224, 256, 320, 384, 448,
    512, 640, 768, 896, 1024, 1280, 1536, 1792,
    2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168,
    8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672,
    32768, 40960, 49152, 57344, 65536, 81920, 98304, 114688,
    131072, 163840, 196608, 229376, 262144,
};

static inline size_t dm_sc_size(unsigned k) { return dm_sc_sizes[k]; }

#endif /* DM_RUNTIME_SIZECLASS_H */
