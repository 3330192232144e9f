/*
 * spill.c: file-backed (spill) arenas: the file, its regions, the commit and
 * decommit of pages as disk blocks, zeroing, and fork (spill.h has the layout
 * and the thread rules).
 *
 * Disk blocks are reserved (fallocate) before jemalloc may touch a page, and
 * `backing.max` bounds what is reserved, so running out of disk or of `max`
 * fails the allocation that needed the blocks (jemalloc returns NULL, NumPy
 * raises MemoryError, or `fallback` serves it): a page of a MAP_SHARED file
 * mapping whose block cannot be allocated at fault time would raise SIGBUS
 * instead. Decay returns freed pages by decommit (the purge hooks decline:
 * MADV_FREE / MADV_DONTNEED on a shared file mapping would keep the blocks),
 * which punches a hole, so disk space comes back as arrays die. jemalloc
 * decays an arena only from that arena's own allocations and frees, so an
 * idle spill arena (its arrays freed, the job busy elsewhere or asleep) would
 * keep its freed blocks on disk for good: the spill thread drives its decay
 * (below, "The spill thread"). The file is
 * sized to cover every region (sparse: a size costs no blocks), so no mapped
 * page is ever past its end.
 *
 * Fork: MAP_SHARED stays shared across fork(), where users expect a copy, so
 * the prepare handler copies each spill file's reserved pages into a new
 * nameless file (never a reflink: os.c, dm__os_file_copy) that the child maps
 * over its regions before it runs code of its own; without room for the copy
 * the child maps the parent's file MAP_PRIVATE and says so (design.md, "Spill
 * arenas", fork; the cost per fork: docs/spill-and-limits.md).
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/os.h"
#include "runtime/spill.h"

static size_t page_size(void) { return dm__os_page_size(); }

static _Atomic bool pager_on; /* the spill thread runs (see "The spill thread") */
/* Every spill arena's state, for the pager: appended under dm__mem_mu,
 * published by the release-increment of the count. */
static dm__spill_t *all[DM_JE_MAX];
static _Atomic int nall;

/* The engine's own objects live in jemalloc's arena 0, as arena.c's do, and
 * for the process. */
static void *zalloc(size_t n) {
    return dmje_mallocx(n, MALLOCX_ZERO | MALLOCX_TCACHE_NONE | MALLOCX_ARENA(0));
}

/* ---- the file ------------------------------------------------------------- */

/* `s` as one word of a POSIX shell command line, as the Python side's
 * _text.shell_arg writes it: bare when every byte is safe, else in single
 * quotes with ' as '\''; control bytes as \xNN (a pasted command stays one
 * line). Truncated to fit `cap`. */
static void shell_arg(char *buf, size_t cap, const char *s) {
    size_t o = 0;
    bool bare = *s != 0;
    for (const char *p = s; *p; p++)
        if (!(isalnum((unsigned char)*p) || strchr("@%+=:,./-_", *p)))
            bare = false;
    if (cap == 0)
        return;
#define PUT(str) for (const char *q_ = (str); *q_ && o + 1 < cap; q_++) buf[o++] = *q_
    if (!bare)
        PUT("'");
    for (const char *p = s; *p; p++) {
        char one[8] = {*p, 0};
        if (*p == '\'')
            PUT("'\\''");
        else if ((unsigned char)*p < 0x20 || *p == 0x7f) {
            snprintf(one, sizeof one, "\\x%02x", (unsigned char)*p);
            PUT(one);
        } else
            PUT(one);
    }
    if (!bare)
        PUT("'");
#undef PUT
    buf[o] = 0;
}

int dm__spill_check_dir(const char *dir, char *why, size_t cap, char *fix, size_t fixcap) {
    int dfd = dm__os_dir_open_owned(dir, false, 0700, why, cap);
    if (fixcap)
        fix[0] = 0;
    if (dfd < 0 && errno == ENOENT && fixcap) { /* what to run: the directory rule's mode */
        char word[4 * sizeof(((dm_backing_spec_t *)0)->dir) + 8];
        shell_arg(word, sizeof word, dir);
        int w = snprintf(fix, fixcap, "make it with: mkdir -m 700 -p %s", word);
        if (w < 0 || (size_t)w >= fixcap) /* a command cut short is worse than none */
            fix[0] = 0;
    }
    if (dfd < 0)
        return dfd;
    int fd = dm__os_tmpfile(dfd);
    close(dfd);
    if (fd < 0) {
        snprintf(why, cap, "%s: cannot make a file with no name there (O_TMPFILE): %s", dir,
                 strerror(-fd));
        return DM_EIO;
    }
    close(fd);
    return 0;
}

