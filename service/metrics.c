/*
 * metrics.c: a dm_stats_t as Prometheus text exposition (format 0.0.4) and as
 * JSON, from one table of per-arena numbers.
 *
 * Names follow Prometheus' conventions (notes/jemalloc.md): base units, `_bytes`
 * for sizes, `_total` for counters, the arena as a label, settings in an info
 * metric (`datamem_arena_info{...} 1`), reloads as Prometheus reports its own
 * (`datamem_config_last_reload_successful`). The JSON carries the same numbers
 * under the keys datamem.stats() uses, so `/stats.json` and the Python dict have
 * one shape.
 *
 * The text buffer is buf.c's; what a fresh snapshot adds (hugepages, the
 * service's own numbers) is gathered by render.c and svc_stats.c.
 *
 * Thread safety: pure functions of their arguments.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "service/buf.h"
#include "service/metrics.h"

/* ---- names of settings ----------------------------------------------------- */

static const char *thp_name(int m) {
    static const char *const names[] = {"system", "on", "off"};
    return m >= 0 && m < 3 ? names[m] : "?";
}

static const char *numa_name(int m) {
    static const char *const names[] = {"none", "local", "bind", "interleave", "preferred"};
    return m >= 0 && m < 5 ? names[m] : "?";
}

/* "0,1,3": the nodes of a bit mask. */
static void nodes_text(uint64_t nodes, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; i < 64 && n + 4 < cap; i++)
        if (nodes & (UINT64_C(1) << i))
            n += (size_t)snprintf(buf + n, cap - n, "%s%d", n ? "," : "", i);
}

/* ---- the per-arena table ---------------------------------------------------- */

/* Every uint64_t number of dm_arena_stats_t: metric name (after
 * "datamem_arena_"), type, JSON key (datamem.stats()), help. */
typedef struct arena_metric {
    const char *name;
    const char *type;
    const char *key;
    size_t off;
    const char *help;
} arena_metric_t;

#define AM(name, type, key, field, help) {name, type, key, offsetof(dm_arena_stats_t, field), help}

static const arena_metric_t arena_metrics[] = {
    AM("allocated_bytes", "gauge", "allocated_bytes", allocated,
       "Bytes in live allocations (jemalloc small + large allocated)."),
    AM("active_bytes", "gauge", "active_bytes", active,
       "Bytes in pages holding live allocations (jemalloc pactive)."),
    AM("resident_bytes", "gauge", "resident_bytes", resident,
       "Bytes jemalloc maps for the arena that are resident in memory."),
    AM("mapped_bytes", "gauge", "mapped_bytes", mapped,
       "Bytes in extents jemalloc has mapped for the arena."),
    AM("retained_bytes", "gauge", "retained_bytes", retained,
       "Bytes of address space retained for reuse instead of unmapped."),
    AM("dirty_bytes", "gauge", "dirty_bytes", dirty,
       "Bytes in freed pages not yet purged (decay returns them)."),
    AM("muzzy_bytes", "gauge", "muzzy_bytes", muzzy,
       "Bytes in pages purged lazily (MADV_FREE) and not yet reclaimed."),
    AM("reserved_bytes", "gauge", "reserved_bytes", reserved,
       "Address space reserved for the arena's extents."),
    AM("hugepage_bytes", "gauge", "hugepage_bytes", hugepage_bytes,
       "Bytes backed by transparent hugepages in the arena's address ranges."),
    AM("allocations_total", "counter", "allocations", counts.nalloc,
       "Allocations the arena served (datamem's counter)."),
    AM("frees_total", "counter", "frees", counts.nfree,
       "Frees of blocks the arena owns."),
    AM("reallocs_total", "counter", "reallocs", counts.nrealloc,
       "Reallocations served by the arena."),
    AM("failures_total", "counter", "failures", counts.nfail,
       "Allocations the arena could not serve."),
    AM("fallbacks_total", "counter", "fallbacks", counts.nfallback,
       "Allocations served as the fallback arena after another arena failed."),
    AM("dtype_known_allocations_total", "counter", "dtype_known", counts.ndtype_known,
       "Allocations whose dtype was known."),
    AM("requested_bytes_total", "counter", "bytes_requested", counts.bytes_requested,
       "Sum of the sizes asked for."),
    AM("placement_errors_total", "counter", "placement_errors", nplacement_errors,
       "Failed mbind/madvise calls on new extents."),
    AM("growth_purges_total", "counter", "growth_purges", ngrowth_purges,
       "Times the arena purged its dirty pages as it grew past decay.budget."),
    AM("reuse_bytes", "gauge", "reuse_bytes", reuse_bytes,
       "Freed blocks of 4 MiB or more kept for the next allocations: the bytes they have not lent to newer blocks."),
    AM("lent_bytes_total", "counter", "lent_bytes", lent_bytes,
       "Bytes of resident pages kept blocks lent to new blocks (moved, so not zeroed again)."),
    AM("jemalloc_allocations_total", "counter", "jemalloc_allocations", je_nmalloc,
       "Allocations jemalloc made in the arena (small + large nmalloc)."),
    AM("jemalloc_frees_total", "counter", "jemalloc_frees", je_ndalloc,
       "Frees jemalloc made in the arena (small + large ndalloc)."),
    AM("limit_hits_total", "counter", "limit_hits", counts.nlimit,
       "Allocations the arena's limit refused."),
    AM("live_bytes", "gauge", "live_bytes", live,
       "Bytes of live blocks counted against the limit (0 for an arena that never had one)."),
    AM("locked_bytes", "gauge", "locked_bytes", locked_bytes,
       "Bytes page-locked (mlock) for the arena's `lock: true`."),
    AM("pinned_bytes", "gauge", "pinned_bytes", pinned_bytes,
       "Bytes registered with the CUDA runtime for the arena's `pinned: cuda`."),
    AM("backing_reserved_bytes", "gauge", "backing_reserved_bytes", backing_reserved_bytes,
       "Disk blocks a file-backed arena reserved for its memory (fallocate)."),
    AM("backing_disk_bytes", "gauge", "backing_disk_bytes", backing_disk_bytes,
       "Bytes a file-backed arena's file holds on disk (st_blocks): its spilled bytes."),
    AM("backing_resident_bytes", "gauge", "backing_resident_bytes", backing_resident_bytes,
       "Bytes of a file-backed arena's reserved pages in memory (page cache)."),
    AM("backing_paged_out_bytes_total", "counter", "backing_paged_out_bytes",
       backing_paged_out_bytes, "Bytes paged out to keep a file-backed arena under resident_max."),
    AM("backing_full_total", "counter", "backing_full", backing_full,
       "Reservations a file-backed arena refused: backing.max reached or the disk full."),
    AM("backing_fork_copies_total", "counter", "backing_fork_copies", backing_fork_copies,
       "Fork children given their own copy of a file-backed arena's file."),
    AM("backing_fork_failures_total", "counter", "backing_fork_failures", backing_fork_failures,
       "Fork children left with a copy-on-write view of the parent's file instead."),
};

