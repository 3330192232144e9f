/*
 * profile.c: the allocation profile writer (datamem_profile.h).
 *
 * Owns the process's profile file, the record buffer, the intern tables
 * (strings, call sites, stacks: each written once, as a definition record,
 * before its first use) and, in sampled mode, the set of sampled blocks still
 * live. Everything is guarded by `mu`; the only lock-free part is the counting
 * filter dm__profile_filter, which lets a free that is certainly not of a sampled
 * block skip the lock (one load). Memory comes from libc, never from NumPy.
 *
 * A fork child keeps recording into its own file: the atfork child handler
 * drops what the parent had buffered (the parent writes it), forgets the
 * intern tables (the new file needs its own definitions) and the live set
 * (the parent's blocks are not the child's samples), and opens DIR/<pid>.dmprof.
 *
 * Files: DIR is used through one descriptor, opened once by
 * dm_prof_start and checked there (files.h: a directory, owned by this user,
 * not writable by others; refused otherwise, and the job runs on without a
 * profile). Every process's file, a fork child's included, is created
 * relative to it with O_CREAT|O_EXCL|O_NOFOLLOW, so nothing already in DIR (a
 * planted symbolic link, an earlier run's file of a reused pid) is ever written
 * through or truncated: a taken name moves to DIR/<pid>-<n>.dmprof.
 *
 * Size: a file stops growing at its limit (dm_prof_start's
 * max_bytes). Before each record the writer checks that the record, at its
 * largest, still fits with room for the tail; when it would not, a 'T' record
 * closes the file, recording stops in this process (one line on stderr) and
 * the file never exceeds the limit. A fork child starts a file of its own, with
 * the whole limit.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "service/datamem_profile.h"
#include "service/files.h"
#include "service/term.h"

#define BUF_CAP ((size_t)1 << 20)
#define FLUSH_NS 1000000000ull /* records reach the file within a second (flusher) */
#define TERM_WAIT_MS 200       /* how long a SIGTERM waits for the lock before dying unflushed */
#define STR_MAX 1024           /* longer strings are cut */

/* The most bytes one allocation record can add, with the definitions it may
 * need first: four strings (thread, tags, rule, arena) and its call site (a
 * 'C' record and three strings); with stacks, every frame's site and the 'K'. */
#define SITE_MAX (21 + 3 * (9 + STR_MAX))
#define REC_MAX (59 + 4 * (9 + STR_MAX) + SITE_MAX)
#define REC_MAX_STACKS (REC_MAX + DM_PROF_FRAMES_MAX * SITE_MAX + 9 + 4 * DM_PROF_FRAMES_MAX)
/* Kept free below the limit after every record: the 'P' a flush may add, then
 * the 'T', 'P' and 'X' that can still close the file. */
#define TAIL_MAX (25 + 25 + 25 + 9)

_Atomic uint32_t dm__profile_filter[1u << DM_PROF_FILTER_BITS];

/* ---- intern tables: byte-string key -> id (open addressing) -------------- */

typedef struct ient {
    uint64_t hash;
    uint32_t id, len; /* id 0 = empty slot */
    unsigned char *key;
} ient_t;

typedef struct itab {
    ient_t *slots;
    uint32_t cap, n;
} itab_t;

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void itab_clear(itab_t *t) {
    for (uint32_t i = 0; i < t->cap; i++)
        free(t->slots[i].key);
    free(t->slots);
    t->slots = NULL;
    t->cap = t->n = 0;
}

