/*
 * runtime.c: publishing policies and the allocation fast path.
 *
 * Publication: dm_runtime_install compiles the next table aside, makes sure its
 * arenas exist, and publishes it with one release-store to g_table. The fast
 * path reads g_table with one acquire-load and compares it with the table the
 * calling thread is bound to; only when they differ (first use, reload, new
 * context) does it take dm__mu to bind. A table is reference counted: the global
 * pointer holds one reference and every thread bound to it another, so a
 * retired table is freed as soon as the last thread moves on or exits, and the
 * fast path never touches a table it does not hold. Threads that never allocate
 * again keep at most one old table each; reloads never accumulate tables.
 *
 * Fast path (sizes up to 256 KiB whose class the thread's view sends wholly to
 * one arena): acquire-load, pointer compares, a memo read, a pop from the
 * thread's block cache (or one jemalloc call), a tag store and relaxed
 * per-thread counter adds. General path: the same checks, a view lookup (binary
 * search over size bounds), a slot read and one jemalloc call with the thread's
 * cache for that arena. Neither takes a lock, logs, allocates outside jemalloc
 * or touches Python.
 *
 * Free never consults the policy: a block's tag (cached path) or its address's
 * segment (otherwise) names its arena.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/bigblock.h"
#include "runtime/internal.h"
#include "runtime/tally.h"
#include "runtime/os.h"

/* jemalloc is not instrumented, so ThreadSanitizer cannot see that a block freed
 * on one thread and handed out again on another was passed through jemalloc's
 * locks. In TSan builds free releases and alloc acquires one sync object, which
 * models that hand-off (coarsely: it orders every free before every later
 * allocation). Compiled out otherwise. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
static char tsan_sync;
#define TSAN_ACQUIRE() __tsan_acquire(&tsan_sync)
#define TSAN_RELEASE() __tsan_release(&tsan_sync)
#else
#define TSAN_ACQUIRE() ((void)0)
#define TSAN_RELEASE() ((void)0)
#endif

/* jemalloc options, read once at its initialisation (docs/performance.md).
 * tcache_max: cache sizes up to 1 MiB per thread and arena (the default 32 KiB
 * sends 256 KiB create/destroy down jemalloc's locked large path, +190 ns;
 * performance-baseline).
 * tcache_nslots_large: jemalloc never garbage-collects explicit caches (its GC
 * visits only the thread's own cache) and decay cannot see what they hold; with
 * the default 20 slots per size class, one (thread, arena) kept 130 MiB of freed
 * 16 KiB-1 MiB arrays for good. 4 slots: 26 MiB at most.
 * tcache_gc_incr_bytes: that GC is then pure overhead, run every 64 KiB
 * allocated, i.e. on every big array (190 of 700 instructions per 256 KiB
 * malloc+free, bench/callgrind.sh); push it out of the way.
 * oversize_threshold:0: no hidden "huge" arena. A thread's bound arena (see
 * auto_bind) is served by plain malloc(), which would otherwise send requests
 * of 8 MiB and more to jemalloc's own huge arena instead of ours. */
DM_API const char *dmje_malloc_conf =
    "tcache_max:1048576,tcache_nslots_large:4,tcache_gc_incr_bytes:1073741824,"
    "oversize_threshold:0";

pthread_mutex_t dm__mu = PTHREAD_MUTEX_INITIALIZER;

static _Atomic(rt_table_t *) g_table;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static pthread_key_t tls_key;
static __thread dm_tls_t tls;

static dm_tls_t *registry;           /* live threads, under dm__mu */
static int nthreads;
static _Atomic uint64_t foreign_frees;
static uint64_t reloads, reload_failures; /* under dm__mu */
static double last_reload_time;
static bool last_reload_failed;           /* under dm__mu */

static struct dm_ctx root_ctx;
static struct dm_ctx stale_ctx; /* never handed out: forces the next call to bind */
static struct dm_ctx *contexts = &root_ctx; /* interned, never freed */
static int ncontexts = 1;

/* ---- logging (never on the fast path) ---------------------------------- */

void dm_log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ---- observers: the services' seam (datamem.h) -----------------------------
 * Registered once at start-up (a constructor in service/), never removed: a
 * slot is filled, then published by the release-increment of the count. */

static struct {
    dm_install_hook_t on_install;
    dm_fork_hook_t on_fork_child;
    void *arg;
} observers[DM_OBSERVERS_MAX];
static _Atomic int nobservers;
/* DATAMEM_CUDART, handed down by the Python layer (the runtime never calls
 * getenv); "" = the usual names. Read at install. */
static char cudart_path[256];
static pthread_mutex_t observers_mu = PTHREAD_MUTEX_INITIALIZER;

int dm_runtime_observe(dm_install_hook_t on_install, dm_fork_hook_t on_fork_child, void *arg) {
    pthread_mutex_lock(&observers_mu);
    int n = atomic_load_explicit(&nobservers, memory_order_relaxed);
    if (n >= DM_OBSERVERS_MAX) {
        pthread_mutex_unlock(&observers_mu);
        return DM_ERANGE;
    }
    observers[n].on_install = on_install;
    observers[n].on_fork_child = on_fork_child;
    observers[n].arg = arg;
    atomic_store_explicit(&nobservers, n + 1, memory_order_release);
    pthread_mutex_unlock(&observers_mu);
    return 0;
}

int dm_runtime_hugepages(uint64_t *out, int cap) { return dm__arena_hugepages(out, cap); }

/* ---- the block cache: tags ------------------------------------------------
 *
 * Most of what NumPy allocates is small and short-lived, and jemalloc's own
 * paths cost about 95 instructions per malloc+free pair even at their fastest
 * (each call fetches jemalloc's thread state through __tls_get_addr), 260 with
 * an explicit cache. So each thread keeps a few freed blocks per size class up
 * to 256 KiB (a bin holds blocks of one arena, named by its tag), and an
 * allocation whose size class the bound view sends wholly to one arena with
 * alignment <= 64 (t->memo says which) pops one from that arena's bin: no
 * policy lookup, no jemalloc call (alloc_impl).
 *
 * Free must know a block's class, and NumPy's size argument is only a guess
 * (NEP 49). So the cached allocation path records it in a global tag table,
 * one 64-bit word per address hash:
 *     address (47 bits) | class (6) | je arena slot + 1 (11).
 * A free whose address matches its word owns the tag: it clears the word and,
 * when the arena is the thread's bound one, caches the block. Every path that
 * releases a block (free, realloc) clears a matching word first, so a word
 * never describes a block that was freed; a collision only overwrites another
 * block's word, which sends that block down the slow path (untagged blocks are
 * always freed correctly, by address). Words are single relaxed atomics: never
 * torn, and a block's allocation happens-before its free, so the free sees its
 * tag or a later word. */
#define TAG_BITS 14
#define TAG_PMASK (((uint64_t)1 << DM_VA_BITS) - 1)
#define TAG_CLASS_SHIFT DM_VA_BITS
#define TAG_ARENA_SHIFT (DM_VA_BITS + 6)
_Static_assert(DM_SC_COUNT <= 64, "class field is 6 bits");
_Static_assert(DM_JE_MAX + 1 <= (1 << (64 - TAG_ARENA_SHIFT)), "arena field too small");

static _Atomic uint64_t block_tags[1u << TAG_BITS];
static uint8_t fc_cap[DM_SC_COUNT]; /* blocks a bin may hold; set once at init */

static inline uint32_t bin_count(const dm_fc_bin_t *b) {
    return atomic_load_explicit(&b->n, memory_order_relaxed);
}
static inline void bin_set(dm_fc_bin_t *b, uint32_t n) {
    atomic_store_explicit(&b->n, n, memory_order_relaxed);
}

static inline _Atomic uint64_t *tag_word(uintptr_t u) {
    return &block_tags[(uint32_t)(((uint64_t)u * 0x9E3779B97F4A7C15ull) >> (64 - TAG_BITS))];
}

/* The block is being released some other way than the cached free: its tag,
 * if it still has one, goes with it. */
static inline void tag_drop(const void *p) {
    _Atomic uint64_t *w = tag_word((uintptr_t)p);
    if ((atomic_load_explicit(w, memory_order_relaxed) & TAG_PMASK) == (uintptr_t)p)
        atomic_store_explicit(w, 0, memory_order_relaxed);
}

int dm__tag_class(const void *p) {
    uint64_t v = atomic_load_explicit(tag_word((uintptr_t)p), memory_order_relaxed);
    return p && (v & TAG_PMASK) == (uintptr_t)p ? (int)((v >> TAG_CLASS_SHIFT) & 63u) : -1;
}

/* Gives every cached block back to its arena, past any jemalloc cache. Each
 * block leaves the count before it is freed, as a pop does: a fork that copies
 * this thread mid-flush leaves the child a bin whose every counted block is
 * still unfreed, which the child then frees itself (fork_child_retire). */
