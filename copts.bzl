"""Compiler flags shared by every C target (one place, like tcmalloc's copts.bzl)."""

DM_COPTS = [
    "-std=c11",
    "-D_GNU_SOURCE",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-Wno-unused-parameter",
    "-fvisibility=hidden",
    "-O2",
]

# Tests may use helper statics without prototypes.
DM_TEST_COPTS = DM_COPTS + ["-Wno-missing-prototypes"]
