/*
 * gen_metrics_reference.c: prints docs/metrics-reference.md, generated from
 * the exporter itself: a snapshot with every feature on (a limited, file-backed
 * arena, a rule, a tag with a limit, a worker limit, the endpoint's counters,
 * the process around the arenas, pyarrow) is rendered by service/metrics.c as
 * /metrics and as /stats.json, and the reference lists what those say: every
 * metric family with its type, labels and help, and every key of
 * /stats.json and datamem.stats() (one JSON). A metric added to metrics.c is
 * in the reference by construction; reference_test fails until the checked-in
 * file is regenerated.
 *
 *   bazel run //service:gen_metrics_reference -- --write
 *   bazel run //service:gen_metrics_reference > docs/metrics-reference.md
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/gen_main.h"
#include "service/buf.h"
#include "service/http.h"
#include "service/metrics.h"
#include "service/svc_stats.h"

/* ---- a snapshot with every family in it -------------------------------------- */

typedef struct sample {
    dm_stats_t s;
    dm_rule_stats_t rule;
    dm_tag_stats_t tag;
    dm_svc_stats_t svc;
} sample_t;

static void everything(sample_t *x) {
    dm_stats_t *s = &x->s;
    dm_svc_stats_t *svc = &x->svc;
    memset(x, 0, sizeof(*x));
    dm_arena_stats_t *a = &s->arenas[0];
    s->narenas = 1;
    snprintf(a->name, sizeof(a->name), "<arena>");
    a->in_policy = a->tracked = a->backed = true;
    a->alignment = 64;
    a->njemalloc = 1;
    a->limit = a->backing_max = a->backing_resident_max = 1;
    s->nrules = 1;
    s->rules = &x->rule;
    snprintf(x->rule.name, sizeof(x->rule.name), "<rule>");
    snprintf(x->rule.arena, sizeof(x->rule.arena), "<arena>");
    s->tally_on = true;
    s->ntags = 1;
    s->tags = &x->tag;
    snprintf(x->tag.name, sizeof(x->tag.name), "<tag>");
    x->tag.limit = 1;
    s->worker_limit = 1;
    snprintf(s->policy_path, sizeof(s->policy_path), "<path>");
    dm__http_counters(&svc->http); /* the status codes it counts */
    svc->threads_not_covered = 1;
    snprintf(svc->uncovered_names, sizeof(svc->uncovered_names), "<thread>");
    svc->process.resident = 2;
    svc->process.pyarrow_allocated = 1;
}

/* ---- /metrics: one row per family ---------------------------------------------- */

/* The label names of the first sample of family `name` in `text` ("" none). */
static void labels_of(const char *text, const char *name, char *out, size_t cap) {
    size_t n = strlen(name), len = 0;
    out[0] = 0;
    for (const char *l = text; *l; l = strchr(l, '\n') + 1) {
        if (l[0] != '#' && strncmp(l, name, n) == 0 &&
            (l[n] == '{' || l[n] == ' ' || strncmp(l + n, "_total", 6) == 0)) {
            const char *p = strchr(l, '{'), *end = strchr(l, '\n');
            for (; p && p < end && *p != '}';) {
                const char *eq = strchr(p + 1, '=');
                if (!eq || eq > end)
                    break;
                len += (size_t)snprintf(out + len, cap - len, "%s`%.*s`", len ? ", " : "",
                                        (int)(eq - p - 1), p + 1);
                p = strchr(eq + 2, '"'); /* the value's closing quote (none hold one here) */
                p = p ? p + 1 : NULL;
            }
            return;
        }
        if (!strchr(l, '\n'))
            return;
    }
}

static void families_table(FILE *f, const char *text) {
    fprintf(f, "| metric | type | labels | what |\n|---|---|---|---|\n");
    for (const char *l = text; *l && strchr(l, '\n'); l = strchr(l, '\n') + 1) {
        char name[128], help[1024], type[32], labels[256];
        if (sscanf(l, "# HELP %127s %1023[^\n]", name, help) != 2)
            continue;
        const char *t = strchr(l, '\n') + 1;
        if (sscanf(t, "# TYPE %*s %31s", type) != 1)
            continue;
        labels_of(t, name, labels, sizeof(labels));
        fprintf(f, "| `%s` | %s | %s | %s |\n", name, type, labels, help);
    }
}

/* ---- /stats.json: one row per key ---------------------------------------------- */

#define ROWS_MAX 512
typedef struct row {
    char key[160];
    const char *kind;
} row_t;

/* A JSON text being walked, and the rows it gave. */
typedef struct walk {
    const char *p;
    row_t rows[ROWS_MAX];
    int n;
} walk_t;

static void skip_value(walk_t *w);

static void skip_string(walk_t *w) {
    for (w->p++; *w->p && *w->p != '"'; w->p++)
        if (*w->p == '\\')
            w->p++;
    w->p++;
}

/* The JSON value at w->p: an object's keys, as paths under `path`, each with
 * its value's kind, into w->rows, and walked into. */
static void walk_value(walk_t *w, const char *path) {
    if (*w->p != '{') {
        skip_value(w);
        return;
    }
    for (w->p++; *w->p && *w->p != '}';) {
        const char *k = w->p + 1;
        skip_string(w);
        row_t *r = &w->rows[w->n < ROWS_MAX - 1 ? w->n++ : w->n];
        snprintf(r->key, sizeof(r->key), "%s%s%.*s", path, *path ? "." : "",
                 (int)(w->p - 1 - k), k);
        w->p++; /* ':' */
        r->kind = *w->p == '{' ? "object" : *w->p == '[' ? "list" : *w->p == '"' ? "string"
                  : *w->p == 't' || *w->p == 'f' ? "bool" : *w->p == 'n' ? "null" : "number";
        walk_value(w, r->key);
        if (*w->p == ',')
            w->p++;
    }
    w->p++;
}

