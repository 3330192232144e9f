/*
 * cgroup.c: the memory limit of the control group this process runs in, for
 * `worker_limit: N%` (tally.c through dm__cgroup_process_limit).
 *
 * A limit set on any ancestor of the process's cgroup bounds it too, so the
 * limit is the smallest one on the way from the process's cgroup up to the
 * root of the hierarchy's mount:
 *   cgroup v2  memory.max of each cgroup on the way ("max": none);
 *   cgroup v1  memory.limit_in_bytes of each (a value of 2^62 or more is the
 *              kernel's "unlimited", PAGE_COUNTER_MAX pages), and the leaf's
 *              hierarchical_memory_limit in memory.stat, which the kernel
 *              computes over every ancestor, those above a container's mount
 *              included.
 * The process's cgroup comes from /proc/self/cgroup (v1: the line whose
 * controllers include "memory"; v2: "0::PATH"), the hierarchy's mount point
 * and the cgroup its mount shows as its root from /proc/self/mountinfo (a
 * container's /sys/fs/cgroup often shows only its own subtree). Both versions
 * are read: on a hybrid host the memory controller is in one of them, and the
 * other has no limit files. Every path is read under `root` so that tests can
 * hand in a fake tree.
 *
 * The limiting cgroup's charge (dm__cgroup_charge) makes `worker_limit: N%`
 * of a cgroup's limit a budget for every process in that cgroup (tally.c,
 * "Memory beside the arenas").
 *
 * Every file is read through os.c. Thread safety: reentrant (reads files only). dm__cgroup_memory_limit runs at
 * install; dm__cgroup_charge on an allocation's slow path (os.c's
 * dm__os_read_small: no allocation, no lock), at most every DM_TALLY_BESIDE_STALE_MS.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "policy/policy.h"
#include "runtime/datamem.h"
#include "runtime/os.h"

#define V1_UNLIMITED (UINT64_C(1) << 62)

/* A cgroup hierarchy: where it is mounted, the cgroup it shows at its mount
 * point, and the process's cgroup in it. */
typedef struct hierarchy {
    char mount[512];  /* mount point, as mountinfo names it */
    char mroot[512];  /* the cgroup at the mount point ("/" for the whole tree) */
    char cgroup[512]; /* the process's cgroup, from /proc/self/cgroup */
} hierarchy_t;

/* Whether comma-separated `list` holds `word`. */
static bool list_has(const char *list, const char *word) {
    size_t n = strlen(word);
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",");
        if (len == n && strncmp(p, word, n) == 0)
            return true;
        p += len + (p[len] == ',');
    }
    return false;
}

/* mountinfo's octal escapes (\040 for a space) undone in place. */
static void unescape(char *s) {
    char *w = s;
    for (char *r = s; *r; r++) {
        if (r[0] == '\\' && r[1] >= '0' && r[1] <= '3' && r[2] >= '0' && r[2] <= '7' &&
            r[3] >= '0' && r[3] <= '7') {
            *w++ = (char)((r[1] - '0') * 64 + (r[2] - '0') * 8 + (r[3] - '0'));
            r += 3;
        } else {
            *w++ = *r;
        }
    }
    *w = 0;
}

typedef bool line_fn(char *line, int version, hierarchy_t *h);

typedef struct line_call {
    line_fn *fn;
    int version;
    hierarchy_t *h;
} line_call_t;

static bool call_line(char *line, void *arg) {
    line_call_t *c = arg;
    return c->fn(line, c->version, c->h);
}

/* Calls fn on each line of `root`/`rel` (its newline cut) until one returns
 * true; whether one did. */
static bool find_line(const char *root, const char *rel, line_fn *fn, int version,
                      hierarchy_t *h) {
    char path[4096];
    if (snprintf(path, sizeof(path), "%s/%s", root, rel) >= (int)sizeof(path))
        return false;
    line_call_t c = {fn, version, h};
    return dm__os_each_line(path, call_line, &c);
}

/* A line of /proc/self/cgroup, "ID:CONTROLLERS:PATH": the process's cgroup in
 * hierarchy `version` (1: the memory controller's) into h->cgroup. */
static bool own_cgroup(char *line, int version, hierarchy_t *h) {
    char *ctl = strchr(line, ':'), *cg = ctl ? strchr(ctl + 1, ':') : NULL;
    if (!cg)
        return false;
    *cg++ = 0;
    *ctl++ = 0;
    bool match = version == 2 ? strcmp(line, "0") == 0 && !*ctl : list_has(ctl, "memory");
    if (!match || cg[0] != '/' || strlen(cg) >= sizeof(h->cgroup))
        return false;
    snprintf(h->cgroup, sizeof(h->cgroup), "%s", cg);
    return true;
}