#define NARENA_METRICS (sizeof(arena_metrics) / sizeof(arena_metrics[0]))

/* The uint64_t at byte offset `off` of a stats struct (a metric row's field). */
static uint64_t field_u64(const void *stats, size_t off) {
    uint64_t v;
    memcpy(&v, (const char *)stats + off, sizeof(v));
    return v;
}

/* Per-rule counters: one row each, for both the Prometheus and the JSON form. */
typedef struct rule_metric {
    const char *name; /* datamem_rule_<name> */
    const char *key;  /* JSON / datamem.stats() key */
    size_t off;
    const char *help;
} rule_metric_t;

#define RM(name, key, field, help) {name, key, offsetof(dm_rule_stats_t, field), help}

static const rule_metric_t rule_metrics[] = {
    RM("allocations_total", "allocations", counts.nalloc,
       "Allocations each rule routed (\"default\": no rule matched)."),
    RM("requested_bytes_total", "bytes_requested", counts.bytes_requested,
       "Sum of the sizes each rule routed."),
    RM("reallocs_total", "reallocs", counts.nrealloc, "Reallocations each rule routed."),
    RM("failures_total", "failures", counts.nfail, "Allocations routed by the rule that failed."),
    RM("fallbacks_total", "fallbacks", counts.nfallback,
       "Failed allocations of the rule served by the fallback arena."),
    RM("dtype_known_allocations_total", "dtype_known", counts.ndtype_known,
       "Allocations of the rule whose dtype was known."),
    RM("limit_hits_total", "limit_hits", counts.nlimit,
       "Allocations of the rule refused by an arena's limit."),
};

#define NRULE_METRICS (sizeof(rule_metrics) / sizeof(rule_metrics[0]))

/* ---- Prometheus text -------------------------------------------------------- */

typedef struct sample {
    dm_buf_t *b;
    int nlabels;
} sample_t;

static sample_t sample_begin(dm_buf_t *b, const char *prefix, const char *name) {
    dm__buf_puts(b, prefix);
    dm__buf_puts(b, name);
    return (sample_t){b, 0};
}

static void label(sample_t *s, const char *key, const char *value) {
    dm__buf_puts(s->b, s->nlabels++ ? "," : "{");
    dm__buf_puts(s->b, key);
    dm__buf_puts(s->b, "=\"");
    dm__buf_text(s->b, value, strlen(value), DM_TEXT_LABEL);
    dm__buf_puts(s->b, "\"");
}