static void skip_value(walk_t *w) {
    if (*w->p == '"') {
        skip_string(w);
    } else if (*w->p == '[' || *w->p == '{') {
        int depth = 0;
        do {
            if (*w->p == '"') {
                skip_string(w);
                continue;
            }
            depth += (*w->p == '[' || *w->p == '{') - (*w->p == ']' || *w->p == '}');
            w->p++;
        } while (depth && *w->p);
    } else {
        w->p += strcspn(w->p, ",}]");
    }
}

static const char header[] =
    "# Metrics reference\n"
    "\n"
    "<!-- Generated by `bazel run //service:gen_metrics_reference -- --write` from what\n"
    "     service/metrics.c renders; //service:metrics_reference_test fails when this\n"
    "     file is out of date. Do not edit by hand. -->\n"
    "\n"
    "Every number datamem exports, as `/metrics` (Prometheus text 0.0.4) and as\n"
    "`/stats.json`, whose JSON `datamem.stats()` returns parsed (one renderer, one\n"
    "shape). Names in angle brackets stand for an arena's, rule's or tag's name.\n"
    "Families that exist only with a feature: `datamem_tag_*`, `datamem_counted_*`\n"
    "and `datamem_worker_*` while bytes are counted per tag (`tag_bytes`,\n"
    "`tag_limits`, `worker_limit`, `DATAMEM_TAG_BYTES=1`; the worker limit's gauges\n"
    "only with one), `datamem_tag_limit_bytes` for tags with a limit,\n"
    "`datamem_pyarrow_allocated_bytes` while pyarrow is loaded, the process's\n"
    "numbers where `/proc/self/statm` can be read. How to read them:\n"
    "docs/monitoring.md (\"Stats and scraping\") and\n"
    "docs/what-a-policy-governs.md.\n"
    "\n"
    "## /metrics\n"
    "\n";

/* The keys of `s` rendered as JSON into *w (walked from the start). */
static int json_rows(const dm_stats_t *s, const dm_svc_stats_t *svc, walk_t *w) {
    dm_buf_t j = {0};
    dm__metrics_json(s, svc, INT_MAX, &j);
    char *json = NULL;
    size_t len;
    if (dm__buf_finish(&j, &json, &len) != 0)
        return -1;
    w->p = json;
    w->n = 0;
    walk_value(w, "");
    free(json);
    if (w->n < ROWS_MAX - 1)
        return 0;
    fprintf(stderr, "gen_metrics_reference: more than %d keys: raise ROWS_MAX\n", ROWS_MAX - 2);
    return -1;
}

/* The JSON rows of `x` with every limit set, then with none (null). */
static int json_both(sample_t *x, walk_t *set, walk_t *unset) {
    if (json_rows(&x->s, &x->svc, set) != 0)
        return -1;
    dm_arena_stats_t *a = &x->s.arenas[0];
    a->limit = a->backing_max = a->backing_resident_max = UINT64_MAX;
    x->tag.limit = x->s.worker_limit = UINT64_MAX;
    return json_rows(&x->s, &x->svc, unset);
}

static int write_reference(FILE *f) {
    sample_t *x = malloc(sizeof(*x));
    walk_t *set = malloc(sizeof(*set)), *unset = malloc(sizeof(*unset));
    char *text = NULL;
    int rc = -1;
    if (!x || !set || !unset)
        goto done;
    everything(x);
    dm_buf_t b = {0};
    dm__metrics_text(&x->s, NULL, &b);
    dm__metrics_service_text(&x->svc, NULL, &b);
    size_t len;
    if (dm__buf_finish(&b, &text, &len) != 0 || json_both(x, set, unset) != 0)
        goto done;
    fputs(header, f);
    families_table(f, text);
    fprintf(f, "\n## /stats.json and datamem.stats()\n\n"
               "The same numbers, each under a key named as its metric is\n"
               "(`arenas.<arena>.allocated_bytes` is `datamem_arena_allocated_bytes`,\n"
               "`arenas.<arena>.allocations` `datamem_arena_allocations_total`,\n"
               "`tag_bytes.worker_refused` `datamem_worker_limit_refusals_total`); a limit\n"
               "not set is `null`. `/stats.json` keeps the 50 tags with the most live bytes\n"
               "plus `(other)`; `datamem.stats()` every tag, and reads\n"
               "`pyarrow_allocated_bytes` and `threads_not_covered` at the call.\n\n"
               "| key | value |\n|---|---|\n");
    for (int i = 0; i < set->n; i++) {
        const row_t *r = &set->rows[i], *u = &unset->rows[i];
        const char *other =
            i < unset->n && strcmp(u->key, r->key) == 0 && strcmp(u->kind, r->kind) != 0 ? u->kind
                                                                                       : NULL;
        fprintf(f, "| `%s` | %s%s%s |\n", r->key, r->kind, other ? " or " : "",
                other ? other : "");
    }
    rc = ferror(f) ? -1 : 0;
done:
    free(text);
    free(x);
    free(set);
    free(unset);
    return rc;
}

int main(int argc, char **argv) {
    return dm__gen_main_run(argc, argv, "gen_metrics_reference", "docs/metrics-reference.md",
                        write_reference);
}