static bool itab_grow(itab_t *t) {
    uint32_t cap = t->cap ? t->cap * 2 : 256;
    ient_t *s = calloc(cap, sizeof(*s));
    if (!s)
        return false;
    for (uint32_t i = 0; i < t->cap; i++) {
        if (!t->slots[i].id)
            continue;
        uint32_t j = (uint32_t)t->slots[i].hash & (cap - 1);
        while (s[j].id)
            j = (j + 1) & (cap - 1);
        s[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = s;
    t->cap = cap;
    return true;
}

/* The id of `key`; *fresh says it was just added (the caller writes its
 * definition). 0 when out of memory. */
static uint32_t itab_intern(itab_t *t, const void *key, uint32_t len, bool *fresh) {
    *fresh = false;
    if ((t->n + 1) * 2 > t->cap && !itab_grow(t))
        return 0;
    uint64_t h = hash_bytes(key, len);
    uint32_t j = (uint32_t)h & (t->cap - 1);
    for (; t->slots[j].id; j = (j + 1) & (t->cap - 1))
        if (t->slots[j].hash == h && t->slots[j].len == len &&
            memcmp(t->slots[j].key, key, len) == 0)
            return t->slots[j].id;
    unsigned char *k = malloc(len ? len : 1);
    if (!k)
        return 0;
    memcpy(k, key, len);
    t->slots[j] = (ient_t){h, ++t->n, len, k};
    *fresh = true;
    return t->n;
}

/* ---- the live set (sampled mode): addresses of sampled blocks ------------- */

#define LIVE_TOMB ((uintptr_t)1)

static struct {
    uintptr_t *slots;
    uint32_t cap, used, live; /* used counts tombstones too */
} live;

static inline uint32_t live_hash(uintptr_t p) {
    return (uint32_t)((p * 0x9E3779B97F4A7C15ull) >> 32);
}

static bool live_rehash(uint32_t cap) {
    uintptr_t *s = calloc(cap, sizeof(*s));
    if (!s)
        return false;
    for (uint32_t i = 0; i < live.cap; i++) {
        uintptr_t p = live.slots[i];
        if (p <= LIVE_TOMB)
            continue;
        uint32_t j = live_hash(p) & (cap - 1);
        while (s[j])
            j = (j + 1) & (cap - 1);
        s[j] = p;
    }
    free(live.slots);
    live.slots = s;
    live.cap = cap;
    live.used = live.live;
    return true;
}

static bool live_add(uintptr_t p) {
    if ((live.used + 1) * 4 > live.cap * 3) {
        uint32_t cap = live.cap ? live.cap : 1024;
        while ((live.live + 1) * 2 > cap)
            cap *= 2;
        if (!live_rehash(cap))
            return false;
    }
    uint32_t j = live_hash(p) & (live.cap - 1);
    while (live.slots[j] > LIVE_TOMB) {
        if (live.slots[j] == p)
            return true;
        j = (j + 1) & (live.cap - 1);
    }
    if (live.slots[j] == 0)
        live.used++;
    live.slots[j] = p;
    live.live++;
    atomic_fetch_add_explicit(&dm__profile_filter[dm__prof_filter_index((void *)p)], 1,
                              memory_order_relaxed);
    return true;
}

static bool live_remove(uintptr_t p) {
    if (!live.cap)
        return false;
    for (uint32_t j = live_hash(p) & (live.cap - 1); live.slots[j];
         j = (j + 1) & (live.cap - 1)) {
        if (live.slots[j] != p)
            continue;
        live.slots[j] = LIVE_TOMB;
        live.live--;
        atomic_fetch_sub_explicit(&dm__profile_filter[dm__prof_filter_index((void *)p)], 1,
                                  memory_order_relaxed);
        return true;
    }
    return false;
}

static void live_clear(void) {
    free(live.slots);
    memset(&live, 0, sizeof(live));
    for (size_t i = 0; i < (1u << DM_PROF_FILTER_BITS); i++)
        atomic_store_explicit(&dm__profile_filter[i], 0, memory_order_relaxed);
}

/* ---- the writer ------------------------------------------------------------ */

/* The writer's lock. Its word is the holder's pthread_self() (0: free), set by
 * the very compare-and-swap that takes it, so the SIGTERM handler can tell
 * whether the thread it interrupted holds it (a pthread mutex records its owner
 * apart from taking it: a handler that lands between the two cannot tell).
 * Waiters sleep on a futex over `mu_seq`, which each release that sees a waiter
 * bumps. Uncontended: one compare-and-swap to take, a store and a load to release. */
static _Atomic uintptr_t mu;
static _Atomic uint32_t mu_seq, mu_waiters;
static _Atomic bool active; /* recording now */
static bool started;        /* between dm_prof_start and dm_prof_stop (a fork child records) */
/* The records not yet written, apart from `w` so that it stays in .bss: an
 * initialised 1 MiB would be stored in the shared object (and each wheel). */
static unsigned char wbuf[BUF_CAP];
static struct {
    int fd;
    int dirfd;                /* DIR, checked by dm_prof_start */
    unsigned flags;
    uint64_t sample;
    uint64_t max_bytes;       /* the file's size limit */
    char dir[4096], path[4160];
    char *meta;               /* the caller's JSON object text */
    unsigned char *buf;       /* wbuf, below */
    size_t len;
    size_t whole;             /* buf[0, whole) holds whole records (SIGTERM writes them) */
    uint64_t last_flush;
    uint64_t samples, written;
    itab_t strings, sites, stacks;
    bool write_failed;
    bool flusher;             /* this process's flusher thread runs */
    unsigned flusher_gen;     /* bumped by stop and fork: an older flusher exits */
} w = {.fd = -1, .dirfd = -1, .buf = wbuf};

uint64_t dm_prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Writes n bytes; *done says how many went. Async-signal-safe. */
static bool write_all(const unsigned char *p, size_t n, size_t *done) {
    *done = 0;
    while (*done < n) {
        ssize_t k = write(w.fd, p + *done, n - *done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return false;
        *done += (size_t)k;
    }
    return true;
}

/* Called with mu held, between records: writes the buffer out and empties it;
 * false on a write error (errno says which). A SIGTERM handler that interrupts
 * it in this thread learns from the file offset how much of buf is written
 * (buf[0] is at w.written until the end): the fences keep the stores below in
 * this order for it. */
static bool write_buf(void) {
    size_t done = 0;
    w.whole = w.len;
    atomic_signal_fence(memory_order_seq_cst);
    bool ok = w.fd < 0 || w.write_failed || write_all(w.buf, w.len, &done);
    w.whole = 0;
    atomic_signal_fence(memory_order_seq_cst);
    w.written += (uint64_t)done;
    atomic_signal_fence(memory_order_seq_cst);
    w.len = 0;
    return ok;
}

static bool writer_trylock(void) {
    uintptr_t free_ = 0;
    return atomic_compare_exchange_strong(&mu, &free_, (uintptr_t)pthread_self());
}

static void writer_lock(void) {
    if (writer_trylock())
        return;
    atomic_fetch_add(&mu_waiters, 1);
    for (;;) {
        uint32_t seq = atomic_load(&mu_seq);
        if (writer_trylock())
            break;
        /* returns at once when mu_seq moved since the load: no lost wake-up */
        syscall(SYS_futex, &mu_seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
    }
    atomic_fetch_sub(&mu_waiters, 1);
}

static void writer_unlock(void) {
    atomic_store(&mu, 0);
    if (atomic_load(&mu_waiters)) {
        atomic_fetch_add(&mu_seq, 1);
        syscall(SYS_futex, &mu_seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
}

/* Called with mu held. */
static void flush_locked(void) {
    if (!write_buf()) {
        dm_log("datamem: profile: cannot write %s (%s); recording stops", w.path,
               strerror(errno));
        w.write_failed = true;
        atomic_store_explicit(&active, false, memory_order_relaxed);
    }
}

static void put(const void *p, size_t n) {
    memcpy(w.buf + w.len, p, n);
    w.len += n;
}
static void put8(uint8_t v) { put(&v, 1); }
static void put32(uint32_t v) { put(&v, 4); } /* x86-64 and aarch64: little-endian */
static void put64(uint64_t v) { put(&v, 8); }
static void putf64(double v) { put(&v, 8); }

/* Room for `n` more bytes (flushing first if needed). Called with mu held. */
static void reserve(size_t n) {
    if (w.len + n > BUF_CAP)
        flush_locked();
    w.whole = w.len; /* every record starts here */
    atomic_signal_fence(memory_order_seq_cst);
}

static void put_process_record(uint64_t t) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    reserve(25);
    put8('P');
    put64(t);
    put64((uint64_t)ru.ru_maxrss * 1024);
    put64(w.samples);
}

static uint32_t intern_string(const char *s) {
    if (!s)
        return 0;
    size_t n = strnlen(s, STR_MAX);
    bool fresh;
    uint32_t id = itab_intern(&w.strings, s, (uint32_t)n, &fresh);
    if (fresh) {
        reserve(9 + n);
        put8('S');
        put32(id);
        put32((uint32_t)n);
        put(s, n);
    }
    return id;
}

static uint32_t intern_site(const dm_prof_frame_t *f) {
    struct {
        const void *key;
        uint32_t line, pad;
    } k = {f->key, f->line, 0};
    bool fresh;
    uint32_t id = itab_intern(&w.sites, &k, sizeof(k), &fresh);
    if (fresh) {
        uint32_t m = intern_string(f->module), fn = intern_string(f->function),
                 file = intern_string(f->file);
        reserve(21);
        put8('C');
        put32(id);
        put32(m);
        put32(fn);
        put32(file);
        put32(f->line);
    }
    return id;
}

static uint32_t intern_stack(const dm_prof_frame_t *frames, int n) {
    uint32_t ids[DM_PROF_FRAMES_MAX];
    if (n > DM_PROF_FRAMES_MAX)
        n = DM_PROF_FRAMES_MAX;
    for (int i = 0; i < n; i++)
        ids[i] = intern_site(&frames[i]);
    bool fresh;
    uint32_t id = itab_intern(&w.stacks, ids, (uint32_t)n * 4, &fresh);
    if (fresh) {
        reserve(9 + (size_t)n * 4);
        put8('K');
        put32(id);
        put32((uint32_t)n);
        put(ids, (size_t)n * 4);
    }
    return id;
}

/* Called with mu held, in a new file. */
static void put_header(void) {
    char head[8192];
    int n = snprintf(head, sizeof(head),
                     "{\"format\": 1, \"pid\": %d, \"ppid\": %d, \"sample_bytes\": %llu, "
                     "\"full\": %s, \"stacks\": %s, \"t0_ns\": %llu, \"unix_time\": %.6f%s%s}",
                     (int)getpid(), (int)getppid(), (unsigned long long)w.sample,
                     (w.flags & DM_PROF_FULL) ? "true" : "false",
                     (w.flags & DM_PROF_STACKS) ? "true" : "false",
                     (unsigned long long)dm_prof_now(), (double)time(NULL),
                     w.meta && w.meta[0] ? ", " : "", w.meta ? w.meta : "");
    if (n < 0 || (size_t)n >= sizeof(head))
        n = snprintf(head, sizeof(head), "{\"format\": 1, \"pid\": %d, \"truncated\": true}",
                     (int)getpid());
    put("DMPROF1\n", 8);
    put8('H');
    put32((uint32_t)n);
    put(head, (size_t)n);
    w.last_flush = dm_prof_now();
}

/* Called with mu held, before a record of at most `n` bytes: whether it fits
 * under the size limit, leaving TAIL_MAX. If not, a 'T' record (u64 t_ns, u64
 * limit, u64 records written) and a last 'P' close the file, and recording stops
 * in this process. */
static bool fits(size_t n, uint64_t t) {
    if (w.written + w.len + n + TAIL_MAX <= w.max_bytes)
        return true;
    reserve(25);
    put8('T');
    put64(t);
    put64(w.max_bytes);
    put64(w.samples);
    put_process_record(t);
    flush_locked();
    atomic_store_explicit(&active, false, memory_order_relaxed);
    dm_log("datamem: profile: %s reached its size limit (%llu bytes, %llu records); recording "
           "stops in process %d (DATAMEM_PROFILE_MAX sets the limit)",
           w.path, (unsigned long long)w.max_bytes, (unsigned long long)w.samples,
           (int)getpid());
    return false;
}

/* Called with mu held: creates this process's file in DIR, never through or over
 * anything already there (O_EXCL|O_NOFOLLOW relative to the checked directory). */
static int open_file(void) {
    int pid = (int)getpid();
    char name[64];
    w.fd = -1;
    for (int n = 0; n < 1000 && w.fd < 0; n++) {
        if (n == 0)
            snprintf(name, sizeof(name), "%d.dmprof", pid);
        else
            snprintf(name, sizeof(name), "%d-%d.dmprof", pid, n);
        snprintf(w.path, sizeof(w.path), "%s/%s", w.dir, name);
        w.fd = dm__files_create(w.dirfd, name, 0644);
        if (w.fd < 0 && errno != EEXIST)
            break;
    }
    if (w.fd < 0) {
        dm_log("datamem: profile: cannot create %s: %s", w.path, strerror(errno));
        return DM_EIO;
    }
    w.len = 0;
    w.write_failed = false;
    put_header();
    flush_locked(); /* a process killed at once still leaves a readable, empty profile */
    return 0;
}

static void flusher_ensure(void); /* below, with the SIGTERM handler */

static void maybe_flush(uint64_t t) {
    if (w.len > BUF_CAP - 4096 || t - w.last_flush > FLUSH_NS) {
        put_process_record(t);
        flush_locked();
        w.last_flush = t;
    }
}

void dm_prof_record_alloc(const dm_prof_alloc_t *a) {
    if (!atomic_load_explicit(&active, memory_order_relaxed))
        return;
    writer_lock();
    if (!atomic_load_explicit(&active, memory_order_relaxed) ||
        !fits((w.flags & DM_PROF_STACKS) ? REC_MAX_STACKS : REC_MAX, a->t_ns))
        goto out;
    uint32_t th = intern_string(a->thread), tg = intern_string(a->tags),
             ru = intern_string(a->rule), ar = intern_string(a->arena);
    uint32_t site = a->site >= 0 && a->site < a->nframes ? intern_site(&a->frames[a->site]) : 0;
    uint32_t stack = (w.flags & DM_PROF_STACKS) && a->nframes > 0
                         ? intern_stack(a->frames, a->nframes)
                         : 0;
    if (!(w.flags & DM_PROF_FULL) && !live_add((uintptr_t)a->ptr))
        goto out; /* out of memory: an allocation whose free we could not match */
    reserve(59);
    put8('A');
    put64(a->t_ns);
    put64((uint64_t)(uintptr_t)a->ptr);
    put64(a->size);
    putf64(a->weight);
    put32(th);
    put32(tg);
    put32(ru);
    put32(ar);
    put32(site);
    put32(stack);
    put8(a->dtype);
    put8(a->flags);
    w.samples++;
    maybe_flush(a->t_ns);
    flusher_ensure();
out:
    writer_unlock();
}

void dm_prof_record_free(const void *p, uint64_t t_ns) {
    if (!p || !atomic_load_explicit(&active, memory_order_relaxed))
        return;
    writer_lock();
    if (atomic_load_explicit(&active, memory_order_relaxed) &&
        ((w.flags & DM_PROF_FULL) || live_remove((uintptr_t)p)) && fits(17, t_ns)) {
        reserve(17);
        put8('F');
        put64(t_ns);
        put64((uint64_t)(uintptr_t)p);
        maybe_flush(t_ns);
        flusher_ensure();
    }
    writer_unlock();
}

void dm_prof_mark_exit(void) {
    writer_lock();
    uint64_t t = dm_prof_now();
    if (atomic_load_explicit(&active, memory_order_relaxed) && fits(9, t)) {
        reserve(9);
        put8('X');
        put64(t);
    }
    writer_unlock();
}

void dm_prof_flush(void) {
    writer_lock();
    uint64_t t = dm_prof_now();
    if (atomic_load_explicit(&active, memory_order_relaxed) && fits(25, t)) {
        put_process_record(t);
        flush_locked();
        w.last_flush = t;
    }
    writer_unlock();
}

void dm_prof_stop(void) {
    writer_lock();
    uint64_t t = dm_prof_now();
    if (atomic_load_explicit(&active, memory_order_relaxed) && fits(25, t)) {
        put_process_record(t);
        flush_locked();
    }
    atomic_store_explicit(&active, false, memory_order_relaxed);
    started = false;
    w.flusher = false;
    w.flusher_gen++;
    if (w.fd >= 0)
        close(w.fd);
    if (w.dirfd >= 0)
        close(w.dirfd);
    w.fd = w.dirfd = -1;
    writer_unlock();
}

bool dm_prof_active(void) { return atomic_load_explicit(&active, memory_order_relaxed); }

void dm_prof_path(char *out, size_t cap) {
    writer_lock();
    snprintf(out, cap, "%s", started ? w.path : "");
    writer_unlock();
}

void dm_prof_counts(uint64_t *samples, uint64_t *bytes) {
    writer_lock();
    *samples = w.samples;
    *bytes = w.written + w.len;
    writer_unlock();
}

/* ---- keeping the file current: the flusher and SIGTERM ---------------------
 *
 * A pool worker often allocates, then waits for work until its pool kills it
 * (Pool.terminate: SIGTERM) or it leaves by _exit: atexit never runs. A thread
 * of the writer's own (libc only; started under the lock by the first record of
 * each process, fork child included) flushes every FLUSH_NS, so SIGKILL loses at
 * most the last second. SIGTERM, where the process dies of it (the default
 * action), flushes first (service/term.h: the handler, then the death by the
 * signal, same wait status). It uses async-signal-safe calls only and takes
 * the lock by trylock, for at most TERM_WAIT_MS, unless its own thread holds
 * it (interrupted inside the writer): then it writes the whole records
 * buffered (buf[0, whole)), never the one cut. */
static void *flusher_main(void *arg) {
    unsigned gen = (unsigned)(uintptr_t)arg;
    const struct timespec tick = {(time_t)(FLUSH_NS / 1000000000ull),
                                  (long)(FLUSH_NS % 1000000000ull)};
    for (;;) {
        nanosleep(&tick, NULL);
        writer_lock();
        if (gen != w.flusher_gen) { /* stopped: the next start makes a new one */
            writer_unlock();
            return NULL;
        }
        uint64_t t = dm_prof_now();
        if (w.len && atomic_load_explicit(&active, memory_order_relaxed) && fits(25, t)) {
            put_process_record(t);
            flush_locked();
            w.last_flush = t;
        }
        writer_unlock();
    }
}

/* Called with mu held: this process's flusher, once. Failing to start one
 * costs only the timeliness of the file (flushes still come with records). */
static void flusher_ensure(void) {
    if (w.flusher)
        return;
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* No signal is ever delivered to the flusher: SIGTERM's handler then never
     * interrupts it holding the mutex, and Python's own handlers stay with its threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    w.flusher = pthread_create(&th, &attr, flusher_main, (void *)(uintptr_t)w.flusher_gen) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

/* Called from the SIGTERM handler, owning the writer (its lock, or this thread
 * was interrupted holding it): writes the whole records not yet in the file,
 * then 'X' and 'P'. Async-signal-safe. */
static void term_flush(void) {
    if (!atomic_load_explicit(&active, memory_order_relaxed) || w.fd < 0 || w.write_failed)
        return;
    /* buf[0] is at file offset w.written; an interrupted write_buf may have
     * written part of it already */
    off_t pos = lseek(w.fd, 0, SEEK_CUR);
    if (pos < 0 || (uint64_t)pos < w.written || (uint64_t)pos - w.written > w.whole)
        return;
    size_t done, from = (size_t)((uint64_t)pos - w.written);
    if (!write_all(w.buf + from, w.whole - from, &done))
        return;
    w.written += (uint64_t)(from + done);
    uint64_t t = dm_prof_now();
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    uint64_t maxrss = (uint64_t)ru.ru_maxrss * 1024;
    unsigned char tail[34]; /* TAIL_MAX keeps room for it under the size limit */
    tail[0] = 'X'; /* the process ends here: what is live lived to the end */
    memcpy(tail + 1, &t, 8);
    tail[9] = 'P';
    memcpy(tail + 10, &t, 8);
    memcpy(tail + 18, &maxrss, 8);
    memcpy(tail + 26, &w.samples, 8);
    write_all(tail, sizeof(tail), &done);
}

/* The SIGTERM function (service/term.h): flushes only where the process dies
 * of the signal ('X' and 'P' say the process ended). */
static void on_sigterm(bool dies) {
    if (!dies)
        return;
    const struct timespec ms = {0, 1000000};
    for (int i = 0; i < TERM_WAIT_MS; i++) {
        if (writer_trylock()) {
            w.whole = w.len; /* between records: all of it */
            term_flush();
            writer_unlock();
            break;
        }
        /* Held by this very thread, interrupted inside the writer: waiting
         * would never end, and the buffer is whole up to w.whole. */
        if (atomic_load(&mu) == (uintptr_t)pthread_self()) {
            term_flush();
            break;
        }
        nanosleep(&ms, NULL);
    }
}

static void atfork_prepare(void) { writer_lock(); }
static void atfork_parent(void) { writer_unlock(); }

static void atfork_child(void) {
    /* the only thread now: the lock is free (fork ran in writer_lock's hold) */
    atomic_store(&mu, 0);
    atomic_store(&mu_waiters, 0);
    if (!started) /* recording in the parent, or stopped there at its size limit */
        return;
    if (w.fd >= 0)
        close(w.fd);
    w.fd = -1;
    w.flusher = false; /* the parent's; this process starts its own */
    w.flusher_gen++;
    w.len = w.whole = 0; /* the parent writes what it had buffered */
    w.samples = w.written = 0;
    itab_clear(&w.strings);
    itab_clear(&w.sites);
    itab_clear(&w.stacks);
    live_clear();
    atomic_store_explicit(&active, open_file() == 0, memory_order_relaxed);
    if (!atomic_load_explicit(&active, memory_order_relaxed))
        started = false;
}

static void at_exit(void) { dm_prof_stop(); }

int dm_prof_start(const char *dir, uint64_t sample_bytes, unsigned flags, uint64_t max_bytes,
                  const char *meta_json) {
    static bool registered;
    int rc = 0;
    writer_lock();
    if (started) {
        rc = DM_ESTATE;
        goto out;
    }
    char why[4400];
    int dirfd = dm__files_dir_open_owned(dir, true, 0755, why, sizeof(why));
    if (dirfd < 0) {
        rc = dirfd;
        if (rc == DM_EUNSAFE)
            dm_log("datamem: profile: refusing %s; no profile recorded, the job runs on", why);
        else
            dm_log("datamem: profile: %s", why);
        goto out;
    }
    if (w.dirfd >= 0)
        close(w.dirfd);
    w.dirfd = dirfd;
    free(w.meta);
    w.meta = strdup(meta_json ? meta_json : "");
    if (!w.meta) {
        rc = DM_ENOMEM;
        goto out;
    }
    snprintf(w.dir, sizeof(w.dir), "%s", dir);
    w.flags = flags;
    w.sample = sample_bytes;
    w.max_bytes = max_bytes == 0                     ? DM_PROF_MAX_BYTES_DEFAULT
                  : max_bytes < DM_PROF_MAX_BYTES_MIN ? DM_PROF_MAX_BYTES_MIN
                                                     : max_bytes;
    w.samples = w.written = 0;
    if ((rc = open_file()) != 0) {
        close(w.dirfd);
        w.dirfd = -1;
        goto out;
    }
    if (!registered) {
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
        atexit(at_exit);
        dm__term_on(on_sigterm); /* inherited by fork children */
        registered = true;
    }
    started = true;
    atomic_store_explicit(&active, true, memory_order_relaxed);
out:
    writer_unlock();
    return rc;
}
