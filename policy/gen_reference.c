/*
 * gen_reference.c: prints docs/policy-reference.md, generated from the schema.
 *
 *   bazel run //policy:gen_reference > docs/policy-reference.md
 *   bazel run //policy:gen_reference -- --write   (writes it in the workspace,
 *                                                  via BUILD_WORKSPACE_DIRECTORY)
 */
#include "policy/gen_main.h"
#include "policy/schema.h"

int main(int argc, char **argv) {
    return dm__gen_main_run(argc, argv, "gen_reference", "docs/policy-reference.md",
                        dm__reference_write);
}
