/*
 * explain.c: human-readable answers for tools: why an allocation lands where it
 * does (dm_table_explain), and what a compiled table contains (dm_table_dump).
 *
 * Both evaluate rules one by one, the slow and obvious way, which makes them a
 * cross-check of the view tables as well as an explanation. Read-only on the
 * table; safe from any thread.
 */
#include <fnmatch.h>
#include <string.h>

#include "policy/internal.h"

static const char *const thp_names[] = {"system", "on", "off"};
static const char *const numa_names[] = {"none", "local", "bind", "interleave",
                                         "preferred"};

/* "float32, int8" for a dtype mask. */
static void put_dtypes(dm__sbuf_t *b, dm_dtype_mask_t m) {
    const char *sep = "";
    for (int dt = 0; dt < 32; dt++) {
        if (!(m >> dt & 1))
            continue;
        const char *name = dm_dtype_name(dt);
        if (name)
            dm__text_sb_printf(b, "%s%s", sep, name);
        else
            dm__text_sb_printf(b, "%s#%d", sep, dt);
        sep = ", ";
    }
}

static void put_list(dm__sbuf_t *b, const char (*v)[DM_NAME_MAX], int n) {
    for (int i = 0; i < n; i++)
        dm__text_sb_printf(b, "%s'%s'", i ? ", " : "", v[i]);
}

/* Appends "; "-separated reasons why r does not match; returns how many. */
static int why_not(dm__sbuf_t *b, const dm_rule_spec_t *r,
                   const dm_context_t *ctx, size_t size, int dt) {
    int n = 0;
    const char *thread = (ctx && ctx->thread) ? ctx->thread : "";
#define REASON(...)                                                             \
    (dm__text_sb_printf(b, "%s", n++ ? "; " : ""), dm__text_sb_printf(b, __VA_ARGS__))
    if (size < r->size_min)
        REASON("size %zu is below min %zu", size, r->size_min);
    if (size > r->size_max)
        REASON("size %zu is above max %zu", size, r->size_max);
    if (r->dtypes && (dt <= DM_DT_UNKNOWN || dt >= 32 || !(r->dtypes >> dt & 1))) {
        const char *name = dm_dtype_name(dt);
        REASON("dtype %s not in [", name ? name : "(invalid)");
        put_dtypes(b, r->dtypes);
        dm__text_sb_printf(b, "]");
    }
    if (!dm__compile_thread_match(r, thread)) {
        REASON("thread '%s' does not match ", thread);
        put_list(b, r->threads, r->nthreads);
    }
    for (int i = 0; i < r->ntags; i++)
        if (!dm__compile_ctx_has_tag(ctx, r->tags[i]))
            REASON("tag '%s' not set", r->tags[i]);
    const char *module = ctx ? ctx->module : NULL, *function = ctx ? ctx->function : NULL;
    if ((r->nmodules || r->nfunctions) && !dm__compile_site_match(r, module, function)) {
        if (!module || !function) {
            REASON("call site unknown (give --module and --function)");
        } else {
            REASON("call site %s (%s) does not match", function, module);
            if (r->nmodules) {
                dm__text_sb_printf(b, " module ");
                put_list(b, r->modules, r->nmodules);
            }
            if (r->nfunctions) {
                dm__text_sb_printf(b, " function ");
                put_list(b, r->functions, r->nfunctions);
            }
        }
    }
#undef REASON
    return n;
}

/* Where an allocation of arena `a` would go on disk: the arena itself when it
 * is file-backed, else where a limit that refuses it sends it (its arena's
 * `limit` to the fallback, a tag's limit or worker_limit to their `spill`).
 * Lines only for what involves a file-backed arena. */
