/*
 * parse_fuzz.c: libFuzzer target for everything in policy/ that reads
 * untrusted text: dm_policy_parse (then compile, context keys, views, lookups,
 * explain, dump and the diagnostics formatter on whatever parses), and the
 * value parsers dm_parse_size, dm_parse_duration_ms and dm_glob_valid.
 *
 * Build and run: policy/fuzz.sh [seconds]. Without libFuzzer, fuzz_driver.c
 * replays files through the same entry point (//policy:parse_fuzz_test).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_values(const uint8_t *data, size_t size) {
    char s[256];
    size_t n = size < sizeof s - 1 ? size : sizeof s - 1, v, off = 0;
    int64_t ms;
    const char *why = NULL;
    memcpy(s, data, n);
    s[n] = '\0';
    dm_parse_size(s, &v);
    if (dm_parse_duration_ms(s, &ms) == 0 && ms < -1)
        abort(); /* -1 is the only negative */
    if (!dm_glob_valid(s, &off, &why) && (off >= n || !why) && n)
        abort();
}

static void fuzz_table(const dm_table_t *t, const uint8_t *data, size_t size) {
    static char buf[1 << 16];
    const char *tags[] = {"ingest", "batch", "a"};
    /* The last two have a call site: the view's answer corrected by the site
     * rules (dm_table_site_pick) must agree with explain's rule-by-rule walk. */
    const dm_context_t ctxs[] = {{"main", NULL, 0, NULL, NULL},
                                 {"loader-1", tags, 3, NULL, NULL},
                                 {NULL, tags, 1, NULL, NULL},
                                 {"main", NULL, 0, "mypkg.loader", "mypkg.loader.read_csv"},
                                 {"loader-1", tags, 2, "app", "app.Job.run"}};
    uint64_t key[DM_RULES_MAX / 64 + 1];
    dm_table_dump(t, buf, sizeof buf);
    for (size_t c = 0; c < sizeof ctxs / sizeof ctxs[0]; c++) {
        dm_table_ctx_key(t, &ctxs[c], key);
        dm_view_t *v = dm_table_view_build(t, key);
        if (!v)
            continue;
        for (size_t i = 0; i + 8 <= size && i < 256; i += 8) {
            size_t sz;
            memcpy(&sz, data + i, sizeof sz);
            int dt = data[i] % DM_DT_COUNT;
            int got = dm_view_lookup(v, sz, dt);
            if (ctxs[c].module)
                got = dm_table_site_pick(t, v,
                                         dm_table_site_mask(t, ctxs[c].module, ctxs[c].function),
                                         sz, dt, got);
            int want = dm_table_explain(t, &ctxs[c], sz, dt, buf, sizeof buf);
            if (got != want) /* the view and the slow path must agree */
                abort();
        }
        dm_view_free(v);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static dm_diags_t d;
    static char text[1 << 16];
    static const dm_topology_t topo = {0x3};
    dm_policy_t *p;
    dm_table_t *t;
    fuzz_values(data, size);
    /* with the lint: its checks are a superset of start-up's */
    int rc = dm_policy_parse_ex((const char *)data, size, "fuzz.yaml", &topo,
                                DM_PARSE_LINT, &p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    if ((rc == 0) != (p != NULL) || (rc == 0 && d.nerrors) || (rc && !d.nerrors))
        abort(); /* success and errors must agree */
    if (p && dm_table_compile(p, &t) == 0) {
        dm_policy_free(p);
        fuzz_table(t, data, size);
        dm_table_free(t);
    } else {
        dm_policy_free(p);
    }
    return 0;
}