static void labels_close(sample_t *s, const char *const_labels) {
    if (const_labels && *const_labels) {
        dm__buf_puts(s->b, s->nlabels++ ? "," : "{");
        dm__buf_puts(s->b, const_labels);
    }
    if (s->nlabels)
        dm__buf_puts(s->b, "}");
}

static void value_u64(sample_t *s, const char *cl, uint64_t v) {
    labels_close(s, cl);
    dm__buf_printf(s->b, " %llu\n", (unsigned long long)v);
}

static void value_f64(sample_t *s, const char *cl, double v) {
    labels_close(s, cl);
    dm__buf_printf(s->b, " %.3f\n", v);
}

/* # HELP and # TYPE for a family (HELP text needs no escaping: ours has no
 * backslash or newline). */
static void family(dm_buf_t *b, const char *prefix, const char *name, const char *type,
                   const char *help) {
    dm__buf_printf(b, "# HELP %s%s %s\n# TYPE %s%s %s\n", prefix, name, help, prefix, name, type);
}

static void process_u64(dm_buf_t *b, const char *cl, const char *name, const char *type,
                        const char *help, uint64_t v) {
    family(b, "datamem_", name, type, help);
    sample_t s = sample_begin(b, "datamem_", name);
    value_u64(&s, cl, v);
}

/* ---- bytes per tag ----------------------------------------------------------
 * Tags can be many (one per Dask key prefix): the text and JSON show the
 * biggest by live bytes (the snapshot comes sorted) and fold the rest into one
 * row "(other)": live and refusals summed, peak the largest of theirs. */
#define TAGS_TEXT_MAX 20

/* The rows shown: the first `max` by live bytes (the snapshot's order) but
 * the runtime's own "(other)" (names that found no row in its table: tally.c),
 * as indexes into `idx`; the rest fold into `*o`, with that row. Returns how
 * many are shown; *o is named "(other)" and `*folded` says whether any row
 * went into it. */
/* The tags shown on their own are the first `max` but the runtime's own
 * "(other)"; the rest fold into one "(other)" row, `o` (other_init makes it
 * empty). tag_fold: whether t folds into o (then *folded), else it is shown and
 * counted in *shown. */
static void other_init(dm_tag_stats_t *o, bool *folded) {
    memset(o, 0, sizeof(*o));
    snprintf(o->name, sizeof(o->name), "(other)");
    o->limit = UINT64_MAX;
    *folded = false;
}

static bool tag_fold(const dm_tag_stats_t *t, int max, int *shown, dm_tag_stats_t *o,
                     bool *folded) {
    if (*shown < max && strcmp(t->name, "(other)") != 0) {
        (*shown)++;
        return false;
    }
    *folded = true;
    o->live += t->live;
    o->refused += t->refused;
    if (t->peak > o->peak)
        o->peak = t->peak;
    return true;
}

/* The indices of the tags shown (at most `max`) and the folded row. */
static int tags_pick(const dm_stats_t *st, int max, int *idx, dm_tag_stats_t *o, bool *folded) {
    other_init(o, folded);
    int shown = 0;
    for (int i = 0; i < st->ntags; i++) {
        int at = shown;
        if (!tag_fold(&st->tags[i], max, &shown, o, folded))
            idx[at] = i;
    }
    return shown;
}

typedef struct tag_metric {
    const char *name, *type, *help;
    size_t off;
} tag_metric_t;

static const tag_metric_t tag_metrics[] = {
    {"live_bytes", "gauge", "Live bytes (usable sizes) of the arrays made under the tag.",
     offsetof(dm_tag_stats_t, live)},
    {"peak_bytes", "gauge", "Most live bytes the tag has held.", offsetof(dm_tag_stats_t, peak)},
    {"refusals_total", "counter", "Allocations the tag's limit refused.",
     offsetof(dm_tag_stats_t, refused)},
};