dm__spill_t *dm__spill_open(const char *dir, uint64_t max, char *why, size_t cap) {
    int dfd = dm__os_dir_open_owned(dir, false, 0700, why, cap);
    if (dfd < 0)
        return NULL;
    int fd = dm__os_tmpfile(dfd);
    dm__spill_t *s = fd >= 0 ? zalloc(sizeof(*s)) : NULL;
    if (!s) {
        snprintf(why, cap, "%s: cannot make a file with no name there (O_TMPFILE): %s", dir,
                 fd < 0 ? strerror(-fd) : "out of memory");
        if (fd >= 0)
            close(fd);
        close(dfd);
        return NULL;
    }
    s->dirfd = dfd;
    s->fd = fd;
    s->fork_fd = -1;
    pthread_mutex_init(&s->pass_mu, NULL);
    pthread_mutex_init(&s->reserve_mu, NULL);
    atomic_store_explicit(&s->max, max, memory_order_relaxed);
    atomic_store_explicit(&s->resident_max, UINT64_MAX, memory_order_relaxed);
    snprintf(s->dir, sizeof(s->dir), "%s", dir);
    return s;
}

void dm__spill_attach(dm__spill_t *s, dm__arena_je_t *ja, void (*expire)(dm__arena_je_t *)) {
    s->ja = ja;
    s->expire = expire;
    int n = atomic_load_explicit(&nall, memory_order_relaxed);
    if (n < DM_JE_MAX) {
        all[n] = s;
        atomic_store_explicit(&nall, n + 1, memory_order_release);
    }
    dm__spill_pager_ensure();
}

uint64_t dm__spill_disk_bytes(const dm__spill_t *s) {
    return s->fd >= 0 ? dm__os_file_disk_bytes(s->fd) : 0;
}

/* ---- regions and page bits ------------------------------------------------ */

bool dm__spill_region_add(dm__spill_t *s, char *base, size_t len) {
    int n = atomic_load_explicit(&s->nregions, memory_order_relaxed);
    if (n >= DM_SPILL_REGIONS_MAX || s->fd < 0)
        return false;
    size_t pages = len / page_size(), chunks = len / DM_SPILL_CHUNK + 1;
    _Atomic uint64_t *bits = zalloc((pages + 63) / 64 * sizeof(uint64_t));
    _Atomic uint64_t *stale = zalloc((pages + 63) / 64 * sizeof(uint64_t));
    _Atomic uint64_t *held = zalloc((chunks + 63) / 64 * sizeof(uint64_t));
    _Atomic uint32_t *stamps = zalloc(chunks * sizeof(uint32_t));
    if (!bits || !stale || !held || !stamps ||
        dm__os_file_size(s->fd, s->file_end + len) != 0) {
        void *v[] = {bits, stale, held, stamps};
        for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
            if (v[i])
                dmje_dallocx(v[i], MALLOCX_TCACHE_NONE);
        return false;
    }
    dm__spill_region_t *r = &s->regions[n];
    r->base = base;
    r->len = len;
    atomic_store_explicit(&r->mapped, 0, memory_order_relaxed);
    r->off = s->file_end;
    r->bits = bits;
    r->stale = stale;
    r->held = held;
    r->stamps = stamps;
    r->priv = false;
    s->file_end += len;
    atomic_store_explicit(&s->nregions, n + 1, memory_order_release);
    return true;
}

/* The region holding [p, p+n), or NULL. Newest first: an older region's
 * released tail (extent.c, region_grow) may be a newer region now. */
static dm__spill_region_t *region_of(dm__spill_t *s, const char *p, size_t n) {
    for (int i = atomic_load_explicit(&s->nregions, memory_order_acquire) - 1; i >= 0; i--) {
        dm__spill_region_t *r = &s->regions[i];
        if (p >= r->base && p < r->base + r->len)
            return (size_t)(r->base + r->len - p) >= n ? r : NULL;
    }
    return NULL;
}

bool dm__spill_same_region(dm__spill_t *s, const void *a, const void *b) {
    const dm__spill_region_t *r = region_of(s, a, 1);
    return r && (const char *)b >= r->base && (const char *)b < r->base + r->len;
}

/* Sets (or clears) the bits of pages [first, first+count); returns how many
 * changed. */
static size_t bits_update(_Atomic uint64_t *bits, size_t first, size_t count, bool set) {
    size_t changed = 0;
    for (size_t pg = first; pg < first + count;) {
        size_t w = pg / 64, lo = pg % 64, k = 64 - lo < first + count - pg ? 64 - lo
                                                                         : first + count - pg;
        uint64_t m = (k == 64 ? ~UINT64_C(0) : ((UINT64_C(1) << k) - 1)) << lo;
        uint64_t old = set ? atomic_fetch_or_explicit(&bits[w], m, memory_order_relaxed)
                           : atomic_fetch_and_explicit(&bits[w], ~m, memory_order_relaxed);
        changed += (size_t)__builtin_popcountll(set ? (~old & m) : (old & m));
        pg += k;
    }
    return changed;
}

