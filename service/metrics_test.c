/*
 * metrics_test.c: Prometheus text and JSON for a hand-made dm_stats_t (exact
 * lines), then the exporter end to end in this process: the endpoint on port 0
 * answers GET /metrics, /stats.json, 404 and 405 over a real socket; a busy
 * fixed port is a logged error, not a failure of the job; the textfile is
 * written atomically; the discovery file appears and goes.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <iconv.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <inttypes.h>

#include "service/datamem_service.h"
#include "service/buf.h"
#include "service/metrics.h"
#include "service/svc_stats.h"
#include "testing/test.h"

/* `text` has `line` as a whole line. */
static bool has_line(const char *text, const char *line) {
    size_t n = strlen(line);
    for (const char *p = text; (p = strstr(p, line)); p++)
        if ((p == text || p[-1] == '\n') && p[n] == '\n')
            return true;
    return false;
}

#define EXPECT_LINE(text, line)                                                \
    do {                                                                       \
        if (!has_line((text), (line)))                                         \
            TEST_FAIL_("missing line:\n  %s\nin:\n%s", (line), (text));        \
    } while (0)

static dm_stats_t *sample_stats(void) {
    static dm_stats_t s;
    static dm_rule_stats_t rules[2];
    memset(&s, 0, sizeof(s));
    s.narenas = 2;
    dm_arena_stats_t *a = &s.arenas[0];
    snprintf(a->name, sizeof(a->name), "general");
    a->in_policy = true;
    a->alignment = 64;
    a->hugepages = DM_THP_SYSTEM;
    a->numa = DM_NUMA_NONE;
    a->njemalloc = 1;
    a->counts.nalloc = 1000;
    a->counts.nfree = 990;
    a->counts.bytes_requested = 123456789;
    a->allocated = 4096;
    a->active = 8192;
    a->resident = 2097152;
    a->mapped = 4194304;
    a->retained = 1073741824;
    a->dirty = 12288;
    a->reserved = UINT64_C(1) << 30;
    a->limit = UINT64_MAX; /* none */
    a = &s.arenas[1];
    snprintf(a->name, sizeof(a->name), "big");
    a->alignment = 4096;
    a->hugepages = DM_THP_ON;
    a->numa = DM_NUMA_INTERLEAVE;
    a->numa_nodes = 0x5; /* nodes 0 and 2 */
    a->per_node = true;
    a->njemalloc = 2;
    a->hugepage_bytes = 4194304;
    a->counts.nfallback = 3;
    a->je_nmalloc = UINT64_C(18446744073709551615); /* u64 max prints exactly */
    a->limit = UINT64_C(8) << 30;
    a->tracked = true;
    a->live = 3 << 20;
    a->counts.nlimit = 4;
    a->lock = true;
    a->dirty_decay_ms = -1; /* never */
    a->muzzy_decay_ms = 250;
    a->locked_bytes = 2 << 20;
    a->backing_disk_bytes = 5 << 20;
    a->lent_bytes = UINT64_C(6) << 21;
    s.nrules = 2;
    s.rules = rules;
    snprintf(rules[0].name, sizeof(rules[0].name), "huge");
    snprintf(rules[0].arena, sizeof(rules[0].arena), "big");
    rules[0].counts.nalloc = 7;
    rules[0].counts.bytes_requested = 7 << 20;
    rules[0].counts.nrealloc = 2;
    rules[0].counts.nfail = 1;
    rules[0].counts.nfallback = 1;
    rules[0].counts.ndtype_known = 5;
    rules[0].counts.nlimit = 4;
    snprintf(rules[1].name, sizeof(rules[1].name), "default");
    snprintf(rules[1].arena, sizeof(rules[1].arena), "general");
    rules[1].counts.nalloc = 993;
    s.policy_hash = UINT64_C(0x00ab12cd34ef5678);
    /* Label values escape backslash, double quote and newline. */
    snprintf(s.policy_path, sizeof(s.policy_path), "/etc/job \"a\"\\b\n.yaml");
    s.reloads = 3;
    s.reload_failures = 1;
    s.last_reload_failed = true;
    s.last_reload_time = 1700000000.25;
    s.foreign_frees = 5;
    s.cached_bytes = 4096;
    s.lend_frames = 37;
    s.lend_frames_max = 8192;
    s.lend_capped = 6;
    s.nthreads = 4;
    s.ncontexts = 2;
    s.snapshot_time = 1700000001.5;
    return &s;
}