static void fc_flush(dm_tls_t *t) {
    TSAN_RELEASE();
    for (unsigned k = 0; k < DM_SC_COUNT; k++) {
        dm_fc_bin_t *b = &t->bins[k];
        for (uint32_t n = bin_count(b); n; n--) {
            void *p = b->items[n - 1];
            bin_set(b, n - 1);
            dmje_dallocx(p, MALLOCX_TCACHE_NONE);
        }
        b->tag = 0;
    }
}

/* ---- threads ------------------------------------------------------------ */

static void table_release(rt_table_t *t);

static void ctrs_add(dm_arena_ctrs_t *dst, const dm_arena_ctrs_t *src);

/* Called with dm__mu held: the thread's per-rule counts go to its table. */
static void fold_rules(dm_tls_t *t) {
    rt_table_t *tab = t->table;
    if (!tab || !t->rule_ctrs)
        return;
    for (int i = 0; i < tab->nslots; i++)
        ctrs_add(&tab->rule_ctrs[i], &t->rule_ctrs[i]);
    free(t->rule_ctrs);
    t->rule_ctrs = NULL;
}

static void ctrs_add(dm_arena_ctrs_t *dst, const dm_arena_ctrs_t *src) {
    DM_CTR_ADD(dst->nalloc, DM_CTR_GET(src->nalloc));
    DM_CTR_ADD(dst->nfree, DM_CTR_GET(src->nfree));
    DM_CTR_ADD(dst->nrealloc, DM_CTR_GET(src->nrealloc));
    DM_CTR_ADD(dst->nfail, DM_CTR_GET(src->nfail));
    DM_CTR_ADD(dst->nfallback, DM_CTR_GET(src->nfallback));
    DM_CTR_ADD(dst->ndtype_known, DM_CTR_GET(src->ndtype_known));
    DM_CTR_ADD(dst->bytes, DM_CTR_GET(src->bytes));
    DM_CTR_ADD(dst->nlimit, DM_CTR_GET(src->nlimit));
}

/* pthread key destructor: the thread is exiting. */
static void tls_exit(void *arg) {
    dm_tls_t *t = arg;
    t->fast = false;
    t->exiting = true; /* frees after this point bypass the (gone) caches */
    fc_flush(t);
    if (t->auto_je) { /* jemalloc's own destructor may run after this one */
        t->auto_je = NULL;
        dmje_mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    }
    pthread_mutex_lock(&dm__mu);
    for (int i = 0; i < dm__arena_count(); i++)
        ctrs_add(&dm__arena_at(i)->dead, &t->ctrs[i]);
    fold_rules(t);
    if (t->prev)
        t->prev->next = t->next;
    else
        registry = t->next;
    if (t->next)
        t->next->prev = t->prev;
    rt_table_t *tab = t->table;
    t->table = NULL;
    t->registered = false;
    pthread_mutex_unlock(&dm__mu);
    for (int i = 0; i < DM_JE_MAX; i++) {
        unsigned f = t->tcache[i];
        if (f && f != (unsigned)MALLOCX_TCACHE_NONE)
            dm__tcache_destroy((f >> 8) - 1);
        t->tcache[i] = (unsigned)MALLOCX_TCACHE_NONE;
    }
    if (tab)
        table_release(tab);
    /* Counted out last: a stats reader that sees the thread gone sees its
     * caches' blocks back in their arenas (tests wait for the count to drop
     * and then count jemalloc's live blocks). */
    pthread_mutex_lock(&dm__mu);
    nthreads--;
    pthread_mutex_unlock(&dm__mu);
}

/* Called with dm__mu held. */
static void tls_register(dm_tls_t *t) {
    if (t->registered || t->exiting)
        return;
    t->registered = true;
    t->next = registry;
    t->prev = NULL;
    if (registry)
        registry->prev = t;
    registry = t;
    nthreads++;
    pthread_setspecific(tls_key, t);
}

/* The flags that select the calling thread's explicit cache for `ja`. */
static __attribute__((noinline)) unsigned tcache_slow(dm_tls_t *t, je_arena_t *ja) {
    if (ja->is_big) /* its blocks are all past jemalloc's cache sizes: none */
        return t->tcache[ja->slot] = (unsigned)MALLOCX_TCACHE_NONE;
    if (t->exiting)
        return (unsigned)MALLOCX_TCACHE_NONE;
    pthread_mutex_lock(&dm__mu);
    tls_register(t);
    pthread_mutex_unlock(&dm__mu);
    unsigned tc = dm__tcache_create();
    /* Out of explicit caches (jemalloc has 4096): correct but uncached. */
    t->tcache[ja->slot] = tc ? (unsigned)MALLOCX_TCACHE(tc - 1)
                             : (unsigned)MALLOCX_TCACHE_NONE;
    return t->tcache[ja->slot];
}

static inline unsigned tcache_flags(dm_tls_t *t, je_arena_t *ja) {
    unsigned f = t->tcache[ja->slot];
    return DM_LIKELY(f != 0) ? f : tcache_slow(t, ja);
}

/* ---- contexts ----------------------------------------------------------- */

const dm_ctx_t *dm_ctx_root(void) { return &root_ctx; }

/* The root context is tally.c's context 0. Under dm__mu. */
static void root_tally_init(void) {
    if (!root_ctx.tally)
        (void)dm__tally_ctx_init(&root_ctx, true);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

const dm_ctx_t *dm_ctx_with_tag(const dm_ctx_t *base, const char *tag) {
    if (!base)
        base = &root_ctx;
    for (int i = 0; i < base->ntags; i++)
        if (strcmp(base->tags[i], tag) == 0)
            return base;
    if (base->ntags >= DM_GLOBS_MAX * 4 || strlen(tag) >= DM_NAME_MAX)
        return NULL;
    const char *want[DM_GLOBS_MAX * 4 + 1];
    int n = 0;
    for (int i = 0; i < base->ntags; i++)
        want[n++] = base->tags[i];
    want[n++] = tag;
    qsort(want, (size_t)n, sizeof(want[0]), cmp_str);

    pthread_mutex_lock(&dm__mu);
    root_tally_init();
    struct dm_ctx *c;
    for (c = contexts; c; c = c->next) {
        if (c->ntags != n)
            continue;
        int i = 0;
        while (i < n && strcmp(c->tags[i], want[i]) == 0)
            i++;
        if (i == n)
            break;
    }
    if (!c && ncontexts < DM_CTX_MAX && (c = calloc(1, sizeof(*c)))) {
        c->tags = calloc((size_t)n, sizeof(char *));
        bool ok = c->tags != NULL;
        for (int i = 0; ok && i < n; i++)
            ok = (c->tags[i] = strdup(want[i])) != NULL;
        c->ntags = n;
        if (ok && dm__tally_ctx_init(c, false)) {
            c->next = contexts;
            contexts = c;
            ncontexts++;
        } else {
            for (int i = 0; c->tags && i < n; i++)
                free(c->tags[i]);
            free(c->tags);
            free(c);
            c = NULL;
        }
    }
    pthread_mutex_unlock(&dm__mu);
    return c;
}

int dm_ctx_tags(const dm_ctx_t *c, const char **tags, int cap) {
    for (int i = 0; i < c->ntags && i < cap; i++)
        tags[i] = c->tags[i];
    return c->ntags;
}

void dm_thread_set_name(const char *name) {
    dm_tls_t *t = &tls;
    snprintf(t->thread_name, sizeof(t->thread_name), "%s", name ? name : "");
    t->ctx = &stale_ctx; /* rebind: thread rules may now match differently */
    t->auto_stale = true;
}

/* ---- tables -------------------------------------------------------------- */

static _Atomic int tables_live; /* published or retired but still referenced */

static void table_destroy(rt_table_t *t) {
    atomic_fetch_sub_explicit(&tables_live, 1, memory_order_relaxed);
    for (rt_view_entry_t *e = t->views, *next; e; e = next) {
        next = e->next;
        dm_view_free(e->view);
        free(e);
    }
    dm_table_free(t->table);
    dm_policy_free(t->policy);
    free(t->slots);
    free(t->rule_ctrs);
    free(t);
}

static void table_release(rt_table_t *t) {
    if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) == 1)
        table_destroy(t);
}

static void slot_init(rt_slot_t *s, dm_arena_t *a, const dm_arena_spec_t *spec) {
    s->arena = a;
    s->arena_id = (uint16_t)a->id;
    s->je = spec->per_node ? NULL : atomic_load_explicit(&a->single, memory_order_relaxed);
    s->tracked = atomic_load_explicit(&a->tracked, memory_order_relaxed);
    /* Alignment <= 64: round the size up instead of MALLOCX_ALIGN, which sends
     * requests above ~14 KiB past the thread cache (340-375 ns instead of ~100 ns
     * for 16 KiB; performance-baseline). jemalloc's size classes that are
     * multiples of 64 are 64-aligned, and large extents are page + k*64
     * (runtime_test checks every size up to 1 MiB). */
    if (spec->alignment <= 64) {
        s->round = spec->alignment - 1;
        s->flags = 0;
    } else {
        s->round = 0;
        s->flags = MALLOCX_ALIGN(spec->alignment);
    }
}

