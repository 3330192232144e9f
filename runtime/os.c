/*
 * os.c: mmap/mprotect/madvise/mbind, NUMA topology, and the files of
 * file-backed arenas (the directory rule, O_TMPFILE, fallocate), nothing else.
 *
 * NUMA placement uses the raw mbind(2) wrapper from libnuma's numaif.h rather than
 * libnuma's higher-level calls, which allocate and may print to stderr.
 */
#include "policy/trust.h"
#include "runtime/os.h"

#include <dlfcn.h>
#include <errno.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <pthread.h>
#include <fcntl.h>
#include <malloc.h>
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "policy/policy.h"
#include "runtime/datamem.h"

#ifndef MPOL_LOCAL
#define MPOL_LOCAL 4
#endif

static _Atomic uint64_t fake_nodes; /* tests only */

/* Where the last reservation started: the next is tried just below it (the
 * kernel maps top-down), which is usually free and aligned, so no overshoot. */
static _Atomic uintptr_t reserve_hint;

/* Address space that holds no memory yet (reservations, the tally's sparse
 * shadow) is mapped and unmapped with syscall(2), not libc's mmap/munmap:
 * memory profilers hook those symbols (memray patches them in every loaded
 * library's GOT, ours included; Fil and Scalene interpose them) and count each
 * mapping as an allocation of its whole length, so a 1 GiB PROT_NONE segment
 * read as 1 GiB of the job's peak (memray: 3.85 GB against 343 MB without a
 * policy on an fft job). Memory an arena takes to serve arrays
 * (dm__os_commit, a spill file's pages) goes through mmap, so that a profiler
 * interposing it for the whole process sees datamem's arrays somehow, until
 * the extension finds its own GOT hooked (pyext/shadow.c): it then shows each
 * array to the hook itself, and dm_runtime_hide_mappings turns these mappings
 * unseen too. (jemalloc's own metadata is always unseen:
 * third_party/jemalloc/jemalloc.bzl.) */
static void *unseen_map(void *want, size_t size, int prot) {
    long p = syscall(SYS_mmap, want, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0L);
    return (void *)p; /* MAP_FAILED with errno set on error (syscall(2)) */
}

static _Atomic bool hide_mappings;

void dm_runtime_hide_mappings(void) {
    atomic_store_explicit(&hide_mappings, true, memory_order_relaxed);
}

/* A mapping that holds an arena's memory: mmap(2), through syscall(2) once
 * the mappings are hidden. */
static void *memory_map(void *p, size_t n, int flags, int fd, off_t off) {
    if (atomic_load_explicit(&hide_mappings, memory_order_relaxed))
        return (void *)syscall(SYS_mmap, p, n, PROT_READ | PROT_WRITE, flags, fd, off);
    return mmap(p, n, PROT_READ | PROT_WRITE, flags, fd, off);
}

static void unseen_unmap(void *p, size_t size) { syscall(SYS_munmap, p, size); }

/* A reservation of exactly `size` at `want`; kept only if the kernel put it there. */
static void *reserve_at(uintptr_t want, size_t size, size_t align) {
    char *p = unseen_map((void *)want, size, PROT_NONE);
    if (p == MAP_FAILED)
        return NULL;
    if (((uintptr_t)p & (align - 1)) == 0)
        return p;
    unseen_unmap(p, size);
    return NULL;
}

void *dm__os_reserve(size_t size, size_t align) {
    /* First try exactly `size` at aligned hints: reserving size + align and
     * trimming would need twice the address space for a moment, which fails
     * under an RLIMIT_AS that the reservation itself fits in. The
     * hints: below the last reservation, then below where the kernel would put
     * `size` now (it maps top-down). */
    uintptr_t hints[4] = {atomic_load_explicit(&reserve_hint, memory_order_relaxed)};
    char *probe = unseen_map(NULL, size, PROT_NONE);
    if (probe != MAP_FAILED) {
        if (((uintptr_t)probe & (align - 1)) == 0) {
            atomic_store_explicit(&reserve_hint, (uintptr_t)probe, memory_order_relaxed);
            return probe;
        }
        unseen_unmap(probe, size);
        uintptr_t top = ((uintptr_t)probe + size) & ~(uintptr_t)(align - 1);
        hints[1] = top;
        hints[2] = top - align;
        hints[3] = top - 2 * align;
    }
    for (int i = 0; i < 4; i++) {
        if (hints[i] <= size + align)
            continue;
        void *p = reserve_at((hints[i] - size) & ~(uintptr_t)(align - 1), size, align);
        if (p) {
            atomic_store_explicit(&reserve_hint, (uintptr_t)p, memory_order_relaxed);
            return p;
        }
    }
    size_t len = size + align;
    if (len < size)
        return NULL;
    char *raw = unseen_map(NULL, len, PROT_NONE);
    if (raw == MAP_FAILED)
        return NULL;
    uintptr_t start = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    size_t head = start - (uintptr_t)raw;
    size_t tail = len - head - size;
    if (head)
        unseen_unmap(raw, head);
    if (tail)
        unseen_unmap((char *)start + size, tail);
    atomic_store_explicit(&reserve_hint, start, memory_order_relaxed);
    return (void *)start;
}