static bool bit_get(_Atomic uint64_t *bits, size_t i) {
    return atomic_load_explicit(&bits[i / 64], memory_order_relaxed) >> (i % 64) & 1;
}

/* The next run of bits equal to `set` in [*from, end): true with the run in
 * [*from, *to), false when there is none. */
static bool bits_run(_Atomic uint64_t *bits, bool set, size_t *from, size_t *to, size_t end) {
    size_t i = *from;
    while (i < end && bit_get(bits, i) != set)
        i++;
    size_t e = i;
    while (e < end && bit_get(bits, e) == set)
        e++;
    *from = i;
    *to = e;
    return i < end;
}

/* Pages of [first, first+count) whose bit is clear. */
static size_t bits_clear_in(_Atomic uint64_t *bits, size_t first, size_t count) {
    size_t n = 0;
    for (size_t pg = first; pg < first + count; pg++)
        n += !(atomic_load_explicit(&bits[pg / 64], memory_order_relaxed) >> (pg % 64) & 1);
    return n;
}

/* ---- commit and decommit ---------------------------------------------------- */

/* At most one line a second, from the failure path only. */
static void full_log(const dm__arena_je_t *ja, size_t n, int err) {
    static _Atomic int64_t last_s;
    if (!dm__mem_log_due(&last_s))
        return;
    const dm__spill_t *s = ja->spill;
    if (err == -EDQUOT || err == -ENOSPC) {
        dm__log("datamem: arena '%s': cannot reserve %zu KiB of disk in %s: %s; the allocation "
                "fails (MemoryError) unless `fallback` serves it", ja->place->name, n >> 10,
                s->dir, strerror(-err));
    } else if (err == -EFBIG) {
        dm__log("datamem: arena '%s': its file in %s is at backing.max (%llu MiB): a request "
                "for %zu KiB more fails (MemoryError) unless `fallback` serves it",
                ja->place->name, s->dir,
                (unsigned long long)(atomic_load_explicit(&s->max, memory_order_relaxed) >> 20),
                n >> 10);
    } else {
        dm__log("datamem: arena '%s': cannot map its file in %s: %s", ja->place->name, s->dir,
                strerror(-err));
    }
}

/* The pager pages out the least recently allocated chunks first: each
 * chunk's pages were reserved at the stamp it holds (a commit is where a
 * spill arena's memory starts to serve; reuse of pages jemalloc kept is not
 * seen, so a short decay.dirty makes the order closer). */
static _Atomic uint32_t clock_now;

static void stamp(dm__spill_region_t *r, const char *p, size_t n) {
    uint32_t t = atomic_fetch_add_explicit(&clock_now, 1, memory_order_relaxed) + 1;
    size_t c0 = (size_t)(p - r->base) / DM_SPILL_CHUNK, c1 = (size_t)(p + n - 1 - r->base) /
                                                             DM_SPILL_CHUNK;
    for (size_t c = c0; c <= c1; c++)
        atomic_store_explicit(&r->stamps[c], t, memory_order_relaxed);
    dm__spill_pager_ensure(); /* a fork child's first commit starts its own */
}

static void pager_pass(dm__spill_t *s, uint64_t room);

/* ---- chunks ---------------------------------------------------------------
 * A filesystem with large page-cache folios (XFS; ext4 since Linux 6.16)
 * reserves blocks at a write fault for the whole folio, up to 2 MiB and
 * aligned to its size in the file: a fault on the last page of a reserved
 * range could need blocks past it, and on a full disk that fault is a SIGBUS
 * (16 MiB fallocated at the end of a full XFS or ext4, then written through a
 * shared mapping, SIGBUSes without datamem). So blocks are reserved in whole
 * 2 MiB chunks of the file (`held`, a bit per chunk): every folio a fault can
 * make lies in one chunk, and a chunk with a committed page is held whole. A
 * chunk is punched only when none of its pages is committed; a page
 * decommitted in a chunk that stays held keeps its old bytes and is `stale`,
 * and is zeroed when it is committed again (commit promises zeros; its chunk
 * is held, so the writes need no new block). `committed` counts held chunks,
 * so `max` bounds the blocks the file reserves, rounding included: what the
 * arrays can use is less by what the partly used chunks leave (at most 2 MiB
 * less a page at each end of each committed range). All of it under
 * reserve_mu, with the sweep (below, "The spill thread"). */

/* Whether chunk c of region r has a committed page. */
static bool chunk_used(const dm__spill_region_t *r, size_t c) {
    size_t per = DM_SPILL_CHUNK / page_size(), w0 = c * per / 64, w1 = (c + 1) * per / 64;
    for (size_t w = w0; w < w1; w++)
        if (atomic_load_explicit(&r->bits[w], memory_order_relaxed))
            return true;
    return false;
}

