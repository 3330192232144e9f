/*
 * tables_test.c: the engine's tables at 100x their size: views and contexts
 * stay bounded and route right, and the arena-name table when full.
 */
#define TEST_NAME "tables_test"
#include "runtime/test_runtime.h"

/* Views are kept per context key (which context rules a context matches): a
 * policy with 15 tag rules meets up to 32,768 keys over a process's life. A
 * table keeps DM_VIEWS_MAX before freeing those no thread is bound to, and
 * every context still routes as its tags say: 100 x DM_VIEWS_MAX keys, each
 * context made, used and given back (contexts are recycled too). */
static void test_views_and_contexts_bounded(void) {
    char policy[4096] = "version: 1\ndefault: general\narenas:\n  general: {}\nrules:\n";
    for (int i = 0; i < 15; i++)
        snprintf(policy + strlen(policy), sizeof(policy) - strlen(policy),
                 "  - {name: r%d, match: {tag: b%d}, arena: general}\n", i, i);
    load_ok(policy);
    int most = 0, wrong = 0;
    for (int k = 1; k <= 100 * DM_VIEWS_MAX; k++) {
        const dm_ctx_t *c = dm_ctx_root();
        for (int i = 0; i < 15; i++) {
            if (!(k & (1 << i)))
                continue;
            char t[8];
            snprintf(t, sizeof(t), "b%d", i);
            const dm_ctx_t *next = dm_ctx_with_tag(c, t);
            dm_ctx_release(c);
            c = next;
        }
        void *p = dm_alloc(c, 64, DM_DT_UNKNOWN);
        char want[8];
        snprintf(want, sizeof(want), "r%d", __builtin_ctz((unsigned)k));
        const char *got = dm_runtime_rule_of(c, 64, DM_DT_UNKNOWN);
        if (!p || !got || strcmp(got, want) != 0) {
            if (wrong++ < 3)
                fprintf(stderr, "key %d: rule %s, want %s\n", k, got ? got : "(null)", want);
        }
        dm_free(p);
        dm_ctx_release(c);
        pthread_mutex_lock(&dm__mem_mu);
        dm__dispatch_t *tab = atomic_load(&dm__dispatch_current);
        if (tab->nviews > most)
            most = tab->nviews;
        pthread_mutex_unlock(&dm__mem_mu);
    }
    CHECK(wrong == 0, "%d contexts routed by another rule than their tags say", wrong);
    CHECK(most <= 2 * DM_VIEWS_MAX, "views kept: %d for %d keys (at most %d)", most,
          100 * DM_VIEWS_MAX, 2 * DM_VIEWS_MAX);
    dm_free(dm_alloc(NULL, 64, DM_DT_UNKNOWN)); /* the thread lets its last context go */
    dm_stats_t s;
    dm_stats_snapshot(&s);
    CHECK(s.ncontexts <= DM_CTX_MAX + 1, "contexts interned: %d (at most %d)", s.ncontexts,
          DM_CTX_MAX + 1);
    dm_stats_release(&s);
    load_ok(POLICY);
}

/* Arenas live for the process, so their names fill a table (DM_RT_ARENAS_MAX):
 * policies that keep naming new arenas, 100 x that many, are refused past it
 * with a line that says why, the policy in force stays, and allocation goes
 * on. Runs last: the process has every arena name afterwards. */
static void test_arena_names_fill(void) {
    int before = dm__arena_count(), refused = 0, clear = 0, last = -1, wrong = 0;
    char policy[256], want[32] = "";
    for (int i = 0; i < 100 * DM_RT_ARENAS_MAX; i++) {
        snprintf(policy, sizeof(policy), "version: 1\ndefault: fill%d\narenas:\n  fill%d: {}\n", i, i);
        static dm_diags_t d;
        dm_diags_init(&d, "fill.yaml");
        dm_topology_t topo;
        dm_runtime_topology(&topo);
        dm_policy_t *pol = NULL;
        CHECK(dm_policy_parse(policy, strlen(policy), "fill.yaml", &topo, &pol, &d) == 0, "%s",
              policy);
        if (dm_runtime_install(pol, &d) == 0) {
            last = i;
            continue;
        }
        refused++;
        char buf[2048];
        dm_diags_format_all(&d, buf, sizeof(buf));
        clear += strstr(buf, "can name at most 256 arenas over its life") != NULL;
        snprintf(want, sizeof(want), "fill%d", last);
        void *p = dm_alloc(NULL, 1000, DM_DT_UNKNOWN);
        const char *got = dm_owner_arena(p);
        wrong += !p || !got || strcmp(got, want) != 0; /* the policy in force serves it */
        dm_free(p);
    }
    CHECK(refused == 100 * DM_RT_ARENAS_MAX - (DM_RT_ARENAS_MAX - before),
          "refused %d of %d", refused, 100 * DM_RT_ARENAS_MAX);
    CHECK(clear == refused, "%d of %d refusals say why", clear, refused);
    CHECK(wrong == 0, "%d allocations after a refusal not served by the policy in force", wrong);
}

int main(void) {
    test_begin();
    test_views_and_contexts_bounded();
    test_arena_names_fill();
    return test_end();
}
