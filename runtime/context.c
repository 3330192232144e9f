/*
 * context.c: contexts, the interned sets of tags (datamem.h: dm_ctx_with_tag)
 * that select a view of the dispatch table. A context is made once per set of
 * tags, sorted, and never freed: callers cache the pointer, and the per-thread
 * binding compares pointers. At most DM_CTX_MAX exist; past that a new set of
 * tags gets NULL.
 *
 * Thread safety: interning runs under dm__runtime_mu; a context is immutable
 * once published.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"
#include "runtime/tally.h"

struct dm_ctx dm__context_root;
struct dm_ctx dm__context_stale;
static struct dm_ctx *contexts = &dm__context_root; /* interned, under dm__runtime_mu */
static int ncontexts = 1;

const dm_ctx_t *dm_ctx_root(void) { return &dm__context_root; }

int dm__context_count(void) { return ncontexts; }

/* The root context is tally.c's context 0. */
void dm__context_root_tally_init(void) {
    if (!dm__context_root.tally)
        (void)dm__tally_ctx_init(&dm__context_root, true);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

const dm_ctx_t *dm_ctx_with_tag(const dm_ctx_t *base, const char *tag) {
    if (!base)
        base = &dm__context_root;
    for (int i = 0; i < base->ntags; i++)
        if (strcmp(base->tags[i], tag) == 0)
            return base;
    if (base->ntags >= DM_GLOBS_MAX * 4 || strlen(tag) >= DM_NAME_MAX)
        return NULL;
    const char *want[DM_GLOBS_MAX * 4 + 1];
    int n = 0;
    for (int i = 0; i < base->ntags; i++)
        want[n++] = base->tags[i];
    want[n++] = tag;
    qsort(want, (size_t)n, sizeof(want[0]), cmp_str);

    pthread_mutex_lock(&dm__runtime_mu);
    dm__context_root_tally_init();
    struct dm_ctx *c;
    for (c = contexts; c; c = c->next) {
        if (c->ntags != n)
            continue;
        int i = 0;
        while (i < n && strcmp(c->tags[i], want[i]) == 0)
            i++;
        if (i == n)
            break;
    }
    if (!c && ncontexts < DM_CTX_MAX && (c = calloc(1, sizeof(*c)))) {
        c->tags = calloc((size_t)n, sizeof(char *));
        bool ok = c->tags != NULL;
        for (int i = 0; ok && i < n; i++)
            ok = (c->tags[i] = strdup(want[i])) != NULL;
        c->ntags = n;
        if (ok && dm__tally_ctx_init(c, false)) {
            c->next = contexts;
            contexts = c;
            ncontexts++;
        } else {
            for (int i = 0; c->tags && i < n; i++)
                free(c->tags[i]);
            free(c->tags);
            free(c);
            c = NULL;
        }
    }
    pthread_mutex_unlock(&dm__runtime_mu);
    return c;
}

int dm_ctx_tags(const dm_ctx_t *c, const char **tags, int cap) {
    for (int i = 0; i < c->ntags && i < cap; i++)
        tags[i] = c->tags[i];
    return c->ntags;
}