/* Punches chunks [c, c+k) of region r (none used, under reserve_mu): 0 or
 * -errno. On success they are no longer held nor counted. */
static int chunks_punch(dm__spill_t *s, dm__spill_region_t *r, size_t c, size_t k) {
    size_t per = DM_SPILL_CHUNK / page_size();
    int rc = r->priv ? 0 : dm__os_file_punch(s->fd, r->off + (uint64_t)c * DM_SPILL_CHUNK,
                                             k * DM_SPILL_CHUNK);
    if (rc)
        return rc;
    size_t gone = bits_update(r->held, c, k, false);
    bits_update(r->stale, c * per, k * per, false);
    atomic_fetch_sub_explicit(&s->committed, (uint64_t)gone * DM_SPILL_CHUNK,
                              memory_order_relaxed);
    return 0;
}

/* Reserves the blocks of [p, p+n) in region r, rounded out to whole chunks:
 * `max` first (a compare-and-swap: never passed, even by racing threads),
 * then the disk, one fallocate per run of chunks not yet held. `mapped`: the
 * range is mapped from the file now (a commit), so its stale pages can be
 * zeroed in place. */
static int reserve(dm__arena_je_t *ja, dm__spill_region_t *r, char *p, size_t n, bool mapped) {
    dm__spill_t *s = ja->spill;
    size_t first = (size_t)(p - r->base) / page_size(), count = n / page_size();
    size_t c0 = (size_t)(p - r->base) / DM_SPILL_CHUNK,
           c1 = (size_t)(p + n - 1 - r->base) / DM_SPILL_CHUNK + 1;
    pthread_mutex_lock(&s->reserve_mu);
    uint64_t need = (uint64_t)bits_clear_in(r->held, c0, c1 - c0) * DM_SPILL_CHUNK; /* new */
    uint64_t max = atomic_load_explicit(&s->max, memory_order_relaxed);
    uint64_t before = atomic_load_explicit(&s->committed, memory_order_relaxed);
    int rc = 0;
    do {
        if (before + need > max || before + need < before) {
            rc = -EFBIG;
            break;
        }
    } while (!atomic_compare_exchange_weak_explicit(&s->committed, &before, before + need,
                                                    memory_order_relaxed, memory_order_relaxed));
    if (rc == 0 && r->priv) { /* a fork child's copy-on-write region: anonymous pages */
        rc = dm__os_map_anon(p, n);
    } else if (rc == 0) {
        for (size_t c = c0, e; rc == 0 && bits_run(r->held, false, &c, &e, c1); c = e) {
            rc = dm__os_file_reserve(s->fd, r->off + (uint64_t)c * DM_SPILL_CHUNK,
                                     (e - c) * DM_SPILL_CHUNK);
            if (rc == 0)
                bits_update(r->held, c, e - c, true);
            else /* a failed fallocate may keep some blocks: give them back */
                dm__os_file_punch(s->fd, r->off + (uint64_t)c * DM_SPILL_CHUNK,
                                  (e - c) * DM_SPILL_CHUNK);
        }
    }
    if (rc == 0) {
        if (r->priv)
            bits_update(r->held, c0, c1 - c0, true);
        for (size_t pg = first; pg < first + count; pg++) /* commit promises zeros */
            if (bit_get(r->stale, pg)) {
                if (mapped && !r->priv)
                    memset(r->base + pg * page_size(), 0, page_size());
                bits_update(r->stale, pg, 1, false);
            }
        bits_update(r->bits, first, count, true);
    } else if (rc != -EFBIG) { /* uncount the chunks not held; punch those held but unused */
        atomic_fetch_sub_explicit(&s->committed,
                                  (uint64_t)bits_clear_in(r->held, c0, c1 - c0) * DM_SPILL_CHUNK,
                                  memory_order_relaxed);
        for (size_t c = c0; c < c1; c++)
            if (bit_get(r->held, c) && !chunk_used(r, c))
                chunks_punch(s, r, c, 1);
    }
    pthread_mutex_unlock(&s->reserve_mu);
    if (rc == 0) {
        stamp(r, p, n);
        dm__spill_catch_up(s, n);
        return 0;
    }
    atomic_fetch_add_explicit(&s->nfull, 1, memory_order_relaxed);
    full_log(ja, n, rc);
    return rc;
}

