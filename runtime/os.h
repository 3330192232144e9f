/*
 * os.h: every system call the runtime makes, behind one small interface (the way
 * mimalloc keeps src/prim/ behind prim.h), so arena and dispatch code read as
 * policy, not syscalls.
 *
 * Thread safety: all functions are reentrant. Topology can be replaced for tests
 * (dm__os_set_topology) before dm_runtime_init.
 */
#ifndef DM_RUNTIME_OS_H
#define DM_RUNTIME_OS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Reserves `size` bytes of address space aligned to `align` (PROT_NONE, nothing
 * committed). Returns NULL on failure. Reservations, their release and the
 * sparse maps below are made with syscall(2), unseen by profilers that hook
 * libc's mmap/munmap (memray): they are no memory of the job's (os.c). */
void *dm__os_reserve(size_t size, size_t align);
/* Makes [p, p+n) readable and writable (commits it, with the kernel's
 * overcommit accounting). 0 or -errno. */
int dm__os_commit(void *p, size_t n);
/* Gives reserved address space back. */
void dm__os_release(void *p, size_t n);
/* `size` bytes of zeroed, readable and writable memory that takes no commit
 * charge (MAP_NORESERVE): pages appear as they are first written. For sparse
 * tables (tally.c's shadow). NULL on failure. */
void *dm__os_map_sparse(size_t size);
/* cgroup.c: the process's memory limit in *bytes (0 when none can be read) and where it
 * came from (`source`: "env", "cgroup v1", "cgroup v2" or "ram"):
 * DATAMEM_MEMORY_LIMIT when set, a size in the policy's grammar (bytes, or a
 * whole number with a unit: 4GiB); else the smaller of the cgroup's limit
 * (dm__cgroup_memory_limit) and physical memory. A DATAMEM_MEMORY_LIMIT that
 * is not such a size is an error, never ignored: DM_EINVALID with one line in
 * `why`. When the limit is a cgroup's, that cgroup's directory is in `group`
 * (else ""), and its hierarchy in *group_version (1 or 2; 0 without one).
 * Reads files: never on an allocation path. */
int dm__cgroup_process_limit(uint64_t *bytes, char *source, size_t cap, char *why, size_t whycap,
                             char *group, size_t groupcap, int *group_version);
/* cgroup.c: the smallest memory limit on this process's cgroup and its
 * ancestors up to its hierarchy's mount (v1 memory.limit_in_bytes and
 * hierarchical_memory_limit, v2 memory.max), in bytes, the hierarchy's
 * version in *version and the directory of the cgroup that sets it in `at`
 * ("" and 0 when there is none). Every path read is prefixed by `root` (""
 * for the real one; tests pass a fake tree holding proc/self/cgroup,
 * proc/self/mountinfo and the mounts). */
uint64_t dm__cgroup_memory_limit(const char *root, int *version, char *at, size_t atcap);
/* cgroup.c: what the cgroup at directory `dir` (hierarchy `version`) and the
 * cgroups below it hold that reclaim cannot drop: anonymous pages and shmem
 * (memory.stat: v1 total_rss + total_shmem, v2 anon + shmem), in bytes;
 * UINT64_MAX when it cannot be read. open, read, close: no allocation, no lock. */
uint64_t dm__cgroup_charge(const char *dir, int version);
/* Reads the small file at `path` (/proc, cgroupfs) whole into `buf`, at most
 * cap - 1 bytes, NUL-terminated: its length, or -errno. open, read, close: no
 * allocation, no lock (an allocation's slow path may call it). */
ssize_t dm__os_read_small(const char *path, char *buf, size_t cap);
/* Calls fn(line, arg) on each line of the file at `path` (its newline cut)
 * until one returns true; whether one did (false: none, or unreadable).
 * Allocates (getline): never on an allocation path. */
