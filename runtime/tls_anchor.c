/*
 * tls_anchor.c: the one thread-local pointer the allocation fast path reads.
 *
 * The runtime's thread state (thread.c, dm__thread_self) is large, and so is jemalloc's;
 * in the dlopen'ed extension both are dynamic TLS, which costs a TLS-descriptor
 * call (17 instructions) per handler call, a fifth of the cached path. An
 * initial-exec variable would be one %fs-relative load, but glibc must then
 * place the defining module's whole TLS block in the few KiB of static TLS it
 * keeps for dlopen'ed libraries, and the extension's (25 KiB) does not fit. So
 * the pointer lives alone here: the extension is linked against
 * libdatamem_tls.so (8 bytes of TLS), and test binaries link this file in.
 */
#include <stddef.h>

__attribute__((visibility("default"), tls_model("initial-exec"))) __thread void *datamem_tls_anchor;