int dm__spill_map(dm__arena_je_t *ja, char *p, size_t n, bool commit) {
    dm__spill_t *s = ja->spill;
    dm__spill_region_t *r = region_of(s, p, n);
    if (!r)
        return -EINVAL;
    int rc = commit ? reserve(ja, r, p, n, false) : 0;
    if (rc)
        return rc;
    rc = dm__os_map_file(p, n, s->fd, r->off + (uint64_t)(p - r->base), true);
    if (rc) {
        full_log(ja, n, rc);
        if (commit)
            dm__spill_decommit(ja, p, n);
        return rc;
    }
    if ((size_t)(p + n - r->base) > atomic_load_explicit(&r->mapped, memory_order_relaxed))
        atomic_store_explicit(&r->mapped, (size_t)(p + n - r->base), memory_order_relaxed);
    return 0;
}

int dm__spill_commit(dm__arena_je_t *ja, char *p, size_t n) {
    dm__spill_region_t *r = region_of(ja->spill, p, n);
    return r ? reserve(ja, r, p, n, true) : -EINVAL;
}

/* Clears the pages' bits and punches the chunks none of whose pages is still
 * committed; the pages of chunks that stay held (or whose punch failed) keep
 * their blocks and bytes, stale until their next commit zeroes them. */
int dm__spill_decommit(dm__arena_je_t *ja, char *p, size_t n) {
    dm__spill_t *s = ja->spill;
    dm__spill_region_t *r = region_of(s, p, n);
    if (!r || r->priv) /* a copy-on-write region keeps its pages (see Fork) */
        return -EBUSY;
    size_t first = (size_t)(p - r->base) / page_size(), count = n / page_size();
    size_t c0 = (size_t)(p - r->base) / DM_SPILL_CHUNK,
           c1 = (size_t)(p + n - 1 - r->base) / DM_SPILL_CHUNK + 1;
    pthread_mutex_lock(&s->reserve_mu);
    bits_update(r->bits, first, count, false);
    bits_update(r->stale, first, count, true);
    for (size_t c = c0; c < c1;) {
        if (!bit_get(r->held, c) || chunk_used(r, c)) {
            c++;
            continue;
        }
        size_t e = c;
        while (e < c1 && bit_get(r->held, e) && !chunk_used(r, e))
            e++;
        chunks_punch(s, r, c, e - c); /* failed: held, stale, counted */
        c = e;
    }
    pthread_mutex_unlock(&s->reserve_mu);
    return 0;
}

/* calloc of a block jemalloc did not know to be zero: on ext4 the whole pages
 * of the file range become zeros that keep their blocks (FALLOC_FL_ZERO_RANGE:
 * no writes, no page faults), the rest is cleared in place; elsewhere all of it
 * is (dm__os_file_zero says why: XFS's zero range lets the blocks go). Its
 * chunks are held, so the writes need no new block. MADV_DONTNEED, which
 * zeroes anonymous memory, would only drop the mapping of a file's pages. */
void dm__spill_zero(dm__arena_je_t *ja, void *p, size_t n) {
    uintptr_t page = page_size(), b = (uintptr_t)p, e = b + n;
    uintptr_t lo = (b + page - 1) & ~(page - 1), hi = e & ~(page - 1);
    dm__spill_region_t *r = hi > lo ? region_of(ja->spill, (char *)lo, hi - lo) : NULL;
    if (!r || r->priv ||
        dm__os_file_zero(ja->spill->fd, r->off + (uint64_t)((char *)lo - r->base), hi - lo) != 0) {
        memset(p, 0, n);
        return;
    }
    memset(p, 0, lo - b);
    memset((void *)hi, 0, e - hi);
}

/* ---- fork ------------------------------------------------------------------- */

/* Copies region r's committed pages to file `to`, into blocks reserved first
 * in whole chunks, as the region's own (see "chunks"). */
static int snapshot_region(const dm__spill_t *s, const dm__spill_region_t *r, int to) {
    size_t mapped = atomic_load_explicit(&r->mapped, memory_order_relaxed);
    size_t chunks = (mapped + DM_SPILL_CHUNK - 1) / DM_SPILL_CHUNK;
    for (size_t c = 0, e; bits_run(r->held, true, &c, &e, chunks); c = e) {
        int rc = dm__os_file_reserve(to, r->off + (uint64_t)c * DM_SPILL_CHUNK,
                                     (e - c) * DM_SPILL_CHUNK);
        if (rc)
            return rc;
    }
    size_t pages = mapped / page_size();
    for (size_t pg = 0, end; bits_run(r->bits, true, &pg, &end, pages); pg = end) {
        uint64_t off = r->off + (uint64_t)pg * page_size();
        size_t len = (end - pg) * page_size();
        int rc = 0;
        if (r->priv) { /* its pages are in memory, not in the file */
            if (pwrite(to, r->base + pg * page_size(), len, (off_t)off) != (ssize_t)len)
                rc = -EIO;
        } else {
            rc = dm__os_file_copy(s->fd, to, off, len);
        }
        if (rc)
            return rc;
    }
    return 0;
}