static void tags_text(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    if (!st->tally_on)
        return;
    process_u64(b, cl, "counted_live_bytes", "gauge",
                "Live bytes of every counted array (tag_bytes): what worker_limit caps.",
                st->tally_live);
    process_u64(b, cl, "counted_peak_bytes", "gauge", "Most counted live bytes so far.",
                st->tally_peak);
    process_u64(b, cl, "worker_limit_refusals_total", "counter",
                "Allocations the worker limit said no to (those worker_spill then served "
                "included).", st->worker_refused);
    process_u64(b, cl, "worker_limit_spills_total", "counter",
                "Allocations the worker limit said no to that worker_spill served instead.",
                st->worker_spilled);
    if (st->worker_limit != UINT64_MAX) {
        process_u64(b, cl, "worker_limit_bytes", "gauge",
                    "worker_limit: the most counted live bytes plus the bytes beside them.",
                    st->worker_limit);
        process_u64(b, cl, "worker_beside_bytes", "gauge",
                    "Resident anonymous bytes beside the counted arrays (malloc, Arrow, "
                    "Python objects; with a share of a cgroup's limit, the cgroup's other "
                    "processes too), as the worker limit last read them: they count "
                    "against it.", st->worker_beside);
    }
    process_u64(b, cl, "tag_names_overflowed_total", "counter",
                "Tag names counted under tag=\"(other)\" because every row of the "
                "process's tag table held bytes or a tag set.", st->tags_overflowed);
    process_u64(b, cl, "tag_limits_unenforced", "gauge",
                "Tags with a tag_limits limit counted under tag=\"(other)\" in a held tag "
                "set now: their limit is not applied (stats.json tag_bytes.unenforced_tags "
                "names them).", st->tags_unenforced);
    int idx[TAGS_TEXT_MAX];
    dm_tag_stats_t other;
    bool folded;
    int shown = tags_pick(st, TAGS_TEXT_MAX, idx, &other, &folded);
    for (size_t m = 0; m < sizeof(tag_metrics) / sizeof(tag_metrics[0]); m++) {
        const tag_metric_t *tm = &tag_metrics[m];
        family(b, "datamem_tag_", tm->name, tm->type, tm->help);
        for (int i = 0; i < shown + folded; i++) {
            const dm_tag_stats_t *t = i < shown ? &st->tags[idx[i]] : &other;
            sample_t s = sample_begin(b, "datamem_tag_", tm->name);
            label(&s, "tag", t->name);
            value_u64(&s, cl, field_u64(t, tm->off));
        }
    }
    family(b, "datamem_", "tag_limit_bytes", "gauge",
           "The tag's limit (tag_limits); tags without one have no sample.");
    for (int i = 0; i < shown; i++) {
        const dm_tag_stats_t *t = &st->tags[idx[i]];
        if (t->limit == UINT64_MAX)
            continue;
        sample_t s = sample_begin(b, "datamem_", "tag_limit_bytes");
        label(&s, "tag", t->name);
        value_u64(&s, cl, t->limit);
    }
}

/* The process's families: build, policy, reloads, frees, caches, threads. */
static void text_process(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    char hash[17];
    snprintf(hash, sizeof(hash), "%016llx", (unsigned long long)st->policy_hash);

    family(b, "datamem_", "build_info", "gauge", "datamem's version; always 1.");
    sample_t s = sample_begin(b, "datamem_", "build_info");
    label(&s, "version", DM_VERSION_STRING);
    value_u64(&s, cl, 1);

    if (st->policy_path[0] || st->policy_hash) {
        family(b, "datamem_", "policy_info", "gauge",
               "The policy in force: its path and a hash of its bytes; always 1.");
        s = sample_begin(b, "datamem_", "policy_info");
        label(&s, "path", st->policy_path);
        label(&s, "hash", hash);
        value_u64(&s, cl, 1);
    }

    process_u64(b, cl, "config_last_reload_successful", "gauge",
                "Whether the last attempt to load a policy succeeded.",
                !st->last_reload_failed);
    family(b, "datamem_", "config_last_reload_success_timestamp_seconds", "gauge",
           "When a policy was last loaded successfully (Unix time).");
    s = sample_begin(b, "datamem_", "config_last_reload_success_timestamp_seconds");
    value_f64(&s, cl, st->last_reload_time);
    process_u64(b, cl, "reloads_total", "counter",
                "Policies loaded successfully, the first included.", st->reloads);
    process_u64(b, cl, "reload_failures_total", "counter",
                "Policy loads that failed (the last good policy stayed in force).",
                st->reload_failures);
    process_u64(b, cl, "foreign_frees_total", "counter",
                "Frees of blocks datamem does not own (made by another allocator).",
                st->foreign_frees);
    process_u64(b, cl, "thread_cache_bytes", "gauge",
                "Freed blocks held in threads' block caches, for reuse by the same thread.",
                st->cached_bytes);
    process_u64(b, cl, "lend_frames", "gauge",
                "2 MiB frames holding pages kept blocks lent, each possibly a mapping of its own.",
                (uint64_t)st->lend_frames);
    process_u64(b, cl, "lend_frames_max", "gauge",
                "The cap on lend_frames: at it, blocks fault their pages in instead.",
                (uint64_t)st->lend_frames_max);
    process_u64(b, cl, "lend_capped_total", "counter",
                "Frame moves not made because lend_frames was at its cap.", st->lend_capped);
    process_u64(b, cl, "threads", "gauge",
                "Live threads that have allocated through datamem.", (uint64_t)st->nthreads);
    process_u64(b, cl, "contexts", "gauge", "Distinct tag sets seen.", (uint64_t)st->ncontexts);
}

/* What each arena is: its settings as labels, whether the policy names it,
 * how many jemalloc arenas it has. */
