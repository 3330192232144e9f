/*
 * os_test.c: the OS primitives behind hugepage accounting (PAGEMAP_SCAN and
 * the /proc/self/smaps fallback) count the same hugepages; the cgroup memory
 * limit (cgroup.c) read from fake v1 and v2 trees; the resident set and its peak.
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

static char limit_at[4096]; /* the limiting cgroup of expect_limit's last call */

/* The limiting cgroup of the last expect_limit is `rel` under the fake root. */
static void expect_at(const char *rel, const char *why) {
    char want[4096];
    snprintf(want, sizeof(want), "%s/%s", fake_root, rel);
    EXPECT_STR_EQ(limit_at, want, why);
}

static void expect_limit(uint64_t want, int want_version, const char *why) {
    int version = 0;
    uint64_t got = dm__cgroup_memory_limit(fake_root, &version, limit_at, sizeof(limit_at));
    EXPECT_TRUE(want ? strncmp(limit_at, fake_root, strlen(fake_root)) == 0 : !limit_at[0], why);
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
    expect_at("sys/fs/cgroup/kubepods", "v2: the ancestor's charge is the budget's");
    fake_file("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "1073741824\n");
    expect_limit(UINT64_C(1) << 30, 2, "v2: the process's own, smaller");
    expect_at("sys/fs/cgroup/kubepods/pod1/ctr", "v2: the process's own cgroup");
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
    expect_at("sys/fs/cgroup/memory x/jobs/child", "v1: above the mount, the nearest in view");
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

/* A cgroup's charge: what reclaim cannot drop, over the cgroup and those
 * below it. v1: the total_ lines (the group's own rss and shmem lines are
 * smaller); v2: anon and shmem, the format of a 6.x kernel's memory.stat
 * (written here by hand: no v2 memory controller on this host). */
static void test_cgroup_charge(void) {
    fake_reset("charge");
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/g", fake_root);
    EXPECT_UINT_EQ(dm__cgroup_charge(dir, 1), UINT64_MAX, "no memory.stat: unknown");
    fake_file("g/memory.stat", "cache 609406976\nrss 3117056\nrss_huge 0\nshmem 9084928\n"
                               "hierarchical_memory_limit 9223372036854771712\n"
                               "total_cache 2859077632\ntotal_rss 487596032\n"
                               "total_rss_huge 0\ntotal_shmem 9084928\ntotal_mapped_file 1\n");
    EXPECT_UINT_EQ(dm__cgroup_charge(dir, 1), UINT64_C(487596032) + 9084928,
                   "v1: total_rss + total_shmem");
    fake_file("g/memory.stat", "anon 1048576000\nfile 2147483648\nkernel 33554432\n"
                               "kernel_stack 245760\nsock 0\nshmem 4194304\n"
                               "file_mapped 1048576\nanon_thp 0\n");
    EXPECT_UINT_EQ(dm__cgroup_charge(dir, 2), UINT64_C(1048576000) + 4194304,
                   "v2: anon + shmem (anon_thp is within anon)");
    fake_file("g/memory.stat", "anon_thp 5\nfile 7\n");
    EXPECT_UINT_EQ(dm__cgroup_charge(dir, 2), UINT64_MAX, "no anon line: unknown, not 0");
    fake_file("g/memory.stat", "anon 12x\nshmem 1\n");
    EXPECT_UINT_EQ(dm__cgroup_charge(dir, 2), UINT64_MAX, "not a number: unknown");
}

/* The process's resident set and its peak: 32 MiB touched and unmapped leave
 * the peak 32 MiB or more over the resident set (the purge on growth compares
 * the two, runtime/arena.c). */
static void test_rss_peak(void) {
    uint64_t rss0, peak0, rss, peak;
    EXPECT_TRUE(dm__os_rss_peak(&rss0, &peak0), "/proc/self/status read");
    EXPECT_TRUE(rss0 > 0 && rss0 <= peak0, "resident under its peak");
    size_t len = 32 << 20;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_TRUE(p != MAP_FAILED, "mmap");
    if (p == MAP_FAILED)
        return;
    memset(p, 1, len);
    EXPECT_TRUE(dm__os_rss_peak(&rss, &peak), "read again");
    EXPECT_TRUE(rss >= rss0 + len - (1 << 20), "touched: the resident set grew by 32 MiB");
    munmap(p, len);
    EXPECT_TRUE(dm__os_rss_peak(&rss, &peak), "read after munmap");
    EXPECT_TRUE(peak >= rss + len - (1 << 20), "unmapped: the peak stays 32 MiB over the resident set");
}

int main(void) {
    test_rss_peak();
    test_hugepage_primitives();
    test_cgroup_limit();
    test_cgroup_charge();
    return TEST_EXIT();
}