static void test_text(void) {
    char *t = NULL;
    size_t len = 0;
    EXPECT_INT_EQ(dm_stats_render(sample_stats(), DM_STATS_PROMETHEUS, &t, &len), 0, "render");
    if (!t)
        return;
    EXPECT_UINT_EQ(len, strlen(t), "length");
    EXPECT_TRUE(len > 0 && t[len - 1] == '\n', "ends with a newline");
    EXPECT_LINE(t, "# HELP datamem_build_info datamem's version; always 1.");
    EXPECT_LINE(t, "# TYPE datamem_build_info gauge");
    EXPECT_LINE(t, "datamem_build_info{version=\"" DM_VERSION_STRING "\"} 1");
    EXPECT_LINE(t, "datamem_policy_info{path=\"/etc/job \\\"a\\\"\\\\b\\n.yaml\","
                   "hash=\"00ab12cd34ef5678\"} 1");
    EXPECT_LINE(t, "# TYPE datamem_config_last_reload_successful gauge");
    EXPECT_LINE(t, "datamem_config_last_reload_successful 0");
    EXPECT_LINE(t, "datamem_config_last_reload_success_timestamp_seconds 1700000000.250");
    EXPECT_LINE(t, "# TYPE datamem_reloads_total counter");
    EXPECT_LINE(t, "datamem_reloads_total 3");
    EXPECT_LINE(t, "datamem_reload_failures_total 1");
    EXPECT_LINE(t, "datamem_foreign_frees_total 5");
    EXPECT_LINE(t, "datamem_thread_cache_bytes 4096");
    EXPECT_LINE(t, "datamem_threads 4");
    EXPECT_LINE(t, "# TYPE datamem_lend_frames gauge");
    EXPECT_LINE(t, "datamem_lend_frames 37");
    EXPECT_LINE(t, "datamem_lend_frames_max 8192");
    EXPECT_LINE(t, "# TYPE datamem_lend_capped_total counter");
    EXPECT_LINE(t, "datamem_lend_capped_total 6");
    EXPECT_LINE(t, "# TYPE datamem_arena_lent_bytes_total counter");
    EXPECT_LINE(t, "datamem_arena_lent_bytes_total{arena=\"big\"} 12582912");
    EXPECT_LINE(t, "datamem_arena_lent_bytes_total{arena=\"general\"} 0");
    EXPECT_LINE(t, "# TYPE datamem_arena_info gauge");
    EXPECT_LINE(t, "datamem_arena_info{arena=\"general\",alignment=\"64\",hugepages=\"system\","
                   "numa=\"none\",nodes=\"\",per_node=\"false\"} 1");
    EXPECT_LINE(t, "datamem_arena_info{arena=\"big\",alignment=\"4096\",hugepages=\"on\","
                   "numa=\"interleave\",nodes=\"0,2\",per_node=\"true\"} 1");
    EXPECT_LINE(t, "datamem_arena_in_policy{arena=\"general\"} 1");
    EXPECT_LINE(t, "datamem_arena_in_policy{arena=\"big\"} 0");
    EXPECT_LINE(t, "datamem_arena_jemalloc_arenas{arena=\"big\"} 2");
    EXPECT_LINE(t, "# HELP datamem_arena_allocated_bytes Bytes in live allocations "
                   "(jemalloc small + large allocated).");
    EXPECT_LINE(t, "# TYPE datamem_arena_allocated_bytes gauge");
    EXPECT_LINE(t, "datamem_arena_allocated_bytes{arena=\"general\"} 4096");
    EXPECT_LINE(t, "datamem_arena_active_bytes{arena=\"general\"} 8192");
    EXPECT_LINE(t, "datamem_arena_resident_bytes{arena=\"general\"} 2097152");
    EXPECT_LINE(t, "datamem_arena_mapped_bytes{arena=\"general\"} 4194304");
    EXPECT_LINE(t, "datamem_arena_retained_bytes{arena=\"general\"} 1073741824");
    EXPECT_LINE(t, "datamem_arena_dirty_bytes{arena=\"general\"} 12288");
    EXPECT_LINE(t, "datamem_arena_muzzy_bytes{arena=\"general\"} 0");
    EXPECT_LINE(t, "datamem_arena_reserved_bytes{arena=\"general\"} 1073741824");
    EXPECT_LINE(t, "datamem_arena_hugepage_bytes{arena=\"big\"} 4194304");
    EXPECT_LINE(t, "# TYPE datamem_arena_allocations_total counter");
    EXPECT_LINE(t, "datamem_arena_allocations_total{arena=\"general\"} 1000");
    EXPECT_LINE(t, "datamem_arena_frees_total{arena=\"general\"} 990");
    EXPECT_LINE(t, "datamem_arena_requested_bytes_total{arena=\"general\"} 123456789");
    EXPECT_LINE(t, "datamem_arena_fallbacks_total{arena=\"big\"} 3");
    EXPECT_LINE(t, "datamem_arena_jemalloc_allocations_total{arena=\"big\"} "
                   "18446744073709551615");
    EXPECT_LINE(t, "# TYPE datamem_rule_allocations_total counter");
    EXPECT_LINE(t, "datamem_rule_allocations_total{rule=\"huge\",arena=\"big\"} 7");
    EXPECT_LINE(t, "datamem_rule_allocations_total{rule=\"default\",arena=\"general\"} 993");
    EXPECT_LINE(t, "datamem_rule_requested_bytes_total{rule=\"huge\",arena=\"big\"} 7340032");
    EXPECT_LINE(t, "datamem_rule_reallocs_total{rule=\"huge\",arena=\"big\"} 2");
    EXPECT_LINE(t, "datamem_rule_failures_total{rule=\"huge\",arena=\"big\"} 1");
    EXPECT_LINE(t, "datamem_rule_fallbacks_total{rule=\"huge\",arena=\"big\"} 1");
    EXPECT_LINE(t, "datamem_rule_dtype_known_allocations_total{rule=\"huge\",arena=\"big\"} 5");

    /* Structure: every sample's family was announced by HELP then TYPE, each
     * family once; counters end in _total; nothing else is on a line. */
    int samples = 0, families = 0;
    char last_type[128] = "";
    for (char *line = t, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl) {
            TEST_FAIL_("unterminated last line: %s", line);
            break;
        }
        char buf[512];
        snprintf(buf, sizeof(buf), "%.*s", (int)(nl - line), line);
        char name[128], type[32];
        if (strncmp(buf, "# HELP ", 7) == 0) {
            families++;
            continue;
        }
        if (sscanf(buf, "# TYPE %127s %31s", name, type) == 2) {
            size_t n = strlen(name);
            if (strcmp(type, "counter") == 0 && (n < 6 || strcmp(name + n - 6, "_total") != 0))
                TEST_FAIL_("counter without _total: %s", name);
            if (strstr(t, buf) != line)
                TEST_FAIL_("family announced twice: %s", buf);
            snprintf(last_type, sizeof(last_type), "%s", name);
            continue;
        }
        samples++;
        size_t n = strcspn(buf, "{ ");
        if (strlen(last_type) != n || strncmp(buf, last_type, n) != 0)
            TEST_FAIL_("sample outside its family (%s): %s", last_type, buf);
    }
    /* 13 process families (one sample each), 3 arena families outside the table,
     * 33 in it (2 arenas each), the limit (a sample only for the arena with
     * one), 7 rule families (2 rules each). */
    EXPECT_INT_EQ(families, 13 + 3 + 33 + 1 + 7, "families");
    EXPECT_INT_EQ(samples, 13 + 2 * (3 + 33) + 1 + 2 * 7, "samples");
    EXPECT_LINE(t, "datamem_arena_limit_bytes{arena=\"big\"} 8589934592");
    EXPECT_LINE(t, "datamem_arena_live_bytes{arena=\"big\"} 3145728");
    EXPECT_LINE(t, "datamem_arena_limit_hits_total{arena=\"big\"} 4");
    EXPECT_LINE(t, "datamem_rule_limit_hits_total{rule=\"huge\",arena=\"big\"} 4");
    EXPECT_LINE(t, "datamem_arena_locked_bytes{arena=\"big\"} 2097152");
    EXPECT_LINE(t, "datamem_arena_backing_disk_bytes{arena=\"big\"} 5242880");
    EXPECT_TRUE(!strstr(t, "datamem_arena_limit_bytes{arena=\"general\"}"),
                "no limit, no limit sample");
    free(t);

    /* No policy yet: no policy_info; successful until a load fails. */
    dm_stats_t *s = sample_stats();
    s->policy_path[0] = 0;
    s->policy_hash = 0;
    s->last_reload_failed = false;
    EXPECT_INT_EQ(dm_stats_render(s, DM_STATS_PROMETHEUS, &t, &len), 0, "render");
    EXPECT_TRUE(!strstr(t, "datamem_policy_info"), "no policy, no policy_info");
    EXPECT_LINE(t, "datamem_config_last_reload_successful 1");
    free(t);
    EXPECT_INT_EQ(dm_stats_render(s, 7, &t, &len), DM_ERANGE, "unknown format");
}

