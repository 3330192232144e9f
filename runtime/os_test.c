/*
 * os_test.c: the OS primitives behind hugepage accounting (PAGEMAP_SCAN and
 * the /proc/self/smaps fallback) count the same hugepages.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "runtime/os.h"
#include "testing/test.h"

/* ---- hugepage accounting: PAGEMAP_SCAN and the smaps fallback agree ---------- */

static uintptr_t hp_lo, hp_hi;
static uint64_t hp_smaps;

static void smaps_cb(void *arg, uintptr_t start, uintptr_t end, uint64_t huge) {
    if (start <= hp_lo && hp_hi <= end)
        hp_smaps += huge;
}

static void test_hugepage_primitives(void) {
    size_t len = 8 << 20, two = 2 << 20;
    char *raw = mmap(NULL, len + two, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        TEST_FAIL_("mmap: %s", "failed");
        return;
    }
    char *p = (char *)(((uintptr_t)raw + two - 1) & ~(uintptr_t)(two - 1));
    madvise(p, len, MADV_HUGEPAGE);
    memset(p, 1, len);
    hp_lo = (uintptr_t)p, hp_hi = (uintptr_t)p + len;
    EXPECT_INT_EQ(dm__os_smaps_huge(smaps_cb, NULL), 0, "smaps walk");
    uintptr_t r[1][2] = {{hp_lo, hp_hi}};
    uint64_t scan = 0;
    int rc = dm__os_huge_bytes((const uintptr_t(*)[2])r, 1, &scan);
    if (hp_smaps == 0)
        printf("SKIP: no transparent hugepages here (THP off or memory fragmented)\n");
    else if (rc != 0)
        printf("SKIP: PAGEMAP_SCAN unavailable (%s): the smaps fallback is in use\n",
               strerror(-rc));
    else
        EXPECT_UINT_EQ(scan, hp_smaps, "PAGEMAP_SCAN and smaps count the same hugepages");
    munmap(raw, len + two);
}

int main(void) {
    test_hugepage_primitives();
    return TEST_EXIT();
}
