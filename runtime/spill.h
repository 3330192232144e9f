/*
 * spill.h: file-backed (spill) arenas (spill.c). Internal to the runtime.
 *
 * An arena with `backing` serves its memory from one file with no name
 * (O_TMPFILE) in its directory: each address-space region the extent hooks
 * reserve (extent.c) is given its own stretch of the file, so that an address
 * names one file offset (region offset + distance from the region's start),
 * and is mapped MAP_SHARED from there. A bit per page says which pages are
 * committed (jemalloc's); disk blocks are reserved (fallocate) in whole
 * DM_SPILL_CHUNKs of the file, 2 MiB-aligned, a bit per chunk: commit reserves
 * every chunk its pages touch before jemalloc may touch the memory, so a full
 * disk fails the allocation instead of raising SIGBUS at a page fault (a
 * write fault's page-cache folio, up to 2 MiB and aligned, lies inside one
 * chunk); decommit punches each chunk none of whose pages is still committed.
 *
 * Thread safety: regions are added under the je arena's bump mutex (ja->region.mu) and
 * published with a release-store of their count; a region never changes after
 * that but for `mapped` (under ja->region.mu). The page bits are atomics (jemalloc
 * never commits or decommits one page from two threads at once; neighbouring
 * extents share words). The counters are atomics. A reservation allocates
 * its chunks and sets their bits, and a decommit clears its pages' bits and
 * punches the chunks left empty, under reserve_mu, which the spill thread's
 * sweep also holds while it checks a chunk and punches it; `ja` is written
 * before the arena is published to the spill thread (dm__spill_attach), and
 * `sweep_wait` is the spill thread's own.
 */
#ifndef DM_RUNTIME_SPILL_H
#define DM_RUNTIME_SPILL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/mem.h"

#define DM_SPILL_REGIONS_MAX 4096 /* address-space regions of one spill arena */
/* The unit of disk reservation (the largest page-cache folio a write fault
 * makes: XFS, ext4 since Linux 6.16) and of what resident_max pages out. A
 * region's file offset is a multiple of DM_SEG_SIZE, so its chunks are
 * aligned in the file as well as in memory. */
#define DM_SPILL_CHUNK ((size_t)2 << 20)

typedef struct dm__spill_region {
    char *base;                 /* its first address */
    size_t len;                 /* bytes of address space (and of file) it spans */
    _Atomic size_t mapped;      /* bytes from base mapped from the file (written under ja->region.mu) */
    uint64_t off;               /* file offset of base */
    _Atomic uint64_t *bits;     /* a bit per page: committed */
    _Atomic uint64_t *stale;    /* a bit per page: decommitted, not zeroed (its chunk kept) */
    _Atomic uint64_t *held;     /* a bit per DM_SPILL_CHUNK: its disk blocks reserved */
    _Atomic uint32_t *stamps;   /* per DM_SPILL_CHUNK: when its pages were last reserved */
    bool priv;                  /* a fork child's copy-on-write view (spill.c, fork) */
} dm__spill_region_t;

typedef struct dm__spill {
    int dirfd, fd;
    dm__arena_je_t *ja;         /* the jemalloc arena it backs (dm__spill_attach) */
    void (*expire)(dm__arena_je_t *); /* the spill thread's first step for it (dm__spill_attach) */
    uint64_t file_end;          /* where the next region's stretch starts (ja->region.mu) */
    _Atomic int nregions;
    dm__spill_region_t regions[DM_SPILL_REGIONS_MAX];
    _Atomic uint64_t committed; /* bytes of held chunks (counted against max) */
    pthread_mutex_t reserve_mu; /* a reservation vs the sweep (spill.c, "The spill thread") */
    int sweep_wait;             /* passes before the next sweep (spill thread only) */
    _Atomic uint64_t max;       /* backing.max; UINT64_MAX = none */
    _Atomic uint64_t resident_max; /* backing.resident_max; UINT64_MAX = none */
    _Atomic uint64_t paged_out;    /* bytes the pager dropped from memory */
    pthread_mutex_t pass_mu;       /* one paging pass at a time (spill.c, resident_max) */
    _Atomic uint64_t seen;         /* resident bytes the last pass left */
    _Atomic uint64_t since;        /* bytes reserved since the last pass began */
    _Atomic uint64_t nfull;     /* commits refused: max reached, or the disk full */
    _Atomic uint64_t fork_copies, fork_failures; /* fork snapshots (spill.c) */
    int fork_fd;                /* the snapshot made for a fork child, or -1 */
    char dir[256];
} dm__spill_t;

