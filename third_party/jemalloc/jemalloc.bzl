"""Builds jemalloc 5.3.0 from Debian's source package into a private, static library.

Why not Debian's libjemalloc2: it is built with the initial-exec TLS model and cannot
be dlopen'ed into a running Python ("cannot allocate memory in static TLS block").
We build the same source with

  --with-jemalloc-prefix=dmje_            every public name becomes dmje_*
  --with-private-namespace=dmje_private_  internal names cannot clash either
  --without-export                        nothing is exported from the final .so
  --disable-initial-exec-tls              global-dynamic TLS: safe to dlopen
  --disable-cxx --disable-shared          a C-only static archive, linked -fPIC

The source comes from `apt-get source` (Debian's archive is the one registry we may
use); scripts/setup.sh adds the deb-src entries and dpkg-dev. The build runs once per
Bazel output base, outside any --config, so sanitizer builds reuse it.
"""

_VERSION = "5.3.0"

def _run(rctx, args, what, timeout = 900, env = {}):
    res = rctx.execute(args, timeout = timeout, environment = env, quiet = True)
    if res.return_code != 0:
        fail("jemalloc: %s failed (%d):\n%s\n%s" % (what, res.return_code, res.stdout[-4000:], res.stderr[-4000:]))
    return res

def _debian_jemalloc_impl(rctx):
    rctx.report_progress("fetching jemalloc source from Debian")
    _run(rctx, ["mkdir", "-p", "dl"], "mkdir")
    _run(rctx, ["sh", "-c", "cd dl && apt-get source --download-only -qq jemalloc"], "apt-get source jemalloc " +
         "(run scripts/setup.sh first: it adds deb-src entries and dpkg-dev)")
    _run(rctx, ["sh", "-c", "dpkg-source -q -x dl/jemalloc_*.dsc src"], "dpkg-source -x")
    version = rctx.read("src/VERSION") if rctx.path("src/VERSION").exists else ""
    if not version.startswith(_VERSION):
        fail("jemalloc: expected version %s from Debian, got %r" % (_VERSION, version))

    rctx.report_progress("configuring jemalloc")
    env = {"CFLAGS": "-O2 -g -fPIC -fno-omit-frame-pointer", "CC": "gcc"}
    _run(rctx, [
        "sh",
        "-c",
        "cd src && ./configure -q " +
        "--with-jemalloc-prefix=dmje_ " +
        "--with-private-namespace=dmje_private_ " +
        "--without-export " +
        "--disable-initial-exec-tls " +
        "--disable-cxx --disable-shared " +
        "--disable-doc",
    ], "configure", env = env)
    rctx.report_progress("building jemalloc (about a minute)")
    _run(rctx, ["sh", "-c", "cd src && make -s -j$(nproc) build_lib_static"], "make", env = env)
    _run(rctx, ["mkdir", "-p", "lib", "include/jemalloc"], "mkdir")
    _run(rctx, ["cp", "src/lib/libjemalloc_pic.a", "lib/"], "copy lib")
    _run(rctx, ["cp", "src/include/jemalloc/jemalloc.h", "include/jemalloc/"], "copy header")
    _run(rctx, ["rm", "-rf", "dl", "src"], "clean")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", "workspace(name = \"jemalloc\")\n")

debian_jemalloc = repository_rule(
    implementation = _debian_jemalloc_impl,
    attrs = {
        "build_file": attr.label(default = "//third_party/jemalloc:jemalloc.BUILD"),
    },
    local = False,
)
