/*
 * policy.h: the datamem policy, from YAML bytes to an immutable compiled table.
 *
 * This module knows nothing of jemalloc, NUMA system calls or Python: it turns a
 * policy file into plain data (dm_policy_t), and that data into a dispatch table
 * (dm_table_t) whose per-context views (dm_view_t) answer "which rule serves an
 * allocation of this size and dtype" in O(log rules).
 *
 * Thread safety: parsing and compiling are reentrant (no globals). A compiled
 * table and its views are immutable once returned and may be read by any number
 * of threads without synchronisation. dm_table_view_build() allocates; callers
 * cache its result (the runtime does, per table and context).
 */
#ifndef DM_POLICY_H
#define DM_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/diag.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DM_NAME_MAX 64          /* arena and rule names, incl. NUL */
#define DM_ARENAS_MAX 64        /* arenas in one policy */
#define DM_RULES_MAX 1024       /* rules in one policy */
#define DM_TAG_LIMITS_MAX 64    /* tag_limits entries in one policy */
#define DM_GLOBS_MAX 16         /* thread globs / tags in one rule */
#define DM_SITE_GLOBS_MAX 4     /* module / function globs in one rule */
#define DM_SITE_RULES_MAX 64    /* rules with a module or function part */
#define DM_NODES_MAX 64         /* NUMA nodes a policy can name (bitmask) */
#define DM_POLICY_FILE_MAX (1u << 20) /* policy files larger than 1 MiB are refused */

/* dtype codes: what the Python layer reports for the array being built. The
 * policy knows these only as names; the mapping from NumPy type numbers lives in
 * pyext/. DM_DT_UNKNOWN is a normal outcome: a rule with a dtype match never
 * matches an allocation whose dtype is unknown. */
#define DM_DTYPE_LIST(X)                                                       \
    X(UNKNOWN, "unknown", 0)                                                   \
    X(BOOL, "bool", 1)                                                         \
    X(INT8, "int8", 2)                                                         \
    X(INT16, "int16", 3)                                                       \
    X(INT32, "int32", 4)                                                       \
    X(INT64, "int64", 5)                                                       \
    X(UINT8, "uint8", 6)                                                       \
    X(UINT16, "uint16", 7)                                                     \
    X(UINT32, "uint32", 8)                                                     \
    X(UINT64, "uint64", 9)                                                     \
    X(FLOAT16, "float16", 10)                                                  \
    X(FLOAT32, "float32", 11)                                                  \
    X(FLOAT64, "float64", 12)                                                  \
    X(LONGDOUBLE, "longdouble", 13)                                            \
    X(COMPLEX64, "complex64", 14)                                              \
    X(COMPLEX128, "complex128", 15)                                            \
    X(CLONGDOUBLE, "clongdouble", 16)                                          \
    X(OBJECT, "object", 17)                                                    \
    X(BYTES, "bytes", 18)                                                      \
    X(STR, "str", 19)                                                          \
    X(VOID, "void", 20)                                                        \
    X(DATETIME, "datetime64", 21)                                              \
    X(TIMEDELTA, "timedelta64", 22)                                            \
    X(OTHER, "other", 23)

typedef enum {
#define DM_DT_ENUM(sym, name, num) DM_DT_##sym = num,
    DM_DTYPE_LIST(DM_DT_ENUM)
#undef DM_DT_ENUM
    DM_DT_COUNT
} dm_dtype_t;

#define DM_DT_SLOTS 32 /* power of two >= DM_DT_COUNT: the view's row width */

typedef uint32_t dm_dtype_mask_t; /* bit (1u << dm_dtype_t) */

/* Returns "float32" etc., or NULL for an out-of-range code. */
const char *dm_dtype_name(int dt);
/* The inverse: dtype code of "float32" etc., or -1. */
int dm_dtype_from_name(const char *name);

/* ---- value syntax (the parser's, exposed for tools and fuzzing) --------- */

/* Bytes: "4096", or a number and a unit, "64KiB", "8 MiB", "1GB", "1.5GiB"
 * (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; case matters; a fraction needs
 * a unit and must come to whole bytes). Returns 0, DM_EINVALID (syntax,
 * unknown unit, a fraction of a byte) or DM_ERANGE (does not fit a size_t). */
int dm_parse_size(const char *s, size_t *out);
/* worker_limit's value: a size (bytes set, *permille 0) or "N%" / "N.N%" of a
 * memory limit (*permille 1..1000, *bytes 0). "" gives both 0. */
int dm_parse_share(const char *s, uint64_t *bytes, unsigned *permille);