static void explain_spill(dm__sbuf_t *b, const dm_policy_t *p, int a,
                          const dm_context_t *ctx) {
    const dm_arena_spec_t *ar = &p->arenas[a];
    if (ar->backing.dir[0]) {
        dm__text_sb_printf(b, "   spills: arena '%s' is a file in %s\n", ar->name,
                           ar->backing.dir);
        return;
    }
    int f = p->fallback_arena;
    if (ar->limit != SIZE_MAX && f >= 0 && f != a && p->arenas[f].backing.dir[0])
        dm__text_sb_printf(b, "   past its limit of %zu bytes: spills to arena '%s' (fallback, "
                           "a file in %s)\n", ar->limit, p->arenas[f].name,
                           p->arenas[f].backing.dir);
    for (int i = 0; ctx && i < ctx->ntags; i++) {
        for (int k = 0; k < p->ntag_limits; k++) {
            const dm_tag_limit_spec_t *tl = &p->tag_limits[k];
            if (fnmatch(tl->tag, ctx->tags[i], 0) != 0)
                continue;
            if (tl->spill >= 0)
                dm__text_sb_printf(b, "   past tag '%s''s limit of %zu bytes: spills to arena "
                                   "'%s'\n", ctx->tags[i], tl->limit, p->arenas[tl->spill].name);
            break;
        }
    }
    if (p->worker_limit[0] && p->worker_spill >= 0)
        dm__text_sb_printf(b, "   past worker_limit %s: spills to arena '%s'\n", p->worker_limit,
                           p->arenas[p->worker_spill].name);
}

int dm_table_explain(const dm_table_t *t, const dm_context_t *ctx, size_t size,
                     int dtype, char *buf, size_t cap) {
    const dm_policy_t *p = dm_table_policy(t);
    dm__sbuf_t b;
    dm__text_sb_init(&b, buf, cap);
    for (int i = 0; i < p->nrules; i++) {
        const dm_rule_spec_t *r = &p->rules[i];
        size_t mark = b.len;
        dm__text_sb_printf(&b, "rule '%s': ", r->name);
        if (why_not(&b, r, ctx, size, dtype) == 0) {
            b.len = mark; /* matched: drop the prefix */
            dm__text_sb_printf(&b, "-> rule '%s' -> arena '%s'\n", r->name,
                          p->arenas[r->arena].name);
            explain_spill(&b, p, r->arena, ctx);
            dm__text_sb_done(&b);
            return i;
        }
        dm__text_sb_printf(&b, "\n");
    }
    dm__text_sb_printf(&b, "-> default arena '%s'\n", p->arenas[p->default_arena].name);
    explain_spill(&b, p, p->default_arena, ctx);
    dm__text_sb_done(&b);
    return p->nrules;
}

/* ---- dump ---------------------------------------------------------------- */

static void dump_arena(dm__sbuf_t *b, const dm_arena_spec_t *a, int i) {
    dm__text_sb_printf(b, "  %d %s: alignment %zu, hugepages %s, numa %s", i, a->name,
                  a->alignment, thp_names[a->hugepages % 3], numa_names[a->numa % 5]);
    if (a->numa_all)
        dm__text_sb_printf(b, " all");
    else if (a->numa >= DM_NUMA_BIND)
        dm__text_sb_printf(b, " 0x%llx", (unsigned long long)a->numa_nodes);
    dm__text_sb_printf(b, ", per_node %s, decay dirty %lldms muzzy %lldms",
                  a->per_node ? "true" : "false", (long long)a->dirty_decay_ms,
                  (long long)a->muzzy_decay_ms);
    if (a->dirty_budget == SIZE_MAX)
        dm__text_sb_printf(b, " budget never");
    else
        dm__text_sb_printf(b, " budget %zu", a->dirty_budget);
    /* Only when set, so that a policy without them dumps no empty fields. */
    if (a->limit != SIZE_MAX)
        dm__text_sb_printf(b, ", limit %zu", a->limit);
    if (a->lock)
        dm__text_sb_printf(b, ", lock");
    if (a->pinned == DM_PIN_CUDA)
        dm__text_sb_printf(b, ", pinned cuda");
    if (a->backing.dir[0])
        dm__text_sb_printf(b, ", backed by a file in %s", a->backing.dir);
    if (a->backing.dir[0] && a->backing.max != SIZE_MAX)
        dm__text_sb_printf(b, " (max %zu)", a->backing.max);
    if (a->backing.dir[0] && a->backing.resident_max != SIZE_MAX)
        dm__text_sb_printf(b, " (resident_max %zu)", a->backing.resident_max);
    dm__text_sb_printf(b, "\n");
}