/* Called with dm__mu held: the view of `tab` for the thread's context. */
static const dm_view_t *view_for(rt_table_t *tab, const dm_ctx_t *c, const char *thread) {
    int words = dm_table_ctx_key_words(tab->table);
    uint64_t stack_key[16];
    uint64_t *key = words <= 16 ? stack_key : calloc((size_t)words, sizeof(uint64_t));
    if (!key)
        return NULL;
    dm_context_t ctx = {thread, (const char *const *)c->tags, c->ntags, NULL, NULL};
    dm_table_ctx_key(tab->table, &ctx, key);
    const dm_view_t *v = NULL;
    for (rt_view_entry_t *e = tab->views; e && !v; e = e->next)
        if (memcmp(e->key, key, (size_t)words * sizeof(uint64_t)) == 0)
            v = e->view;
    if (!v) {
        rt_view_entry_t *e = calloc(1, sizeof(*e) + (size_t)words * sizeof(uint64_t));
        dm_view_t *nv = e ? dm_table_view_build(tab->table, key) : NULL;
        if (nv) {
            memcpy(e->key, key, (size_t)words * sizeof(uint64_t));
            e->view = nv;
            e->next = tab->views;
            tab->views = e;
            v = nv;
        } else {
            free(e);
        }
    }
    if (key != stack_key)
        free(key);
    return v;
}

/* Behind the block cache, the arena that serves this thread's small arrays is
 * used through jemalloc's plain malloc()/free(), whose fast paths only work with
 * the thread's own automatic cache and arena (mallocx with an explicit cache has
 * none in 5.3: 259 instructions per pair at 64 B, against 116 for malloc+free;
 * bench/callgrind.sh).
 * So the thread is bound ("thread.arena") to that arena, chosen from its
 * thread-name view without tags, and every block of that arena — any size, so
 * that allocation and free use the same cache — goes through the automatic
 * cache. The cache is flushed before any change of binding, so it only ever
 * holds blocks of the bound arena. Other arenas keep their explicit caches.
 * Called with dm__mu held. */

static void auto_bind(dm_tls_t *t, rt_table_t *tab) {
    je_arena_t *cand = NULL;
    const dm_view_t *rv = view_for(tab, &root_ctx, t->thread_name);
    if (rv) {
        const rt_slot_t *s = &tab->slots[dm_view_lookup(rv, 64, DM_DT_UNKNOWN)];
        if (s->je && s->flags == 0)
            cand = s->je;
    }
    t->auto_stale = false;
    if (cand == t->auto_je)
        return;
    t->auto_je = NULL;
    dmje_mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    unsigned idx = cand ? cand->index : 0;
    if (cand && dmje_mallctl("thread.arena", NULL, NULL, &idx, sizeof(idx)) == 0)
        t->auto_je = cand;
}

/* Binds the calling thread to the current table and context. */
static __attribute__((noinline)) bool bind(dm_tls_t *t, const dm_ctx_t *key) {
    const dm_ctx_t *c = key ? key : &root_ctx; /* NULL means the root context */
    rt_table_t *old = NULL;
    bool ok = false;
    pthread_mutex_lock(&dm__mu);
    tls_register(t);
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_relaxed);
    if (!tab)
        goto out;
    if (t->table != tab) {
        dm_arena_ctrs_t *ctr = calloc((size_t)tab->nslots, sizeof(dm_arena_ctrs_t));
        if (!ctr)
            goto out;
        fold_rules(t);
        /* A new policy: cached blocks of arenas it may no longer use go back.
         * (Bins are per arena, so nothing else needs a flush.) */
        if (!t->exiting)
            fc_flush(t);
        old = t->table;
        atomic_fetch_add_explicit(&tab->refs, 1, memory_order_relaxed);
        t->table = tab;
        t->rule_ctrs = ctr;
        t->auto_stale = true;
    }
    if (t->auto_stale && !t->exiting)
        auto_bind(t, tab);
    const dm_view_t *v = view_for(tab, c, t->thread_name);
    if (v) {
        t->view = v;
        t->ctx = key; /* cache under what callers pass, NULL included */
        ok = true;
    } else {
        t->ctx = &stale_ctx;
    }
    memset(t->memo, 0, sizeof(t->memo)); /* learnt again for the new view */
out:
    t->fast = ok && !t->exiting;
    pthread_mutex_unlock(&dm__mu);
    if (old)
        table_release(old);
    return ok;
}

/* ---- the fast path -------------------------------------------------------- */

/* The calling thread's state. We are dlopen'ed, so `tls` is global-dynamic and
 * every &tls is a call (a TLS descriptor here, -mtls-dialect=gnu2; otherwise
 * __tls_get_addr); GCC rematerializes it after each call rather than keep it in
 * a register (with __tls_get_addr: 5 calls per malloc+free, 55 instructions;
 * bench/callgrind.sh). The empty asm hides where the pointer came from, so it is
 * computed once per entry point and passed down. */
static inline dm_tls_t *tls_self(void) {
    dm_tls_t *t = &tls;
    __asm__("" : "+r"(t));
    return t;
}

/* The same, through the initial-exec anchor (tls_anchor.c): one load. */
extern __thread void *datamem_tls_anchor __attribute__((tls_model("initial-exec")));

static __attribute__((noinline)) dm_tls_t *tls_anchor_set(void) {
    dm_tls_t *t = tls_self();
    datamem_tls_anchor = t;
    return t;
}

static inline dm_tls_t *tls_fast(void) {
    dm_tls_t *t = datamem_tls_anchor;
    return DM_LIKELY(t != NULL) ? t : tls_anchor_set();
}

static inline je_arena_t *slot_je(const rt_slot_t *s) {
    return DM_LIKELY(s->je != NULL) ? s->je
                                    : dm__arena_je_for_node(s->arena, dm__os_current_node());
}

static void *slot_alloc_tracked(dm_tls_t *t, const rt_slot_t *s, size_t size, int zero);

/* Where a block of n >= DM_BIG_THP_MIN bytes goes: ja's big half if it has one
 * (arena.c, "Big halves"). */
static inline je_arena_t *big_half(je_arena_t *ja) {
    je_arena_t *big = atomic_load_explicit(&ja->big, memory_order_acquire);
    return big ? big : ja;
}

static inline void *je_alloc_flags(dm_tls_t *t, int flags, je_arena_t *ja, size_t n, int zero) {
    TSAN_ACQUIRE();
    if (ja == t->auto_je && flags == 0) /* the thread's bound arena */
        return zero ? dmje_mallocx(n, MALLOCX_ZERO) : dmje_malloc(n);
    return dmje_mallocx(n, (int)((unsigned)flags | (unsigned)zero |
                                 (unsigned)MALLOCX_ARENA(ja->index) | tcache_flags(t, ja)));
}

static inline void *je_alloc(dm_tls_t *t, const rt_slot_t *s, je_arena_t *ja, size_t n, int zero) {
    return je_alloc_flags(t, s->flags, ja, n, zero);
}

/* n >= 4 MiB: a block kept by dm__big_keep if one of its size is there
 * (bigblock.c, "Reuse"), else jemalloc's, its pages past n trimmed
 * ("Trimming"), then the growth check. */
static __attribute__((noinline)) void *slot_alloc_big(dm_tls_t *t, const rt_slot_t *s,
                                                      je_arena_t *ja, size_t n, int zero) {
    int flags = dm__big_flags(ja, s->flags);
    void *p = dm__big_take(ja, n, flags);
    if (p) {
        if (zero)
            memset(p, 0, n);
        return p;
    }
    p = je_alloc_flags(t, flags, ja, n, zero);
    if (p)
        dm__big_trim(p, n, SIZE_MAX);
    dm__arena_check_growth(ja);
    return p;
}

static inline __attribute__((always_inline)) void *
slot_alloc(dm_tls_t *t, const rt_slot_t *s, size_t size, int zero) {
    if (DM_UNLIKELY(s->tracked))
        return slot_alloc_tracked(t, s, size, zero);
    size_t n = size ? size : 1; /* mallocx(0) is undefined */
    n = (n + s->round) & ~s->round;
    if (DM_UNLIKELY(n < size))
        return NULL;
    je_arena_t *ja = slot_je(s);
    if (DM_UNLIKELY(!ja))
        return NULL;
    if (DM_UNLIKELY(n >= DM_BIG_THP_MIN))
        return slot_alloc_big(t, s, big_half(ja), n, zero);
    void *p = je_alloc(t, s, ja, n, zero);
    if (n > DM_SC_MAX)
        dm__arena_check_growth(ja);
    return p;
}

/* Adds `usable` bytes to a tracked arena's live count unless that would pass
 * its limit; then the refusal is recorded for the thread (dm_runtime_last_failure;
 * the caller's caller names the rule) and nothing changes. */