/* Milliseconds: "250", "250ms", "10s", "1.5s" (whole milliseconds only),
 * "never" or "-1" (-> -1). Returns 0, DM_EINVALID or DM_ERANGE. */
int dm_parse_duration_ms(const char *s, int64_t *out);

/* Whether `glob` is a well-formed fnmatch(3) pattern: not empty, every `[`
 * closed, no trailing backslash. On false, *off (if given) is the offending
 * byte and *why (if given) a static reason. */
bool dm_glob_valid(const char *glob, size_t *off, const char **why);

typedef enum {
    DM_THP_SYSTEM = 0, /* leave to the kernel's setting (default) */
    DM_THP_ON,         /* madvise(MADV_HUGEPAGE) on every extent */
    DM_THP_OFF,        /* madvise(MADV_NOHUGEPAGE) on every extent */
} dm_thp_t;

typedef enum {
    DM_PIN_NONE = 0,   /* ordinary pageable memory */
    DM_PIN_CUDA,       /* extents registered with cudaHostRegister */
} dm_pin_t;

typedef enum {
    DM_NUMA_NONE = 0,   /* no placement: the kernel's default (first touch) */
    DM_NUMA_LOCAL,      /* MPOL_LOCAL: the node of the CPU that first touches */
    DM_NUMA_BIND,       /* MPOL_BIND to `nodes` */
    DM_NUMA_INTERLEAVE, /* MPOL_INTERLEAVE over `nodes` (all = every node) */
    DM_NUMA_PREFERRED,  /* MPOL_PREFERRED: first node of `nodes` */
} dm_numa_mode_t;

/* `backing`: the arena's memory is a file on disk (spilling). */
typedef struct dm_backing_spec {
    char dir[256];          /* absolute directory path; "" = RAM (no backing) */
    size_t max;             /* bytes of disk the file may hold; SIZE_MAX = no bound */
    size_t resident_max;    /* file pages kept in memory at most; SIZE_MAX = the kernel's call */
    int line, col;          /* the `dir:` key's position, for diagnostics (0: none) */
} dm_backing_spec_t;

typedef struct dm_arena_spec {
    char name[DM_NAME_MAX];
    size_t alignment;       /* power of two, >= 16 */
    dm_thp_t hugepages;
    dm_numa_mode_t numa;
    uint64_t numa_nodes;    /* bit n = node n; for BIND/INTERLEAVE/PREFERRED */
    bool numa_all;          /* interleave: all (resolved by the runtime) */
    bool per_node;          /* one jemalloc arena per NUMA node */
    int64_t dirty_decay_ms; /* -1 = never purge */
    int64_t muzzy_decay_ms; /* -1 = never purge */
    size_t dirty_budget;    /* purge on growth above this; SIZE_MAX = never */
    size_t limit;           /* live bytes at most; SIZE_MAX = no limit */
    bool lock;              /* mlock extents */
    dm_pin_t pinned;        /* register extents with a GPU runtime */
    dm_backing_spec_t backing; /* file-backed (spill) arena when backing.dir[0] */
    int line, col;          /* where it was declared (1-based) */
} dm_arena_spec_t;

typedef struct dm_rule_spec {
    char name[DM_NAME_MAX];
    size_t size_min;        /* inclusive; 0 when absent */
    size_t size_max;        /* inclusive; SIZE_MAX when absent */
    dm_dtype_mask_t dtypes; /* 0 = any dtype (known or not) */
    int nthreads;           /* thread-name globs; 0 = any thread */
    char threads[DM_GLOBS_MAX][DM_NAME_MAX];
    int ntags;              /* tags, all must be set; 0 = any context */
    char tags[DM_GLOBS_MAX][DM_NAME_MAX];
    /* The call site (the innermost Python frame outside NumPy, pandas, SciPy,
     * scikit-learn and datamem): globs on its module's __name__ and on its
     * qualified function name "module.qualname"; any one of each list may
     * match; 0 = any site, known or not. */
    int nmodules;
    char modules[DM_SITE_GLOBS_MAX][DM_NAME_MAX];
    int nfunctions;
    char functions[DM_SITE_GLOBS_MAX][DM_NAME_MAX];
    int arena;              /* index into dm_policy_t.arenas */
    int line, col;
} dm_rule_spec_t;

typedef struct dm_tag_limit_spec {
    char tag[DM_NAME_MAX];  /* fnmatch(3) glob on tag names */
    size_t limit;           /* live bytes of one matching tag at most */
    int spill;              /* arena index serving what the limit refuses, or -1 */
    int line, col;
} dm_tag_limit_spec_t;

