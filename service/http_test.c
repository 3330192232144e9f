/*
 * http_test.c: the stats endpoint's server alone (http.c), over real loopback
 * and Unix sockets, serving a fixed body through the render function it is
 * started with: the request line parser (400 for a malformed line, 405 for a
 * method other than GET or HEAD, 404 for an unknown path whatever its length),
 * the request size bound (431 past 8 KiB of line and headers, however they are
 * split), HEAD, a failing render (500), every answer counted by status code,
 * the Unix socket's mode and its path removed at stop, a stale socket replaced
 * and a file that is not a socket left alone, and dm__http_check_address.
 *
 * The server never sends 414: a request line longer than the whole bound is a
 * 431 like an over-long header block (one bound for both; 414 stays in the
 * counters' code list, always 0).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "service/datamem_service.h"
#include "service/http.h"
#include "testing/test.h"

static int renders, fail_render;

/* The body every /metrics and /stats.json gets: which format was asked for. */
static int fake_render(int format, char **out, size_t *len) {
    __atomic_add_fetch(&renders, 1, __ATOMIC_RELAXED);
    if (__atomic_load_n(&fail_render, __ATOMIC_RELAXED))
        return DM_ENOMEM;
    const char *body = format == DM_STATS_JSON ? "{\"fake\": 1}\n" : "fake_metric 1\n";
    *out = strdup(body);
    *len = strlen(body);
    return *out ? 0 : DM_ENOMEM;
}

