/*
 * gen_main.c: the command line the reference generators share (gen_main.h).
 */
#include "policy/gen_main.h"

#include <stdlib.h>
#include <string.h>

int dm__gen_main_run(int argc, char **argv, const char *name, const char *doc, int (*write)(FILE *f)) {
    FILE *f = stdout;
    char path[4096];
    if (argc > 1 && strcmp(argv[1], "--write") == 0) {
        const char *ws = getenv("BUILD_WORKSPACE_DIRECTORY");
        if (!ws) {
            fprintf(stderr, "%s: --write needs `bazel run` (BUILD_WORKSPACE_DIRECTORY is not set)\n",
                    name);
            return 2;
        }
        snprintf(path, sizeof path, "%s/%s", ws, doc);
        if (!(f = fopen(path, "w"))) {
            perror(path);
            return 1;
        }
    } else if (argc > 1) {
        fprintf(stderr, "usage: %s [--write]\n", name);
        return 2;
    }
    int rc = write(f);
    if (f != stdout && fclose(f) != 0)
        rc = -1;
    if (rc)
        fprintf(stderr, "%s: write failed\n", name);
    else if (f != stdout)
        fprintf(stderr, "wrote %s\n", path);
    return rc ? 1 : 0;
}
