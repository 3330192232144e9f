/*
 * corpus_test.c: the policy fixtures in tests/policies.
 *
 *  - bad/NAME.yaml is parsed as "NAME.yaml" against a machine with NUMA nodes
 *    0-1, with DM_PARSE_LINT (what `check` reports); every diagnostic, formatted, must equal bad/NAME.expected byte for
 *    byte (write them with `policy_check NAME.yaml --nodes 3 2> NAME.expected`
 *    from that directory, and read them before committing).
 *  - warn/NAME.yaml the same way against warn/NAME.expected, but the policy
 *    must load: warnings (and their notes) only, no error.
 *  - every good/NAME.yaml must parse with no error and no warning, and compile
 *    (as at start-up: without DM_PARSE_LINT).
 */
#include <dirent.h>
#include <stdlib.h>

#include "policy/policy.h"
#include "testing/test.h"

#define MIN_BAD 25 /* the corpus cannot quietly vanish */
#define MIN_WARN 3

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(DM_POLICY_FILE_MAX + 2);
    *len = buf ? fread(buf, 1, DM_POLICY_FILE_MAX + 1, f) : 0;
    fclose(f);
    if (buf)
        buf[*len] = '\0';
    return buf;
}

static bool has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n > k && strcmp(s + n - k, suffix) == 0;
}

static const dm_topology_t two_nodes = {0x3};
static dm_diags_t d;

/* Parses dir/name and compares the diagnostics with dir/NAME.expected;
 * returns the parse's result (1 when a file is missing). */
static int check_expected(const char *dir, const char *name) {
    char path[1024], exp_path[1024];
    static char got[1 << 16];
    size_t len, elen;
    dm_policy_t *p;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(exp_path, sizeof exp_path, "%s/%.*s.expected", dir,
             (int)(strlen(name) - 5), name);
    char *buf = read_file(path, &len), *exp = read_file(exp_path, &elen);
    int rc = 1;
    EXPECT_TRUE(buf != NULL, path);
    EXPECT_TRUE(exp != NULL, exp_path);
    if (buf && exp) {
        rc = dm_policy_parse_ex(buf, len, name, &two_nodes, DM_PARSE_LINT, &p, &d);
        dm_diags_format_all(&d, got, sizeof got);
        EXPECT_STR_EQ(got, exp, name);
        EXPECT_TRUE(d.n > 0, "a bad policy says something");
        EXPECT_INT_EQ(rc == 0, d.nerrors == 0, name);
        dm_policy_free(p);
    }
    free(buf);
    free(exp);
    return rc;
}

static void check_bad(const char *dir, const char *name) {
    check_expected(dir, name);
}

static void check_warn(const char *dir, const char *name) {
    EXPECT_INT_EQ(check_expected(dir, name), 0, "a warned policy still loads");
    EXPECT_INT_EQ(d.nerrors, 0, name);
    EXPECT_TRUE(d.nwarnings > 0, name);
}

static void check_good(const char *dir, const char *name) {
    char path[1024], text[4096];
    size_t len;
    dm_policy_t *p;
    dm_table_t *t = NULL;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *buf = read_file(path, &len);
    EXPECT_TRUE(buf != NULL, path);
    if (!buf)
        return;
    int rc = dm_policy_parse(buf, len, name, &two_nodes, &p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    EXPECT_INT_EQ(rc, 0, text);
    EXPECT_INT_EQ(d.nerrors + d.nwarnings, 0, text);
    if (p) {
        EXPECT_INT_EQ(dm_table_compile(p, &t), 0, name);
        dm_table_free(t);
    }
    dm_policy_free(p);
    free(buf);
}

/* Runs fn on every file of dir ending in suffix; returns how many. */
static int each_file(const char *dir, const char *suffix,
                     void (*fn)(const char *, const char *)) {
    DIR *dp = opendir(dir);
    struct dirent *e;
    int n = 0;
    EXPECT_TRUE(dp != NULL, dir);
    while (dp && (e = readdir(dp))) {
        if (has_suffix(e->d_name, suffix)) {
            fn(dir, e->d_name);
            n++;
        }
    }
    if (dp)
        closedir(dp);
    return n;
}

int main(int argc, char **argv) {
    char root_dir[900], bad[1024], good[1024], warn[1024];
    const char *root = getenv("TEST_SRCDIR");
    if (argc > 1) /* a checkout's tests/policies, outside Bazel */
        snprintf(root_dir, sizeof root_dir, "%s", argv[1]);
    else
        snprintf(root_dir, sizeof root_dir, "%s/datamem/tests/policies",
                 root ? root : ".");
    snprintf(good, sizeof good, "%s/good", root_dir);
    snprintf(bad, sizeof bad, "%s/bad", root_dir);
    snprintf(warn, sizeof warn, "%s/warn", root_dir);
    int nbad = each_file(bad, ".yaml", check_bad);
    int nwarn = each_file(warn, ".yaml", check_warn);
    int ngood = each_file(good, ".yaml", check_good);
    printf("%d bad, %d warned and %d good policies\n", nbad, nwarn, ngood);
    EXPECT_TRUE(nbad >= MIN_BAD, "bad corpus present");
    EXPECT_TRUE(nwarn >= MIN_WARN, "warn corpus present");
    EXPECT_TRUE(ngood >= 3, "good corpus present");
    return TEST_EXIT();
}
