/*
 * test_policy.h: the runtime tests' way to put a policy in force from text
 * (written to a per-process file under /tmp, loaded, and a failed load ends the
 * test with its diagnostics). Tests only.
 */
#ifndef DM_RUNTIME_TEST_POLICY_H
#define DM_RUNTIME_TEST_POLICY_H
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime/datamem.h"

/* The policy file's path: $TEST_TMPDIR (Bazel's, one per test run: sandboxed
 * runs may share a pid) or /tmp, dm_<who>_<pid>.yaml, rewritten with `text`. */
static inline const char *test_write_policy(const char *who, const char *text) {
    static char path[512];
    const char *dir = getenv("TEST_TMPDIR");
    snprintf(path, sizeof(path), "%s/dm_%s_%d.yaml", dir && *dir ? dir : "/tmp", who,
             (int)getpid());
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    fputs(text, f);
    fclose(f);
    return path;
}

static inline void test_load_policy(const char *who, const char *text) {
    static dm_diags_t d;
    const char *path = test_write_policy(who, text);
    dm_diags_init(&d, path);
    int rc = dm_runtime_load(path, &d);
    if (rc) {
        char buf[8192];
        dm_diags_format_all(&d, buf, sizeof(buf));
        fprintf(stderr, "load failed: %s\n%s\n", dm_strerror(rc), buf);
        exit(1);
    }
}
#endif /* DM_RUNTIME_TEST_POLICY_H */
