/*
 * corpus_test.c: the policy fixtures in tests/policies.
 *
 *  - bad/NAME.yaml is parsed as "NAME.yaml" against a machine with NUMA nodes
 *    0-1; every diagnostic, formatted, must equal bad/NAME.expected byte for
 *    byte (write them with `policy_check NAME.yaml --nodes 3 2> NAME.expected`
 *    from that directory, and read them before committing).
 *  - every good/NAME.yaml must parse with no error and no warning, and compile.
 */
#include <dirent.h>
#include <stdlib.h>

#include "policy/policy.h"
#include "testing/test.h"

#define MIN_BAD 25 /* the corpus cannot quietly vanish */

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

static void check_bad(const char *dir, const char *name) {
    char path[1024], exp_path[1024];
    static char got[1 << 16];
    static dm_diags_t d;
    size_t len, elen;
    dm_policy_t *p;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(exp_path, sizeof exp_path, "%s/%.*s.expected", dir,
             (int)(strlen(name) - 5), name);
    char *buf = read_file(path, &len), *exp = read_file(exp_path, &elen);
    EXPECT_TRUE(buf != NULL, path);
    EXPECT_TRUE(exp != NULL, exp_path);
    if (buf && exp) {
        int rc = dm_policy_parse(buf, len, name, &two_nodes, &p, &d);
        dm_diags_format_all(&d, got, sizeof got);
        EXPECT_STR_EQ(got, exp, name);
        EXPECT_TRUE(d.n > 0, "a bad policy says something");
        EXPECT_INT_EQ(rc == 0, d.nerrors == 0, name);
        dm_policy_free(p);
    }
    free(buf);
    free(exp);
}

static void check_good(const char *dir, const char *name) {
    char path[1024], text[4096];
    static dm_diags_t d;
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
    char root_dir[900], bad[1024], good[1024];
    const char *root = getenv("TEST_SRCDIR");
    if (argc > 1) /* a checkout's tests/policies, outside Bazel */
        snprintf(root_dir, sizeof root_dir, "%s", argv[1]);
    else
        snprintf(root_dir, sizeof root_dir, "%s/datamem/tests/policies",
                 root ? root : ".");
    snprintf(good, sizeof good, "%s/good", root_dir);
    snprintf(bad, sizeof bad, "%s/bad", root_dir);
    int nbad = each_file(bad, ".yaml", check_bad);
    int ngood = each_file(good, ".yaml", check_good);
    printf("%d bad and %d good policies\n", nbad, ngood);
    EXPECT_TRUE(nbad >= MIN_BAD, "bad corpus present");
    EXPECT_TRUE(ngood >= 3, "good corpus present");
    return TEST_EXIT();
}