static void test_json(void) {
    char *j = NULL;
    size_t len = 0;
    EXPECT_INT_EQ(dm_stats_render(sample_stats(), DM_STATS_JSON, &j, &len), 0, "render");
    if (!j)
        return;
    EXPECT_CONTAINS(j, "\"policy_path\":\"/etc/job \\\"a\\\"\\\\b\\u000a.yaml\"", "escapes");
    EXPECT_CONTAINS(j, "\"policy_hash\":\"00ab12cd34ef5678\"", "hash");
    EXPECT_CONTAINS(j, "\"time\":1700000001.500000", "snapshot time");
    EXPECT_CONTAINS(j, "\"last_reload_successful\":false", "last reload");
    EXPECT_CONTAINS(j, "\"big\":{\"in_policy\":false,\"alignment\":4096,\"hugepages\":\"on\","
                       "\"numa\":\"interleave\",\"numa_nodes\":[0,2],\"per_node\":true,"
                       "\"jemalloc_arenas\":2,", "arena settings");
    EXPECT_CONTAINS(j, "\"allocations\":1000,\"frees\":990,", "counters");
    EXPECT_CONTAINS(j, "\"hugepage_bytes\":4194304", "hugepages");
    EXPECT_CONTAINS(j, "\"rules\":{\"huge\":{\"arena\":\"big\",\"allocations\":7,"
                       "\"bytes_requested\":7340032,\"reallocs\":2,\"failures\":1,"
                       "\"fallbacks\":1,\"dtype_known\":5,\"limit_hits\":4},\"default\":", "rules");
    EXPECT_CONTAINS(j, "\"jemalloc_arenas\":2,\"limit_bytes\":8589934592,"
                       "\"decay_dirty_ms\":-1,\"decay_muzzy_ms\":250,\"lock\":true,"
                       "\"pinned\":\"none\",", "limit, decay and lock");
    EXPECT_CONTAINS(j, "\"jemalloc_arenas\":1,\"limit_bytes\":null,", "no limit: null");
    EXPECT_TRUE(j[0] == '{' && strcmp(j + len - 2, "}\n") == 0, "one object");
    free(j);
}