static void dump_rule(dm__sbuf_t *b, const dm_table_t *t, int i) {
    const dm_rule_spec_t *r = &dm_table_policy(t)->rules[i];
    dm__text_sb_printf(b, "  %d %s: size [%zu, %zu]", i, r->name, r->size_min,
                  r->size_max);
    if (r->dtypes) {
        dm__text_sb_printf(b, ", dtype [");
        put_dtypes(b, r->dtypes);
        dm__text_sb_printf(b, "]");
    }
    if (r->nthreads) {
        dm__text_sb_printf(b, ", thread [");
        put_list(b, r->threads, r->nthreads);
        dm__text_sb_printf(b, "]");
    }
    if (r->ntags) {
        dm__text_sb_printf(b, ", tag [");
        put_list(b, r->tags, r->ntags);
        dm__text_sb_printf(b, "]");
    }
    dm__text_sb_printf(b, " -> arena %s\n", dm_table_arena_name(t, r->arena));
}

static const char *slot_name(const dm_table_t *t, int rule) {
    const char *n = dm_table_rule_name(t, rule);
    return n ? n : "(default)";
}

/* One interval: its rule, or per dtype where the slots differ. */
static void dump_row(dm__sbuf_t *b, const dm_table_t *t, const dm_view_t *v,
                     uint32_t i) {
    const uint16_t *row = v->slots + (size_t)i * v->row_width;
    size_t end = i + 1 < v->nbounds ? v->bounds[i + 1] - 1 : SIZE_MAX;
    dm__text_sb_printf(b, "  [%zu, %zu]:", v->bounds[i], end);
    if (v->row_width == 1) {
        dm__text_sb_printf(b, " %s\n", slot_name(t, row[0]));
        return;
    }
    dm__text_sb_printf(b, " %s", slot_name(t, row[0])); /* unknown and the rest */
    for (int dt = 1; dt < DM_DT_COUNT; dt++) {
        bool seen = row[dt] == row[0];
        for (int k = 1; k < dt && !seen; k++)
            seen = row[k] == row[dt];
        if (seen)
            continue; /* printed with an earlier dtype */
        dm__text_sb_printf(b, "; %s for", slot_name(t, row[dt]));
        for (int k = dt; k < DM_DT_COUNT; k++)
            if (row[k] == row[dt])
                dm__text_sb_printf(b, " %s", dm_dtype_name(k));
    }
    dm__text_sb_printf(b, "\n");
}

int dm_table_dump(const dm_table_t *t, char *buf, size_t cap) {
    const dm_policy_t *p = dm_table_policy(t);
    dm__sbuf_t b;
    dm__text_sb_init(&b, buf, cap);
    int words = dm_table_ctx_key_words(t);
    dm__text_sb_printf(&b, "policy %s (hash %016llx): %d arena%s, %d rule%s, "
                  "%d context word%s, dtype %s\n", p->path[0] ? p->path : "-",
                  (unsigned long long)p->hash, p->narenas, DM__PLURAL(p->narenas),
                  p->nrules, DM__PLURAL(p->nrules), words, DM__PLURAL(words),
                  dm_table_uses_dtype(t) ? "yes" : "no");
    dm__text_sb_printf(&b, "arenas (default %s, fallback %s):\n",
                  p->arenas[p->default_arena].name,
                  p->fallback_arena >= 0 ? p->arenas[p->fallback_arena].name : "-");
    for (int i = 0; i < p->narenas; i++)
        dump_arena(&b, &p->arenas[i], i);
    dm__text_sb_printf(&b, "rules:\n");
    for (int i = 0; i < p->nrules; i++)
        dump_rule(&b, t, i);
    dm_view_t *v = dm_table_view_build(t, NULL);
    if (!v) {
        dm__text_sb_printf(&b, "view: out of memory\n");
        return dm__text_sb_done(&b);
    }
    dm__text_sb_printf(&b, "view without context: %u interval%s\n", v->nbounds,
                  DM__PLURAL(v->nbounds));
    for (uint32_t i = 0; i < v->nbounds; i++)
        dump_row(&b, t, v, i);
    dm_view_free(v);
    return dm__text_sb_done(&b);
}
