/*
 * units.c: the syntax of single values: sizes, durations, globs, booleans,
 * names and dtypes.
 *
 * Every input is untrusted (these are fuzzed directly): no allocation, overflow
 * checked, NUL-terminated strings only. Pure functions, safe from any thread.
 */
#include <stdbool.h>
#include <string.h>

#include "policy/internal.h"
#include "policy/schema.h"

/* Reads decimal digits at *s into *v; returns digits read, -1 on overflow. */
static int read_digits(const char **s, uint64_t *v) {
    int n = 0;
    *v = 0;
    for (; **s >= '0' && **s <= '9'; (*s)++, n++) {
        unsigned d = (unsigned)(**s - '0');
        if (*v > (UINT64_MAX - d) / 10)
            return -1;
        *v = *v * 10 + d;
    }
    return n;
}

static const char *skip_spaces(const char *s) {
    while (*s == ' ')
        s++;
    return s;
}

typedef struct unit {
    const char *suffix;
    uint64_t mult;
} unit_t;

static const unit_t size_units[] = {
#define DM_UNIT_ROW(suffix, mult) {suffix, mult},
    DM_SIZE_UNITS(DM_UNIT_ROW)
};
static const unit_t duration_units[] = {
    DM_DURATION_UNITS(DM_UNIT_ROW)
#undef DM_UNIT_ROW
};

/* The unit spelled exactly `s`, or NULL. */
static const unit_t *find_unit(const unit_t *units, size_t n, const char *s) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, units[i].suffix) == 0)
            return &units[i];
    return NULL;
}

/* "N", "N UNIT" or "N.F UNIT": a decimal fraction needs a unit, and the
 * result must be a whole number of bytes (1.5GiB is 1610612736; 1.1KiB, 1126.4
 * bytes, is DM_EINVALID: a size is never rounded into another). At most 12
 * fraction digits, so that F * unit fits in 128 bits with room. */
int dm_parse_size(const char *s, size_t *out) {
    uint64_t v, frac = 0, scale = 1;
    int n = read_digits(&s, &v);
    if (n == 0)
        return DM_EINVALID;
    if (n < 0)
        return DM_ERANGE;
    bool fraction = *s == '.';
    if (fraction) {
        s++;
        const char *f = s;
        int nf = read_digits(&s, &frac);
        if (nf <= 0 || nf > 12)
            return DM_EINVALID;
        for (const char *c = f; c < s; c++)
            scale *= 10;
    }
    const char *u = skip_spaces(s);
    if (*u == '\0' && u == s) {
        if (fraction)
            return DM_EINVALID; /* bytes are whole */
        *out = (size_t)v;
        return v > SIZE_MAX ? DM_ERANGE : 0;
    }
    const unit_t *unit = find_unit(size_units, sizeof size_units / sizeof *size_units, u);
    if (!unit)
        return DM_EINVALID;
    unsigned __int128 part = (unsigned __int128)frac * unit->mult;
    if (part % scale)
        return DM_EINVALID;
    unsigned __int128 total = (unsigned __int128)v * unit->mult + part / scale;
    if (total > SIZE_MAX)
        return DM_ERANGE;
    *out = (size_t)total;
    return 0;
}

int dm_parse_share(const char *s, uint64_t *bytes, unsigned *permille) {
    *bytes = 0;
    *permille = 0;
    if (!*s)
        return 0;
    size_t len = strlen(s);
    if (s[len - 1] != '%') {
        size_t v;
        int rc = dm_parse_size(s, &v);
        if (rc == 0 && v == 0)
            return DM_EINVALID; /* 0 bytes would refuse everything: "" is none */
        *bytes = v;
        return rc;
    }
    /* "N%" or "N.D%": whole per-mille, 0.1% .. 100% */
    unsigned whole = 0, tenth = 0;
    const char *q = s;
    int nd = 0;
    for (; *q >= '0' && *q <= '9' && nd < 4; q++, nd++)
        whole = whole * 10 + (unsigned)(*q - '0');
    if (nd == 0)
        return DM_EINVALID;
    if (*q == '.') {
        q++;
        if (*q < '0' || *q > '9')
            return DM_EINVALID;
        tenth = (unsigned)(*q++ - '0');
    }
    if (*q != '%' || q[1] != '\0')
        return DM_EINVALID;
    unsigned pm = whole * 10 + tenth;
    if (pm == 0 || pm > 1000)
        return DM_ERANGE;
    *permille = pm;
    return 0;
}

/* Fraction digits after '.' as thousandths; -1 unless they are whole ones. */
static int64_t read_millis_fraction(const char **s) {
    int64_t ms = 0;
    int k = 0;
    for (; **s >= '0' && **s <= '9'; (*s)++, k++) {
        if (k < 3)
            ms = ms * 10 + (**s - '0');
        else if (**s != '0')
            return -1;
    }
    if (k == 0)
        return -1;
    for (; k < 3; k++)
        ms *= 10;
    return ms;
}