static int snapshot(dm__spill_t *s) {
    int to = dm__os_tmpfile(s->dirfd);
    if (to < 0)
        return to;
    int rc = dm__os_file_size(to, s->file_end);
    int n = atomic_load_explicit(&s->nregions, memory_order_acquire);
    for (int i = 0; rc == 0 && i < n; i++)
        rc = snapshot_region(s, &s->regions[i], to);
    if (rc) {
        close(to);
        return rc;
    }
    return to;
}

/* In the child: the regions are the snapshot's (shared), or, without one,
 * the parent's file copy-on-write; new regions go to a file of its own. */
static void child_remap(dm__spill_t *s, const char *name) {
    int n = atomic_load_explicit(&s->nregions, memory_order_relaxed);
    bool shared = s->fork_fd >= 0;
    int own = shared ? s->fork_fd : dm__os_tmpfile(s->dirfd), rc = 0;
    if (!shared && own >= 0 && dm__os_file_size(own, s->file_end) != 0) {
        close(own);
        own = -1;
    }
    for (int i = 0; i < n; i++) {
        dm__spill_region_t *r = &s->regions[i];
        size_t mapped = atomic_load_explicit(&r->mapped, memory_order_relaxed);
        if (mapped && !r->priv) {
            int e = dm__os_map_file(r->base, mapped, shared ? own : s->fd, r->off, shared);
            rc = rc ? rc : e;
        }
        r->priv = r->priv || !shared;
    }
    close(s->fd);
    s->fd = own; /* -1: no new regions (their allocations fail cleanly) */
    s->fork_fd = -1;
    if (!shared || rc)
        dm__log("datamem: arena '%s': this fork child could not get its own copy of the "
                "spilled arrays (%s): it sees them copy-on-write from the parent's file, where "
                "pages it has not written show the parent's later writes",
                name, rc ? strerror(-rc) : "the copy failed before fork");
}

void dm__spill_fork(int phase) {
    for (int i = 0; i < DM_JE_MAX && dm__mem_by_slot[i]; i++) {
        dm__arena_je_t *ja = dm__mem_by_slot[i];
        dm__spill_t *s = ja->spill;
        if (!s)
            continue;
        if (phase == 0) {
            int fd = snapshot(s);
            s->fork_fd = fd >= 0 ? fd : -1;
            atomic_fetch_add_explicit(fd >= 0 ? &s->fork_copies : &s->fork_failures, 1,
                                      memory_order_relaxed);
        } else if (phase == 1) {
            if (s->fork_fd >= 0)
                close(s->fork_fd);
            s->fork_fd = -1;
        } else {
            child_remap(s, ja->place->name);
            pthread_mutex_init(&s->pass_mu, NULL); /* the spill thread may have held them */
            pthread_mutex_init(&s->reserve_mu, NULL);
        }
    }
    if (phase == 2) /* the spill thread did not survive the fork */
        atomic_store_explicit(&pager_on, false, memory_order_relaxed);
}

/* ---- resident_max -----------------------------------------------------------
 * The kernel writes back and drops a file's pages only under memory pressure,
 * while a cgroup or a Dask nanny counts resident file pages against the job:
 * waiting for the kernel is not enough. So a spill arena with resident_max
 * keeps at most that much of its reserved pages in memory. The pager (the
 * spill thread, started with the first spill arena; the allocation that
 * reserves pages stamps their chunks) measures each such arena five times a
 * second
 * (mincore over the chunks that hold blocks) and pages out whole 2 MiB chunks,
 * least recently allocated first, until the arena is under its bound:
 * writeback (sync_file_range), then MADV_PAGEOUT, which needs Linux 5.4;
 * before that MADV_DONTNEED, which is as safe on a shared file mapping once it
 * is written back (its pages are the file's: the next touch reads them again);
 * then POSIX_FADV_DONTNEED for the pages of the chunk in the page cache but
 * not mapped (read ahead by a fault). A fork child has no spill thread until
 * its first commit, or its first free of a spill arena's block, starts one.
 *
 * A job can write its spilled arrays far faster than the disk takes them (a
 * Dask task filling 128 MiB arrays: page cache at memory speed, while each
 * pass waits for writeback), and five passes a second then fall behind: the
 * nanny saw 1.5 GiB resident and killed the worker. So a commit also keeps
 * count (`since`), and so does every allocation of DM_BIG_THP_MIN or more
 * (alloc.c: reused pages, which need no commit, may have been paged out): when
 * what the last pass left plus what came since would pass resident_max, the
 * allocating thread (in jemalloc's extent hook, which may hold the arena's
 * bump mutex, or right after a big allocation: the slow path, never the fast
 * path) runs a pass itself first, down to resident_max less room for what it
 * is about to write (at least DM_SPILL_ROOM, so that a run of small commits
 * does not pass on each one). An allocation that outruns the disk waits for
 * it, and the arena's resident bytes stay within about resident_max plus the
 * block being written. */

