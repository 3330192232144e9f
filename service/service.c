/*
 * service.c: plugs the services into the engine. Linking //service registers,
 * before main() (or when the extension is loaded), one engine observer that
 * tells the file watcher and then the stats export about every install and
 * every fork child (the two share no state, so the order is only fixed, not
 * needed). The engine itself calls no service.
 */
#include "service/datamem_service.h"
#include "service/export.h"
#include "service/watch.h"

static void on_install(const dm_policy_t *p, uint64_t seq, void *arg) {
    (void)arg;
    dm__watch_on_install(p);
    (void)seq; /* the engine delivers installs in order */
    dm__export_configure(&p->stats);
}

static void on_fork_child(void *arg) {
    (void)arg;
    dm__watch_on_fork_child();
    dm__export_restart_in_child();
}

__attribute__((constructor)) static void service_init(void) {
    dm__watch_init();
    if (dm_runtime_observe(on_install, on_fork_child, NULL) != 0)
        dm_log("datamem: cannot register the stats and watcher services");
}
