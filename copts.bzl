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
    # Bazel's toolchain adds -fno-omit-frame-pointer; the allocation fast path
    # is ~40 instructions per call and a frame costs 3-4 of them
    # (bench/callgrind.sh). perf still unwinds through DWARF (--call-graph dwarf).
    "-fomit-frame-pointer",
]

# Tests may use helper statics without prototypes.
DM_TEST_COPTS = DM_COPTS + ["-Wno-missing-prototypes"]