void dm__os_release(void *p, size_t n) { unseen_unmap(p, n); }

/* Commits by mapping the range again without MAP_NORESERVE, so the kernel
 * accounts it as NumPy's default allocator's memory is: under the default
 * heuristic overcommit an impossible request (np.zeros(2**45)) fails here and
 * NumPy raises MemoryError at once, and with vm.overcommit_memory=2 the commit
 * limit applies. (mprotect of a MAP_NORESERVE reservation is never accounted:
 * such requests would succeed and the job be OOM-killed later.) */
int dm__os_commit(void *p, size_t n) {
    void *q = memory_map(p, n, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    return q == p ? 0 : -errno;
}

void *dm__os_map_sparse(size_t size) {
    void *p = unseen_map(NULL, size, PROT_READ | PROT_WRITE);
    return p == MAP_FAILED ? NULL : p;
}

uint64_t dm__os_as_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return 0;
    return (uint64_t)rl.rlim_cur;
}

int dm__os_thp(void *p, size_t n, int mode) {
    int advice;
    switch (mode) {
    case DM_THP_ON: advice = MADV_HUGEPAGE; break;
    case DM_THP_OFF: advice = MADV_NOHUGEPAGE; break;
    default: return 0;
    }
    return madvise(p, n, advice) == 0 ? 0 : -errno;
}

int dm__os_numa(void *p, size_t n, int mode, uint64_t nodes) {
    unsigned long mask[1] = {(unsigned long)nodes};
    int mpol;
    switch (mode) {
    case DM_NUMA_NONE: return 0;
    case DM_NUMA_LOCAL: mpol = MPOL_LOCAL; mask[0] = 0; break;
    case DM_NUMA_BIND: mpol = MPOL_BIND; break;
    case DM_NUMA_INTERLEAVE: mpol = MPOL_INTERLEAVE; break;
    case DM_NUMA_PREFERRED: mpol = MPOL_PREFERRED; mask[0] = nodes & -nodes; break;
    default: return -EINVAL;
    }
    long rc = mbind(p, n, mpol, mask[0] ? mask : NULL, mask[0] ? 64 : 0, 0);
    return rc == 0 ? 0 : -errno;
}

int dm__os_purge(void *p, size_t n, bool forced) {
    return madvise(p, n, forced ? MADV_DONTNEED : MADV_FREE) == 0 ? 0 : -errno;
}

void dm__os_trim_libc(void) {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
}

