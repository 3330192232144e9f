/*
 * check.c: `policy_check FILE [--nodes MASK] [--dump] [--explain SIZE DTYPE
 * THREAD [TAG...]]`. Prints a policy's diagnostics like a compiler, and on
 * request the compiled table or why one allocation goes where it goes. Exits 1
 * when the policy has errors. Lints as `python -m datamem check` does
 * (DM_PARSE_LINT). A tool for policy authors and for writing the
 * .expected files of tests/policies/bad.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy.h"

static int explain(const dm_table_t *t, int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "--explain SIZE DTYPE THREAD [TAG...]\n");
        return 2;
    }
    size_t size;
    int dt = dm_dtype_from_name(argv[1]);
    if (dm_parse_size(argv[0], &size) || dt < 0) {
        fprintf(stderr, "bad size '%s' or dtype '%s'\n", argv[0], argv[1]);
        return 2;
    }
    dm_context_t ctx = {argv[2], (const char *const *)argv + 3, argc - 3, NULL, NULL};
    char buf[1 << 16];
    dm_table_explain(t, &ctx, size, dt, buf, sizeof buf);
    fputs(buf, stdout);
    return 0;
}

int main(int argc, char **argv) {
    static dm_diags_t d;
    static char text[1 << 20];
    dm_topology_t topo = {0};
    dm_policy_t *p;
    dm_table_t *t;
    int a = 2, rc = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: policy_check FILE [--nodes MASK] [--dump] "
                        "[--explain SIZE DTYPE THREAD [TAG...]]\n");
        return 2;
    }
    if (argc > 3 && strcmp(argv[2], "--nodes") == 0)
        topo.nodes = strtoull(argv[3], NULL, 0), a = 4;
    int prc = dm_policy_load_ex(argv[1], a == 4 ? &topo : NULL, DM_PARSE_LINT, &p, &d);
    dm_diags_format_all(&d, text, sizeof text);
    fputs(text, stderr);
    if (prc)
        return 1;
    if (dm_table_compile(p, &t)) {
        fprintf(stderr, "cannot compile\n");
        return 1;
    }
    if (a < argc && strcmp(argv[a], "--dump") == 0) {
        dm_table_dump(t, text, sizeof text);
        fputs(text, stdout);
    } else if (a < argc && strcmp(argv[a], "--explain") == 0) {
        rc = explain(t, argc - a - 1, argv + a + 1);
    }
    dm_table_free(t);
    dm_policy_free(p);
    return rc;
}