/* "tags" is an object by name in both JSONs: /stats.json's holds the 50
 * biggest and "(other)" (the rest and the runtime's own "(other)" summed, the
 * peak the largest), datamem.stats()'s every row: 100x the cut, 5000 rows. */
static void test_json_tags(void) {
    enum { N = 100 * DM_STATS_JSON_TAGS };
    static dm_tag_stats_t tags[N + 1];
    for (int i = 0; i < N; i++) { /* biggest live first, as the snapshot comes */
        tags[i] = (dm_tag_stats_t){.live = (uint64_t)(N - i), .peak = 7, .limit = UINT64_MAX,
                                   .refused = 1};
        snprintf(tags[i].name, sizeof(tags[i].name), "t%d", i);
    }
    tags[N] = (dm_tag_stats_t){.live = 1000, .peak = 9, .limit = UINT64_MAX, .refused = 2};
    snprintf(tags[N].name, sizeof(tags[N].name), "(other)");
    dm_stats_t *s = sample_stats();
    s->tally_on = true;
    s->ntags = N + 1;
    s->tags = tags;
    for (int all = 0; all < 2; all++) {
        dm_buf_t b = {0};
        dm__metrics_json(s, NULL, all ? INT_MAX : DM_STATS_JSON_TAGS, &b);
        char *j = NULL;
        size_t len = 0;
        if (dm__buf_finish(&b, &j, &len) != 0 || !j)
            return;
        int rows = 0;
        for (const char *p = strstr(j, "\"tags\":{"); p && (p = strstr(p, ":{\"live\":")); p++)
            rows++;
        EXPECT_INT_EQ(rows, (all ? N : DM_STATS_JSON_TAGS) + 1, "rows, \"(other)\" last");
        EXPECT_CONTAINS(j, "\"tags\":{\"t0\":{\"live\":5000,\"peak\":7,\"limit\":null,", "first");
        /* folded: t50..t4999 live 4950..1 (4950 * 4951 / 2 = 12253725) + 1000 */
        EXPECT_CONTAINS(j, all ? "\"(other)\":{\"live\":1000,\"peak\":9,\"limit\":null,\"refused\":2}"
                               : "\"(other)\":{\"live\":12254725,\"peak\":9,\"limit\":null,"
                                 "\"refused\":4952}", "(other)");
        free(j);
    }
}

/* ---- text from outside: always valid UTF-8 -------------------------------------- */

/* Whether `s` (n bytes) is valid UTF-8, by glibc's decoder (not buf.c's). */
static bool valid_utf8(const char *s, size_t n) {
    iconv_t cd = iconv_open("UTF-32LE", "UTF-8");
    if (cd == (iconv_t)-1)
        return false;
    char out[4096];
    char *in = (char *)s;
    bool ok = true;
    while (n > 0 && ok) {
        char *o = out;
        size_t olen = sizeof(out);
        if (iconv(cd, &in, &n, &o, &olen) == (size_t)-1 && errno != E2BIG)
            ok = false;
    }
    iconv_close(cd);
    return ok;
}

