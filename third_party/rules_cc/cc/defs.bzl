"""Offline stand-in for rules_cc: Bazel 4.2.3's native C++ rules under rules_cc's names.

Debian's bazel-rules-cc 0.0.4 needs a newer Bazel (use_cpp_toolchain), so the
WORKSPACE points @rules_cc here. See ../shared/notes/build-offline.md.
"""

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