static bool live_reserve(dm_tls_t *t, dm_arena_t *a, size_t usable, size_t request) {
    size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
    /* A compare-and-swap, not add-then-undo: the count itself never passes the
     * limit, not even for an instant (stats read it while threads race). */
    uint64_t before = atomic_load_explicit(&a->live, memory_order_relaxed);
    while (before + usable <= limit && before + usable >= before)
        if (atomic_compare_exchange_weak_explicit(&a->live, &before, before + usable,
                                                  memory_order_relaxed, memory_order_relaxed))
            return true;
    dm_failure_t *f = &t->last_failure;
    f->seq++;
    f->kind = DM_REFUSED_ARENA;
    f->tag[0] = 0;
    memcpy(f->arena, a->name, sizeof(f->arena));
    f->rule[0] = 0;
    f->request = request;
    f->limit = limit;
    f->live = before;
    f->fallback_tried = false;
    t->limit_refused = true;
    return false;
}

/* An arena with a limit (`s->tracked`): the block's usable size is added to
 * the arena's live bytes (a compare-and-swap that refuses to pass the limit)
 * *before* it is allocated, and taken back if jemalloc then fails, so
 * concurrent threads can never take the arena past it. Frees (free_slow) subtract the same usable
 * size. No block cache: its blocks are never tagged. */
static __attribute__((noinline)) void *slot_alloc_tracked(dm_tls_t *t, const rt_slot_t *s,
                                                          size_t size, int zero) {
    size_t n = size ? size : 1;
    n = (n + s->round) & ~s->round;
    if (DM_UNLIKELY(n < size))
        return NULL;
    je_arena_t *ja = slot_je(s);
    if (DM_UNLIKELY(!ja))
        return NULL;
    if (n >= DM_BIG_THP_MIN)
        ja = big_half(ja);
    int flags = (int)((unsigned)s->flags | (unsigned)MALLOCX_ARENA(ja->index));
    size_t usable = dmje_nallocx(n, flags);
    if (DM_UNLIKELY(usable == 0))
        return NULL;
    dm_arena_t *a = s->arena;
    if (!live_reserve(t, a, usable, size))
        return NULL;
    TSAN_ACQUIRE();
    void *p = dmje_mallocx(n, (int)((unsigned)flags | (unsigned)zero | tcache_flags(t, ja)));
    if (DM_UNLIKELY(!p)) {
        atomic_fetch_sub_explicit(&a->live, usable, memory_order_relaxed);
    } else if (n > DM_SC_MAX) {
        if (n >= DM_BIG_THP_MIN)
            dm__big_trim(p, n, SIZE_MAX);
        dm__arena_check_growth(ja);
    }
    return p;
}

/* NumPy's MemoryError text is fixed ("Unable to allocate ... for an array with
 * shape ..."), so a refusal by a limit also says, on stderr, which arena, rule,
 * limit and request it was: at most one line a second (a job that catches
 * MemoryError in a loop is not flooded), with the number not shown. Failure
 * path only; datamem.last_failure() gives the same for the calling thread. */
/* "8 bytes", "1.5 KiB", "64.0 MiB", "2.0 GiB" */
static void fmt_bytes(char *buf, size_t cap, uint64_t v) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (v < 1024) {
        snprintf(buf, cap, "%llu bytes", (unsigned long long)v);
        return;
    }
    double x = (double)v / 1024.0;
    int u = 0;
    while (x >= 1024.0 && u < 3)
        x /= 1024.0, u++;
    snprintf(buf, cap, "%.1f %s", x, units[u]);
}

static void limit_log(const dm_failure_t *f) {
    static _Atomic int64_t last_s;
    static _Atomic uint64_t quiet;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    int64_t prev = atomic_load_explicit(&last_s, memory_order_relaxed);
    if ((prev && ts.tv_sec - prev < 1) ||
        !atomic_compare_exchange_strong_explicit(&last_s, &prev, (int64_t)ts.tv_sec,
                                                 memory_order_relaxed, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&quiet, 1, memory_order_relaxed);
        return;
    }
    uint64_t more = atomic_exchange_explicit(&quiet, 0, memory_order_relaxed);
    char more_text[64] = "";
    if (more)
        snprintf(more_text, sizeof(more_text), " (%llu more refusals not shown)",
                 (unsigned long long)more);
    char lim[32], live[32], req[32];
    fmt_bytes(lim, sizeof(lim), f->limit);
    fmt_bytes(live, sizeof(live), f->live);
    fmt_bytes(req, sizeof(req), f->request);
    if (f->kind == DM_REFUSED_TAG)
        dm__log("datamem: MemoryError: tag '%s' is at its limit of %s with %s live: a "
                "request of %s was refused%s", f->tag, lim, live, req, more_text);
    else if (f->kind == DM_REFUSED_WORKER)
        dm__log("datamem: MemoryError: the worker limit of %s is reached with %s live: a "
                "request of %s was refused%s", lim, live, req, more_text);
    else
        dm__log("datamem: MemoryError: arena '%s' (rule '%s') is at its limit of %s with %s "
                "live: a request of %s was refused%s%s", f->arena, f->rule, lim, live, req,
                f->fallback_tried ? "; the fallback arena had no room either" : "", more_text);
}

/* A tracked arena's block goes: its usable size leaves the arena's count. */
static __attribute__((noinline)) void untrack_slow(je_arena_t *ja, const void *p) {
    atomic_fetch_sub_explicit(&ja->owner->live, dmje_sallocx(p, 0), memory_order_relaxed);
}

static inline void untrack(je_arena_t *ja, const void *p) {
    if (DM_UNLIKELY(atomic_load_explicit(&ja->tracked, memory_order_relaxed)))
        untrack_slow(ja, p);
}

static __attribute__((noinline)) void *alloc_failed(dm_tls_t *t, rt_table_t *tab,
                                                    const rt_slot_t *s, int rule,
                                                    size_t size, int zero) {
    bool limited = t->limit_refused;
    t->limit_refused = false;
    const dm_policy_t *pol = tab->policy;
    const char *rule_name = rule < pol->nrules ? pol->rules[rule].name : "default";
    DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
    DM_CTR_ADD(t->rule_ctrs[rule].nfail, 1);
    if (limited) {
        snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s", rule_name);
        DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
        DM_CTR_ADD(t->rule_ctrs[rule].nlimit, 1);
    }
    if (tab->fallback < 0 || tab->fallback_slot.arena == s->arena) {
        if (limited)
            limit_log(&t->last_failure);
        return NULL;
    }
    const rt_slot_t *f = &tab->fallback_slot;
    dm_failure_t first = t->last_failure;
    void *p = slot_alloc(t, f, size, zero);
    if (p) {
        DM_CTR_ADD(t->ctrs[f->arena_id].nfallback, 1);
        DM_CTR_ADD(t->rule_ctrs[rule].nfallback, 1);
        return p;
    }
    DM_CTR_ADD(t->ctrs[f->arena_id].nfail, 1);
    if (t->limit_refused) { /* the fallback's own limit */
        t->limit_refused = false;
        DM_CTR_ADD(t->ctrs[f->arena_id].nlimit, 1);
        snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s", rule_name);
    }
    if (limited) { /* report the rule's own arena, noting the fallback had no room */
        first.seq = t->last_failure.seq;
        first.fallback_tried = true;
        t->last_failure = first;
    }
    if (limited || t->last_failure.seq != first.seq)
        limit_log(&t->last_failure);
    return NULL;
}

/* Returns the slot for (size, dt) in the caller's context, binding if needed. */
static inline const rt_slot_t *route(dm_tls_t *t, const dm_ctx_t *c, size_t size,
                                     int dt, int *rule) {
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_acquire);
    if (DM_UNLIKELY(t->table != tab || t->ctx != c) && !bind(t, c))
        return NULL;
    int r = dm_view_lookup(t->view, size, dt);
    *rule = r;
    return &t->table->slots[r];
}

/* Learns what the bound view does with raw size class k: when every request
 * size of the class falls in one interval of the view (no rule boundary splits
 * it, and no rule uses dtype) and that interval's arena has one jemalloc arena
 * and alignment <= 64, the class is CACHED, with everything the fast path
 * needs precomputed: the rule, the arena, and the bin of the class its blocks
 * have once rounded to the alignment. Otherwise SLOW. */
static void memo_fill(dm_tls_t *t, unsigned k) {
    dm_memo_t *m = &t->memo[k];
    const dm_view_t *v = t->view;
    size_t lo = k ? dm_sc_size(k - 1) + 1 : 1, hi = dm_sc_size(k);
    m->state = DM_MEMO_SLOW;
    if (v->dt_mask != 0 || t->table->tally)
        return;
    uint32_t row = dm_view_interval(v, lo);
    if (row != dm_view_interval(v, hi))
        return;
    int r = v->slots[row * v->row_width];
    const rt_slot_t *s = &t->table->slots[r];
    unsigned bin = dm_sc_index((hi + s->round) & ~s->round);
    if (!s->je || s->flags != 0 || s->tracked ||
        bin != dm_sc_index((lo + s->round) & ~s->round))
        return;
    m->bin = &t->bins[bin];
    m->tag = (uint32_t)s->je->slot + 1;
    m->tag_bits = (uint64_t)bin << TAG_CLASS_SHIFT | (uint64_t)m->tag << TAG_ARENA_SHIFT;
    m->arena_ctrs = &t->ctrs[s->arena_id];
    m->rule_ctrs = &t->rule_ctrs[r];
    m->rule = (uint16_t)r;
    m->state = DM_MEMO_CACHED;
}