typedef struct dm_stats_spec {
    char http[128];         /* "host:port" or "" (off); port 0 = any free port */
    char unix_socket[256];  /* path or "" */
    char textfile[256];     /* node_exporter textfile path or "" */
    int64_t interval_ms;    /* textfile refresh */
} dm_stats_spec_t;

typedef struct dm_reload_spec {
    bool watch;             /* inotify on the policy's directory */
    int64_t debounce_ms;
    bool signal;            /* SIGHUP reloads (installed through Python) */
} dm_reload_spec_t;

typedef struct dm_policy {
    int version;
    int narenas;
    dm_arena_spec_t arenas[DM_ARENAS_MAX];
    int nrules;
    dm_rule_spec_t *rules;  /* nrules entries, owned */
    int default_arena;      /* index into arenas */
    int fallback_arena;     /* index, or -1: tried when an arena fails */
    bool tag_bytes;         /* count bytes per tag (also on with limits below) */
    int ntag_limits;
    dm_tag_limit_spec_t tag_limits[DM_TAG_LIMITS_MAX];
    char worker_limit[32];  /* "" (none), a size, or "N%" of the memory limit
                               (dm_parse_share) */
    int worker_spill;       /* arena index serving what worker_limit refuses, or -1 */
    dm_stats_spec_t stats;
    dm_reload_spec_t reload;
    uint64_t hash;          /* FNV-1a 64 of the file's bytes */
    char path[256];
} dm_policy_t;

/* Topology the validator checks NUMA node numbers against. The runtime passes
 * the machine's; tests pass anything. NULL means "do not check nodes". */
typedef struct dm_topology {
    uint64_t nodes; /* bit n set = node n exists */
} dm_topology_t;

/* Parses and validates. On success returns 0 and *out (free with
 * dm_policy_free). On failure returns a negative dm error code, *out = NULL, and
 * `diags` holds every error found (and warnings either way). `fname` is used in
 * messages only. */
int dm_policy_parse(const char *buf, size_t len, const char *fname,
                    const dm_topology_t *topo, dm_policy_t **out,
                    dm_diags_t *diags);

/* Flags of the _ex variants. DM_PARSE_LINT adds advice for a policy's author
 * that a running job need not repeat at every start: warnings that are
 * usually right but can be wrong for a given job (a thread glob 'etl-*' next
 * to pools that name their threads etl_0, ...). `check` and `explain` ask
 * for it; start-up and reload do not. */
#define DM_PARSE_LINT 1u

int dm_policy_parse_ex(const char *buf, size_t len, const char *fname,
                       const dm_topology_t *topo, unsigned flags,
                       dm_policy_t **out, dm_diags_t *diags);

/* Opens a policy file for reading (O_CLOEXEC, blocking reads) under the
 * rule of trust.c: the file and every directory on its resolved path owned by
 * this user or root and writable by no one else; symbolic links are followed
 * from such directories only. Never blocks in open: a FIFO, directory, device
 * or socket is refused. Returns the descriptor, or -1 with errno set (EACCES
 * when the rule refuses it) and one line in `why` saying what is wrong and
 * how to fix it (a diagnostic's message: no file name in front). */
int dm_policy_open(const char *path, char *why, size_t cap);

/* Reads a file (refusing more than DM_POLICY_FILE_MAX bytes, anything but a
 * regular file and what the rule refuses, see dm_policy_open) and parses it.
 * DM_EUNSAFE when the rule refuses it. */
int dm_policy_load(const char *path, const dm_topology_t *topo,
                   dm_policy_t **out, dm_diags_t *diags);
int dm_policy_load_ex(const char *path, const dm_topology_t *topo,
                      unsigned flags, dm_policy_t **out, dm_diags_t *diags);

void dm_policy_free(dm_policy_t *p);

/* The policy's content hash (FNV-1a 64 of the file's bytes), as in
 * dm_policy_t.hash: the reload watcher compares it to skip no-op writes. */
uint64_t dm_policy_hash(const char *buf, size_t len);

/* ---- compiled dispatch ------------------------------------------------ */

/* A context: what is constant for a stretch of code on one thread. */
typedef struct dm_context {
    const char *thread;      /* thread name, "" if unknown */
    const char *const *tags; /* tags set with datamem.tag(), any order */
    int ntags;
    const char *module;      /* call site (explain only); NULL: unknown */
    const char *function;    /* "module.qualname"; NULL: unknown */
} dm_context_t;