/* dm__buf_text of `in` (n bytes) as `how`, compared with `want`. */
static void expect_text(const char *in, size_t n, dm_text_esc_t how, const char *want) {
    dm_buf_t b = {0};
    dm__buf_text(&b, in, n, how);
    char *t = NULL;
    EXPECT_INT_EQ(dm__buf_finish(&b, &t, NULL), 0, "render");
    EXPECT_STR_EQ(t, want, how == DM_TEXT_JSON ? "as JSON" : "as a label");
    free(t);
}

/* A policy path that is not UTF-8 made /metrics and /stats.json invalid UTF-8
 * (`top`: "the reply is not JSON"). Every byte a valid sequence does not hold
 * is the text \xNN, everywhere. */
static void test_text_not_utf8(void) {
    static const char in[] = "caf\xe9 \xe2\x82 \xc0\xaf \xed\xa0\x80 \xf5\xff \xf4\x90\x80\x80 "
                             "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
    expect_text(in, sizeof(in) - 1, DM_TEXT_JSON,
                "caf\\\\xe9 \\\\xe2\\\\x82 \\\\xc0\\\\xaf \\\\xed\\\\xa0\\\\x80 \\\\xf5\\\\xff "
                "\\\\xf4\\\\x90\\\\x80\\\\x80 \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
    expect_text(in, sizeof(in) - 1, DM_TEXT_LABEL,
                "caf\\\\xe9 \\\\xe2\\\\x82 \\\\xc0\\\\xaf \\\\xed\\\\xa0\\\\x80 \\\\xf5\\\\xff "
                "\\\\xf4\\\\x90\\\\x80\\\\x80 \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
    static const char ctl[] = "a\"b\\c\nd\re\tf\x1b[0m\x7fg";
    expect_text(ctl, sizeof(ctl) - 1, DM_TEXT_JSON,
                "a\\\"b\\\\c\\u000ad\\u000de\\u0009f\\u001b[0m\\u007fg");
    expect_text(ctl, sizeof(ctl) - 1, DM_TEXT_LABEL,
                "a\\\"b\\\\c\\nd\\\\x0de\\\\x09f\\\\x1b[0m\\\\x7fg");
    expect_text("\xe2\x82\xac", 2, DM_TEXT_JSON, "\\\\xe2\\\\x82"); /* cut inside a character */
    expect_text("a\0b", 3, DM_TEXT_JSON, "a\\u0000b");

    /* Every emitter: the policy path, arena, rule and tag names, the threads not
     * covered, each with the hostile bytes, in both formats. */
    static const char hostile[] = "x\xe9\"\\\n\r\x1b\xc3\xa9";
    dm_stats_t *s = sample_stats();
    snprintf(s->policy_path, sizeof(s->policy_path), "/tmp/%s.yaml", hostile);
    snprintf(s->arenas[0].name, sizeof(s->arenas[0].name), "%s", hostile);
    snprintf(s->rules[0].name, sizeof(s->rules[0].name), "%s", hostile);
    snprintf(s->rules[0].arena, sizeof(s->rules[0].arena), "%s", hostile);
    dm_tag_stats_t tags[1] = {{.limit = 1 << 20, .live = 5}};
    snprintf(tags[0].name, sizeof(tags[0].name), "%s", hostile);
    s->tally_on = true;
    s->ntags = 1;
    s->tags = tags;
    snprintf(s->worker_limit_source, sizeof(s->worker_limit_source), "\xff");
    dm_svc_stats_t svc;
    memset(&svc, 0, sizeof(svc));
    svc.threads_not_covered = 2;
    memcpy(svc.uncovered_names, "t\xe9\0\xe2\x82\0", 7);
    svc.process.pyarrow_allocated = -1;

    dm_buf_t b = {0};
    dm__metrics_json(s, &svc, DM_STATS_JSON_TAGS, &b);
    char *j = NULL;
    size_t len = 0;
    EXPECT_INT_EQ(dm__buf_finish(&b, &j, &len), 0, "render");
    EXPECT_TRUE(valid_utf8(j, len), j);
    const char *want_json = "x\\\\xe9\\\"\\\\\\u000a\\u000d\\u001b\xc3\xa9";
    char needle[256];
    snprintf(needle, sizeof(needle), "\"policy_path\":\"/tmp/%s.yaml\"", want_json);
    EXPECT_CONTAINS(j, needle, "policy path");
    snprintf(needle, sizeof(needle), "\"arenas\":{\"%s\":{", want_json);
    EXPECT_CONTAINS(j, needle, "arena name");
    snprintf(needle, sizeof(needle), "\"rules\":{\"%s\":{\"arena\":\"%s\",", want_json, want_json);
    EXPECT_CONTAINS(j, needle, "rule and its arena");
    snprintf(needle, sizeof(needle), "\"tags\":{\"%s\":{\"live\":", want_json);
    EXPECT_CONTAINS(j, needle, "tag name");
    EXPECT_CONTAINS(j, "\"worker_limit_source\":\"\\\\xff\"", "worker limit source");
    EXPECT_CONTAINS(j, "\"threads_not_covered\":[\"t\\\\xe9\",\"\\\\xe2\\\\x82\"]", "threads");
    free(j);

    b = (dm_buf_t){0};
    dm__metrics_text(s, "pid=\"7\"", &b);
    dm__metrics_service_text(&svc, "pid=\"7\"", &b);
    EXPECT_INT_EQ(dm__buf_finish(&b, &j, &len), 0, "render");
    EXPECT_TRUE(valid_utf8(j, len), j);
    const char *want_label = "x\\\\xe9\\\"\\\\\\n\\\\x0d\\\\x1b\xc3\xa9";
    snprintf(needle, sizeof(needle), "datamem_policy_info{path=\"/tmp/%s.yaml\",", want_label);
    EXPECT_CONTAINS(j, needle, "policy path");
    snprintf(needle, sizeof(needle), "datamem_arena_in_policy{arena=\"%s\",pid=\"7\"} 1",
             want_label);
    EXPECT_LINE(j, needle);
    snprintf(needle, sizeof(needle),
             "datamem_rule_allocations_total{rule=\"%s\",arena=\"%s\",pid=\"7\"} 7", want_label,
             want_label);
    EXPECT_LINE(j, needle);
    snprintf(needle, sizeof(needle), "datamem_tag_live_bytes{tag=\"%s\",pid=\"7\"} 5", want_label);
    EXPECT_LINE(j, needle);
    snprintf(needle, sizeof(needle), "datamem_tag_limit_bytes{tag=\"%s\",pid=\"7\"} 1048576",
             want_label);
    EXPECT_LINE(j, needle);
    /* One sample a line: the newline in every name stayed escaped. */
    for (char *line = j, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl)
            break;
        if (line[0] != '#' && strncmp(line, "datamem_", 8) != 0)
            TEST_FAIL_("a line that is no sample: %.*s", (int)(nl - line), line);
    }
    free(j);
}

/* ---- the process around the arenas (process.c) ------------------------------------ */

/* VmRSS of this process, read fresh (the reference dm_stats_process must match). */
static uint64_t vmrss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return (uint64_t)kb << 10;
}