/* Serves slot `s` (rule `r`) and counts it; a failure goes to alloc_failed. */
static inline __attribute__((always_inline)) void *
alloc_counted(dm_tls_t *t, const rt_slot_t *s, int r, size_t size, int dt, int zero) {
    void *p = slot_alloc(t, s, size, zero);
    if (DM_UNLIKELY(!p))
        return alloc_failed(t, t->table, s, r, size, zero);
    dm_arena_ctrs_t *ac = &t->ctrs[s->arena_id], *rc = &t->rule_ctrs[r];
    DM_CTR_ADD(ac->nalloc, 1);
    DM_CTR_ADD(ac->bytes, size);
    DM_CTR_ADD(ac->ndtype_known, dt != DM_DT_UNKNOWN);
    DM_CTR_ADD(rc->nalloc, 1);
    DM_CTR_ADD(rc->bytes, size);
    DM_CTR_ADD(rc->ndtype_known, dt != DM_DT_UNKNOWN);
    return p;
}

/* Bytes per tag are counted (tally.c): the block's usable size is reserved
 * against the worker limit and its context's tags, then allocated as
 * alloc_counted does, then recorded for its free. A refusal fails the
 * allocation (no fallback: another arena would not change the tag's bytes). */
static __attribute__((noinline)) void *alloc_tallied(dm_tls_t *t, const dm_ctx_t *c,
                                                     const rt_slot_t *s, int r, size_t size,
                                                     int dt, int zero) {
    const dm_ctx_t *cx = c ? c : &root_ctx;
    size_t n = size ? size : 1;
    n = (n + s->round) & ~s->round;
    if (DM_UNLIKELY(n < size))
        return alloc_counted(t, s, r, size, dt, zero); /* fails as it would untallied */
    /* The usable size: jemalloc's class, from our table when no alignment
     * flag changes it (sizeclass.h), else jemalloc's answer. */
    bool small = s->flags == 0 && n <= DM_SC_MAX;
    uint64_t est = small ? dm_sc_size(dm_sc_index(n)) : dmje_nallocx(n, s->flags);
    if (DM_UNLIKELY(est == 0))
        return alloc_counted(t, s, r, size, dt, zero);
    if (DM_UNLIKELY(!dm__tally_reserve(cx, est, size, &t->last_failure))) {
        DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
        DM_CTR_ADD(t->rule_ctrs[r].nfail, 1);
        DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
        DM_CTR_ADD(t->rule_ctrs[r].nlimit, 1);
        const dm_policy_t *pol = t->table->policy;
        snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s",
                 r < pol->nrules ? pol->rules[r].name : "default");
        snprintf(t->last_failure.arena, sizeof(t->last_failure.arena), "%s", s->arena->name);
        limit_log(&t->last_failure);
        return NULL;
    }
    void *p = alloc_counted(t, s, r, size, dt, zero);
    if (DM_UNLIKELY(!p)) {
        dm__tally_unreserve(cx, est);
        return NULL;
    }
    /* the block's size is the one reserved unless the fallback arena served it */
    je_arena_t *owner = dm__owner_of(p);
    dm__tally_record(cx, p, est, small && owner && owner->owner == s->arena);
    return p;
}

static __attribute__((noinline)) void *alloc_slow(dm_tls_t *t, const dm_ctx_t *c, size_t size,
                                                  int dt, int zero) {
    int r;
    const rt_slot_t *s = route(t, c, size, dt, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_UNLIKELY(t->table->tally))
        return alloc_tallied(t, c, s, r, size, dt, zero);
    if (size - 1 < DM_SC_MAX) { /* the cached path, next time */
        unsigned k = dm_sc_index(size);
        if (t->memo[k].state == DM_MEMO_UNKNOWN)
            memo_fill(t, k);
    }
    return alloc_counted(t, s, r, size, dt, zero);
}

/* A call site whose module/function matches some site rule (mask != 0): the
 * view's answer, then the first earlier site rule that matches size and dtype
 * (dm_table_site_pick). Never the block cache's memo, which knows sizes only.
 * The mask was computed against the table of install number `gen`; after a
 * reload its bits mean other rules, so it is dropped (the allocation is routed
 * as if its site were unknown, once, until the caller's cache catches up). */
static __attribute__((noinline)) void *alloc_site(dm_tls_t *t, const dm_ctx_t *c, size_t size,
                                                  int dt, uint64_t mask, uint64_t gen, int zero) {
    int r;
    const rt_slot_t *s = route(t, c, size, dt, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_LIKELY(t->table->seq == gen)) {
        r = dm_table_site_pick(t->table->table, t->view, mask, size, dt, r);
        s = &t->table->slots[r];
    }
    if (DM_UNLIKELY(t->table->tally))
        return alloc_tallied(t, c, s, r, size, dt, zero);
    return alloc_counted(t, s, r, size, dt, zero);
}

_Atomic int dm_runtime_site_rules;
static _Atomic uint64_t site_gen; /* install number of the table in force */

uint64_t dm_runtime_site_mask(const char *module, const char *function, uint64_t *gen) {
    uint64_t m = 0;
    pthread_mutex_lock(&dm__mu); /* the table in force cannot be retired meanwhile */
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_relaxed);
    if (tab)
        m = dm_table_site_mask(tab->table, module, function);
    *gen = tab ? tab->seq : 0;
    pthread_mutex_unlock(&dm__mu);
    return m;
}

uint64_t dm_runtime_site_gen(void) { return atomic_load_explicit(&site_gen, memory_order_acquire); }

/* A block leaves through the cached path: tag it with its class and arena,
 * and count it. */
static inline __attribute__((always_inline)) void fc_hand_out(const dm_memo_t *m, void *p,
                                                              size_t size) {
    atomic_store_explicit(tag_word((uintptr_t)p), (uintptr_t)p | m->tag_bits,
                          memory_order_relaxed);
    DM_CTR_ADD(m->arena_ctrs->nalloc, 1);
    DM_CTR_ADD(m->arena_ctrs->bytes, size);
    DM_CTR_ADD(m->rule_ctrs->nalloc, 1);
    DM_CTR_ADD(m->rule_ctrs->bytes, size);
}

/* The cached path with no block in the bin: the rule's arena through jemalloc
 * (its malloc fast path for the thread's bound arena). Out of line, so that a
 * cache hit makes no call and needs no stack frame. */
static __attribute__((noinline)) void *fc_miss(dm_tls_t *t, const dm_ctx_t *c, size_t size,
                                               const dm_memo_t *m, int zero) {
    void *p = slot_alloc(t, &t->table->slots[m->rule], size, zero);
    if (DM_UNLIKELY(!p))
        return alloc_slow(t, c, size, DM_DT_UNKNOWN, zero); /* failure, fallback */
    fc_hand_out(m, p, size);
    return p;
}

/* The fast path: a size class the bound view sends wholly to one arena. Pops a
 * cached block of that arena (or asks jemalloc), tags it, counts. Anything else
 * (first call, reload, another context, a class split by a rule, dtype known,
 * alignment > 64, per-node arenas, arrays > 256 KiB, failure) goes to
 * alloc_slow. */
static inline __attribute__((always_inline)) void *alloc_impl(const dm_ctx_t *c, size_t size,
                                                              int dt, int zero) {
    dm_tls_t *t = tls_fast();
    if (DM_LIKELY(t->fast) && size - 1 < DM_SC_MAX && dt == DM_DT_UNKNOWN) {
        rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_acquire);
        const dm_memo_t *m = &t->memo[dm_sc_index(size)];
        if (DM_LIKELY(t->table == tab && t->ctx == c && m->state == DM_MEMO_CACHED)) {
            dm_fc_bin_t *b = m->bin;
            uint32_t n = bin_count(b);
            if (DM_UNLIKELY(n == 0 || b->tag != m->tag))
                return fc_miss(t, c, size, m, zero);
            void *p = b->items[n - 1];
            bin_set(b, n - 1);
            fc_hand_out(m, p, size);
            return zero ? memset(p, 0, size) : p;
        }
    }
    return alloc_slow(t, c, size, dt, zero);
}

/* Blocks of 4 MiB and more: NumPy's hugepage advice, and from 32 MiB zeroing by
 * giving pages back (bigblock.c). Out of line: one compare on the fast path. */
static __attribute__((noinline)) void *alloc_big(const dm_ctx_t *c, size_t size, int dt,
                                                 bool zero) {
    bool purge = zero && size >= DM_BIG_ZERO_PURGE_MIN;
    void *p = alloc_impl(c, size, dt, zero && !purge ? MALLOCX_ZERO : 0);
    if (DM_UNLIKELY(!p))
        return NULL;
    dm__big_advise(p, size);
    return purge ? dm__big_zero(p, size) : p;
}

void *dm_alloc(const dm_ctx_t *c, size_t size, int dt) {
    if (DM_UNLIKELY(size >= DM_BIG_THP_MIN))
        return alloc_big(c, size, dt, false);
    return alloc_impl(c, size, dt, 0);
}

