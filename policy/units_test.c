/*
 * units_test.c: the value syntax (sizes, durations, globs, booleans, names,
 * dtypes) and the text helpers behind diagnostics (positions, UTF-8, quoting,
 * nearest names), table-driven.
 */
#include <stdint.h>

#include "policy/internal.h"
#include "policy/policy.h"
#include "policy/schema.h"
#include "testing/test.h"

static void test_sizes(void) {
    static const struct {
        const char *s;
        int rc;
        size_t v;
    } cases[] = {
        {"0", 0, 0},
        {"4096", 0, 4096},
        {"64KiB", 0, 65536},
        {"8 MiB", 0, 8u << 20},
        {"1GiB", 0, 1u << 30},
        {"2TiB", 0, 2ull << 40},
        {"3KB", 0, 3000},
        {"5MB", 0, 5000000},
        {"1GB", 0, 1000000000},
        {"1TB", 0, 1000000000000ull},
        {"7B", 0, 7},
        {"18446744073709551615", 0, SIZE_MAX},
        {"18446744073709551616", DM_ERANGE, 0},
        {"99999999999999999999999", DM_ERANGE, 0},
        {"16777216TiB", DM_ERANGE, 0},
        {"16777215TiB", 0, 16777215ull << 40},
        {"", DM_EINVALID, 0},
        {"k", DM_EINVALID, 0},
        {"8k", DM_EINVALID, 0},
        {"8K", DM_EINVALID, 0},
        {"8kib", DM_EINVALID, 0},
        {"8M", DM_EINVALID, 0},
        {"1.5GiB", 0, 3ull << 29},
        {"0.5KiB", 0, 512},
        {"1.25 MiB", 0, 1310720},
        {"1.000000000001TB", 0, 1000000000001ull},
        {"1.0000000000001TB", DM_EINVALID, 0}, /* 13 fraction digits */
        {"1.1KiB", DM_EINVALID, 0},            /* 1126.4 bytes: never rounded */
        {"1.5", DM_EINVALID, 0},               /* bytes are whole */
        {"1.5B", DM_EINVALID, 0},
        {"1.GiB", DM_EINVALID, 0},
        {".5GiB", DM_EINVALID, 0},
        {"1..5GiB", DM_EINVALID, 0},
        {"16777215.99TiB", DM_EINVALID, 0},
        {"16777215.5TiB", 0, (16777215ull << 40) + (1ull << 39)},
        {"16777216.0TiB", DM_ERANGE, 0},
        {"-1", DM_EINVALID, 0},
        {"+1", DM_EINVALID, 0},
        {" 1", DM_EINVALID, 0},
        {"1 ", DM_EINVALID, 0},
        {"0x10", DM_EINVALID, 0},
        {"8MiBs", DM_EINVALID, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t v = 12345;
        int rc = dm_parse_size(cases[i].s, &v);
        EXPECT_INT_EQ(rc, cases[i].rc, cases[i].s);
        if (rc == 0)
            EXPECT_UINT_EQ(v, cases[i].v, cases[i].s);
    }
}

/* worker_limit: a size, or a share in per-mille (0.1% .. 100%). */
static void test_shares(void) {
    static const struct {
        const char *s;
        int rc;
        uint64_t bytes;
        unsigned permille;
    } cases[] = {
        {"", 0, 0, 0},
        {"85%", 0, 0, 850},
        {"92.5%", 0, 0, 925},
        {"100%", 0, 0, 1000},
        {"0.1%", 0, 0, 1},
        {"8GiB", 0, 8ull << 30, 0},
        {"4096", 0, 4096, 0},
        {"0%", DM_ERANGE, 0, 0},
        {"100.1%", DM_ERANGE, 0, 0},
        {"150%", DM_ERANGE, 0, 0},
        {"0", DM_EINVALID, 0, 0},
        {"%", DM_EINVALID, 0, 0},
        {"85 %", DM_EINVALID, 0, 0},
        {"8.%", DM_EINVALID, 0, 0},
        {"1.25%", DM_EINVALID, 0, 0},
        {"-5%", DM_EINVALID, 0, 0},
        {"12345%", DM_EINVALID, 0, 0},
        {"lots", DM_EINVALID, 0, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint64_t b = 7;
        unsigned pm = 7;
        int rc = dm_parse_share(cases[i].s, &b, &pm);
        EXPECT_INT_EQ(rc, cases[i].rc, cases[i].s);
        if (rc == 0) {
            EXPECT_UINT_EQ(b, cases[i].bytes, cases[i].s);
            EXPECT_UINT_EQ(pm, cases[i].permille, cases[i].s);
        }
    }
}

static void test_durations(void) {
    static const struct {
        const char *s;
        int rc;
        int64_t v;
    } cases[] = {
        {"0", 0, 0},
        {"250", 0, 250},
        {"250ms", 0, 250},
        {"250 ms", 0, 250},
        {"10s", 0, 10000},
        {"1.5s", 0, 1500},
        {"0.001s", 0, 1},
        {"1.2500s", 0, 1250},
        {"1.2345s", DM_EINVALID, 0},
        {"never", 0, -1},
        {"-1", 0, -1},
        {"-2", DM_EINVALID, 0},
        {"1.5ms", DM_EINVALID, 0},
        {"1.5", DM_EINVALID, 0},
        {"1.", DM_EINVALID, 0},
        {"1.s", DM_EINVALID, 0},
        {"10m", DM_EINVALID, 0},
        {"10S", DM_EINVALID, 0},
        {"Never", DM_EINVALID, 0},
        {"", DM_EINVALID, 0},
        {"s", DM_EINVALID, 0},
        {"9223372036854775807", 0, INT64_MAX},
        {"9223372036854775808", DM_ERANGE, 0},
        {"9223372036854775s", 0, 9223372036854775000},
        {"9223372036854776s", DM_ERANGE, 0},
        {"9223372036854775.807s", 0, INT64_MAX},
        {"9223372036854775.808s", DM_ERANGE, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = 12345;
        int rc = dm_parse_duration_ms(cases[i].s, &v);
        EXPECT_INT_EQ(rc, cases[i].rc, cases[i].s);
        if (rc == 0)
            EXPECT_INT_EQ(v, cases[i].v, cases[i].s);
    }
}

static void test_globs(void) {
    static const struct {
        const char *g;
        bool ok;
        size_t off;
    } cases[] = {
        {"loader-*", true, 0},   {"*", true, 0},         {"w?rker", true, 0},
        {"[abc]x", true, 0},     {"[!a]x", true, 0},     {"[]]", true, 0},
        {"[^]]x", true, 0},      {"a\\[", true, 0},      {"[[:alpha:]]", true, 0},
        {"", false, 0},          {"loader-[0-9", false, 7}, {"a[", false, 1},
        {"[!", false, 0},        {"[]", false, 0},       {"ab\\", false, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t off = 99;
        const char *why = NULL;
        bool ok = dm_glob_valid(cases[i].g, &off, &why);
        EXPECT_INT_EQ(ok, cases[i].ok, cases[i].g);
        if (!ok && cases[i].g[0]) {
            EXPECT_UINT_EQ(off, cases[i].off, cases[i].g);
            EXPECT_TRUE(why != NULL, cases[i].g);
        }
    }
    EXPECT_TRUE(!dm_glob_valid("[", NULL, NULL), "NULL out-params are allowed");
}

static void test_words(void) {
    bool b = false;
    const char *yes[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"};
    const char *no[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"};
    const char *bad[] = {"tRUE", "1", "0", "y", "n", "", "truex"};
    for (size_t i = 0; i < 9; i++) {
        EXPECT_INT_EQ(dm__units_bool_parse(yes[i], &b), 0, yes[i]);
        EXPECT_TRUE(b, yes[i]);
        EXPECT_INT_EQ(dm__units_bool_parse(no[i], &b), 0, no[i]);
        EXPECT_TRUE(!b, no[i]);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        EXPECT_INT_EQ(dm__units_bool_parse(bad[i], &b), -1, bad[i]);
    EXPECT_TRUE(dm__units_yaml_null("") && dm__units_yaml_null("~") && dm__units_yaml_null("null") &&
                dm__units_yaml_null("Null") && dm__units_yaml_null("NULL"), "nulls");
    EXPECT_TRUE(!dm__units_yaml_null("nul") && !dm__units_yaml_null("nUll"), "not nulls");
    EXPECT_TRUE(dm__units_name_valid("a") && dm__units_name_valid("_x-1") &&
                dm__units_name_valid("Big_arena-2"), "valid names");
    EXPECT_TRUE(!dm__units_name_valid("") && !dm__units_name_valid("1a") &&
                !dm__units_name_valid("-a") && !dm__units_name_valid("a b") &&
                !dm__units_name_valid("a.b") && !dm__units_name_valid("\xc3\xa9"), "invalid names");
    char n63[64], n64[65];
    memset(n63, 'a', 63), n63[63] = '\0';
    memset(n64, 'a', 64), n64[64] = '\0';
    EXPECT_TRUE(dm__units_name_valid(n63) && !dm__units_name_valid(n64), "name length");
}

static void test_dtypes(void) {
    for (int dt = 0; dt < DM_DT_COUNT; dt++) {
        EXPECT_TRUE(dm_dtype_name(dt) != NULL, "every code has a name");
        EXPECT_INT_EQ(dm_dtype_from_name(dm_dtype_name(dt)), dt, dm_dtype_name(dt));
        if (dt > DM_DT_UNKNOWN)
            EXPECT_UINT_EQ(dm__units_dtype_mask(dm_dtype_name(dt)), 1u << dt,
                           dm_dtype_name(dt));
    }
    EXPECT_TRUE(dm_dtype_name(-1) == NULL && dm_dtype_name(DM_DT_COUNT) == NULL,
                "out of range");
    EXPECT_UINT_EQ(dm__units_dtype_mask("unknown"), 0, "unknown cannot be matched");
    EXPECT_UINT_EQ(dm__units_dtype_mask("int"),
                   (1u << DM_DT_INT8) | (1u << DM_DT_INT16) | (1u << DM_DT_INT32) |
                       (1u << DM_DT_INT64), "int = signed ints");
    EXPECT_UINT_EQ(dm__units_dtype_mask("integer"), dm__units_dtype_mask("int") | dm__units_dtype_mask("uint"),
                   "integer");
    EXPECT_UINT_EQ(dm__units_dtype_mask("float"),
                   (1u << DM_DT_FLOAT16) | (1u << DM_DT_FLOAT32) |
                       (1u << DM_DT_FLOAT64) | (1u << DM_DT_LONGDOUBLE), "float");
    EXPECT_UINT_EQ(dm__units_dtype_mask("number"),
                   dm__units_dtype_mask("integer") | dm__units_dtype_mask("float") |
                       dm__units_dtype_mask("complex"), "number");
    EXPECT_UINT_EQ(dm__units_dtype_mask("datetime"), 1u << DM_DT_DATETIME, "datetime");
    EXPECT_UINT_EQ(dm__units_dtype_mask("str"), 1u << DM_DT_STR, "str");
    EXPECT_UINT_EQ(dm__units_dtype_mask("float33"), 0, "no such dtype");
    EXPECT_TRUE(DM_DT_COUNT <= DM_DT_SLOTS, "a view row holds every dtype");
}

static void test_text(void) {
    int line, col;
    const char *t = "ab\ncd\r\nef\rg\xc3\xa9h\xe2\x80\xa8xy";
    dm__text_pos(t, strlen(t), 0, &line, &col);
    EXPECT_INT_EQ(line * 100 + col, 101, "start");
    dm__text_pos(t, strlen(t), 4, &line, &col);
    EXPECT_INT_EQ(line * 100 + col, 202, "after \\n");
    dm__text_pos(t, strlen(t), 7, &line, &col);
    EXPECT_INT_EQ(line * 100 + col, 301, "\\r\\n is one break");
    dm__text_pos(t, strlen(t), 13, &line, &col);
    EXPECT_INT_EQ(line * 100 + col, 403, "\\r alone breaks; columns count characters");
    dm__text_pos(t, strlen(t), 18, &line, &col);
    EXPECT_INT_EQ(line * 100 + col, 502, "U+2028 breaks a line as in libyaml");
    char src[16];
    dm__text_source_line(t, strlen(t), 4, src, sizeof src);
    EXPECT_STR_EQ(src, "g\xc3\xa9h", "source line keeps UTF-8");
    dm__text_source_line("a\x01\xff\tb", 5, 1, src, sizeof src);
    EXPECT_STR_EQ(src, "a??\tb", "control and invalid bytes are masked, tabs kept");
    dm__text_source_line("abc", 3, 2, src, sizeof src);
    EXPECT_STR_EQ(src, "", "no such line");

    EXPECT_UINT_EQ(dm__text_utf8_check("ok \xc3\xa9", 5), 5, "valid");
    EXPECT_UINT_EQ(dm__text_utf8_check("ab\xff", 3), 2, "0xff");
    EXPECT_UINT_EQ(dm__text_utf8_check("a\xc0\x80", 3), 1, "overlong NUL");
    EXPECT_UINT_EQ(dm__text_utf8_check("\xed\xa0\x80", 3), 0, "surrogate");
    EXPECT_UINT_EQ(dm__text_utf8_check("\xf4\x90\x80\x80", 4), 0, "above U+10FFFF");
    EXPECT_UINT_EQ(dm__text_utf8_check("x\xe2\x82", 3), 1, "truncated");

    char q[DM__QUOTE_CAP];
    EXPECT_STR_EQ(dm__text_quote(q, sizeof q, "a'b\n\x1b", 5), "'a\\'b\\x0a\\x1b'",
                  "quote escapes");
    char long_s[200];
    memset(long_s, 'x', sizeof long_s);
    dm__text_quote(q, sizeof q, long_s, sizeof long_s);
    EXPECT_TRUE(strlen(q) < sizeof q && strstr(q, "...'"), q);

    const char *keys[] = {"alignment", "hugepages", "numa", "per_node", "decay"};
    EXPECT_STR_EQ(dm__text_nearest("alignmnet", keys, 5), "alignment", "swap");
    EXPECT_STR_EQ(dm__text_nearest("hugepage", keys, 5), "hugepages", "missing letter");
    EXPECT_STR_EQ(dm__text_nearest("pernode", keys, 5), "per_node", "missing _");
    EXPECT_TRUE(dm__text_nearest("colour", keys, 5) == NULL, "nothing close");
    EXPECT_TRUE(dm__text_nearest("x", keys, 0) == NULL, "no candidates");
}

static void test_sbuf(void) {
    char small[8];
    dm__sbuf_t b;
    dm__text_sb_init(&b, small, sizeof small);
    dm__text_sb_printf(&b, "%s", "0123456789");
    dm__text_sb_putc(&b, '!', 3);
    EXPECT_INT_EQ(dm__text_sb_done(&b), 13, "length as if unbounded");
    EXPECT_STR_EQ(small, "0123456", "truncated, terminated");
    EXPECT_STR_EQ(dm_strerror(DM_EINVALID), "invalid policy", "strerror");
    EXPECT_STR_EQ(dm_strerror(0), "success", "strerror 0");
    EXPECT_STR_EQ(dm_strerror(-999), "unknown error", "strerror unknown");
}

int main(void) {
    test_sizes();
    test_durations();
    test_globs();
    test_words();
    test_dtypes();
    test_shares();
    test_text();
    test_sbuf();
    return TEST_EXIT();
}