/* Hysteresis of a commit's own pass: at most one per this many bytes reserved. */
#define DM_SPILL_ROOM ((uint64_t)8 * DM_SPILL_CHUNK)

typedef struct chunk {
    uint32_t stamp;
    uint32_t region;
    uint32_t index;
    uint32_t pages; /* resident */
} chunk_t;

static int by_stamp(const void *a, const void *b) {
    uint32_t x = ((const chunk_t *)a)->stamp, y = ((const chunk_t *)b)->stamp;
    return x < y ? -1 : x > y;
}

/* The resident chunks that hold blocks (malloc'ed, *n of them), and their
 * resident bytes in all. NULL with *n 0 when none or out of memory. */
static chunk_t *resident_chunks(dm__spill_t *s, size_t *n, uint64_t *bytes) {
    size_t cap = 0;
    chunk_t *v = NULL;
    *n = 0;
    *bytes = 0;
    int nr = atomic_load_explicit(&s->nregions, memory_order_acquire);
    for (int i = 0; i < nr; i++) {
        dm__spill_region_t *r = &s->regions[i];
        size_t mapped = atomic_load_explicit(&r->mapped, memory_order_relaxed);
        for (size_t c = 0; !r->priv && c < mapped / DM_SPILL_CHUNK; c++) {
            if (!chunk_used(r, c))
                continue;
            int64_t in = dm__os_resident_pages(r->base + c * DM_SPILL_CHUNK, DM_SPILL_CHUNK);
            if (in <= 0)
                continue;
            if (*n == cap) {
                chunk_t *w = realloc(v, (cap = cap ? 2 * cap : 256) * sizeof(*v));
                if (!w)
                    break;
                v = w;
            }
            v[(*n)++] = (chunk_t){atomic_load_explicit(&r->stamps[c], memory_order_relaxed),
                                  (uint32_t)i, (uint32_t)c, (uint32_t)in};
            *bytes += (uint64_t)in * page_size();
        }
    }
    return v;
}

uint64_t dm__spill_resident_bytes(dm__spill_t *s) {
    size_t n;
    uint64_t bytes;
    free(resident_chunks(s, &n, &bytes));
    return bytes;
}

/* Pages out the oldest chunks until at most resident_max - room stays. */
static void pager_pass(dm__spill_t *s, uint64_t room) {
    uint64_t max = atomic_load_explicit(&s->resident_max, memory_order_relaxed), bytes;
    size_t n;
    if (max == UINT64_MAX)
        return;
    max = max > room ? max - room : 0;
    pthread_mutex_lock(&s->pass_mu);
    atomic_store_explicit(&s->since, 0, memory_order_relaxed);
    chunk_t *v = resident_chunks(s, &n, &bytes);
    if (bytes > max)
        qsort(v, n, sizeof(*v), by_stamp);
    for (size_t i = 0; i < n && bytes > max; i++) {
        dm__spill_region_t *r = &s->regions[v[i].region];
        size_t at = (size_t)v[i].index * DM_SPILL_CHUNK;
        if (dm__os_pageout_file(r->base + at, DM_SPILL_CHUNK, s->fd, r->off + at) != 0)
            break;
        uint64_t b = (uint64_t)v[i].pages * page_size();
        bytes -= b;
        atomic_fetch_add_explicit(&s->paged_out, b, memory_order_relaxed);
    }
    free(v);
    atomic_store_explicit(&s->seen, bytes, memory_order_relaxed);
    pthread_mutex_unlock(&s->pass_mu);
}

void dm__spill_catch_up(dm__spill_t *s, size_t n) {
    uint64_t max = atomic_load_explicit(&s->resident_max, memory_order_relaxed);
    if (max == UINT64_MAX)
        return;
    uint64_t since = atomic_fetch_add_explicit(&s->since, n, memory_order_relaxed) + n;
    if (atomic_load_explicit(&s->seen, memory_order_relaxed) + since > max)
        pager_pass(s, n > DM_SPILL_ROOM ? n : DM_SPILL_ROOM);
}

