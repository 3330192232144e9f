/*
 * gen_reference.c: prints docs/policy-reference.md, generated from the schema.
 *
 *   bazel run //policy:gen_reference > docs/policy-reference.md
 *   bazel run //policy:gen_reference -- --write   (writes it in the workspace,
 *                                                  via BUILD_WORKSPACE_DIRECTORY)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/schema.h"

int main(int argc, char **argv) {
    FILE *f = stdout;
    char path[4096];
    if (argc > 1 && strcmp(argv[1], "--write") == 0) {
        const char *ws = getenv("BUILD_WORKSPACE_DIRECTORY");
        if (!ws) {
            fprintf(stderr, "gen_reference: --write needs `bazel run` "
                            "(BUILD_WORKSPACE_DIRECTORY is not set)\n");
            return 2;
        }
        snprintf(path, sizeof path, "%s/docs/policy-reference.md", ws);
        if (!(f = fopen(path, "w"))) {
            perror(path);
            return 1;
        }
    } else if (argc > 1) {
        fprintf(stderr, "usage: gen_reference [--write]\n");
        return 2;
    }
    int rc = dm__reference_write(f);
    if (f != stdout && fclose(f) != 0)
        rc = -1;
    if (rc)
        fprintf(stderr, "gen_reference: write failed\n");
    else if (f != stdout)
        fprintf(stderr, "wrote %s\n", path);
    return rc ? 1 : 0;
}