bool dm__os_each_line(const char *path, bool (*fn)(char *line, void *arg), void *arg);
/* RLIMIT_AS in bytes, 0 when unlimited. */
uint64_t dm__os_as_limit(void);
/* The process's resident anonymous bytes (/proc/self/statm: resident less
 * shared, i.e. RssAnon: what a memory cgroup charges the process beyond page
 * cache), 0 when it cannot be read. open, read, close: no allocation, no lock;
 * about 10 us (tally.c reads it at most every DM_TALLY_BESIDE_STALE_MS). */
uint64_t dm__os_anon_resident(void);
/* The process's resident set now and its peak over the process's life
 * (/proc/self/status: VmRSS, VmHWM; file pages included, as every RSS a user
 * reads), in bytes; false when they cannot be read. VmHWM, not getrusage's
 * ru_maxrss: a process started by one that exec'd (subprocess, spawn) inherits
 * its parent's ru_maxrss. open, read, close: no allocation, no lock; about 20 us. */
bool dm__os_rss_peak(uint64_t *rss, uint64_t *peak);
/* mlock / munlock: 0 or -errno. */
int dm__os_lock(void *p, size_t n);
int dm__os_unlock(void *p, size_t n);
/* RLIMIT_MEMLOCK in bytes, UINT64_MAX when unlimited. */
uint64_t dm__os_memlock_limit(void);
/* The CUDA runtime, loaded with dlopen on first need: `path` (NULL: the usual
 * names of libcudart). 0, or an error with the reason in `why`. Idempotent;
 * call before any dm__os_gpu_register. */
int dm__os_gpu_load(const char *path, char *why, size_t cap);
/* cudaHostRegister(p, n, portable): 0, or an error with the reason in `why`. */
int dm__os_gpu_register(void *p, size_t n, char *why, size_t cap);
/* Hugepage advice: mode is a dm_thp_t. 0 or -errno. */
int dm__os_thp(void *p, size_t n, int mode);
/* NUMA policy for a range: mode is a dm_numa_mode_t, nodes a bitmask. */
int dm__os_numa(void *p, size_t n, int mode, uint64_t nodes);
/* Returns pages to the kernel: lazily (MADV_FREE) or at once (MADV_DONTNEED). */
int dm__os_purge(void *p, size_t n, bool forced);

/* glibc's malloc gives the free pages of its heaps back (malloc_trim). */
void dm__os_trim_libc(void);

/* Whether every page of [p, p+n) (page-aligned) is resident (mincore); false
 * on any error. */
bool dm__os_resident(void *p, size_t n);

/* Moves the pages of [from, from+n) to [to, to+n) (page-aligned, private
 * anonymous memory): whatever was at `to` is gone, `from` stays mapped and
 * reads zeros (mremap with MREMAP_DONTUNMAP). 0 or -errno. */
int dm__os_move(void *from, void *to, size_t n);
/* Maps [p, p+n) afresh (committed, empty), replacing what is there, unseen
 * by profilers' hooks. 0 or -errno. */
int dm__os_map_fresh(void *p, size_t n);

/* Sets bit i of out[] (n / frame bits, zeroed by the caller) when frame i of
 * [p, p+n) (frame-aligned, n a multiple of `frame`) has no resident page.
 * 0 or -errno. */
int dm__os_empty_frames(void *p, size_t n, size_t frame, uint64_t *out);

/* Bitmask of the machine's NUMA nodes (bit 0 at least). */
uint64_t dm__os_numa_nodes(void);
/* The NUMA node of the CPU the caller runs on (0 when unknown). */
int dm__os_current_node(void);

/* Tests: pretend the machine has these nodes (0 = use the real topology). */
void dm__os_set_topology(uint64_t nodes);

size_t dm__os_page_size(void);

/* Calls fn(arg, start, end, anon_huge_bytes) for every mapping of the process
 * (/proc/self/smaps: the kernel walks page tables to answer, so the cost grows
 * with mapped memory; never on an allocation path). 0 or -errno. */
int dm__os_smaps_huge(void (*fn)(void *arg, uintptr_t start, uintptr_t end, uint64_t huge),
                      void *arg);