static void text_arena_settings(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    family(b, "datamem_", "arena_info", "gauge",
           "An arena's settings as labels; always 1.");
    for (int i = 0; i < st->narenas; i++) {
        const dm_arena_stats_t *a = &st->arenas[i];
        char align[24], nodes[200];
        snprintf(align, sizeof(align), "%zu", a->alignment);
        nodes_text(a->numa_nodes, nodes, sizeof(nodes));
        sample_t s = sample_begin(b, "datamem_", "arena_info");
        label(&s, "arena", a->name);
        label(&s, "alignment", align);
        label(&s, "hugepages", thp_name(a->hugepages));
        label(&s, "numa", numa_name(a->numa));
        label(&s, "nodes", nodes);
        label(&s, "per_node", a->per_node ? "true" : "false");
        value_u64(&s, cl, 1);
    }
    family(b, "datamem_", "arena_in_policy", "gauge",
           "1 if the policy in force names the arena (arenas live for the process).");
    for (int i = 0; i < st->narenas; i++) {
        sample_t s = sample_begin(b, "datamem_", "arena_in_policy");
        label(&s, "arena", st->arenas[i].name);
        value_u64(&s, cl, st->arenas[i].in_policy);
    }
    family(b, "datamem_", "arena_jemalloc_arenas", "gauge",
           "jemalloc arenas behind the arena (one per NUMA node with per_node; at "
           "hugepages: system each has a second for blocks of 4 MiB and more).");
    for (int i = 0; i < st->narenas; i++) {
        sample_t s = sample_begin(b, "datamem_", "arena_jemalloc_arenas");
        label(&s, "arena", st->arenas[i].name);
        value_u64(&s, cl, (uint64_t)st->arenas[i].njemalloc);
    }
}

/* The per-arena table, then the limits. */
static void text_arena_numbers(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    for (size_t m = 0; m < NARENA_METRICS; m++) {
        const arena_metric_t *am = &arena_metrics[m];
        family(b, "datamem_arena_", am->name, am->type, am->help);
        for (int i = 0; i < st->narenas; i++) {
            sample_t s = sample_begin(b, "datamem_arena_", am->name);
            label(&s, "arena", st->arenas[i].name);
            value_u64(&s, cl, field_u64(&st->arenas[i], am->off));
        }
    }

    /* Only arenas with a limit have a sample: "no limit" is no number. */
    family(b, "datamem_", "arena_limit_bytes", "gauge",
           "The arena's `limit`: live bytes it may hold (arenas without one have no sample).");
    for (int i = 0; i < st->narenas; i++) {
        if (st->arenas[i].limit == UINT64_MAX)
            continue;
        sample_t s = sample_begin(b, "datamem_", "arena_limit_bytes");
        label(&s, "arena", st->arenas[i].name);
        value_u64(&s, cl, st->arenas[i].limit);
    }
}

static void text_rules(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    for (size_t m = 0; m < NRULE_METRICS; m++) {
        const rule_metric_t *rm = &rule_metrics[m];
        family(b, "datamem_rule_", rm->name, "counter", rm->help);
        for (int r = 0; st->rules && r < st->nrules; r++) {
            sample_t s = sample_begin(b, "datamem_rule_", rm->name);
            label(&s, "rule", st->rules[r].name);
            label(&s, "arena", st->rules[r].arena);
            value_u64(&s, cl, field_u64(&st->rules[r], rm->off));
        }
    }
}

void dm__metrics_text(const dm_stats_t *st, const char *cl, dm_buf_t *b) {
    text_process(st, cl, b);
    text_arena_settings(st, cl, b);
    text_arena_numbers(st, cl, b);
    text_rules(st, cl, b);
    tags_text(st, cl, b);
}

/* ---- JSON ------------------------------------------------------------------------ */

static void json_key(dm_buf_t *b, int *n, const char *key) {
    if ((*n)++)
        dm__buf_put(b, ",", 1);
    dm__buf_json_str(b, key);
    dm__buf_put(b, ":", 1);
}

static void json_u64(dm_buf_t *b, int *n, const char *key, uint64_t v) {
    json_key(b, n, key);
    dm__buf_printf(b, "%llu", (unsigned long long)v);
}

static void json_bool(dm_buf_t *b, int *n, const char *key, bool v) {
    json_key(b, n, key);
    dm__buf_puts(b, v ? "true" : "false");
}

static void json_strv(dm_buf_t *b, int *n, const char *key, const char *v) {
    json_key(b, n, key);
    dm__buf_json_str(b, v);
}

static void metrics_http_json(const dm_http_counters_t *c, dm_buf_t *b);
static void metrics_process_json(const dm_process_stats_t *p, dm_buf_t *b, int *n);
static void metrics_process_text(const dm_process_stats_t *p, const char *cl, dm_buf_t *b);

