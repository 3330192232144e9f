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

Cross builds (scripts/wheels.sh, each target in its own output base) set
DATAMEM_TARGET (a zig target, e.g. aarch64-linux-gnu.2.28) and DATAMEM_TARGET_CC
(the compiler for it). The page size is then fixed, not probed on the build machine:
jemalloc cannot run where the kernel's page is larger than its LG_PAGE, and arm64
kernels come with 4, 16 or 64 KiB pages, so aarch64 gets 64 KiB (--with-lg-page=16,
as Debian, Fedora and Arch build it); x86_64 has 4 KiB pages only. The hugepage
size is 2 MiB on both (4 KiB-page kernels; on a 64 KiB-page arm64 kernel THP is
512 MiB and jemalloc's hugepage alignment there is only a missed optimisation).
"""

# Per target architecture: configure's --host and jemalloc's page size.
_CROSS = {
    "x86_64": ["--host=x86_64-linux-gnu", "--with-lg-page=12", "--with-lg-hugepage=21"],
    "aarch64": ["--host=aarch64-linux-gnu", "--with-lg-page=16", "--with-lg-hugepage=21"],
}

_VERSION = "5.3.0"

def _run(rctx, args, what, timeout = 900, env = {}):
    res = rctx.execute(args, timeout = timeout, environment = env, quiet = True)
    if res.return_code != 0:
        fail("jemalloc: %s failed (%d):\n%s\n%s" % (what, res.return_code, res.stdout[-4000:], res.stderr[-4000:]))
    return res

# One anchored edit of jemalloc's source: the anchor must occur exactly once
# (a Debian update that moves it fails the build here, by name, rather than
# building an allocator without the edit).
def _edit_once(rctx, path, old, new, why):
    text = rctx.read("src/" + path)
    if text.count(old) != 1:
        fail("jemalloc: %s has no single anchor for %s (jemalloc %s wrote one)" % (path, why, _VERSION))
    rctx.file("src/" + path, text.replace(old, new, 1))

# jemalloc's own mappings (its metadata, the radix tree, arena 0's extents) are
# made with syscall(2) instead of libc's mmap/munmap: a memory profiler that
# hooks those symbols in every library's GOT (memray) counted them as the
# job's allocations (13.8 MB at datamem's start under `memray run`), though
# they are the allocator's, as glibc's heap metadata is (docs/operations.md,
# "Profilers"). Inserted into src/pages.c, the one file that maps, after its
# includes, so that the prototypes stay as they are.
_UNSEEN_MAPS = """/* datamem (third_party/jemalloc/jemalloc.bzl): mappings unseen by GOT hooks */
#include <sys/syscall.h>
#include <unistd.h>
#define mmap(a, n, prot, flags, fd, off) ((void *)syscall(SYS_mmap, (a), (n), (prot), (flags), (fd), (off)))
#define munmap(a, n) ((int)syscall(SYS_munmap, (a), (n)))

"""
_PAGES_ANCHOR = "/******************************************************************************/\n/* Data. */"


# A purge that keeps pages: `arena.<i>.purge` gives back every dirty page of the
# arena; datamem's purge on growth needs only what the footprint passed its peak
# by (runtime/arena.c, dm__arena_after_growth), and a page given back beyond it
# is zeroed again by the next allocation that wants it. dm_purge_keep(n), called
# on the purging thread just before the purge, leaves the n most recently
# freed dirty pages of that arena (jemalloc evicts the oldest first); 0 gives
# the purge its usual meaning. Only the dirty pages: the muzzy ones are purged
# lazily already. jemalloc's private namespace names it
# dmje_private_je_dm_purge_keep, which runtime/arena.c declares.
_PURGE_KEEP_OLD = """void
pac_decay_all(tsdn_t *tsdn, pac_t *pac, decay_t *decay,
    pac_decay_stats_t *decay_stats, ecache_t *ecache, bool fully_decay) {
	malloc_mutex_assert_owner(tsdn, &decay->mtx);
	pac_decay_to_limit(tsdn, pac, decay, decay_stats, ecache, fully_decay,
	    /* npages_limit */ 0, ecache_npages_get(ecache));
}
"""
_PURGE_KEEP_NEW = """/* datamem (third_party/jemalloc/jemalloc.bzl): a purge that keeps pages */
static __thread size_t dm_purge_keep_pages;

void
dm_purge_keep(size_t pages) {
	dm_purge_keep_pages = pages;
}

void
pac_decay_all(tsdn_t *tsdn, pac_t *pac, decay_t *decay,
    pac_decay_stats_t *decay_stats, ecache_t *ecache, bool fully_decay) {
	malloc_mutex_assert_owner(tsdn, &decay->mtx);
	size_t npages = ecache_npages_get(ecache);
	size_t keep = ecache == &pac->ecache_dirty ? dm_purge_keep_pages : 0;
	pac_decay_to_limit(tsdn, pac, decay, decay_stats, ecache, fully_decay,
	    /* npages_limit */ keep, npages > keep ? npages - keep : 0);
}
"""

def _debian_jemalloc_impl(rctx):
    rctx.report_progress("fetching jemalloc source from Debian")
    _run(rctx, ["mkdir", "-p", "dl"], "mkdir")
    _run(rctx, ["sh", "-c", "cd dl && apt-get source --download-only -qq jemalloc"], "apt-get source jemalloc " +
         "(run scripts/setup.sh first: it adds deb-src entries and dpkg-dev)")
    _run(rctx, ["sh", "-c", "dpkg-source -q -x dl/jemalloc_*.dsc src"], "dpkg-source -x")
    version = rctx.read("src/VERSION") if rctx.path("src/VERSION").exists else ""
    if not version.startswith(_VERSION):
        fail("jemalloc: expected version %s from Debian, got %r" % (_VERSION, version))

    _edit_once(rctx, "src/pages.c", _PAGES_ANCHOR, _UNSEEN_MAPS + _PAGES_ANCHOR,
               "the unseen mappings (before its '/* Data. */' section)")
    _edit_once(rctx, "src/pac.c", _PURGE_KEEP_OLD, _PURGE_KEEP_NEW, "a purge that keeps pages (pac_decay_all)")

    rctx.report_progress("configuring jemalloc")
    env = {"CFLAGS": "-O2 -g -fPIC -fno-omit-frame-pointer", "CC": "gcc"}
    cross = []
    target = rctx.os.environ.get("DATAMEM_TARGET", "")
    if target:
        arch = target.split("-")[0]
        if arch not in _CROSS:
            fail("jemalloc: DATAMEM_TARGET=%s: supported architectures are %s" % (target, ", ".join(_CROSS)))
        if not rctx.os.environ.get("DATAMEM_TARGET_CC"):
            fail("jemalloc: DATAMEM_TARGET=%s needs DATAMEM_TARGET_CC, its C compiler (scripts/wheels.sh sets both)" % target)
        env["CC"] = rctx.os.environ["DATAMEM_TARGET_CC"]
        env["AR"] = "ar"  # GNU ar archives objects of any architecture
        cross = _CROSS[arch]
    _run(rctx, [
        "sh",
        "-c",
        "cd src && ./configure -q " +
        "--with-jemalloc-prefix=dmje_ " +
        "--with-private-namespace=dmje_private_ " +
        "--without-export " +
        "--disable-initial-exec-tls " +
        "--disable-cxx --disable-shared " +
        "--disable-doc " + " ".join(cross),
    ], "configure", env = env)
    rctx.report_progress("building jemalloc (about a minute)")
    _run(rctx, ["sh", "-c", "cd src && make -s -j$(nproc) build_lib_static"], "make", env = env)
    _run(rctx, ["mkdir", "-p", "lib", "include/jemalloc"], "mkdir")
    _run(rctx, ["cp", "src/lib/libjemalloc_pic.a", "lib/"], "copy lib")
    # The name runtime/arena.c calls (a shared object links with it undefined,
    # and only the import would fail).
    _run(rctx, ["sh", "-c", "nm -g lib/libjemalloc_pic.a | grep -q ' T dmje_private_je_dm_purge_keep$'"],
         "finding dmje_private_je_dm_purge_keep in the archive (jemalloc's private namespace names it)")
    _run(rctx, ["cp", "src/include/jemalloc/jemalloc.h", "include/jemalloc/"], "copy header")
    _run(rctx, ["rm", "-rf", "dl", "src"], "clean")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", "workspace(name = \"jemalloc\")\n")

debian_jemalloc = repository_rule(
    implementation = _debian_jemalloc_impl,
    attrs = {
        "build_file": attr.label(default = "//third_party/jemalloc:jemalloc.BUILD"),
    },
    environ = ["DATAMEM_TARGET", "DATAMEM_TARGET_CC"],
    local = False,
)