/* A line of /proc/self/mountinfo, "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS
 * [TAGS] - TYPE SOURCE SUPEROPTS": a mount of hierarchy `version` that holds
 * h->cgroup, into h->mount and h->mroot. */
static bool find_mount(char *line, int version, hierarchy_t *h) {
    char *sep = strstr(line, " - "), *save = NULL;
    if (!sep)
        return false;
    *sep = 0;
    char *type = strtok_r(sep + 3, " ", &save);
    char *source = type ? strtok_r(NULL, " ", &save) : NULL;
    char *super = source ? strtok_r(NULL, " ", &save) : NULL;
    bool match = type && (version == 2 ? strcmp(type, "cgroup2") == 0
                                       : strcmp(type, "cgroup") == 0 && super &&
                                             list_has(super, "memory"));
    if (!match)
        return false;
    char *fields[5];
    int n = 0;
    save = NULL;
    for (char *t = strtok_r(line, " ", &save); t && n < 5; t = strtok_r(NULL, " ", &save))
        fields[n++] = t;
    if (n < 5)
        return false;
    unescape(fields[3]);
    unescape(fields[4]);
    size_t rl = strcmp(fields[3], "/") == 0 ? 0 : strlen(fields[3]); /* "/": the whole tree */
    /* The process's cgroup must be the mount's root or below it. */
    if (strncmp(h->cgroup, fields[3], rl) != 0 || (h->cgroup[rl] && h->cgroup[rl] != '/') ||
        strlen(fields[4]) >= sizeof(h->mount))
        return false;
    snprintf(h->mount, sizeof(h->mount), "%s", fields[4]);
    snprintf(h->mroot, sizeof(h->mroot), "%.*s", (int)rl, fields[3]);
    return true;
}

/* The number in file `dir`/`name`, or UINT64_MAX (none: "max", absent,
 * unreadable, not a number, or v1's unlimited). */
static uint64_t read_limit(const char *dir, const char *name) {
    char path[4096], val[64];
    if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path) ||
        dm__os_read_small(path, val, sizeof(val)) <= 0 || val[0] < '0' || val[0] > '9')
        return UINT64_MAX;
    char *end;
    unsigned long long v = strtoull(val, &end, 10);
    return (*end == '\n' || !*end) && v > 0 && v < V1_UNLIMITED ? (uint64_t)v : UINT64_MAX;
}

/* The value of `key` (followed by a space) in memory.stat text `buf`, or -1. */
static long long stat_value(const char *buf, const char *key) {
    size_t n = strlen(key);
    for (const char *line = buf; line && *line; line = strchr(line, '\n'), line += !!line) {
        if (strncmp(line, key, n) == 0 && line[n] == ' ') {
            char *end;
            unsigned long long v = strtoull(line + n + 1, &end, 10);
            return end > line + n + 1 && (*end == '\n' || !*end) && v < V1_UNLIMITED
                       ? (long long)v
                       : -1;
        }
    }
    return -1;
}

/* `dir`/memory.stat read whole into buf (cap bytes): whether it was. */
static bool read_stat(const char *dir, char *buf, size_t cap) {
    char path[4096];
    return snprintf(path, sizeof(path), "%s/memory.stat", dir) < (int)sizeof(path) &&
           dm__os_read_small(path, buf, cap) > 0;
}

/* hierarchical_memory_limit from v1's memory.stat in `dir`, or UINT64_MAX. */
static uint64_t v1_hierarchical(const char *dir) {
    char buf[8192];
    long long v = read_stat(dir, buf, sizeof(buf)) ? stat_value(buf, "hierarchical_memory_limit")
                                                   : -1;
    return v > 0 ? (uint64_t)v : UINT64_MAX;
}

