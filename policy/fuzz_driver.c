/*
 * fuzz_driver.c: replays files through LLVMFuzzerTestOneInput without
 * libFuzzer, so that the seed corpus and the policy fixtures run as a plain
 * test under any compiler (//policy:parse_fuzz_test). Arguments are files or
 * directories (walked recursively).
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    static uint8_t buf[(1 << 20) + 1];
    if (!f) {
        perror(path);
        return 1;
    }
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    return 0;
}

static int run_path(const char *path, int *count) {
    struct stat st;
    if (stat(path, &st) != 0) {
        perror(path);
        return 1;
    }
    if (!S_ISDIR(st.st_mode))
        return (*count)++, run_file(path);
    DIR *dp = opendir(path);
    struct dirent *e;
    char child[4096];
    int bad = 0;
    while (dp && (e = readdir(dp))) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        bad |= run_path(child, count);
    }
    if (dp)
        closedir(dp);
    return bad;
}

int main(int argc, char **argv) {
    int count = 0, bad = 0;
    for (int i = 1; i < argc; i++)
        bad |= run_path(argv[i], &count);
    printf("%d input%s replayed\n", count, count == 1 ? "" : "s");
    if (count == 0)
        fprintf(stderr, "no inputs\n");
    return bad || count == 0;
}
