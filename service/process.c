/*
 * process.c: the process around the arenas. A policy governs NumPy's data
 * buffers; in a real job hash tables, Python objects, Arrow buffers and BLAS
 * work space live elsewhere. These numbers say how much: the process's resident
 * set, the part of it outside datamem's arenas, and pyarrow's pool as the
 * Python layer reports it (docs/what-a-policy-governs.md).
 *
 * Resident bytes are the second field of /proc/self/statm (pages), read with
 * one pread of at most 127 bytes on a descriptor opened on first use: a scrape
 * costs one system call and cannot fail for want of a descriptor. /proc/self is
 * resolved when the file is opened, so the descriptor remembers its process and
 * a fork child opens its own. Called by the exporter's threads and
 * datamem.stats(), never on an allocation path.
 *
 * Thread safety: `mu` guards the descriptor (a fork child re-initialises it: a
 * scrape in another thread may have held it). The pyarrow figure is one atomic.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "service/datamem_service.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int statm_fd = -1;
static pid_t statm_pid; /* the process statm_fd describes */
static _Atomic int64_t pyarrow_bytes = -1;

static void atfork_child(void) { pthread_mutex_init(&mu, NULL); }

static void init_once(void) { pthread_atfork(NULL, NULL, atfork_child); }

/* The resident set in bytes, or 0 when /proc cannot be read. */
static uint64_t resident_bytes(void) {
    pthread_once(&once, init_once);
    char buf[128];
    ssize_t n = -1;
    pthread_mutex_lock(&mu);
    pid_t me = getpid();
    if (statm_fd >= 0 && statm_pid != me) { /* the parent's file, inherited */
        close(statm_fd);
        statm_fd = -1;
    }
    if (statm_fd < 0) {
        statm_fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
        statm_pid = me;
    }
    if (statm_fd >= 0)
        n = pread(statm_fd, buf, sizeof(buf) - 1, 0);
    pthread_mutex_unlock(&mu);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = buf, *end;
    strtoull(p, &end, 10); /* size */
    if (end == p)
        return 0;
    p = end;
    unsigned long long pages = strtoull(p, &end, 10);
    if (end == p)
        return 0;
    long page = sysconf(_SC_PAGESIZE);
    return (uint64_t)pages * (uint64_t)(page > 0 ? page : 4096);
}

int dm_stats_process(const dm_stats_t *s, dm_process_stats_t *out) {
    memset(out, 0, sizeof(*out));
    for (int i = 0; s && i < s->narenas; i++)
        out->arenas_resident += s->arenas[i].resident;
    out->resident = resident_bytes();
    out->outside_arenas =
        out->resident > out->arenas_resident ? out->resident - out->arenas_resident : 0;
    out->pyarrow_allocated = atomic_load_explicit(&pyarrow_bytes, memory_order_relaxed);
    return out->resident ? 0 : DM_ESYS;
}

void dm_stats_set_pyarrow_bytes(int64_t bytes) {
    atomic_store_explicit(&pyarrow_bytes, bytes < 0 ? -1 : bytes, memory_order_relaxed);
}