static void json_limit(dm_buf_t *b, int *n, const char *key, uint64_t v) {
    json_key(b, n, key);
    if (v == UINT64_MAX)
        dm__buf_puts(b, "null");
    else
        dm__buf_printf(b, "%llu", (unsigned long long)v);
}

/* One tag's row of "tags", the i-th. */
static void tag_json(dm_buf_t *b, const dm_tag_stats_t *t, int i) {
    int k = 0;
    if (i)
        dm__buf_put(b, ",", 1);
    dm__buf_json_str(b, t->name);
    dm__buf_put(b, ":{", 2);
    json_u64(b, &k, "live", t->live);
    json_u64(b, &k, "peak", t->peak);
    json_limit(b, &k, "limit", t->limit);
    json_u64(b, &k, "refused", t->refused);
    dm__buf_put(b, "}", 1);
}

static void tags_json(const dm_stats_t *st, int tags_max, int *n, dm_buf_t *b) {
    json_key(b, n, "tag_bytes");
    int k = 0;
    dm__buf_put(b, "{", 1);
    json_bool(b, &k, "on", st->tally_on);
    json_u64(b, &k, "live", st->tally_live);
    json_u64(b, &k, "peak", st->tally_peak);
    json_limit(b, &k, "worker_limit", st->worker_limit);
    json_strv(b, &k, "worker_limit_source", st->worker_limit_source);
    json_u64(b, &k, "worker_refused", st->worker_refused);
    json_u64(b, &k, "worker_spilled", st->worker_spilled);
    json_u64(b, &k, "worker_beside", st->worker_beside);
    json_u64(b, &k, "ntags", (uint64_t)st->ntags);
    json_u64(b, &k, "overflowed", st->tags_overflowed);
    json_u64(b, &k, "unenforced", st->tags_unenforced);
    json_key(b, &k, "unenforced_tags");
    dm__buf_put(b, "[", 1);
    for (int i = 0; i < st->nunenforced; i++) {
        if (i)
            dm__buf_put(b, ",", 1);
        dm__buf_json_str(b, st->unenforced[i]);
    }
    dm__buf_put(b, "]", 1);
    dm__buf_put(b, "}", 1);
    /* "tags": {name: {live, peak, limit, refused}}, biggest live first (the
     * object keeps the order): the first `tags_max` but the runtime's own
     * "(other)", the rest folded into "(other)" (tag_fold, as the text's) */
    json_key(b, n, "tags");
    dm__buf_put(b, "{", 1);
    dm_tag_stats_t other;
    bool folded;
    other_init(&other, &folded);
    int shown = 0;
    for (int i = 0; i < st->ntags; i++) {
        int at = shown;
        if (!tag_fold(&st->tags[i], tags_max, &shown, &other, &folded))
            tag_json(b, &st->tags[i], at);
    }
    if (folded)
        tag_json(b, &other, shown);
    dm__buf_put(b, "}", 1);
}

/* The process's keys: version, pid, time, policy, reloads, caches, threads. */
static void json_process(const dm_stats_t *st, int *n, dm_buf_t *b) {
    char hash[17];
    snprintf(hash, sizeof(hash), "%016llx", (unsigned long long)st->policy_hash);
    json_strv(b, n, "version", DM_VERSION_STRING);
    json_u64(b, n, "pid", (uint64_t)getpid());
    json_key(b, n, "time");
    dm__buf_printf(b, "%.6f", st->snapshot_time);
    json_strv(b, n, "policy_path", st->policy_path);
    json_strv(b, n, "policy_hash", hash);
    json_u64(b, n, "reloads", st->reloads);
    json_u64(b, n, "reload_failures", st->reload_failures);
    json_bool(b, n, "last_reload_successful", !st->last_reload_failed);
    json_key(b, n, "last_reload_time");
    dm__buf_printf(b, "%.6f", st->last_reload_time);
    json_u64(b, n, "foreign_frees", st->foreign_frees);
    json_u64(b, n, "thread_cache_bytes", st->cached_bytes);
    json_u64(b, n, "lend_frames", (uint64_t)st->lend_frames);
    json_u64(b, n, "lend_frames_max", (uint64_t)st->lend_frames_max);
    json_u64(b, n, "lend_capped", st->lend_capped);
    json_u64(b, n, "threads", (uint64_t)st->nthreads);
    json_u64(b, n, "contexts", (uint64_t)st->ncontexts);
    json_u64(b, n, "tables_live", (uint64_t)st->tables_live);
}

