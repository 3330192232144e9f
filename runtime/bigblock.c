/*
 * bigblock.c: big blocks, treated the way NumPy's default allocator treats big
 * arrays, so that turning a policy on never makes a job slower than NumPy
 * (issue 12; docs/performance.md, "Real jobs").
 *
 *   - Hugepage advice. NumPy's default handler advises MADV_HUGEPAGE on every
 *     array of 4 MiB or more (unless NUMPY_MADVISE_HUGEPAGE=0 or
 *     np._core.multiarray._set_madvise_hugepage(False)); with the kernel's THP
 *     mode at `madvise` (Debian's default) only advised memory gets hugepages.
 *     An arena left at `hugepages: system` lost that: 0 MB of AnonHugePages
 *     where NumPy had 284 MB, a random gather over 2 GiB 1.37x slower. Now a
 *     block of >= 4 MiB from such an arena gets the advice while NumPy's own
 *     setting is on (the Python layer reads it at install). Only whole 2 MiB
 *     frames are advised (a partial frame cannot be a hugepage anyway), so
 *     mappings split less than NumPy's per-array advice splits them, and each
 *     frame once: a bitmap of advised frames makes a reused block cost a few
 *     loads instead of a system call (np.empty(4 MiB) create/destroy stays
 *     ~0.4 us). The advice is never taken back (an arena's memory stays its
 *     own), as NumPy's stays on a heap it reuses. `on` / `off` advise or
 *     forbid whole extents as before (arena.c, place()).
 *   - Zeroing. jemalloc clears a reused block for calloc with memset (our
 *     extent hooks make it so: its default purge-and-refault is 18-45x slower
 *     for np.zeros + use up to 16 MiB). But NumPy's default gets fresh pages
 *     from the kernel for every block of 32 MiB or more (glibc maps them), so
 *     an np.zeros(64 MiB) that is only partly used cost it 13 us where a
 *     memset costs 8 ms. From 32 MiB the block's pages are given back
 *     instead (MADV_DONTNEED) and the kernel supplies zero pages on first
 *     touch, as it does for the default: a used block pays the same faults as
 *     the default, an unused one a system call. Below 32 MiB glibc clears
 *     reused heap memory too, and memset stays.
 *
 * Thread safety: lock-free. The bitmap is updated with relaxed atomic ORs; two
 * threads racing on one frame both advise it, which is harmless.
 */
#include "runtime/bigblock.h"

#include <string.h>

#include "runtime/datamem.h"
#include "runtime/internal.h"
#include "runtime/os.h"

#define FRAME_SHIFT 21 /* 2 MiB: one PMD-mapped hugepage */
#define FRAME ((uintptr_t)1 << FRAME_SHIFT)
#define NFRAMES ((uintptr_t)1 << (DM_VA_BITS - FRAME_SHIFT))

/* One bit per 2 MiB frame of the user address space (8 MiB of zero-filled
 * bss; only the words covering datamem's regions are ever touched, 64 bytes per
 * GiB reserved). Set once the frame was advised MADV_HUGEPAGE. */
static _Atomic uint64_t advised[NFRAMES / 64];
static _Atomic bool numpy_thp = true;

void dm__big_set_numpy_thp(bool on) {
    atomic_store_explicit(&numpy_thp, on, memory_order_relaxed);
}

void dm_runtime_set_numpy_hugepages(bool on) { dm__big_set_numpy_thp(on); }

bool dm__big_numpy_thp(void) { return atomic_load_explicit(&numpy_thp, memory_order_relaxed); }

static bool frames_advised(uintptr_t f0, uintptr_t f1) {
    for (uintptr_t f = f0; f < f1; f++)
        if (!(atomic_load_explicit(&advised[f / 64], memory_order_relaxed) &
              (UINT64_C(1) << (f % 64))))
            return false;
    return true;
}

void dm__big_advise(void *p, size_t n) {
    if (!atomic_load_explicit(&numpy_thp, memory_order_relaxed))
        return;
    uintptr_t lo = ((uintptr_t)p + FRAME - 1) & ~(FRAME - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(FRAME - 1);
    if (hi <= lo || (hi >> FRAME_SHIFT) > NFRAMES)
        return;
    je_arena_t *ja = dm__owner_of(p);
    if (!ja || atomic_load_explicit(&ja->owner->thp, memory_order_relaxed) != DM_THP_SYSTEM)
        return;
    uintptr_t f0 = lo >> FRAME_SHIFT, f1 = hi >> FRAME_SHIFT;
    if (frames_advised(f0, f1))
        return;
    if (dm__os_thp((void *)lo, hi - lo, DM_THP_ON) != 0) {
        atomic_fetch_add_explicit(&ja->owner->placement_errors, 1, memory_order_relaxed);
        return;
    }
    for (uintptr_t f = f0; f < f1; f++)
        atomic_fetch_or_explicit(&advised[f / 64], UINT64_C(1) << (f % 64),
                                 memory_order_relaxed);
}

void *dm__big_zero(void *p, size_t n) {
    uintptr_t page = dm__os_page_size();
    uintptr_t b = (uintptr_t)p, e = b + n;
    uintptr_t lo = (b + page - 1) & ~(page - 1), hi = e & ~(page - 1);
    /* Memory registered with the CUDA runtime (`pinned: cuda`) must keep its
     * pages: MADV_DONTNEED would swap them under the GPU's mapping. */
    je_arena_t *ja = dm__owner_of(p);
    bool keep = ja && atomic_load_explicit(&ja->ever_pinned, memory_order_relaxed);
    if (!keep && hi > lo && dm__os_purge((void *)lo, hi - lo, true) == 0) {
        memset(p, 0, lo - b);
        memset((void *)hi, 0, e - hi);
    } else { /* pinned, locked pages (EINVAL), or less than a page */
        memset(p, 0, n);
    }
    return p;
}