/* ---- The spill thread ---------------------------------------------------------
 * jemalloc decays an arena's dirty pages only when that arena is used: every
 * allocation and free ticks a counter, and each 1000th tick purges what
 * decay.dirty says is due. Once a job has freed its spilled arrays, the spill
 * arena sees no more ticks (its small arrays live in RAM arenas; it may sleep),
 * and every freed block kept its disk blocks: 20 arrays of 8 MiB freed left
 * 170 MiB in the file 10 s later with `decay.dirty: 1s`, and through 13 M
 * small create/free cycles in another arena. So the pager's thread, which runs
 * for every process with a spill arena (resident_max or not), also decays each
 * spill arena on every pass, five times a second: the kept big blocks that
 * waited their decay.dirty go back to jemalloc (the `expire` arena.c gives:
 * bigblock.c, "Reuse"), then
 * `arena.<i>.decay` purges, as a tick would, the dirty pages decay says are
 * due, which decommits (punches) them. A freed block's disk blocks come back
 * within decay.dirty plus one pass, or twice decay.dirty plus two passes for
 * a kept big block (the last few freed blocks of 4 MiB or more), whatever the
 * job does meanwhile. A pass is a few mallctl calls per arena.
 *
 * Blocks can still outlive their chunk: a filesystem's own (a failed
 * fallocate that kept some, which reserve punches at once, is the case we
 * know; before chunks, ext4 left blocks past a reserved range that a shared
 * mapping's writes had reached: 20 freed arrays of 8 MiB left 10 MiB). So
 * when the file holds more than its held chunks (fstat; slack for the
 * filesystem's own blocks), the pass sweeps: it walks the file's data ranges
 * (SEEK_DATA, SEEK_HOLE) and punches the chunks in them that are not held.
 * It checks a chunk and punches it under reserve_mu, where a reservation
 * holds its chunks, so it never punches a chunk just reserved. */
#define DM_SPILL_SWEEP_SLACK ((uint64_t)1 << 20)

/* The chunks of file range [a, b) in region r that are not held, punched:
 * how many. */
static size_t sweep_range(dm__spill_t *s, dm__spill_region_t *r, uint64_t a, uint64_t b) {
    uint64_t lo = a > r->off ? a : r->off, hi = b < r->off + r->len ? b : r->off + r->len;
    size_t c = (size_t)((lo - r->off) / DM_SPILL_CHUNK),
           end = (size_t)((hi - r->off + DM_SPILL_CHUNK - 1) / DM_SPILL_CHUNK), punched = 0;
    for (; c < end; c++) {
        pthread_mutex_lock(&s->reserve_mu);
        if (!bit_get(r->held, c) &&
            dm__os_file_punch(s->fd, r->off + (uint64_t)c * DM_SPILL_CHUNK, DM_SPILL_CHUNK) == 0)
            punched++;
        pthread_mutex_unlock(&s->reserve_mu);
    }
    return punched;
}

/* Sweeps when the file holds more than its reserved pages plus the slack. A
 * sweep that found nothing to punch (the rest is the filesystem's own, or
 * cannot be punched) waits DM_SPILL_SWEEP_BACKOFF passes before the next, so
 * that such a file is not walked five times a second. */
#define DM_SPILL_SWEEP_BACKOFF 25

static void sweep(dm__spill_t *s) {
    if (s->sweep_wait > 0) {
        s->sweep_wait--;
        return;
    }
    if (s->fd < 0)
        return;
    uint64_t committed = atomic_load_explicit(&s->committed, memory_order_relaxed);
    if (dm__os_file_disk_bytes(s->fd) <= committed + committed / 256 + DM_SPILL_SWEEP_SLACK)
        return;
    int n = atomic_load_explicit(&s->nregions, memory_order_acquire);
    size_t punched = 0;
    uint64_t b;
    for (int64_t a = dm__os_file_next_data(s->fd, 0, &b); a >= 0;
         a = dm__os_file_next_data(s->fd, b, &b))
        for (int i = 0; i < n; i++) {
            dm__spill_region_t *r = &s->regions[i];
            if (!r->priv && (uint64_t)a < r->off + r->len && b > r->off)
                punched += sweep_range(s, r, (uint64_t)a, b);
        }
    s->sweep_wait = punched ? 0 : DM_SPILL_SWEEP_BACKOFF;
}

static void decay_pass(dm__spill_t *s) {
    dm__arena_je_t *ja = s->ja;
    s->expire(ja);
    char name[48];
    snprintf(name, sizeof(name), "arena.%u.decay", ja->index);
    dmje_mallctl(name, NULL, NULL, NULL, 0);
    sweep(s);
}

static void *pager_main(void *arg) {
    for (;;) {
        int n = atomic_load_explicit(&nall, memory_order_acquire);
        for (int i = 0; i < n; i++) {
            decay_pass(all[i]);
            pager_pass(all[i], 0);
        }
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return arg;
}

void dm__spill_pager_ensure(void) {
    if (atomic_load_explicit(&pager_on, memory_order_acquire) ||
        atomic_exchange_explicit(&pager_on, true, memory_order_acq_rel))
        return;
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &attr, pager_main, NULL) != 0)
        atomic_store_explicit(&pager_on, false, memory_order_release); /* the next commit tries again */
    pthread_attr_destroy(&attr);
}
