/*
 * policy.c: the entry points: bytes or a file in, a validated dm_policy_t out.
 *
 * Order of the checks: size, UTF-8 and YAML (yaml_tree.c), then the schema walk
 * (parse.c), then whole-policy checks (validate.c). A failure before the walk
 * stops there (the tree is not trustworthy); after it, every error is reported.
 * Reentrant: no globals; the result is owned by the caller.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "policy/internal.h"
#include "policy/trust.h"

uint64_t dm_policy_hash(const char *buf, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)buf[i]) * 0x100000001b3ull;
    return h;
}

/* Walks and validates a loaded tree into p; returns 0 or a negative code. */
static int build(dm__dsrc_t *ds, const dm__ytree_t *yt, const dm_topology_t *topo,
                 unsigned flags, dm_policy_t *p) {
    dm__pctx_t c;
    memset(&c, 0, sizeof c);
    c.ds = ds, c.yt = yt, c.topo = topo, c.p = p;
    c.lint = (flags & DM_PARSE_LINT) != 0;
    dm__parse_walk(&c, yt->root);
    dm__validate_policy(&c);
    free(c.refs);
    if (c.nomem) {
        dm__diag_add(ds, DM_SEV_ERROR, 0, 0, "", "out of memory");
        return DM_ENOMEM;
    }
    return ds->d->nerrors ? DM_EINVALID : 0;
}

int dm_policy_parse(const char *buf, size_t len, const char *fname,
                    const dm_topology_t *topo, dm_policy_t **out,
                    dm_diags_t *diags) {
    return dm_policy_parse_ex(buf, len, fname, topo, 0, out, diags);
}

int dm_policy_parse_ex(const char *buf, size_t len, const char *fname,
                       const dm_topology_t *topo, unsigned flags,
                       dm_policy_t **out, dm_diags_t *diags) {
    dm_diags_t local;
    dm__ytree_t yt;
    int rc;
    if (!diags)
        diags = &local;
    dm_diags_init(diags, fname);
    dm__dsrc_t ds = {diags, buf, buf ? len : 0};
    *out = NULL;
    if (len > DM_POLICY_FILE_MAX) {
        dm__diag_add(&ds, DM_SEV_ERROR, 0, 0, "", "the file is larger than %u "
                     "bytes, the most a policy may have", DM_POLICY_FILE_MAX);
        return DM_ETOOBIG;
    }
    dm_policy_t *p = calloc(1, sizeof *p);
    if (!p)
        return DM_ENOMEM;
    rc = dm__yaml_tree_load(&yt, &ds);
    if (rc == 0)
        rc = build(&ds, &yt, topo, flags, p);
    dm__yaml_tree_free(&yt);
    dm__diag_sort(diags);
    if (rc) {
        dm_policy_free(p);
        return rc;
    }
    p->hash = dm_policy_hash(ds.buf, ds.len);
    snprintf(p->path, sizeof p->path, "%s", fname ? fname : "");
    *out = p;
    return 0;
}

/* Reads at most DM_POLICY_FILE_MAX + 1 bytes; *len tells whether there was
 * more (dm_policy_parse refuses it then). Only ever given a regular file. The
 * buffer is the file's size (a policy is a few KiB), grown up to the cap if
 * the file grows while it is read: a 1 MiB buffer per load showed in a memory
 * profiler's peak of a job that only starts. */
static int read_all(int fd, char **buf, size_t *len) {
    size_t max = DM_POLICY_FILE_MAX + 1, n = 0;
    struct stat st;
    size_t cap = fstat(fd, &st) == 0 && st.st_size >= 0 && (uint64_t)st.st_size < max
                     ? (size_t)st.st_size + 1
                     : max;
    char *b = malloc(cap);
    if (!b)
        return DM_ENOMEM;
    while (n < max) {
        if (n == cap) {
            size_t more = cap * 2 < max ? cap * 2 : max;
            char *nb = realloc(b, more);
            if (!nb) {
                free(b);
                return DM_ENOMEM;
            }
            b = nb, cap = more;
        }
        ssize_t r = read(fd, b + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(b);
            return DM_EIO;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *buf = b, *len = n;
    return 0;
}

/* The policy is read only through trust.c's rule: a file, or a directory on
 * the way to it, that someone the job does not trust could change is refused
 * before a byte of it is read, so its content never reaches a diagnostic.
 * Symbolic links are followed from trusted directories: Kubernetes mounts a
 * ConfigMap as a chain of them (`..data`). Returns the descriptor, or
 * DM_EUNSAFE / DM_EIO with the diagnostic's text in `why`. */
static int open_checked(const char *path, char *why, size_t cap) {
    char what[384];
    int fd = dm__trust_open(path, DM__TRUST_FILE, 0, what, sizeof what), e = errno;
    if (fd >= 0)
        return fd;
    if (fd == DM_EUNSAFE)
        snprintf(why, cap, "refused: %s; a policy and each directory on its way must be owned "
                 "by this user or root and writable by no one else (whoever can change them "
                 "decides what this job writes where): chown or chmod go-w, or move the policy",
                 what);
    else if (fd == DM_EINVALID)
        snprintf(why, cap, "not a regular file (%s); a policy must be a regular file or a "
                 "symbolic link to one", what);
    else
        snprintf(why, cap, "cannot read the policy: %s", strerror(e));
    errno = e;
    return fd == DM_EUNSAFE ? DM_EUNSAFE : DM_EIO;
}

int dm_policy_open(const char *path, char *why, size_t cap) {
    int fd = open_checked(path, why, cap);
    if (fd == DM_EUNSAFE)
        errno = EACCES;
    return fd < 0 ? -1 : fd;
}

int dm_policy_load(const char *path, const dm_topology_t *topo,
                   dm_policy_t **out, dm_diags_t *diags) {
    return dm_policy_load_ex(path, topo, 0, out, diags);
}

int dm_policy_load_ex(const char *path, const dm_topology_t *topo,
                      unsigned flags, dm_policy_t **out, dm_diags_t *diags) {
    dm_diags_t local;
    char *buf = NULL, why[512];
    size_t len = 0;
    int rc = DM_EIO, fd = open_checked(path, why, sizeof why);
    *out = NULL;
    if (!diags)
        diags = &local;
    if (fd >= 0) {
        rc = read_all(fd, &buf, &len);
        int err = errno;
        close(fd);
        errno = err;
    }
    if (rc) {
        dm__dsrc_t ds = {diags, NULL, 0};
        dm_diags_init(diags, path);
        if (fd < 0)
            dm__diag_add(&ds, DM_SEV_ERROR, 0, 0, "", "%s", why);
        else
            dm__diag_add(&ds, DM_SEV_ERROR, 0, 0, "", "cannot read the policy: %s",
                         rc == DM_ENOMEM ? "out of memory" : strerror(errno));
        return fd < 0 ? fd : rc;
    }
    rc = dm_policy_parse_ex(buf, len, path, topo, flags, out, diags);
    free(buf);
    return rc;
}

void dm_policy_free(dm_policy_t *p) {
    if (!p)
        return;
    free(p->rules);
    free(p);
}
