/*
 * os_test.c: the OS primitives behind hugepage accounting (PAGEMAP_SCAN and
 * the /proc/self/smaps fallback) count the same hugepages; the cgroup memory
 * limit (cgroup.c) read from fake v1 and v2 trees.
 */
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* ---- the cgroup's memory limit, from a fake tree ----------------------------------- */

static char fake_root[512];

/* Writes `text` to fake_root/`rel`, making its directories. */
static void fake_file(const char *rel, const char *text) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", fake_root, rel);
    for (char *p = path + strlen(fake_root) + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        mkdir(path, 0755);
        *p = '/';
    }
    test_put_file(path, text);
}

/* A fresh fake tree for each case. */
static void fake_reset(const char *name) {
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(fake_root, sizeof(fake_root), "%s/cg_%d_%s", tmp && *tmp ? tmp : "/tmp",
             (int)getpid(), name);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", fake_root);
    if (system(cmd) != 0)
        TEST_FAIL_("cannot clear %s", fake_root);
    mkdir(fake_root, 0755);
}

static void expect_limit(uint64_t want, int want_version, const char *why) {
    int version = 0;
    uint64_t got = dm__cgroup_memory_limit(fake_root, &version);
    EXPECT_UINT_EQ(got, want, why);
    if (want)
        EXPECT_INT_EQ(version, want_version, why);
}

#define MOUNT_V2 "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n"
#define MOUNT_V1 "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
#define V1_MAX "9223372036854771712\n" /* PAGE_COUNTER_MAX pages: unlimited */

/* worker_limit's base ignored cgroup v1 and every ancestor's limit. The
 * smallest limit from the process's cgroup up to the mount's root, in v1 and
 * v2 alike. */
static void test_cgroup_limit(void) {
    fake_reset("v2");
    fake_file("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
    fake_file("proc/self/mountinfo", "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" MOUNT_V2);
    fake_file("sys/fs/cgroup/kubepods/memory.max", "4294967296\n");
    fake_file("sys/fs/cgroup/kubepods/pod1/memory.max", "max\n");
    fake_file("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "8589934592\n");
    expect_limit(UINT64_C(4) << 30, 2, "v2: an ancestor's smaller limit");
    fake_file("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "1073741824\n");
    expect_limit(UINT64_C(1) << 30, 2, "v2: the process's own, smaller");
    fake_file("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");
    fake_file("sys/fs/cgroup/kubepods/memory.max", "max\n");
    expect_limit(0, 0, "v2: max everywhere is no limit");

    fake_reset("v2sub"); /* the mount shows only the container's subtree */
    fake_file("proc/self/cgroup", "0::/pods/a/job\n");
    fake_file("proc/self/mountinfo", "30 23 0:26 /pods/a /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
    fake_file("sys/fs/cgroup/memory.max", "2147483648\n");
    fake_file("sys/fs/cgroup/job/memory.max", "max\n");
    expect_limit(UINT64_C(2) << 30, 2, "v2: the path below the mount's root");
    fake_file("proc/self/cgroup", "0::/pods/ab/job\n");
    expect_limit(0, 0, "v2: a cgroup outside the mount's root is not read");
    fake_file("proc/self/cgroup", "0::/pods/a/../../etc\n");
    fake_file("etc/memory.max", "1\n");
    expect_limit(0, 0, "v2: '..' never leaves the mount");

    fake_reset("v1"); /* a hybrid host: memory is a v1 controller, v2 holds none */
    fake_file("proc/self/cgroup", "5:devices:/\n4:memory,hugetlb:/jobs/child\n0::/\n");
    fake_file("proc/self/mountinfo",
              "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
              "35 31 0:32 / /sys/fs/cgroup/memory\\040x rw,relatime - cgroup cgroup "
              "rw,memory,hugetlb\n");
    fake_file("sys/fs/cgroup/memory x/memory.limit_in_bytes", V1_MAX);
    fake_file("sys/fs/cgroup/memory x/jobs/memory.limit_in_bytes", "2147483648\n");
    fake_file("sys/fs/cgroup/memory x/jobs/child/memory.limit_in_bytes", "4294967296\n");
    expect_limit(UINT64_C(2) << 30, 1, "v1: the parent's smaller limit");
    fake_file("sys/fs/cgroup/memory x/jobs/memory.limit_in_bytes", V1_MAX);
    fake_file("sys/fs/cgroup/memory x/jobs/child/memory.limit_in_bytes", V1_MAX);
    expect_limit(0, 0, "v1: unlimited everywhere is no limit");
    fake_file("sys/fs/cgroup/memory x/jobs/child/memory.stat",
              "cache 0\nhierarchical_memory_limit 3221225472\ntotal_cache 0\n");
    expect_limit(UINT64_C(3) << 30, 1, "v1: hierarchical_memory_limit (ancestors out of view)");
    fake_file("proc/self/cgroup", "4:memory,hugetlb:/jobs/child\n0::/sub\n");
    fake_file("sys/fs/cgroup/unified/sub/memory.max", "1073741824\n");
    expect_limit(UINT64_C(1) << 30, 2, "both hierarchies: the smaller limit");
    fake_file("proc/self/cgroup", "4:memory,hugetlb:/jobs/child\n0::/\n");
    fake_file("sys/fs/cgroup/unified/memory.max", "536870912\n");
    expect_limit(UINT64_C(512) << 20, 2,
                 "the mount point's own limit counts (in a cgroup namespace it is the job's)");

    fake_reset("none");
    expect_limit(0, 0, "no /proc files: no limit");
    fake_file("proc/self/cgroup", "4:memory:/x\n");
    fake_file("proc/self/mountinfo", MOUNT_V1);
    expect_limit(0, 0, "no limit files: no limit");
    fake_file("sys/fs/cgroup/memory/x/memory.limit_in_bytes", "12abc\n");
    expect_limit(0, 0, "not a number: no limit");
    fake_file("sys/fs/cgroup/memory/x/memory.limit_in_bytes", "536870912\n");
    expect_limit(UINT64_C(512) << 20, 1, "v1 at the mount's first level");
}

int main(void) {
    test_hugepage_primitives();
    test_cgroup_limit();
    return TEST_EXIT();
}