/* Whether path `p` has a component "." or "..". */
static bool has_dot_component(const char *p) {
    while (*p) {
        p += strspn(p, "/");
        size_t len = strcspn(p, "/");
        if ((len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.'))
            return true;
        p += len;
    }
    return false;
}

/* The smallest limit in hierarchy `version`, from the process's cgroup up to
 * the mount's root; UINT64_MAX when none. The directory of the cgroup that
 * sets it into `at` (v1's hierarchical_memory_limit: the process's own, the
 * nearest in view). */
static uint64_t hierarchy_limit(const char *root, int version, char *at, size_t atcap) {
    hierarchy_t h;
    if (!find_line(root, "proc/self/cgroup", own_cgroup, version, &h) ||
        !find_line(root, "proc/self/mountinfo", find_mount, version, &h))
        return UINT64_MAX;
    const char *rel = h.cgroup + strlen(h.mroot); /* "" or "/a/b" */
    if (has_dot_component(rel))
        return UINT64_MAX; /* never read outside the mount */
    char dir[4096];
    if (snprintf(dir, sizeof(dir), "%s%s%s", root, h.mount, rel) >= (int)sizeof(dir))
        return UINT64_MAX;
    size_t top = strlen(root) + strlen(h.mount); /* dir's length at the mount point */
    const char *file = version == 2 ? "memory.max" : "memory.limit_in_bytes";
    uint64_t best = version == 1 ? v1_hierarchical(dir) : UINT64_MAX;
    if (best != UINT64_MAX)
        snprintf(at, atcap, "%s", dir);
    for (;;) {
        uint64_t v = read_limit(dir, file);
        if (v < best) {
            best = v;
            snprintf(at, atcap, "%s", dir);
        }
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= top || !slash || (size_t)(slash - dir) < top)
            break;
        *slash = 0; /* the parent */
    }
    return best;
}

uint64_t dm__cgroup_memory_limit(const char *root, int *version, char *at, size_t atcap) {
    char at1[4096] = "", at2[4096] = "";
    uint64_t v1 = hierarchy_limit(root, 1, at1, sizeof(at1)),
             v2 = hierarchy_limit(root, 2, at2, sizeof(at2));
    *version = v2 <= v1 ? 2 : 1;
    uint64_t best = v2 <= v1 ? v2 : v1;
    snprintf(at, atcap, "%s", best == UINT64_MAX ? "" : v2 <= v1 ? at2 : at1);
    return best == UINT64_MAX ? 0 : best;
}

uint64_t dm__cgroup_charge(const char *dir, int version) {
    char buf[8192];
    if (!read_stat(dir, buf, sizeof(buf)))
        return UINT64_MAX;
    /* v1's total_*: the cgroup and every cgroup below it (use_hierarchy); v2's
     * memory.stat is hierarchical. Anonymous pages and shmem (tmpfs, /dev/shm):
     * what reclaim cannot drop without swap. Page cache (spilled arrays'
     * pages among it) is written back and dropped under the limit. */
    long long anon = stat_value(buf, version == 2 ? "anon" : "total_rss"),
              shmem = stat_value(buf, version == 2 ? "shmem" : "total_shmem");
    return anon < 0 ? UINT64_MAX : (uint64_t)anon + (uint64_t)(shmem > 0 ? shmem : 0);
}

int dm__cgroup_process_limit(uint64_t *bytes, char *source, size_t cap, char *why, size_t whycap,
                             char *group, size_t groupcap, int *group_version) {
    const char *env = getenv("DATAMEM_MEMORY_LIMIT"); /* at install, never hot */
    size_t v = 0;
    *bytes = 0;
    group[0] = 0;
    *group_version = 0;
    if (env && *env) {
        int rc = dm_parse_size(env, &v);
        if (rc == 0 && v > 0) {
            snprintf(source, cap, "env");
            *bytes = v;
            return 0;
        }
        char shown[65];
        snprintf(shown, sizeof(shown), "%s", env);
        for (char *c = shown; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f)
                *c = '?'; /* one line on a terminal */
        snprintf(why, whycap,
                 "DATAMEM_MEMORY_LIMIT=\"%s\" is %s: give bytes or a number with B, KiB, MiB, "
                 "GiB, TiB, KB, MB, GB or TB that comes to whole bytes (1.5GiB), or unset it to use the "
                 "cgroup's memory limit or physical memory",
                 shown, rc == DM_ERANGE ? "too large" : rc ? "not a size" : "0 bytes");
        return DM_EINVALID;
    }
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    uint64_t ram = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
    int version = 0;
    char at[4096];
    uint64_t cg = dm__cgroup_memory_limit("", &version, at, sizeof(at));
    if (cg && (cg < ram || !ram)) {
        snprintf(source, cap, "cgroup v%d", version);
        snprintf(group, groupcap, "%s", at);
        *group_version = version;
        *bytes = cg;
    } else {
        snprintf(source, cap, "ram");
        *bytes = ram;
    }
    return 0;
}