int dm_parse_duration_ms(const char *s, int64_t *out) {
    uint64_t v;
    int64_t frac = 0;
    if (strcmp(s, "never") == 0 || strcmp(s, "-1") == 0) {
        *out = -1;
        return 0;
    }
    int n = read_digits(&s, &v);
    if (n == 0)
        return DM_EINVALID;
    if (n < 0 || v > INT64_MAX)
        return DM_ERANGE;
    bool dot = *s == '.';
    if (dot) {
        s++;
        if ((frac = read_millis_fraction(&s)) < 0)
            return DM_EINVALID;
    }
    const char *u = skip_spaces(s);
    if (*u == '\0' && u == s) {
        *out = (int64_t)v;
        return dot ? DM_EINVALID : 0; /* "1.5": a fraction needs a unit */
    }
    const unit_t *unit =
        find_unit(duration_units, sizeof duration_units / sizeof *duration_units, u);
    if (!unit || (unit->mult == 1 && dot)) /* "1.5ms": not whole milliseconds */
        return DM_EINVALID;
    int64_t mult = (int64_t)unit->mult;
    if ((int64_t)v > (INT64_MAX - frac) / mult)
        return DM_ERANGE;
    *out = (int64_t)v * mult + (mult == 1 ? 0 : frac);
    return 0;
}

bool dm_glob_valid(const char *g, size_t *off, const char **why) {
    const char *reason = NULL;
    size_t i = 0, at = 0;
    if (!g || !*g)
        reason = "a glob cannot be empty";
    for (; !reason && g[i]; i++) {
        if (g[i] == '\\') {
            if (!g[i + 1])
                at = i, reason = "trailing backslash";
            else
                i++;
        } else if (g[i] == '[') {
            size_t j = i + 1;
            if (g[j] == '!' || g[j] == '^')
                j++;
            if (g[j] == ']')
                j++; /* a leading ] is a member */
            while (g[j] && g[j] != ']')
                j++;
            if (!g[j])
                at = i, reason = "unbalanced '[': no closing ']'";
            else
                i = j;
        }
    }
    if (reason) {
        if (off)
            *off = at;
        if (why)
            *why = reason;
    }
    return reason == NULL;
}

/* ---- names, booleans, nulls ------------------------------------------- */

bool dm__units_name_valid(const char *s) {
    size_t n = 0;
    for (; s[n]; n++) {
        char c = s[n];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        bool more = (c >= '0' && c <= '9') || c == '-';
        if (!alpha && (n == 0 || !more))
            return false;
    }
    return n >= 1 && n < DM_NAME_MAX;
}

/* Whether s is w, w Capitalised or W in upper case. */
static bool word_any_case(const char *s, const char *w) {
    size_t n = strlen(w);
    if (strlen(s) != n)
        return false;
    bool same = true, cap = true, upper = true;
    for (size_t i = 0; i < n; i++) {
        char up = (char)(w[i] - 'a' + 'A');
        same &= s[i] == w[i];
        cap &= s[i] == (i == 0 ? up : w[i]);
        upper &= s[i] == up;
    }
    return same || cap || upper;
}

int dm__units_bool_parse(const char *s, bool *out) {
    static const char *const words[] = {"true", "yes", "on",
                                        "false", "no", "off"};
    for (int i = 0; i < 6; i++) {
        if (word_any_case(s, words[i])) {
            *out = i < 3;
            return 0;
        }
    }
    return -1;
}

bool dm__units_yaml_null(const char *s) {
    return s[0] == '\0' || strcmp(s, "~") == 0 || word_any_case(s, "null");
}

/* ---- dtypes ----------------------------------------------------------- */

static const char *const dtype_names[DM_DT_COUNT] = {
#define DM_DT_NAME(sym, name, num) [num] = name,
    DM_DTYPE_LIST(DM_DT_NAME)
#undef DM_DT_NAME
};

const char *dm_dtype_name(int dt) {
    return (dt >= 0 && dt < DM_DT_COUNT) ? dtype_names[dt] : NULL;
}

int dm_dtype_from_name(const char *name) {
    for (int i = 0; i < DM_DT_COUNT; i++)
        if (strcmp(name, dtype_names[i]) == 0)
            return i;
    return -1;
}

dm_dtype_mask_t dm__units_dtype_mask(const char *name) {
    static const struct {
        const char *name;
        dm_dtype_mask_t mask;
    } kinds[] = {
#define DM_KIND_ROW(name, mask, doc) {name, mask},
        DM_DTYPE_KINDS(DM_KIND_ROW)
#undef DM_KIND_ROW
    };
    int dt = dm_dtype_from_name(name);
    if (dt > DM_DT_UNKNOWN)
        return 1u << dt;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (strcmp(name, kinds[i].name) == 0)
            return kinds[i].mask;
    return 0;
}