bool dm__os_resident(void *p, size_t n) {
    unsigned char vec[4096]; /* one byte per page: 4096 pages (16 MiB of 4 KiB pages) a call */
    size_t page = dm__os_page_size();
    for (size_t off = 0; off < n;) {
        size_t len = n - off < sizeof(vec) * page ? n - off : sizeof(vec) * page;
        if (mincore((char *)p + off, len, vec) != 0)
            return false;
        for (size_t i = 0; i < (len + page - 1) / page; i++)
            if (!(vec[i] & 1))
                return false;
        off += len;
    }
    return true;
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 /* Linux 5.7 */
#endif

/* Moves and fresh maps of memory an arena already holds go through syscall(2)
 * whatever a profiler hooks: they move or replace pages it was shown, and a
 * profiler that counted them would count the same array twice. */
int dm__os_move(void *from, void *to, size_t n) {
    long q = syscall(SYS_mremap, from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to);
    return (void *)q == to ? 0 : -errno;
}

int dm__os_map_fresh(void *p, size_t n) {
    long q = syscall(SYS_mmap, p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                     -1, 0L);
    return (void *)q == p ? 0 : -errno;
}

int dm__os_empty_frames(void *p, size_t n, size_t frame, uint64_t *out) {
    unsigned char vec[4096];
    size_t page = dm__os_page_size(), per = frame / page;
    size_t step = sizeof(vec) / per * frame; /* whole frames a call */
    for (size_t off = 0; off < n; off += step) {
        size_t len = n - off < step ? n - off : step;
        if (mincore((char *)p + off, len, vec) != 0)
            return -errno;
        for (size_t f = 0; f < len / frame; f++) {
            bool empty = true;
            for (size_t i = 0; i < per && empty; i++)
                empty = !(vec[f * per + i] & 1);
            size_t k = off / frame + f;
            if (empty)
                out[k / 64] |= UINT64_C(1) << (k % 64);
        }
    }
    return 0;
}

uint64_t dm__os_numa_nodes(void) {
    uint64_t fake = atomic_load_explicit(&fake_nodes, memory_order_relaxed);
    if (fake)
        return fake;
    /* libnuma fixes numa_all_nodes_ptr when it loads and frees it in its
     * destructor; a reload on the watcher thread while the process exits read
     * it as it was freed (TSan, runtime:stress_test). Read once, kept. */
    static _Atomic uint64_t real_nodes;
    uint64_t nodes = atomic_load_explicit(&real_nodes, memory_order_relaxed);
    if (nodes)
        return nodes;
    if (numa_available() >= 0) {
        int max = numa_max_node();
        for (int i = 0; i <= max && i < 64; i++)
            if (numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)i))
                nodes |= UINT64_C(1) << i;
    }
    nodes = nodes ? nodes : 1;
    atomic_store_explicit(&real_nodes, nodes, memory_order_relaxed);
    return nodes;
}

int dm__os_current_node(void) {
    unsigned cpu, node;
    if (getcpu(&cpu, &node) != 0)
        return 0;
    return (int)node;
}

void dm__os_set_topology(uint64_t nodes) {
    atomic_store_explicit(&fake_nodes, nodes, memory_order_relaxed);
}

ssize_t dm__os_read_small(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    size_t got = 0;
    for (ssize_t n; got + 1 < cap && (n = read(fd, buf + got, cap - 1 - got)) > 0;)
        got += (size_t)n;
    close(fd);
    if (cap)
        buf[got] = 0;
    return (ssize_t)got;
}

bool dm__os_each_line(const char *path, bool (*fn)(char *line, void *arg), void *arg) {
    FILE *f = fopen(path, "re");
    if (!f)
        return false;
    char *line = NULL;
    size_t cap = 0;
    bool found = false;
    while (!found && getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = 0;
        found = fn(line, arg);
    }
    free(line);
    fclose(f);
    return found;
}

uint64_t dm__os_anon_resident(void) {
    char buf[128];
    unsigned long long size, resident, shared;
    if (dm__os_read_small("/proc/self/statm", buf, sizeof(buf)) <= 0 ||
        sscanf(buf, "%llu %llu %llu", &size, &resident, &shared) != 3 || shared > resident)
        return 0;
    return (uint64_t)(resident - shared) * dm__os_page_size();
}

/* The kB figure after `key` in a /proc status text, in bytes (false: none). */
static bool status_kb(const char *text, const char *key, uint64_t *bytes) {
    const char *at = strstr(text, key);
    unsigned long long kb;
    if (!at || sscanf(at + strlen(key), " %llu kB", &kb) != 1)
        return false;
    *bytes = (uint64_t)kb * 1024;
    return true;
}

bool dm__os_rss_peak(uint64_t *rss, uint64_t *peak) {
    char buf[4096]; /* /proc/self/status is about 1.5 KB; VmHWM and VmRSS in its first third */
    return dm__os_read_small("/proc/self/status", buf, sizeof(buf)) > 0 &&
           status_kb(buf, "\nVmHWM:", peak) && status_kb(buf, "\nVmRSS:", rss);
}

size_t dm__os_page_size(void) {
    static _Atomic size_t page;
    size_t p = atomic_load_explicit(&page, memory_order_relaxed);
    if (!p) {
        p = (size_t)sysconf(_SC_PAGESIZE);
        atomic_store_explicit(&page, p, memory_order_relaxed);
    }
    return p;
}