void *dm_calloc(const dm_ctx_t *c, size_t size, int dt) {
    if (DM_UNLIKELY(size >= DM_BIG_THP_MIN))
        return alloc_big(c, size, dt, true);
    return alloc_impl(c, size, dt, MALLOCX_ZERO);
}

/* With a call site's mask (see datamem.h); mask == 0: dm_alloc / dm_calloc. */
void *dm_alloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen) {
    if (!mask)
        return dm_alloc(c, size, dt);
    void *p = alloc_site(tls_fast(), c, size, dt, mask, gen, 0);
    if (p && size >= DM_BIG_THP_MIN) /* big blocks: as dm_alloc does */
        dm__big_advise(p, size);
    return p;
}

void *dm_calloc_site(const dm_ctx_t *c, size_t size, int dt, uint64_t mask, uint64_t gen) {
    if (!mask)
        return dm_calloc(c, size, dt);
    bool big = size >= DM_BIG_THP_MIN, purge = size >= DM_BIG_ZERO_PURGE_MIN;
    void *p = alloc_site(tls_fast(), c, size, dt, mask, gen, purge ? 0 : MALLOCX_ZERO);
    if (!p || !big)
        return p;
    dm__big_advise(p, size);
    return purge ? dm__big_zero(p, size) : p;
}

static __attribute__((noinline)) void free_slow(dm_tls_t *t, void *p, _Atomic uint64_t *w,
                                                 uint64_t v, size_t hint) {
    if (!p)
        return;
    if ((v & TAG_PMASK) == (uintptr_t)p) /* tagged, but not for this thread's cache */
        atomic_store_explicit(w, 0, memory_order_relaxed);
    je_arena_t *ja = dm__owner_of(p);
    if (DM_UNLIKELY(!ja)) { /* not ours: never hand it to jemalloc */
        atomic_fetch_add_explicit(&foreign_frees, 1, memory_order_relaxed);
        return;
    }
    DM_CTR_ADD(t->ctrs[ja->owner->id].nfree, 1);
    untrack(ja, p);
    dm__tally_release(p);
    if (hint >= DM_BIG_THP_MIN && dm__big_keep(ja, p, hint)) /* NumPy's size says big: maybe */
        return;
    TSAN_RELEASE();
    if (ja == t->auto_je)
        dmje_free(p); /* jemalloc's fast path; the block is the bound arena's */
    else
        dmje_dallocx(p, (int)tcache_flags(t, ja));
}

/* The fast path: a tagged block goes into its class's bin, if the bin is
 * empty or holds the same arena's blocks and has room; otherwise down the
 * slow path, untagged. The tag says the class; NumPy's size (hint) is only a
 * filter for the slow path: a block it calls big may be kept for reuse after
 * jemalloc tells its real size. */
static inline __attribute__((always_inline)) void free_impl(void *p, size_t hint) {
    dm_tls_t *t = tls_fast();
    _Atomic uint64_t *w = tag_word((uintptr_t)p);
    uint64_t v = atomic_load_explicit(w, memory_order_relaxed);
    if (DM_LIKELY(t->fast) && DM_LIKELY(p != NULL) && (v & TAG_PMASK) == (uintptr_t)p) {
        atomic_store_explicit(w, 0, memory_order_relaxed);
        unsigned k = (unsigned)(v >> TAG_CLASS_SHIFT) & 63u;
        uint32_t tag = (uint32_t)(v >> TAG_ARENA_SHIFT);
        dm_fc_bin_t *b = &t->bins[k];
        uint32_t n = bin_count(b);
        if (DM_LIKELY(n < fc_cap[k]) && (DM_LIKELY(b->tag == tag) || n == 0)) {
            if (DM_UNLIKELY(b->tag != tag)) { /* an empty bin changes arena */
                b->tag = tag;
                b->nfree = &t->ctrs[dm__je[tag - 1]->owner->id].nfree;
            }
            DM_CTR_ADD(*b->nfree, 1);
            b->items[n] = p;
            bin_set(b, n + 1);
            return;
        }
        v = 0; /* the tag is gone */
    }
    free_slow(t, p, w, v, hint);
}

void dm_free(void *p) { free_impl(p, 0); }

void dm_free_hint(void *p, size_t size_hint) { free_impl(p, size_hint); }

/* realloc: the block follows the rules for its new size (a growing array can
 * move to the arena its new size selects). Same arena: rallocx, which may
 * resize in place. Another arena: allocate there, copy, free here; never
 * rallocx across arenas, which would free the old block into the new arena's
 * thread cache. NumPy calls this with or without the GIL. */
/* realloc while bytes are counted per tag: a new block in the caller's
 * context, the bytes copied, the old block freed (its tags give its bytes
 * back). Never in place: the block may change tags. */
static __attribute__((noinline)) void *realloc_tallied(const dm_ctx_t *c, void *p, size_t size) {
    void *q = dm_alloc(c, size, DM_DT_UNKNOWN);
    if (!q)
        return NULL; /* the old block stays valid */
    size_t have = dmje_sallocx(p, 0);
    memcpy(q, p, have < size ? have : size);
    dm_free(p);
    return q;
}

void *dm_realloc(const dm_ctx_t *c, void *p, size_t size) {
    if (!p)
        return dm_alloc(c, size, DM_DT_UNKNOWN);
    je_arena_t *old = dm__owner_of(p);
    if (DM_UNLIKELY(!old))
        return NULL;
    tag_drop(p); /* the block leaves the cached path: resized, moved or freed */
    dm_tls_t *t = tls_self();
    int r;
    const rt_slot_t *s = route(t, c, size, DM_DT_UNKNOWN, &r);
    if (DM_UNLIKELY(!s))
        return NULL;
    if (DM_UNLIKELY(t->table->tally)) /* the bound table: route() holds a reference */
        return realloc_tallied(c, p, size);
    je_arena_t *ja = slot_je(s);
    je_arena_t *big = ja ? atomic_load_explicit(&ja->big, memory_order_acquire) : NULL;
    if (big && old == big)
        ja = old; /* a big block stays in the big half, resized in place if it can */
    /* A block growing to 4 MiB or more moves from the small half to the big
     * one, where the arena's other big blocks are and where its free can be
     * reused. pandas' hash tables grow their vectors by realloc (1 -> 4 -> 16
     * -> 64 MiB); left in the small half, such blocks are served by nothing
     * once freed, while the big half grows for the next big arrays (1.10x
     * NumPy's default peak RSS on pandas3_etl, bench/results/issue28.md). */
    size_t rounded = ((size ? size : 1) + s->round) & ~s->round;
    bool up = big && ja == old && rounded >= DM_BIG_THP_MIN;
    void *q = NULL;
    TSAN_RELEASE();
    TSAN_ACQUIRE();
    if (ja == old && !up) {
        size_t n = size ? size : 1;
        n = (n + s->round) & ~s->round;
        int flags = (int)((unsigned)s->flags | (unsigned)MALLOCX_ARENA(ja->index));
        /* A tracked arena: reserve what the block grows by, settle after. */
        dm_arena_t *a = ja->owner;
        bool tracked = atomic_load_explicit(&a->tracked, memory_order_relaxed);
        size_t had = 0, grow = 0;
        if (DM_UNLIKELY(tracked) && n >= size) {
            had = dmje_sallocx(p, 0);
            size_t want = dmje_nallocx(n, flags);
            grow = want > had ? want - had : 0;
            if (grow && !live_reserve(t, a, grow, size)) {
                n = 0; /* refused: fails below, the old block stays */
                t->limit_refused = false;
                snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s",
                         r < t->table->policy->nrules ? t->table->policy->rules[r].name
                                                      : "default");
                DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
                DM_CTR_ADD(t->rule_ctrs[r].nlimit, 1);
                limit_log(&t->last_failure);
            }
        }
        if (n >= size && n != 0)
            q = dmje_rallocx(p, n, (int)((unsigned)flags | tcache_flags(t, ja)));
        if (DM_UNLIKELY(tracked) && n != 0) {
            if (!q) /* the old block stays as it was */
                atomic_fetch_sub_explicit(&a->live, grow, memory_order_relaxed);
            else /* settle: the count now holds had + grow; make it the new size */
                atomic_fetch_add_explicit(&a->live, (uint64_t)dmje_sallocx(q, 0) - had - grow,
                                          memory_order_relaxed);
        }
    } else {
        q = slot_alloc(t, s, size, 0);
        if (q) {
            size_t have = dmje_sallocx(p, 0);
            memcpy(q, p, have < size ? have : size);
            DM_CTR_ADD(t->ctrs[old->owner->id].nfree, 1);
            DM_CTR_ADD(t->ctrs[s->arena_id].nalloc, 1);
            untrack(old, p);
            dmje_dallocx(p, (int)tcache_flags(t, old));
        } else if (t->limit_refused) {
            t->limit_refused = false;
            snprintf(t->last_failure.rule, sizeof(t->last_failure.rule), "%s",
                     r < t->table->policy->nrules ? t->table->policy->rules[r].name : "default");
            DM_CTR_ADD(t->ctrs[s->arena_id].nlimit, 1);
            DM_CTR_ADD(t->rule_ctrs[r].nlimit, 1);
            limit_log(&t->last_failure);
        }
    }
    if (DM_UNLIKELY(!q)) {
        DM_CTR_ADD(t->ctrs[s->arena_id].nfail, 1);
        DM_CTR_ADD(t->rule_ctrs[r].nfail, 1);
        return NULL; /* the old block stays valid, as realloc promises */
    }
    DM_CTR_ADD(t->ctrs[s->arena_id].nrealloc, 1);
    DM_CTR_ADD(t->ctrs[s->arena_id].bytes, size);
    DM_CTR_ADD(t->rule_ctrs[r].nrealloc, 1);
    DM_CTR_ADD(t->rule_ctrs[r].bytes, size);
    return q;
}