/* A view is the table specialised to one context: rules whose thread/tag parts
 * do not match are gone, leaving a lookup on (size, dtype) only.
 *   i = number of bounds <= size - 1 ... see dm_view_lookup
 * Layout: `nbounds` sorted interval starts (bounds[0] == 0); row i covers
 * [bounds[i], bounds[i+1]) and holds DM_DT_SLOTS rule slots (or 1 when the
 * policy has no dtype rule: dt_mask == 0). A slot is a rule index; nrules
 * means "the default arena". */
typedef struct dm_view {
    uint64_t site_ok;        /* site rules (by site bit) whose thread/tag parts match */
    uint32_t nbounds;
    uint32_t dt_mask;        /* DM_DT_SLOTS - 1, or 0 when no rule uses dtype */
    uint32_t row_width;      /* DM_DT_SLOTS or 1 */
    const size_t *bounds;
    const uint16_t *slots;   /* nbounds * row_width */
} dm_view_t;

typedef struct dm_table dm_table_t;

/* Compiles a validated policy. The table copies what it needs: `p` may be freed
 * afterwards. Returns 0 or a negative code (out of memory). */
int dm_table_compile(const dm_policy_t *p, dm_table_t **out);
void dm_table_free(dm_table_t *t);

int dm_table_nrules(const dm_table_t *t);
bool dm_table_uses_dtype(const dm_table_t *t);
bool dm_table_uses_context(const dm_table_t *t);
/* Rule index -> arena index (rule == nrules gives the default arena). */
int dm_table_rule_arena(const dm_table_t *t, int rule);

/* Bitmask key of the context-dependent rules that match `ctx`; views with the
 * same key are identical. `key` has dm_table_ctx_key_words(t) words. */
int dm_table_ctx_key_words(const dm_table_t *t);
void dm_table_ctx_key(const dm_table_t *t, const dm_context_t *ctx,
                      uint64_t *key);

/* Call-site rules (match.module / match.function) are not in views: a view
 * lookup ignores them. An allocation whose call site is known brings a site
 * mask (dm_table_site_mask: bit b = site rule b's globs match the site, cached
 * per code object by the caller), and dm_table_site_pick lets the first such
 * rule that precedes the view's answer and matches size and dtype win. */
bool dm_table_uses_site(const dm_table_t *t);
uint64_t dm_table_site_mask(const dm_table_t *t, const char *module, const char *function);
int dm_table_site_pick(const dm_table_t *t, const dm_view_t *v, uint64_t mask, size_t size,
                       int dt, int rule);

/* Builds the view for a context key (malloc'ed; free with dm_view_free).
 * key == NULL means no context rule matches. Returns NULL when out of memory. */
dm_view_t *dm_table_view_build(const dm_table_t *t, const uint64_t *key);
void dm_view_free(dm_view_t *v);

/* Names for tools and messages: rule == nrules and out-of-range give NULL. */
const char *dm_table_rule_name(const dm_table_t *t, int rule);
int dm_table_narenas(const dm_table_t *t);
const char *dm_table_arena_name(const dm_table_t *t, int arena);
/* The policy the table was compiled from (the table's own copy). */
const dm_policy_t *dm_table_policy(const dm_table_t *t);

/* Why an allocation goes where it goes: one line per earlier rule saying why
 * it did not match, then "-> rule 'x' -> arena 'y'" or "-> default arena 'y'".
 * ctx may be NULL (no thread name, no tags). Returns the rule index (nrules
 * for the default); buf gets as much as fits (NUL-terminated if cap > 0). */
int dm_table_explain(const dm_table_t *t, const dm_context_t *ctx, size_t size,
                     int dtype, char *buf, size_t cap);

/* Prints arenas, rules and the intervals of the no-context view. Returns the
 * length of the whole text (snprintf semantics). */
int dm_table_dump(const dm_table_t *t, char *buf, size_t cap);

/* The interval (row) of `size`: the last bound <= size. Two sizes in the same
 * interval get the same rule for every dtype. */
static inline uint32_t dm_view_interval(const dm_view_t *v, size_t size) {
    const size_t *b = v->bounds;
    uint32_t n = v->nbounds, lo = 0;
    while (n > 1) { /* branch-light binary search */
        uint32_t half = n / 2;
        lo = (b[lo + half] <= size) ? lo + half : lo;
        n -= half;
    }
    return lo;
}

/* The fast path: which rule serves (size, dtype) in this view. O(log bounds),
 * no allocation, no locks. */
static inline int dm_view_lookup(const dm_view_t *v, size_t size, int dt) {
    uint32_t row = dm_view_interval(v, size);
    return v->slots[row * v->row_width + ((uint32_t)dt & v->dt_mask)];
}

#ifdef __cplusplus
}
#endif
#endif /* DM_POLICY_H */