int dm__os_smaps_huge(void (*fn)(void *arg, uintptr_t start, uintptr_t end, uint64_t huge),
                      void *arg) {
    FILE *f = fopen("/proc/self/smaps", "re");
    if (!f)
        return -errno;
    char line[512];
    unsigned long start = 0, end = 0;
    bool have = false, line_start = true;
    while (fgets(line, sizeof(line), f)) {
        bool whole = strchr(line, '\n') != NULL;
        /* Only a line's beginning can be a mapping header; the rest of a long
         * path name (fgets split it) must not be read as one. */
        if (line_start) {
            unsigned long long kb;
            if (sscanf(line, "%lx-%lx ", &start, &end) == 2 && strchr(line, '-') &&
                line[0] != ' ') {
                have = true;
            } else if (have && strncmp(line, "AnonHugePages:", 14) == 0 &&
                       sscanf(line + 14, "%llu", &kb) == 1) {
                if (kb)
                    fn(arg, (uintptr_t)start, (uintptr_t)end, (uint64_t)kb * 1024);
                have = false;
            }
        }
        line_start = whole;
    }
    fclose(f);
    return 0;
}

/* PAGEMAP_SCAN from Linux 6.7's <linux/fs.h>, which Debian bookworm's headers
 * (6.1) lack. */
struct dm_page_region {
    uint64_t start, end, categories;
};
struct dm_pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define DM_PAGE_IS_PFNZERO (1 << 5)
#define DM_PAGE_IS_HUGE (1 << 6)
#define DM_PAGEMAP_SCAN _IOWR('f', 16, struct dm_pm_scan_arg)

int dm__os_huge_bytes(const uintptr_t (*r)[2], int n, uint64_t *out) {
    /* Opened per call: after fork a kept descriptor would still read the
     * parent's address space. */
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct dm_page_region vec[128];
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        struct dm_pm_scan_arg a = {
            .size = sizeof(a), .start = r[i][0], .end = r[i][1],
            .vec = (uint64_t)(uintptr_t)vec, .vec_len = sizeof(vec) / sizeof(vec[0]),
            /* huge and not the huge zero page */
            .category_mask = DM_PAGE_IS_HUGE | DM_PAGE_IS_PFNZERO,
            .category_inverted = DM_PAGE_IS_PFNZERO,
            .return_mask = DM_PAGE_IS_HUGE,
        };
        while (a.start < a.end) {
            int got = ioctl(fd, DM_PAGEMAP_SCAN, &a);
            if (got < 0) {
                rc = -errno;
                break;
            }
            for (int k = 0; k < got; k++)
                out[i] += vec[k].end - vec[k].start;
            if (a.walk_end <= a.start) /* no progress: never loop forever */
                break;
            a.start = a.walk_end;
        }
    }
    close(fd);
    return rc;
}

/* ---- page-locking and GPU registration ------------------------------------ */

int dm__os_lock(void *p, size_t n) { return mlock(p, n) == 0 ? 0 : -errno; }

int dm__os_unlock(void *p, size_t n) { return munlock(p, n) == 0 ? 0 : -errno; }

uint64_t dm__os_memlock_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return UINT64_MAX;
    return (uint64_t)rl.rlim_cur;
}

/* The three entry points of the CUDA runtime we use, by their C ABI
 * (cudaError_t is an int enum; cudaHostRegisterPortable is 1). No CUDA header
 * or library is needed to build or install datamem. */
static struct {
    pthread_mutex_t mu;
    _Atomic bool ok;    /* set once, before a policy with pinned: cuda is in force */
    int (*host_register)(void *, size_t, unsigned int);
    int (*host_unregister)(void *);
    const char *(*error_string)(int);
    char why[200];
} gpu = {.mu = PTHREAD_MUTEX_INITIALIZER};