#pragma GCC visibility push(hidden)

/* Under dm__mem_mu: checks `dir` with the directory rule and makes the
 * arena's file. NULL with the reason in `why`. */
dm__spill_t *dm__spill_open(const char *dir, uint64_t max, char *why, size_t cap);
/* Under dm__mem_mu, once jemalloc made the arena `ja` that s backs: the
 * spill thread (spill.c, "The spill thread") starts driving its decay, each
 * pass calling `expire` on it first (arena.c passes dm__bigblock_expire: the
 * big blocks it keeps go back to jemalloc once they waited long enough). */
void dm__spill_attach(dm__spill_t *s, dm__arena_je_t *ja, void (*expire)(dm__arena_je_t *));
/* Under dm__mem_mu: whether `dir` passes the rule and takes an O_TMPFILE
 * (install checks every backed arena before anything changes). 0 or an error
 * code with the reason in `why`, and in `fix` what makes a directory that is not
 * there ("make it with: mkdir -m 700 -p DIR", DIR one shell word), "" if that
 * is not the reason. */
int dm__spill_check_dir(const char *dir, char *why, size_t cap, char *fix, size_t fixcap);

/* Under ja->region.mu (extent.c, region_grow): a fresh region [base, base+len). */
bool dm__spill_region_add(dm__spill_t *s, char *base, size_t len);
/* Whether a and b are in one region (extents of two regions never merge). */
bool dm__spill_same_region(dm__spill_t *s, const void *a, const void *b);
/* Under ja->region.mu (hook_alloc): maps [p, p+n) of the newest region from the
 * file, reserving its blocks first when `commit`. 0 or -errno. */
int dm__spill_map(dm__arena_je_t *ja, char *p, size_t n, bool commit);
/* The commit and decommit hooks: 0 or -errno (-ENOSPC: max or disk full). */
int dm__spill_commit(dm__arena_je_t *ja, char *p, size_t n);
int dm__spill_decommit(dm__arena_je_t *ja, char *p, size_t n);
/* Zeroes a block (calloc): the file range keeps its blocks. */
void dm__spill_zero(dm__arena_je_t *ja, void *p, size_t n);
/* Bytes on disk (the file's st_blocks). */
uint64_t dm__spill_disk_bytes(const dm__spill_t *s);
/* Bytes of its reserved pages in memory now (mincore; a walk: stats only). */
uint64_t dm__spill_resident_bytes(dm__spill_t *s);
/* An allocation (or commit) of n bytes in a spill arena: when its resident
 * bytes may pass resident_max, pages out first (spill.c, "resident_max"). */
void dm__spill_catch_up(dm__spill_t *s, size_t n);
/* Starts the spill thread (spill.c, "The spill thread") if it is not running:
 * one relaxed-cheap load when it is (slow paths only). */
void dm__spill_pager_ensure(void);

/* fork (runtime.c), with every ja->region.mu held: 0 before fork snapshots each
 * spill arena's file into a new one for the child; 1 in the parent drops it;
 * 2 in the child maps it in place of the parent's (spill.c, "Fork"). */
void dm__spill_fork(int phase);


#pragma GCC visibility pop

#endif /* DM_RUNTIME_SPILL_H */