void dm_runtime_last_failure(dm_failure_t *out) { *out = tls_self()->last_failure; }

bool dm_runtime_wants_dtype(void) {
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_acquire);
    return tab && tab->uses_dtype;
}

const char *dm_owner_arena(const void *p) {
    je_arena_t *ja = p ? dm__owner_of(p) : NULL;
    return ja ? ja->owner->name : NULL;
}

const char *dm_runtime_rule_of(const dm_ctx_t *c, size_t size, int dt) {
    dm_tls_t *t = tls_self();
    int r;
    if (!route(t, c, size, dt, &r))
        return NULL;
    const char *name = dm_table_rule_name(t->table->table, r);
    return name ? name : "default";
}

/* ---- init, fork ------------------------------------------------------------
 * fork() copies only the calling thread. Before it, the forking thread takes
 * every lock of the engine another thread could hold (dm__mu, then each
 * jemalloc arena's bump and reuse locks: the order the other paths take them;
 * jemalloc's own handler, registered before ours, runs after ours and takes
 * jemalloc's). In the child the threads that did not survive are retired the
 * way tls_exit retires a thread: their per-thread blocks are still linked in
 * the registry, and glibc hands their memory to the child's next threads (a new
 * thread reusing a node's address made the list a cycle, and every stats
 * snapshot then spun under dm__mu). */

static void fork_lock_all(int phase) {
    if (phase == 0) {
        pthread_mutex_lock(&dm__mu);
        dm__arena_fork(0);
        dm__big_fork(0);
    } else {
        dm__big_fork(1);
        dm__arena_fork(1);
        pthread_mutex_unlock(&dm__mu);
    }
}

static void atfork_prepare(void) { fork_lock_all(0); }
static void atfork_parent(void) { fork_lock_all(1); }

/* In the child, dm__mu held: unlinks every registered thread but the caller
 * and returns them as a list (through `next`), their counts folded. */
static dm_tls_t *fork_child_unlink(void) {
    dm_tls_t *self = pthread_getspecific(tls_key), *gone = NULL;
    for (dm_tls_t *t = registry, *next; t; t = next) {
        next = t->next;
        if (t == self)
            continue;
        for (int i = 0; i < dm__arena_count(); i++)
            ctrs_add(&dm__arena_at(i)->dead, &t->ctrs[i]);
        fold_rules(t);
        t->registered = false;
        t->next = gone;
        gone = t;
    }
    registry = self && self->registered ? self : NULL;
    if (registry)
        registry->prev = registry->next = NULL;
    nthreads = registry ? 1 : 0;
    return gone;
}

/* In the child, no lock held (the frees may reach the arenas' extent hooks):
 * what the gone threads held goes back. Their cached blocks are freed (a
 * thread caught mid-pop leaves one counted block that its caller never got,
 * which is then freed here: nobody in the child holds it), their explicit
 * jemalloc caches destroyed, their table references dropped. */
static void fork_child_release(dm_tls_t *gone) {
    for (dm_tls_t *t = gone, *next; t; t = next) {
        next = t->next;
        fc_flush(t);
        for (int i = 0; i < DM_JE_MAX; i++) {
            unsigned f = t->tcache[i];
            if (f && f != (unsigned)MALLOCX_TCACHE_NONE)
                dm__tcache_destroy((f >> 8) - 1);
            t->tcache[i] = 0;
        }
        if (t->table)
            table_release(t->table);
        t->table = NULL;
        t->next = t->prev = NULL;
    }
}

static void atfork_child(void) {
    dm_tls_t *gone = fork_child_unlink();
    fork_lock_all(1);
    fork_child_release(gone);
}

void dm_runtime_after_fork_child(void) {
    int nobs = atomic_load_explicit(&nobservers, memory_order_acquire);
    for (int i = 0; i < nobs; i++)
        if (observers[i].on_fork_child)
            observers[i].on_fork_child(observers[i].arg);
}

static void init_once_fn(void) {
    for (unsigned k = 0; k < DM_SC_COUNT; k++) {
        size_t fit = DM_FC_CLASS_BYTES / dm_sc_size(k);
        fc_cap[k] = (uint8_t)(fit < 1 ? 1 : fit > DM_FC_SLOTS ? DM_FC_SLOTS : fit);
    }
    pthread_key_create(&tls_key, tls_exit);
    /* jemalloc registers its fork handlers when it initialises: make that
     * happen first, so that in the child its handler has made it usable
     * before ours frees the gone threads' blocks. */
    unsigned narenas;
    size_t sz = sizeof(narenas);
    dmje_mallctl("arenas.narenas", &narenas, &sz, NULL, 0);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    pthread_mutex_lock(&dm__mu);
    root_tally_init();
    pthread_mutex_unlock(&dm__mu);
}

void dm_runtime_set_cudart(const char *path) {
    pthread_mutex_lock(&dm__mu);
    snprintf(cudart_path, sizeof(cudart_path), "%s", path ? path : "");
    pthread_mutex_unlock(&dm__mu);
}

int dm_runtime_init(void) {
    pthread_once(&init_once, init_once_fn);
    return 0;
}

void dm_runtime_topology(dm_topology_t *out) { out->nodes = dm__os_numa_nodes(); }

bool dm_runtime_active(void) {
    return atomic_load_explicit(&g_table, memory_order_acquire) != NULL;
}

/* ---- install ----------------------------------------------------------------- */

static int install_fail(dm_diags_t *d, int rc, const char *what) {
    if (d && d->n < DM_DIAG_MAX) {
        dm_diag_t *e = &d->items[d->n++];
        memset(e, 0, sizeof(*e));
        e->severity = DM_SEV_ERROR;
        snprintf(e->msg, sizeof(e->msg), "%s: %s", what, dm_strerror(rc));
        d->nerrors++;
    }
    return rc;
}

/* Called with dm__mu held. Creates every jemalloc arena the policy needs before
 * anything visible changes, so a failure leaves the running policy untouched
 * (at worst an unused arena exists, as after any reload that drops one). */
static int ensure_arenas(const dm_policy_t *p, dm_arena_t **out) {
    for (int i = 0; i < p->narenas; i++) {
        dm_arena_t *a = dm__arena_get(p->arenas[i].name, &p->arenas[i]);
        if (!a)
            return DM_EARENA;
        int rc = dm__arena_ensure(a, &p->arenas[i]);
        if (rc)
            return rc;
        out[i] = a;
    }
    return 0;
}