int dm__os_gpu_load(const char *path, char *why, size_t cap) {
    static const char *const names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                        "libcudart.so.11.0"};
    pthread_mutex_lock(&gpu.mu);
    if (!gpu.ok) {
        void *h = NULL;
        if (path && *path) {
            h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (!h)
                snprintf(gpu.why, sizeof(gpu.why), "%s", dlerror());
        } else {
            for (size_t i = 0; !h && i < sizeof(names) / sizeof(names[0]); i++)
                h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
            if (!h)
                snprintf(gpu.why, sizeof(gpu.why),
                         "no CUDA runtime found (libcudart.so, .13, .12, .11.0)");
        }
        if (h) {
            *(void **)&gpu.host_register = dlsym(h, "cudaHostRegister");
            *(void **)&gpu.host_unregister = dlsym(h, "cudaHostUnregister");
            *(void **)&gpu.error_string = dlsym(h, "cudaGetErrorString");
            gpu.ok = gpu.host_register && gpu.host_unregister;
            if (!gpu.ok)
                snprintf(gpu.why, sizeof(gpu.why), "%s has no cudaHostRegister",
                         path && *path ? path : "libcudart");
        }
    }
    bool ok = gpu.ok;
    if (!ok && why)
        snprintf(why, cap, "%s", gpu.why);
    pthread_mutex_unlock(&gpu.mu);
    return ok ? 0 : -ENOENT;
}

int dm__os_gpu_register(void *p, size_t n, char *why, size_t cap) {
    if (!gpu.ok) { /* loaded before any policy with pinned: cuda is installed */
        snprintf(why, cap, "the CUDA runtime is not loaded");
        return -ENOENT;
    }
    int rc = gpu.host_register(p, n, 1u /* cudaHostRegisterPortable */);
    if (rc == 0)
        return 0;
    snprintf(why, cap, "cudaHostRegister: %s (%d)",
             gpu.error_string ? gpu.error_string(rc) : "error", rc);
    return -EIO;
}

/* ---- files: the directory rule, spill files ------------------------------ */

int dm__os_dir_open_owned(const char *path, bool create, unsigned mode, char *why, size_t cap) {
    int fd = dm__trust_open(path, create ? DM__TRUST_DIR_CREATE : DM__TRUST_DIR, (mode_t)mode,
                            why, cap);
    return fd == DM_EINVALID ? DM_EIO : fd; /* not a directory: an error, not a refusal */
}

int dm_dir_open_owned(const char *path, bool create, unsigned mode, char *why, size_t cap) {
    return dm__os_dir_open_owned(path, create, mode, why, cap);
}

int dm__os_tmpfile(int dirfd) {
    /* O_EXCL: the file can never be given a name (linkat) */
    int fd = openat(dirfd, ".", O_TMPFILE | O_RDWR | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    /* btrfs copies a block on every write to it (copy-on-write), so a block
     * that fallocate reserved holds for the first write only: a rewrite of a
     * page written back needs a fresh block, which on a full disk is a SIGBUS
     * at the page fault. A file marked nodatacow while still empty (the flag
     * takes on an empty file only) rewrites its blocks in place, as ext4 and
     * XFS do (and compresses nothing: a directory marked compressed passes
     * that on, and btrfs refuses nodatacow until it is off, in a call of its
     * own). Elsewhere the flag means nothing or is refused: not asked. */
    struct statfs fs;
    int flags;
    if (fstatfs(fd, &fs) == 0 && fs.f_type == BTRFS_SUPER_MAGIC &&
        ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0 && !(flags & FS_NOCOW_FL)) {
        int plain = flags & ~FS_COMPR_FL, nocow = plain | FS_NOCOW_FL;
        if ((plain != flags && ioctl(fd, FS_IOC_SETFLAGS, &plain) != 0) ||
            ioctl(fd, FS_IOC_SETFLAGS, &nocow) != 0) {
            int e = errno;
            close(fd);
            return -e;
        }
    }
    return fd;
}

int dm__os_file_size(int fd, uint64_t n) { return ftruncate(fd, (off_t)n) == 0 ? 0 : -errno; }

int dm__os_file_reserve(int fd, uint64_t off, size_t n) {
    int rc;
    while ((rc = fallocate(fd, 0, (off_t)off, (off_t)n)) != 0 && errno == EINTR)
        ;
    return rc == 0 ? 0 : -errno;
}

int dm__os_file_punch(int fd, uint64_t off, size_t n) {
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)n) == 0
               ? 0
               : -errno;
}

/* XFS's zero range frees the blocks, then allocates the range again: another
 * process can take the freed blocks in between, the allocation then fails
 * with ENOSPC and leaves a hole where a spill arena's memory was in use, and
 * the next write fault there is a SIGBUS (seen: four processes on a full XFS,
 * one reusing 40 MiB blocks with np.zeros, test_spill_cowfs.py). ext4 turns
 * the range's extents unwritten in place, keeping its blocks. */