/* For each range [r[i][0], r[i][1]), adds the bytes mapped by transparent
 * hugepages (PMD-mapped, not the huge zero page) to out[i], from the
 * PAGEMAP_SCAN ioctl: exact and scoped to the ranges, but Linux >= 6.7 only.
 * 0, or -errno (-ENOTTY / -EINVAL: not supported here). */
int dm__os_huge_bytes(const uintptr_t (*r)[2], int n, uint64_t *out);

/* ---- files ---------------------------------------------------------------
 * The directory rule (docs/security.md), one for the whole project: a
 * descriptor (O_RDONLY|O_DIRECTORY|O_NOFOLLOW, close-on-exec) on `path`,
 * made first with `mode` when `create` and absent, only if it is a directory
 * owned by the effective uid and not writable by group or others, its own name
 * no link, and every directory on the way trusted as the policy's are (the
 * walk is policy/trust.c's, dm__trust_open). Returns the fd, or DM_EIO /
 * DM_EUNSAFE with one line in `why`. (dm_dir_open_owned in datamem.h is the
 * same, for the services.) */
int dm__os_dir_open_owned(const char *path, bool create, unsigned mode, char *why, size_t cap);
/* A file with no name in directory `dirfd` (O_TMPFILE|O_EXCL: it can never be
 * linked in), read-write, mode 0600; on btrfs marked nodatacow (rewrites in
 * place, into the blocks fallocate reserved). The fd or -errno. */
int dm__os_tmpfile(int dirfd);
/* ftruncate. 0 or -errno. */
int dm__os_file_size(int fd, uint64_t n);
/* Disk blocks for [off, off+n) (fallocate): 0, or -ENOSPC on a full disk. */
int dm__os_file_reserve(int fd, uint64_t off, size_t n);
/* Gives the blocks of [off, off+n) back (a hole; reads as zeros). */
int dm__os_file_punch(int fd, uint64_t off, size_t n);
/* Zeroes [off, off+n) keeping its blocks (FALLOC_FL_ZERO_RANGE) where the
 * filesystem does so in place (ext4); -EOPNOTSUPP elsewhere (the caller
 * writes the zeros): XFS frees the range, then allocates it again, and tmpfs
 * has no such call. */
int dm__os_file_zero(int fd, uint64_t off, size_t n);
/* Maps [off, off+n) of `fd` read-write at exactly p (MAP_FIXED), shared or
 * private (copy-on-write). 0 or -errno. */
int dm__os_map_file(void *p, size_t n, int fd, uint64_t off, bool shared);
/* Fresh zero anonymous memory at exactly p (MAP_FIXED). 0 or -errno. */
int dm__os_map_anon(void *p, size_t n);
/* Copies [off, off+n) of `from` to the same offsets of `to`, into blocks of
 * `to`'s own: never shared with `from` (no reflink), so that a later write to
 * either file needs no block it does not hold. Moves `to`'s file position.
 * 0 or -errno. */
int dm__os_file_copy(int from, int to, uint64_t off, size_t n);
/* Pages of [p, p+n) (page-aligned) in memory (mincore: for a file mapping,
 * in the page cache). -errno on failure. */
int64_t dm__os_resident_pages(void *p, size_t n);
/* Writes [p, p+n) of a shared file mapping back (its file range [off,
 * off+n) of fd) and drops its pages: MADV_PAGEOUT (Linux 5.4), else
 * MADV_DONTNEED (the mapping forgets them); then POSIX_FADV_DONTNEED (the page
 * cache drops those of the range left, clean after the writeback: read ahead,
 * never mapped). 0 or -errno. */
int dm__os_pageout_file(void *p, size_t n, int fd, uint64_t off);
/* Bytes of disk the file holds (st_blocks * 512). */
uint64_t dm__os_file_disk_bytes(int fd);
/* The first range of the file at or past `off` that holds data (SEEK_DATA,
 * SEEK_HOLE): its start, its end in *end; -1 when there is none (or on
 * failure: nothing to do). */
int64_t dm__os_file_next_data(int fd, uint64_t off, uint64_t *end);

#endif /* DM_RUNTIME_OS_H */