static void test_process(void) {
    /* Rendering: exact lines, a sample only for what is known. */
    dm_svc_stats_t svc;
    memset(&svc, 0, sizeof(svc));
    svc.process = (dm_process_stats_t){.resident = 1 << 30, .arenas_resident = 768 << 20,
                                       .outside_arenas = 256 << 20,
                                       .pyarrow_allocated = 100 << 20};
    dm_buf_t b = {0};
    dm__metrics_service_text(&svc, NULL, &b);
    char *t = NULL;
    EXPECT_INT_EQ(dm__buf_finish(&b, &t, NULL), 0, "render");
    EXPECT_LINE(t, "# TYPE datamem_process_resident_bytes gauge");
    EXPECT_LINE(t, "datamem_process_resident_bytes 1073741824");
    EXPECT_LINE(t, "# TYPE datamem_outside_arenas_resident_bytes gauge");
    EXPECT_LINE(t, "datamem_outside_arenas_resident_bytes 268435456");
    EXPECT_LINE(t, "# TYPE datamem_pyarrow_allocated_bytes gauge");
    EXPECT_LINE(t, "datamem_pyarrow_allocated_bytes 104857600");
    free(t);
    b = (dm_buf_t){0};
    dm__metrics_json(sample_stats(), &svc, DM_STATS_JSON_TAGS, &b);
    EXPECT_INT_EQ(dm__buf_finish(&b, &t, NULL), 0, "render");
    EXPECT_CONTAINS(t, ",\"process_resident_bytes\":1073741824,"
                       "\"outside_arenas_resident_bytes\":268435456,"
                       "\"pyarrow_allocated_bytes\":104857600}", "json");
    free(t);
    svc.process = (dm_process_stats_t){.pyarrow_allocated = -1}; /* nothing known */
    b = (dm_buf_t){0};
    dm__metrics_service_text(&svc, "pid=\"7\"", &b);
    EXPECT_INT_EQ(dm__buf_finish(&b, &t, NULL), 0, "render");
    EXPECT_LINE(t, "# TYPE datamem_process_resident_bytes gauge"); /* the family, no sample */
    EXPECT_TRUE(!strstr(t, "\ndatamem_process_resident_bytes"), t);
    EXPECT_TRUE(!strstr(t, "\ndatamem_outside_arenas_resident_bytes"), t);
    EXPECT_TRUE(!strstr(t, "\ndatamem_pyarrow_allocated_bytes"), t);
    free(t);
    b = (dm_buf_t){0};
    dm__metrics_json(sample_stats(), &svc, DM_STATS_JSON_TAGS, &b);
    EXPECT_INT_EQ(dm__buf_finish(&b, &t, NULL), 0, "render");
    EXPECT_TRUE(!strstr(t, "process_resident_bytes") && !strstr(t, "pyarrow"), t);
    free(t);

    /* The definition: the arenas' resident bytes summed; outside clamped at 0. */
    dm_stats_t *s = sample_stats(); /* arenas resident: 2 MiB + 0 */
    dm_process_stats_t p;
    EXPECT_INT_EQ(dm_stats_process(s, &p), 0, "/proc/self/statm readable");
    EXPECT_UINT_EQ(p.arenas_resident, 2097152, "sum of the arenas' resident bytes");
    EXPECT_UINT_EQ(p.outside_arenas, p.resident - p.arenas_resident, "outside");
    EXPECT_INT_EQ(p.pyarrow_allocated, -1, "pyarrow not reported");
    s->arenas[1].resident = UINT64_C(1) << 50; /* more than this process has */
    dm_stats_process(s, &p);
    EXPECT_UINT_EQ(p.outside_arenas, 0, "clamped at 0");
    dm_stats_set_pyarrow_bytes(12345);
    dm_stats_process(s, &p);
    EXPECT_INT_EQ(p.pyarrow_allocated, 12345, "pyarrow as set");
    dm_stats_set_pyarrow_bytes(-5);
    dm_stats_process(s, &p);
    EXPECT_INT_EQ(p.pyarrow_allocated, -1, "negative: not loaded");

    /* Live: memory from another allocator grows `outside`, not the arenas. */
    dm_stats_process(NULL, &p);
    uint64_t before = p.resident, ref = vmrss();
    EXPECT_TRUE(before + (8 << 20) > ref && ref + (8 << 20) > before, "statm agrees with VmRSS");
    size_t n = 64 << 20;
    char *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_TRUE(m != MAP_FAILED, "mmap");
    if (m == MAP_FAILED)
        return;
    memset(m, 1, n);
    dm_stats_process(NULL, &p);
    EXPECT_TRUE(p.resident >= before + n - (4 << 20), "64 MiB touched: resident grew");
    EXPECT_TRUE(p.outside_arenas >= before + n - (4 << 20), "and it is outside the arenas");

    /* A fork child reads its own statm, not the descriptor its parent opened:
     * it touches 64 MiB more than the parent has. */
    pid_t pid = fork();
    if (pid == 0) {
        char *c = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (c == MAP_FAILED)
            _exit(3);
        memset(c, 2, n);
        dm_process_stats_t q;
        dm_stats_process(NULL, &q);
        uint64_t own = vmrss();
        _exit(q.resident + (8 << 20) > own && own + (8 << 20) > q.resident ? 0 : 1);
    }
    int st = -1;
    EXPECT_INT_EQ(waitpid(pid, &st, 0), pid, "waitpid");
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child read its own resident set");
    munmap(m, n);
}

