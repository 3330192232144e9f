/*
 * test.h: assertions for the C tests that print both sides, where, and why
 * (libuv's ASSERT_EQ, jemalloc's expect_zu_eq). A failed assertion counts and
 * the test goes on; TEST_EXIT() returns non-zero if any failed.
 */
#ifndef DM_TESTING_TEST_H
#define DM_TESTING_TEST_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int test_failures;

#define TEST_FAIL_(fmt, ...)                                                   \
    (test_failures++,                                                          \
     fprintf(stderr, "%s:%d: FAIL: " fmt "\n", __FILE__, __LINE__, __VA_ARGS__))

/* Any condition, with a printf-style account of what it was about. */
#define EXPECT(cond, ...)                                                      \
    do {                                                                       \
        if (!(cond)) {                                                         \
            TEST_FAIL_("%s is false", #cond);                                  \
            fprintf(stderr, "  " __VA_ARGS__);                                 \
            fputc('\n', stderr);                                               \
        }                                                                      \
    } while (0)

/* Integers of any width, compared as intmax_t. */
#define EXPECT_INT_EQ(a, b, why)                                               \
    do {                                                                       \
        intmax_t a_ = (intmax_t)(a), b_ = (intmax_t)(b);                       \
        if (a_ != b_)                                                          \
            TEST_FAIL_("%s == %s: %jd != %jd (%s)", #a, #b, a_, b_, why);      \
    } while (0)

#define EXPECT_UINT_EQ(a, b, why)                                              \
    do {                                                                       \
        uintmax_t a_ = (uintmax_t)(a), b_ = (uintmax_t)(b);                    \
        if (a_ != b_)                                                          \
            TEST_FAIL_("%s == %s: %ju != %ju (%s)", #a, #b, a_, b_, why);      \
    } while (0)

#define EXPECT_STR_EQ(a, b, why)                                               \
    do {                                                                       \
        const char *a_ = (a), *b_ = (b);                                       \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                 \
            TEST_FAIL_("%s == %s:\n  got:      \"%s\"\n  expected: \"%s\"\n  (%s)", \
                       #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)", why);   \
    } while (0)

/* `hay` contains `needle`. */
#define EXPECT_CONTAINS(hay, needle, why)                                      \
    do {                                                                       \
        const char *h_ = (hay), *n_ = (needle);                                \
        if (!h_ || !strstr(h_, n_))                                            \
            TEST_FAIL_("%s contains %s:\n  text:   \"%s\"\n  wanted: \"%s\"\n  (%s)", \
                       #hay, #needle, h_ ? h_ : "(null)", n_, why);            \
    } while (0)

#define EXPECT_TRUE(c, why)                                                    \
    do {                                                                       \
        if (!(c))                                                              \
            TEST_FAIL_("%s is false (%s)", #c, why);                           \
    } while (0)

/* A case the test exists for that cannot run here: another user's file or
 * directory (a chown to uid 65534), a mount. Root can make it run (outside
 * Bazel's sandbox, which maps no other uid: the targets are tagged
 * "no-sandbox"), so as root the skip is a failure; any other user gets a
 * SKIP line in the log. */
#define TEST_SKIP_UNLESS_ROOT(fmt, ...)                                        \
    (geteuid() == 0                                                            \
         ? TEST_FAIL_("as root this case must run, not skip: " fmt, __VA_ARGS__) \
         : printf("SKIP " fmt " (not root)\n", __VA_ARGS__))

/* Writes `text` to `path` (created or truncated); a failure counts. */
static inline void test_put_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) {
        TEST_FAIL_("cannot write %s", path);
        return;
    }
    fputs(text, f);
    fclose(f);
}

#define TEST_EXIT()                                                            \
    (test_failures ? (fprintf(stderr, "%d failure(s)\n", test_failures), 1)   \
                   : (printf("PASS\n"), 0))

#endif /* DM_TESTING_TEST_H */