int dm_runtime_install(dm_policy_t *p, dm_diags_t *d) {
    dm_runtime_init();
    dm_table_t *tt = NULL;
    int rc = dm_table_compile(p, &tt);
    if (rc) {
        dm_policy_free(p);
        return install_fail(d, rc, "cannot compile the policy");
    }
    rt_table_t *tab = calloc(1, sizeof(*tab));
    int nslots = dm_table_nrules(tt) + 1;
    rt_slot_t *slots = calloc((size_t)nslots, sizeof(rt_slot_t));
    dm_arena_ctrs_t *rc_ctr = calloc((size_t)nslots, sizeof(dm_arena_ctrs_t));
    if (!tab || !slots || !rc_ctr) {
        free(tab), free(slots), free(rc_ctr);
        dm_table_free(tt);
        dm_policy_free(p);
        return install_fail(d, DM_ENOMEM, "cannot install the policy");
    }
    atomic_fetch_add_explicit(&tables_live, 1, memory_order_relaxed);
    tab->table = tt;
    tab->policy = p;
    tab->slots = slots;
    tab->nslots = nslots;
    tab->uses_dtype = dm_table_uses_dtype(tt);
    tab->rule_ctrs = rc_ctr;
    atomic_store_explicit(&tab->refs, 1, memory_order_relaxed);

    /* pinned: cuda needs the CUDA runtime before any of its extents exist. */
    for (int i = 0; i < p->narenas; i++) {
        char why[200];
        if (p->arenas[i].pinned != DM_PIN_CUDA || dm__os_gpu_load(cudart_path, why, sizeof(why)) == 0)
            continue;
        if (d && d->n < DM_DIAG_MAX) {
            dm_diag_t *e = &d->items[d->n++];
            memset(e, 0, sizeof(*e));
            e->severity = DM_SEV_ERROR;
            e->line = p->arenas[i].line;
            e->col = p->arenas[i].col;
            snprintf(e->path, sizeof(e->path), "arenas.%s.pinned", p->arenas[i].name);
            snprintf(e->msg, sizeof(e->msg),
                     "cuda: %s; install the CUDA runtime (libcudart), set DATAMEM_CUDART to its "
                     "path, or use `lock: true` for page-locked memory without a GPU", why);
            d->nerrors++;
        }
        table_destroy(tab);
        return DM_EINVALID;
    }
    dm_arena_t *byspec[DM_ARENAS_MAX];
    pthread_mutex_lock(&dm__mu);
    rc = ensure_arenas(p, byspec);
    if (rc) {
        pthread_mutex_unlock(&dm__mu);
        table_destroy(tab);
        return install_fail(d, rc, "cannot create arenas");
    }
    dm__arena_mark_all_unused();
    for (int i = 0; i < p->narenas; i++)
        dm__arena_apply(byspec[i], &p->arenas[i]);
    for (int r = 0; r < nslots; r++) {
        int ai = dm_table_rule_arena(tt, r);
        slot_init(&slots[r], byspec[ai], &p->arenas[ai]);
    }
    tab->fallback = p->fallback_arena;
    if (p->fallback_arena >= 0)
        slot_init(&tab->fallback_slot, byspec[p->fallback_arena], &p->arenas[p->fallback_arena]);
    tab->tally = dm__tally_configure(p);
    rt_table_t *old = atomic_load_explicit(&g_table, memory_order_relaxed);
    tab->seq = reloads + 1;
    atomic_store_explicit(&g_table, tab, memory_order_release);
    atomic_store_explicit(&site_gen, tab->seq, memory_order_release);
    atomic_store_explicit(&dm_runtime_site_rules, dm_table_uses_site(tt), memory_order_release);
    reloads++;
    last_reload_failed = false;
    dm__big_expire_all(); /* new decay times and limits apply to kept blocks at once */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    last_reload_time = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    uint64_t seq = reloads;
    /* Observers read the policy outside dm__mu: our reference keeps it alive
     * even if another install retires the table meanwhile. */
    atomic_fetch_add_explicit(&tab->refs, 1, memory_order_relaxed);
    pthread_mutex_unlock(&dm__mu);
    if (old)
        table_release(old);
    int nobs = atomic_load_explicit(&nobservers, memory_order_acquire);
    for (int i = 0; i < nobs; i++)
        if (observers[i].on_install)
            observers[i].on_install(tab->policy, seq, observers[i].arg);
    table_release(tab);
    return 0;
}

int dm_runtime_load(const char *path, dm_diags_t *d) {
    dm_runtime_init();
    dm_topology_t topo;
    dm_runtime_topology(&topo);
    dm_policy_t *p = NULL;
    int rc = dm_policy_load(path, &topo, &p, d);
    if (rc == 0)
        rc = dm_runtime_install(p, d);
    if (rc)
        dm_runtime_note_reload_failure();
    return rc;
}

void dm_runtime_note_reload_failure(void) {
    pthread_mutex_lock(&dm__mu);
    reload_failures++;
    last_reload_failed = true;
    pthread_mutex_unlock(&dm__mu);
}

dm_policy_t *dm_runtime_policy_copy(void) {
    dm_policy_t *copy = NULL;
    pthread_mutex_lock(&dm__mu);
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_relaxed);
    if (tab && (copy = malloc(sizeof(*copy)))) {
        *copy = *tab->policy;
        copy->rules = malloc(sizeof(dm_rule_spec_t) * (size_t)(copy->nrules ? copy->nrules : 1));
        if (copy->rules && copy->nrules) /* rules may be NULL when there are none */
            memcpy(copy->rules, tab->policy->rules, sizeof(dm_rule_spec_t) * (size_t)copy->nrules);
        else if (!copy->rules)
            free(copy), copy = NULL;
    }
    pthread_mutex_unlock(&dm__mu);
    return copy;
}

/* ---- stats --------------------------------------------------------------------- */

/* One thread's (or the folded) counters into a snapshot. */
static void counts_add(dm_counts_t *o, const dm_arena_ctrs_t *c) {
    o->nalloc += DM_CTR_GET(c->nalloc);
    o->nfree += DM_CTR_GET(c->nfree);
    o->nrealloc += DM_CTR_GET(c->nrealloc);
    o->nfail += DM_CTR_GET(c->nfail);
    o->nfallback += DM_CTR_GET(c->nfallback);
    o->ndtype_known += DM_CTR_GET(c->ndtype_known);
    o->bytes_requested += DM_CTR_GET(c->bytes);
    o->nlimit += DM_CTR_GET(c->nlimit);
}

int dm_stats_snapshot(dm_stats_t *out) {
    memset(out, 0, sizeof(*out));
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    out->snapshot_time = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    uint64_t epoch = 1;
    size_t esz = sizeof(epoch);
    pthread_mutex_lock(&dm__mu);
    /* Kept big blocks that waited out their arena's decay.dirty go back now:
     * with an exporter running this is their clock when the job is idle.
     * (dm__mu, then an arena's reuse_mu: the order fork's handlers take.) */
    dm__big_expire_all();
    dmje_mallctl("epoch", &epoch, &esz, &epoch, esz);
    out->narenas = dm__arena_count();
    for (int i = 0; i < out->narenas; i++) {
        dm_arena_t *a = dm__arena_at(i);
        dm_arena_stats_t *o = &out->arenas[i];
        snprintf(o->name, sizeof(o->name), "%s", a->name);
        o->in_policy = atomic_load_explicit(&a->in_policy, memory_order_relaxed);
        o->alignment = atomic_load_explicit(&a->alignment, memory_order_relaxed);
        o->hugepages = atomic_load_explicit(&a->thp, memory_order_relaxed);
        o->numa = atomic_load_explicit(&a->numa, memory_order_relaxed);
        o->numa_nodes = atomic_load_explicit(&a->numa_nodes, memory_order_relaxed);
        o->per_node = atomic_load_explicit(&a->per_node, memory_order_relaxed);
        o->nplacement_errors = DM_CTR_GET(a->placement_errors);
        o->ngrowth_purges = DM_CTR_GET(a->growth_purges);
        size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
        o->limit = limit == SIZE_MAX ? UINT64_MAX : (uint64_t)limit;
        o->tracked = atomic_load_explicit(&a->tracked, memory_order_acquire);
        o->live = o->tracked ? atomic_load_explicit(&a->live, memory_order_relaxed) : 0;
        o->lock = atomic_load_explicit(&a->lock, memory_order_relaxed);
        o->pinned = atomic_load_explicit(&a->pinned, memory_order_relaxed);
        o->locked_bytes = atomic_load_explicit(&a->locked_bytes, memory_order_relaxed);
        o->pinned_bytes = atomic_load_explicit(&a->pinned_bytes, memory_order_relaxed);
        counts_add(&o->counts, &a->dead);
        for (dm_tls_t *t = registry; t; t = t->next)
            counts_add(&o->counts, &t->ctrs[i]);
        dm__arena_je_stats(a, o);
    }
    rt_table_t *tab = atomic_load_explicit(&g_table, memory_order_relaxed);
    if (tab) {
        out->nrules = tab->nslots;
        out->rules = calloc((size_t)tab->nslots, sizeof(dm_rule_stats_t));
        for (int r = 0; out->rules && r < tab->nslots; r++) {
            dm_rule_stats_t *rs = &out->rules[r];
            const dm_policy_t *p = tab->policy;
            snprintf(rs->name, sizeof(rs->name), "%s", r < p->nrules ? p->rules[r].name : "default");
            snprintf(rs->arena, sizeof(rs->arena), "%s", tab->slots[r].arena->name);
            counts_add(&rs->counts, &tab->rule_ctrs[r]);
            for (dm_tls_t *t = registry; t; t = t->next)
                if (t->table == tab && t->rule_ctrs)
                    counts_add(&rs->counts, &t->rule_ctrs[r]);
            rs->counts.nfree = 0; /* frees know the arena, not the rule */
        }
        out->policy_hash = tab->policy->hash;
    }
    for (dm_tls_t *t = registry; t; t = t->next)
        for (unsigned k = 0; k < DM_SC_COUNT; k++)
            out->cached_bytes += (uint64_t)bin_count(&t->bins[k]) * dm_sc_size(k);
    if (tab) {
        snprintf(out->policy_path, sizeof(out->policy_path), "%s", tab->policy->path);
    }
    out->reloads = reloads;
    out->reload_failures = reload_failures;
    out->last_reload_time = last_reload_time;
    out->last_reload_failed = last_reload_failed;
    out->nthreads = nthreads;
    out->ncontexts = ncontexts;
    int trc = dm__tally_snapshot(out);
    out->tables_live = atomic_load_explicit(&tables_live, memory_order_relaxed);
    pthread_mutex_unlock(&dm__mu);
    out->foreign_frees = atomic_load_explicit(&foreign_frees, memory_order_relaxed);
    if (trc) {
        dm_stats_release(out);
        return trc;
    }
    return 0;
}

void dm_stats_release(dm_stats_t *s) {
    free(s->rules);
    s->rules = NULL;
    free(s->tags);
    s->tags = NULL;
    s->ntags = 0;
}