/* ---- the endpoint, in this process ------------------------------------------------ */

/* GET (or `method`) `path` from 127.0.0.1:port; returns the whole response. */
static char *http_get(int port, const char *method, const char *path) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return NULL;
    }
    char req[256];
    int n = snprintf(req, sizeof(req), "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                     method, path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 20, len = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && len + 1 < cap && (r = read(fd, buf + len, cap - 1 - len)) > 0)
        len += (size_t)r;
    close(fd);
    if (buf)
        buf[len] = 0;
    return buf;
}

static const char *POLICY =
    "version: 1\n"
    "default: general\n"
    "arenas:\n"
    "  general: {alignment: 64}\n"
    "  big: {alignment: 4096, hugepages: on}\n"
    "rules:\n"
    "  - name: huge\n"
    "    match: {size: {min: 4MiB}}\n"
    "    arena: big\n";

static void test_endpoint(void) {
    char dir[] = "/tmp/dm_metrics_test_XXXXXX";
    if (!mkdtemp(dir)) {
        TEST_FAIL_("mkdtemp: %s", dir);
        return;
    }
    setenv("DATAMEM_STATS_DIR", dir, 1);
    char path[128];
    snprintf(path, sizeof(path), "%s/policy.yaml", dir);
    FILE *f = fopen(path, "w");
    fputs(POLICY, f);
    fclose(f);
    dm_diags_t *d = malloc(sizeof(*d));
    dm_diags_init(d, path);
    EXPECT_INT_EQ(dm_runtime_load(path, d), 0, "load");
    free(d);
    void *p = dm_alloc(dm_ctx_root(), 8 << 20, DM_DT_UNKNOWN);
    EXPECT_TRUE(p != NULL, "alloc");

    EXPECT_INT_EQ(dm_stats_serve("127.0.0.1:0", NULL), 0, "serve on port 0");
    char url[200], upath[256];
    dm_stats_endpoint(url, sizeof(url), upath, sizeof(upath));
    int port = 0;
    EXPECT_INT_EQ(sscanf(url, "http://127.0.0.1:%d/metrics", &port), 1, url);
    EXPECT_STR_EQ(upath, "", "no Unix socket");

    char *r = http_get(port, "GET", "/metrics");
    EXPECT_TRUE(r != NULL, "connect");
    if (r) {
        EXPECT_CONTAINS(r, "HTTP/1.1 200", "status");
        EXPECT_CONTAINS(r, "Content-Type: text/plain; version=0.0.4; charset=utf-8", "type");
        EXPECT_CONTAINS(r, "\ndatamem_rule_allocations_total{rule=\"huge\",arena=\"big\"} 1\n",
                        "the allocation");
        EXPECT_CONTAINS(r, "\ndatamem_policy_info{path=\"", "policy");
        EXPECT_CONTAINS(r, "\ndatamem_process_resident_bytes ", "the process's resident set");
        EXPECT_CONTAINS(r, "\ndatamem_outside_arenas_resident_bytes ", "outside the arenas");
        free(r);
    }
    r = http_get(port, "GET", "/stats.json");
    if (r) {
        EXPECT_CONTAINS(r, "HTTP/1.1 200", "status");
        EXPECT_CONTAINS(r, "Content-Type: application/json", "type");
        EXPECT_CONTAINS(r, "\"rules\":{\"huge\":{\"arena\":\"big\",\"allocations\":1,", "json");
        EXPECT_CONTAINS(r, "\"process_resident_bytes\":", "json: the process");
        free(r);
    }
    r = http_get(port, "GET", "/nope");
    if (r) {
        EXPECT_CONTAINS(r, "HTTP/1.1 404", "unknown path");
        free(r);
    }
    r = http_get(port, "DELETE", "/metrics");
    if (r) {
        EXPECT_CONTAINS(r, "HTTP/1.1 405", "method");
        EXPECT_CONTAINS(r, "Allow: GET, HEAD", "allow");
        free(r);
    }

    /* The discovery file names this process and its URL. */
    char disc[256];
    snprintf(disc, sizeof(disc), "%s/%d.json", dir, (int)getpid());
    f = fopen(disc, "r");
    EXPECT_TRUE(f != NULL, disc);
    if (f) {
        char buf[2048] = "";
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        buf[n] = 0;
        fclose(f);
        EXPECT_CONTAINS(buf, url, "url in the discovery file");
    }

    /* A busy fixed port: an error code and a log line; the old endpoint is
     * replaced by nothing, the process goes on. */
    char busy[64];
    snprintf(busy, sizeof(busy), "127.0.0.1:%d", port);
    EXPECT_TRUE(dm_stats_serve("127.0.0.1:0", NULL) == 0, "same setting: nothing changes");
    int blocker = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    bind(blocker, (struct sockaddr *)&sa, sizeof(sa));
    listen(blocker, 1);
    getsockname(blocker, (struct sockaddr *)&sa, &sl);
    snprintf(busy, sizeof(busy), "127.0.0.1:%d", ntohs(sa.sin_port));
    EXPECT_TRUE(dm_stats_serve(busy, NULL) != 0, "address in use is an error");
    dm_stats_endpoint(url, sizeof(url), NULL, 0);
    EXPECT_STR_EQ(url, "", "no endpoint");
    close(blocker);
    EXPECT_TRUE(access(disc, F_OK) != 0, "discovery file removed with the endpoint");

    /* The textfile: complete Prometheus text, no temporary left behind. */
    char tf[256];
    snprintf(tf, sizeof(tf), "%s/datamem.prom", dir);
    EXPECT_INT_EQ(dm_stats_textfile_write(tf), 0, "textfile");
    f = fopen(tf, "r");
    if (f) {
        char buf[1 << 16];
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        buf[n] = 0;
        fclose(f);
        EXPECT_TRUE(strncmp(buf, "# HELP datamem_build_info", 25) == 0, "starts with a family");
        EXPECT_TRUE(n > 0 && buf[n - 1] == '\n', "complete");
    }
    DIR *dd = opendir(dir);
    struct dirent *e;
    while (dd && (e = readdir(dd)))
        EXPECT_TRUE(!strstr(e->d_name, ".tmp."), e->d_name);
    if (dd)
        closedir(dd);

    dm_stats_export_stop();
    dm_free(p);
    unlink(tf);
    unlink(path);
    rmdir(dir);
}

int main(void) {
    test_text();
    test_json();
    test_json_tags();
    test_text_not_utf8();
    test_process();
    test_endpoint();
    return TEST_EXIT();
}