/* One arena's object: its settings, then the per-arena table. */
static void json_arena(const dm_arena_stats_t *a, dm_buf_t *b) {
    int k = 0;
    dm__buf_json_str(b, a->name);
    dm__buf_put(b, ":{", 2);
    json_bool(b, &k, "in_policy", a->in_policy);
    json_u64(b, &k, "alignment", a->alignment);
    json_strv(b, &k, "hugepages", thp_name(a->hugepages));
    json_strv(b, &k, "numa", numa_name(a->numa));
    json_key(b, &k, "numa_nodes");
    dm__buf_put(b, "[", 1);
    for (int node = 0, first = 1; node < 64; node++)
        if (a->numa_nodes & (UINT64_C(1) << node)) {
            dm__buf_printf(b, first ? "%d" : ",%d", node);
            first = 0;
        }
    dm__buf_put(b, "]", 1);
    json_bool(b, &k, "per_node", a->per_node);
    json_u64(b, &k, "jemalloc_arenas", (uint64_t)a->njemalloc);
    json_limit(b, &k, "limit_bytes", a->limit);
    json_key(b, &k, "decay_dirty_ms"); /* -1: never */
    dm__buf_printf(b, "%lld", (long long)a->dirty_decay_ms);
    json_key(b, &k, "decay_muzzy_ms");
    dm__buf_printf(b, "%lld", (long long)a->muzzy_decay_ms);
    json_bool(b, &k, "lock", a->lock);
    json_strv(b, &k, "pinned", a->pinned ? "cuda" : "none");
    json_bool(b, &k, "backed", a->backed);
    json_limit(b, &k, "backing_max", a->backed ? a->backing_max : UINT64_MAX);
    json_limit(b, &k, "backing_resident_max", a->backed ? a->backing_resident_max : UINT64_MAX);
    for (size_t m = 0; m < NARENA_METRICS; m++)
        json_u64(b, &k, arena_metrics[m].key, field_u64(a, arena_metrics[m].off));
    dm__buf_put(b, "}", 1);
}

static void json_arenas(const dm_stats_t *st, int *n, dm_buf_t *b) {
    json_key(b, n, "arenas");
    dm__buf_put(b, "{", 1);
    for (int i = 0; i < st->narenas; i++) {
        if (i)
            dm__buf_put(b, ",", 1);
        json_arena(&st->arenas[i], b);
    }
    dm__buf_put(b, "}", 1);
}

static void json_rules(const dm_stats_t *st, int *n, dm_buf_t *b) {
    json_key(b, n, "rules");
    dm__buf_put(b, "{", 1);
    for (int r = 0; st->rules && r < st->nrules; r++) {
        int k = 0;
        if (r)
            dm__buf_put(b, ",", 1);
        dm__buf_json_str(b, st->rules[r].name);
        dm__buf_put(b, ":{", 2);
        json_strv(b, &k, "arena", st->rules[r].arena);
        for (size_t m = 0; m < NRULE_METRICS; m++)
            json_u64(b, &k, rule_metrics[m].key, field_u64(&st->rules[r], rule_metrics[m].off));
        dm__buf_put(b, "}", 1);
    }
    dm__buf_put(b, "}", 1);
}

/* What the services add: the endpoint's counters, the threads not covered,
 * the watcher's reloads, the process around the arenas. */
static void json_service(const dm_svc_stats_t *svc, int *n, dm_buf_t *b) {
    json_key(b, n, "http");
    metrics_http_json(&svc->http, b);
    json_key(b, n, "threads_not_covered");
    dm__buf_put(b, "[", 1);
    int i = 0;
    for (const char *p = svc->uncovered_names; *p && i < svc->threads_not_covered;
         p += strlen(p) + 1, i++) {
        if (i)
            dm__buf_put(b, ",", 1);
        dm__buf_json_str(b, p);
    }
    dm__buf_put(b, "]", 1);
    json_u64(b, n, "threads_not_covered_count", (uint64_t)svc->threads_not_covered);
    json_u64(b, n, "watch_reloads", svc->watch_reloads);
    json_u64(b, n, "watch_unchanged", svc->watch_unchanged);
    metrics_process_json(&svc->process, b, n);
}

void dm__metrics_json(const dm_stats_t *st, const dm_svc_stats_t *svc, int tags_max, dm_buf_t *b) {
    int n = 0;
    dm__buf_put(b, "{", 1);
    json_process(st, &n, b);
    json_arenas(st, &n, b);
    json_rules(st, &n, b);
    tags_json(st, tags_max, &n, b);
    if (svc)
        json_service(svc, &n, b);
    dm__buf_put(b, "}\n", 2);
}

static const char *const drop_reason[DM_HTTP_NDROP] = {"deadline", "evicted", "refused"};

