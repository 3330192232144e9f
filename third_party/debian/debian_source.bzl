"""Fetches a Debian source package into an external repository, to be compiled by Bazel.

Why: the extension must not need libraries a wheel does not carry (issue #18). Debian's
libyaml.a is fine, but libnuma.a uses the local-exec TLS model (R_X86_64_TPOFF32),
which cannot go into a shared object. So both are compiled here from Debian's own
source, by Bazel, position-independent, and linked into the extension statically;
their symbols stay hidden (pyext/ext.lds exports only PyInit__ext).

The source comes from `apt-get source` (Debian's archive is the one registry we may
use; scripts/setup.sh adds the deb-src entries and dpkg-dev), is unpacked into src/,
and its upstream version checked against `version`. `config_h`, if given, is written
to src/config.h with {version}, {major}, {minor} and {patch} replaced.
"""

def _run(rctx, args, what):
    res = rctx.execute(args, timeout = 600, quiet = True)
    if res.return_code != 0:
        fail("%s: %s failed (%d):\n%s\n%s" % (rctx.attr.package, what, res.return_code,
                                              res.stdout[-4000:], res.stderr[-4000:]))
    return res

def _debian_source_impl(rctx):
    pkg = rctx.attr.package
    rctx.report_progress("fetching %s source from Debian" % pkg)
    _run(rctx, ["mkdir", "-p", "dl"], "mkdir")
    _run(rctx, ["sh", "-c", "cd dl && apt-get source --download-only -qq " + pkg],
         "apt-get source %s (run scripts/setup.sh first: it adds deb-src entries and dpkg-dev)" % pkg)
    _run(rctx, ["sh", "-c", "dpkg-source -q -x dl/%s_*.dsc src" % pkg], "dpkg-source -x")
    dsc = _run(rctx, ["sh", "-c", "sed -n 's/^Version: //p' dl/%s_*.dsc" % pkg], "read version")
    full = dsc.stdout.strip()
    upstream = full.split("-")[0].split(":")[-1]
    if upstream != rctx.attr.version:
        fail("%s: expected upstream version %s from Debian, got %r" % (pkg, rctx.attr.version, full))
    _run(rctx, ["rm", "-rf", "dl"], "clean")
    if rctx.attr.config_h:
        parts = (upstream.split(".") + ["0", "0", "0"])[:3]
        text = rctx.attr.config_h
        for k, v in [("{version}", upstream), ("{major}", parts[0]), ("{minor}", parts[1]), ("{patch}", parts[2])]:
            text = text.replace(k, v)
        rctx.file("src/config.h", text)
    rctx.file("debian_version.txt", full + "\n")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

debian_source = repository_rule(
    implementation = _debian_source_impl,
    attrs = {
        "package": attr.string(mandatory = True, doc = "Debian source package name"),
        "version": attr.string(mandatory = True, doc = "expected upstream version"),
        "build_file": attr.label(mandatory = True),
        "config_h": attr.string(doc = "contents of src/config.h"),
    },
    local = False,
)