static int connect_tcp(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int connect_unix(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sends `req` (len bytes) on `fd` and reads the whole response (the server
 * closes after one); NULL if the connection fails. The server may answer and
 * close before it has read everything (431), so a failed send ends the
 * sending, not the test. */
static char *exchange(int fd, const char *req, size_t len) {
    if (fd < 0)
        return NULL;
    for (size_t off = 0; off < len;) {
        ssize_t n = send(fd, req + off, len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    size_t cap = 1 << 16, got = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && got + 1 < cap && (r = recv(fd, buf + got, cap - 1 - got, 0)) > 0)
        got += (size_t)r;
    close(fd);
    if (buf)
        buf[got] = 0;
    return buf;
}

static char *ask(int port, const char *req) { return exchange(connect_tcp(port), req, strlen(req)); }

/* The status code of a response ("HTTP/1.1 NNN ..."), or -1. */
static int status(const char *resp) {
    int code = -1;
    if (!resp || sscanf(resp, "HTTP/1.1 %d ", &code) != 1)
        return -1;
    return code;
}

static uint64_t count_of(int code) {
    dm_http_counters_t c;
    dm__http_counters(&c);
    for (int i = 0; i < DM_HTTP_NCODES; i++)
        if (c.code[i] == code)
            return c.requests[i];
    return UINT64_MAX;
}

/* `req` is answered with `code`; the counter for `code` went up by one. The
 * counters are bumped before the response is sent, so reading them after the
 * whole response arrived needs no wait. */
static void expect_status(int port, const char *req, int code, const char *why) {
    uint64_t before = count_of(code);
    char *r = ask(port, req);
    EXPECT_INT_EQ(status(r), code, why);
    EXPECT_UINT_EQ(count_of(code), before + 1, why);
    free(r);
}

static void test_request_line(int port) {
    expect_status(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200, "GET /metrics");
    expect_status(port, "GET /metrics?x=1 HTTP/1.0\r\n\r\n", 200, "a query, HTTP/1.0");
    expect_status(port, "GET /stats.json HTTP/1.1\n\n", 200, "bare LF lines");
    expect_status(port, "GARBAGE\r\n\r\n", 400, "no target, no version");
    expect_status(port, "GET /metrics\r\n\r\n", 400, "no version");
    expect_status(port, "GET /metrics HTTP/2.0\r\n\r\n", 400, "an unknown version");
    expect_status(port, "GET metrics HTTP/1.1\r\n\r\n", 400, "a target without /");
    expect_status(port, " GET /metrics HTTP/1.1\r\n\r\n", 400, "an empty method");
    expect_status(port, "G(T /metrics HTTP/1.1\r\n\r\n", 400, "a method that is not a token");
    expect_status(port, "GET /me\x01trics HTTP/1.1\r\n\r\n", 400, "a control in the target");
    expect_status(port, "POST /metrics HTTP/1.1\r\n\r\n", 405, "POST");
    expect_status(port, "DELETE / HTTP/1.1\r\n\r\n", 405, "DELETE");
    expect_status(port, "GET /nope HTTP/1.1\r\n\r\n", 404, "unknown path");

    char *r = ask(port, "PUT /metrics HTTP/1.1\r\n\r\n");
    EXPECT_CONTAINS(r, "\r\nAllow: GET, HEAD\r\n", "405 says what is allowed");
    free(r);
    r = ask(port, "GET /metrics HTTP/1.1\r\n\r\n");
    EXPECT_CONTAINS(r, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n", "type");
    EXPECT_CONTAINS(r, "\r\nContent-Length: 14\r\n", "length");
    EXPECT_CONTAINS(r, "\r\nConnection: close\r\n\r\nfake_metric 1\n", "the rendered body");
    free(r);
    r = ask(port, "GET /stats.json HTTP/1.1\r\n\r\n");
    EXPECT_CONTAINS(r, "\r\nContent-Type: application/json\r\n", "JSON type");
    EXPECT_CONTAINS(r, "\r\n\r\n{\"fake\": 1}\n", "the JSON body");
    free(r);
    r = ask(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
    EXPECT_INT_EQ(status(r), 200, "HEAD");
    EXPECT_CONTAINS(r, "\r\nContent-Length: 14\r\n", "HEAD: the GET's length");
    EXPECT_TRUE(r && strcmp(r + strlen(r) - 4, "\r\n\r\n") == 0, "HEAD: no body");
    free(r);
    r = ask(port, "GET / HTTP/1.1\r\n\r\n");
    EXPECT_INT_EQ(status(r), 200, "the page");
    EXPECT_CONTAINS(r, "\r\nContent-Security-Policy: ", "the page's CSP");
    free(r);
}

static void test_bounds(int port) {
    /* A long target within the bound is parsed like any other. */
    size_t n = 7000;
    char *req = malloc(n + 64);
    int k = snprintf(req, n + 64, "GET /");
    memset(req + k, 'a', n);
    snprintf(req + k + n, 64, " HTTP/1.1\r\n\r\n");
    expect_status(port, req, 404, "a 7000-byte path");

    /* Past 8 KiB before the end of the headers: 431, whether it is the request
     * line or a flood of headers. */
    free(req);
    n = 9000;
    req = malloc(n + 64);
    k = snprintf(req, n + 64, "GET /");
    memset(req + k, 'a', n);
    snprintf(req + k + n, 64, " HTTP/1.1\r\n\r\n");
    expect_status(port, req, 431, "a 9000-byte request line");
    EXPECT_UINT_EQ(count_of(414), 0, "414 is never sent");
    free(req);

    size_t cap = 20000, len = 0;
    req = malloc(cap);
    len += (size_t)snprintf(req, cap, "GET /metrics HTTP/1.1\r\n");
    for (int i = 0; len + 32 < cap; i++)
        len += (size_t)snprintf(req + len, cap - len, "X-Flood-%d: yes\r\n", i);
    snprintf(req + len, cap - len, "\r\n");
    expect_status(port, req, 431, "a header flood");
    free(req);

    /* The bound counts bytes however they arrive: headers sent in pieces. */
    uint64_t before = count_of(431);
    int fd = connect_tcp(port);
    char line[64];
    int sent_ok = 1;
    for (int i = 0; i < 1000 && sent_ok; i++) {
        int m = snprintf(line, sizeof(line), "X-Slow-%04d: yes\r\n", i);
        sent_ok = send(fd, i ? line : "GET /metrics HTTP/1.1\r\n", i ? (size_t)m : 23,
                       MSG_NOSIGNAL) > 0;
    }
    char *r = exchange(fd, "", 0);
    EXPECT_INT_EQ(status(r), 431, "headers in 1000 sends");
    EXPECT_UINT_EQ(count_of(431), before + 1, "counted");
    free(r);
}

static void test_render_failure(int port) {
    __atomic_store_n(&fail_render, 1, __ATOMIC_RELAXED);
    expect_status(port, "GET /metrics HTTP/1.1\r\n\r\n", 500, "render fails");
    char *r = ask(port, "GET /stats.json HTTP/1.1\r\n\r\n");
    EXPECT_CONTAINS(r, "cannot take a snapshot", "says why");
    free(r);
    __atomic_store_n(&fail_render, 0, __ATOMIC_RELAXED);
    int before = __atomic_load_n(&renders, __ATOMIC_RELAXED);
    expect_status(port, "GET /nope HTTP/1.1\r\n\r\n", 404, "unknown path");
    expect_status(port, "POST /metrics HTTP/1.1\r\n\r\n", 405, "wrong method");
    expect_status(port, "GET / HTTP/1.1\r\n\r\n", 200, "the page");
    EXPECT_INT_EQ(__atomic_load_n(&renders, __ATOMIC_RELAXED), before,
                  "only /metrics and /stats.json take a snapshot");
}

static void test_tcp(void) {
    dm_http_t *h = NULL;
    char url[200] = "";
    EXPECT_INT_EQ(dm__http_start_tcp("127.0.0.1:0", fake_render, &h, url, sizeof(url)), 0,
                  "start on port 0");
    int port = 0;
    EXPECT_INT_EQ(sscanf(url, "http://127.0.0.1:%d/metrics", &port), 1, url);
    if (!h || !port)
        return;
    test_request_line(port);
    test_bounds(port);
    test_render_failure(port);
    dm__http_stop(h);
    EXPECT_TRUE(connect_tcp(port) < 0, "stopped: nothing listens");

    EXPECT_INT_EQ(dm__http_start_tcp("127.0.0.1:99999", fake_render, &h, url, sizeof(url)),
                  DM_ESYS, "a port past 65535 is refused");
}

static void test_unix(void) {
    char dir[] = "/tmp/dm_http_test_XXXXXX";
    if (!mkdtemp(dir)) {
        TEST_FAIL_("mkdtemp: %s", dir);
        return;
    }
    char path[128];
    snprintf(path, sizeof(path), "%s/stats.sock", dir);

    /* A stale socket (nobody accepts on it) is replaced. */
    int stale = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
    EXPECT_INT_EQ(bind(stale, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind a stale socket");
    close(stale);

    dm_http_t *h = NULL;
    EXPECT_INT_EQ(dm__http_start_unix(path, fake_render, &h), 0, "start over a stale socket");
    struct stat st;
    EXPECT_INT_EQ(lstat(path, &st), 0, "the socket is there");
    EXPECT_TRUE(S_ISSOCK(st.st_mode), "a socket");
    EXPECT_INT_EQ(st.st_mode & 0777, 0600, "mode 0600: this user only");
    char *r = exchange(connect_unix(path), "GET /metrics HTTP/1.1\r\n\r\n", 25);
    EXPECT_INT_EQ(status(r), 200, "served over the Unix socket");
    EXPECT_CONTAINS(r, "fake_metric 1\n", "body");
    free(r);

    /* A live socket is not taken over. */
    dm_http_t *h2 = NULL;
    EXPECT_INT_EQ(dm__http_start_unix(path, fake_render, &h2), DM_ESYS, "in use");
    dm__http_stop(h);
    EXPECT_TRUE(access(path, F_OK) != 0, "the path goes with the server");

    /* A file that is not a socket is left alone. */
    FILE *f = fopen(path, "w");
    fputs("precious\n", f);
    fclose(f);
    EXPECT_INT_EQ(dm__http_start_unix(path, fake_render, &h2), DM_ESYS, "a regular file");
    char buf[32] = "";
    f = fopen(path, "r");
    if (f) {
        EXPECT_TRUE(fgets(buf, sizeof(buf), f) != NULL, "read back");
        fclose(f);
    }
    EXPECT_STR_EQ(buf, "precious\n", "untouched");
    unlink(path);
    rmdir(dir);
}

static void test_check_address(void) {
    bool lo = false;
    EXPECT_INT_EQ(dm__http_check_address("127.0.0.1:9100", &lo), 0, "IPv4");
    EXPECT_TRUE(lo, "127.0.0.1 is loopback");
    EXPECT_INT_EQ(dm__http_check_address("[::1]:0", &lo), 0, "IPv6");
    EXPECT_TRUE(lo, "::1 is loopback");
    EXPECT_INT_EQ(dm__http_check_address("127.3.4.5:1", &lo), 0, "127/8");
    EXPECT_TRUE(lo, "all of 127/8 is loopback");
    EXPECT_INT_EQ(dm__http_check_address("0.0.0.0:9100", &lo), 0, "the wildcard");
    EXPECT_TRUE(!lo, "0.0.0.0 is every interface");
    EXPECT_INT_EQ(dm__http_check_address("10.1.2.3:9100", &lo), 0, "private");
    EXPECT_TRUE(!lo, "10.1.2.3 is not loopback");
    const char *bad[] = {"127.0.0.1", "127.0.0.1:", ":9100", "127.0.0.1:65536",
                         "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:9a", "127.0.0.1:000001"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        EXPECT_INT_EQ(dm__http_check_address(bad[i], &lo), DM_ERANGE, bad[i]);
}

int main(void) {
    test_tcp();
    test_unix();
    test_check_address();
    return TEST_EXIT();
}
