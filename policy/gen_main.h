/*
 * gen_main.h: the command line of the reference generators (gen_main.c):
 * //policy:gen_reference and //service:gen_metrics_reference print a checked-in
 * document, or with --write (under `bazel run`) write it in the workspace.
 * Internal: never installed.
 */
#ifndef DM_POLICY_GEN_MAIN_H
#define DM_POLICY_GEN_MAIN_H

#include <stdio.h>

/* main() of generator `name`: write(f) onto stdout, or, with --write, onto
 * `doc` (relative to the workspace) in place. Returns the exit status. */
int dm__gen_main_run(int argc, char **argv, const char *name, const char *doc, int (*write)(FILE *f));

#endif /* DM_POLICY_GEN_MAIN_H */