void dm__metrics_service_text(const dm_svc_stats_t *svc, const char *cl, dm_buf_t *b) {
    const dm_http_counters_t *c = &svc->http;
    char code[8];
    process_u64(b, cl, "threads_not_covered", "gauge",
                "Live Python threads that do not allocate through datamem (started before it "
                "was installed, or outside threading), as the Python layer last counted them.",
                (uint64_t)svc->threads_not_covered);
    family(b, "datamem_", "http_requests_total", "counter",
           "Requests the stats endpoint answered, by status code (4xx: bad requests).");
    for (int i = 0; i < DM_HTTP_NCODES; i++) {
        snprintf(code, sizeof(code), "%d", c->code[i]);
        sample_t s = sample_begin(b, "datamem_", "http_requests_total");
        label(&s, "code", code);
        value_u64(&s, cl, c->requests[i]);
    }
    family(b, "datamem_", "http_connections_dropped_total", "counter",
           "Connections the stats endpoint closed unanswered: past their deadline, evicted "
           "for a newer one when full, or refused.");
    for (int i = 0; i < DM_HTTP_NDROP; i++) {
        sample_t s = sample_begin(b, "datamem_", "http_connections_dropped_total");
        label(&s, "reason", drop_reason[i]);
        value_u64(&s, cl, c->dropped[i]);
    }
    metrics_process_text(&svc->process, cl, b);
}

/* ---- the process around the arenas (process.c) ---------------------------------- */

/* One stem per number: the metric is datamem_<key>, /stats.json and
 * datamem.stats() use <key>. No sample when the number is unknown (/proc
 * unreadable, pyarrow not loaded). */
#define PROCESS_HELP_RESIDENT                                                                \
    "The process's resident set (RSS, /proc/self/statm): datamem's arenas, every other "     \
    "allocator's memory, the interpreter, code and libraries."
#define PROCESS_HELP_OUTSIDE                                                                 \
    "Resident bytes outside datamem's arenas: the process's resident set minus every "       \
    "arena's resident_bytes, at least 0 (Python objects, pandas' hash tables, Arrow "        \
    "buffers, BLAS work space, code). A policy does not govern these."
#define PROCESS_HELP_PYARROW                                                                 \
    "Bytes allocated from pyarrow's default memory pool (pyarrow.total_allocated_bytes()) "  \
    "as datamem's Python layer last read it (every second while pyarrow is loaded; no "      \
    "sample before). Part of the bytes outside the arenas."

static void metrics_process_text(const dm_process_stats_t *p, const char *cl, dm_buf_t *b) {
    family(b, "datamem_", "process_resident_bytes", "gauge", PROCESS_HELP_RESIDENT);
    if (p->resident) {
        sample_t s = sample_begin(b, "datamem_", "process_resident_bytes");
        value_u64(&s, cl, p->resident);
    }
    family(b, "datamem_", "outside_arenas_resident_bytes", "gauge", PROCESS_HELP_OUTSIDE);
    if (p->resident) {
        sample_t s = sample_begin(b, "datamem_", "outside_arenas_resident_bytes");
        value_u64(&s, cl, p->outside_arenas);
    }
    family(b, "datamem_", "pyarrow_allocated_bytes", "gauge", PROCESS_HELP_PYARROW);
    if (p->pyarrow_allocated >= 0) {
        sample_t s = sample_begin(b, "datamem_", "pyarrow_allocated_bytes");
        value_u64(&s, cl, (uint64_t)p->pyarrow_allocated);
    }
}

static void metrics_process_json(const dm_process_stats_t *p, dm_buf_t *b, int *n) {
    if (p->resident) {
        json_u64(b, n, "process_resident_bytes", p->resident);
        json_u64(b, n, "outside_arenas_resident_bytes", p->outside_arenas);
    }
    if (p->pyarrow_allocated >= 0)
        json_u64(b, n, "pyarrow_allocated_bytes", (uint64_t)p->pyarrow_allocated);
}

static void metrics_http_json(const dm_http_counters_t *c, dm_buf_t *b) {
    char code[8];
    int n = 0, k = 0;
    dm__buf_put(b, "{", 1);
    json_key(b, &n, "requests");
    dm__buf_put(b, "{", 1);
    for (int i = 0; i < DM_HTTP_NCODES; i++) {
        snprintf(code, sizeof(code), "%d", c->code[i]);
        json_u64(b, &k, code, c->requests[i]);
    }
    dm__buf_put(b, "}", 1);
    json_key(b, &n, "dropped");
    dm__buf_put(b, "{", 1);
    k = 0;
    for (int i = 0; i < DM_HTTP_NDROP; i++)
        json_u64(b, &k, drop_reason[i], c->dropped[i]);
    dm__buf_put(b, "}}", 2);
}

int dm_stats_render(const dm_stats_t *s, int format, char **out, size_t *len) {
    dm_buf_t b = {0};
    if (format == DM_STATS_JSON)
        dm__metrics_json(s, NULL, DM_STATS_JSON_TAGS, &b);
    else if (format == DM_STATS_PROMETHEUS)
        dm__metrics_text(s, NULL, &b);
    else
        return DM_ERANGE;
    return dm__buf_finish(&b, out, len);
}