int dm__os_file_zero(int fd, uint64_t off, size_t n) {
    struct statfs fs;
    if (fstatfs(fd, &fs) != 0 || fs.f_type != EXT4_SUPER_MAGIC)
        return -EOPNOTSUPP;
    return fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)n) == 0
               ? 0
               : -errno;
}

int dm__os_map_file(void *p, size_t n, int fd, uint64_t off, bool shared) {
    void *q = memory_map(p, n, (shared ? MAP_SHARED : MAP_PRIVATE) | MAP_FIXED, fd, (off_t)off);
    return q == p ? 0 : -errno;
}

int dm__os_map_anon(void *p, size_t n) {
    void *q = memory_map(p, n, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    return q == p ? 0 : -errno;
}

/* sendfile (an in-kernel copy through the page cache), else read and write
 * through a buffer. Never copy_file_range: on XFS and btrfs it reflinks, the
 * two files then share blocks, and the first write to a shared block in either
 * needs a fresh one that no fallocate reserved (a reflinked extent replaces the
 * blocks reserved for the copy): on a full disk that page fault is a SIGBUS.
 * sendfile writes into the blocks `to` already holds. */
int dm__os_file_copy(int from, int to, uint64_t off, size_t n) {
    off_t in = (off_t)off;
    size_t left = n;
    if (lseek(to, (off_t)off, SEEK_SET) == (off_t)off) { /* sendfile writes at the position */
        while (left) {
            ssize_t k = sendfile(to, from, &in, left < 0x40000000 ? left : 0x40000000);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0 && (errno == ENOSPC || errno == EDQUOT || errno == EIO))
                return -errno;
            if (k <= 0)
                break;
            left -= (size_t)k;
        }
    }
    char buf[1 << 16];
    while (left) {
        size_t want = left < sizeof(buf) ? left : sizeof(buf);
        ssize_t k = pread(from, buf, want, in);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k == 0 ? -EIO : -errno;
        for (ssize_t w = 0; w < k;) {
            ssize_t m = pwrite(to, buf + w, (size_t)(k - w), in + w);
            if (m < 0 && errno == EINTR)
                continue;
            if (m <= 0)
                return m == 0 ? -EIO : -errno;
            w += m;
        }
        in += k;
        left -= (size_t)k;
    }
    return 0;
}

uint64_t dm__os_file_disk_bytes(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

int64_t dm__os_file_next_data(int fd, uint64_t off, uint64_t *end) {
    off_t a = lseek(fd, (off_t)off, SEEK_DATA);
    if (a < 0)
        return -1; /* ENXIO: no data past off */
    off_t b = lseek(fd, a, SEEK_HOLE);
    if (b <= a)
        return -1;
    *end = (uint64_t)b;
    return (int64_t)a;
}

int64_t dm__os_resident_pages(void *p, size_t n) {
    size_t page = dm__os_page_size(), pages = n / page;
    unsigned char vec[512];
    int64_t in = 0;
    for (size_t done = 0; done < pages;) {
        size_t k = pages - done < sizeof(vec) ? pages - done : sizeof(vec);
        if (mincore((char *)p + done * page, k * page, vec) != 0)
            return -errno;
        for (size_t i = 0; i < k; i++)
            in += vec[i] & 1;
        done += k;
    }
    return in;
}

int dm__os_pageout_file(void *p, size_t n, int fd, uint64_t off) {
    /* MADV_PAGEOUT reclaims clean file pages but leaves dirty ones to kswapd:
     * write them back first. */
    if (sync_file_range(fd, (off_t)off, (off_t)n,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                            SYNC_FILE_RANGE_WAIT_AFTER) != 0)
        return -errno;
    if (madvise(p, n, MADV_PAGEOUT) != 0) {
        if (errno != EINVAL)
            return -errno;
        /* Before Linux 5.4: safe on a shared mapping once written back (its
         * pages are the file's: the next touch reads them again) */
        if (madvise(p, n, MADV_DONTNEED) != 0)
            return -errno;
    }
    /* MADV_PAGEOUT reclaims the pages mapped here; a page fault also reads
     * ahead pages of the file it does not map, which stay in the page cache
     * (mincore and a cgroup count them; a 64 MiB spilled array kept 9 MiB
     * resident against a resident_max of 8 MiB). Clean once written back:
     * dropped too. */
    return -posix_fadvise(fd, (off_t)off, (off_t)n, POSIX_FADV_DONTNEED);
}
