/* test_gemm_tune.c — the GEMM tuning table (src/backend/cuda/gemm_tune.c) without a GPU: line parsing
 * (valid, torn, foreign, out-of-range entries), the file's path rules (DG_CUDA_GEMM_TUNE_FILE, none,
 * XDG_CACHE_HOME, HOME), a recorded entry read back by a fresh table, device tags kept apart, entries
 * that another process wrote meanwhile kept on rewrite, an unwritable path (warning; the choice still
 * holds in the process), and concurrent writers never leaving a torn file. Label unit. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gemm_tune.h"
#include "dg_check.h"

static dg_gemm_tune_entry_t mk(const char *tag, int m, int pick, int found) {
    dg_gemm_tune_entry_t e;
    memset(&e, 0, sizeof e);
    snprintf(e.tag, sizeof e.tag, "%s", tag);
    for (int i = 0; i < DG_GEMM_TUNE_KEY_N; i++)
        e.key[i] = i + 1;
    e.key[0] = m;
    e.pick = pick;
    e.found = found;
    e.algo_hash = dg_gemm_tune_hash(&m, sizeof m);
    e.ms_first = 0.25f;
    e.ms_pick = 0.2f;
    return e;
}

static int count_lines(const char *path, int *valid) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[1024];
    int n = 0;
    *valid = 0;
    dg_gemm_tune_entry_t e;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        n++;
        *valid += dg_gemm_tune_parse(line, &e);
    }
    fclose(f);
    return n;
}

static void test_parse(void) {
    dg_gemm_tune_entry_t e;
    const char *ok =
        "v1 NVIDIA_H200/sm90/132sms/cublasLt130100 2304 32768 768 1 0 768 768 2304 14 14 4 0 68 256 "
        "256 256 256 0 32 7 8 00ab12cd34ef5678 0.1733 0.1577\n";
    CHECK(dg_gemm_tune_parse(ok, &e) == 1, "a valid line parses");
    CHECK(e.key[0] == 2304 && e.key[1] == 32768 && e.key[18] == 32, "its key");
    CHECK(e.pick == 7 && e.found == 8 && e.algo_hash == 0x00ab12cd34ef5678ull, "its pick, count and hash");
    CHECK(e.ms_first > 0.1732f && e.ms_first < 0.1734f && e.ms_pick > 0.1576f && e.ms_pick < 0.1578f,
          "times");
    CHECK(strcmp(e.tag, "NVIDIA_H200/sm90/132sms/cublasLt130100") == 0, "its tag");
    char buf[1024];
    /* torn: cut anywhere before the last field ends */
    int torn_ok = 0;
    for (size_t cut = 0; cut + 8 < strlen(ok); cut += 3) {
        snprintf(buf, sizeof buf, "%.*s", (int)cut, ok);
        torn_ok += dg_gemm_tune_parse(buf, &e);
    }
    CHECK(torn_ok == 0, "no truncation of a line parses (%d did)", torn_ok);
    const char *bad[] = {
        "v2 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 0 1 ff 1 1\n",          /* other version */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 8 8 ff 1 1\n",          /* pick >= found */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 -1 8 ff 1 1\n",         /* negative pick */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 0 8 ff 0 1\n",          /* no time */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 0 8 ff 1 1 x\n",        /* trailing garbage */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 0 8 ff 1 1\n",             /* key too short */
        "v1 tag 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 99999999999 19 0 8 ff 1 1\n", /* overflow */
        "# a comment\n",
        "\n",
        "v1\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK(dg_gemm_tune_parse(bad[i], &e) == 0, "bad line %zu is rejected: %s", i, bad[i]);
}

static void test_paths(const char *dir) {
    char p[1024];
    unsetenv("DG_CUDA_GEMM_TUNE_FILE");
    snprintf(p, sizeof p, "%s/xdg", dir);
    setenv("XDG_CACHE_HOME", p, 1);
    dg_gemm_tune_reset();
    char want[1200];
    snprintf(want, sizeof want, "%s/xdg/dgtrain/gemm_tune.txt", dir);
    CHECK(dg_gemm_tune_path() && strcmp(dg_gemm_tune_path(), want) == 0, "XDG_CACHE_HOME: %s",
          dg_gemm_tune_path() ? dg_gemm_tune_path() : "(none)");
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", dir, 1);
    dg_gemm_tune_reset();
    snprintf(want, sizeof want, "%s/.cache/dgtrain/gemm_tune.txt", dir);
    CHECK(dg_gemm_tune_path() && strcmp(dg_gemm_tune_path(), want) == 0, "HOME: %s",
          dg_gemm_tune_path() ? dg_gemm_tune_path() : "(none)");
    setenv("DG_CUDA_GEMM_TUNE_FILE", "none", 1);
    dg_gemm_tune_reset();
    CHECK(dg_gemm_tune_path() == NULL, "none: no file");
    setenv("DG_CUDA_GEMM_TUNE_FILE", "", 1);
    dg_gemm_tune_reset();
    CHECK(dg_gemm_tune_path() == NULL, "empty: no file");
    /* the default path is created (directories included) on the first record */
    unsetenv("DG_CUDA_GEMM_TUNE_FILE");
    dg_gemm_tune_reset();
    dg_gemm_tune_entry_t e = mk("T", 7, 1, 4);
    dg_gemm_tune_record(&e);
    int valid = 0;
    CHECK(count_lines(want, &valid) == 1 && valid == 1, "the default file was created with the entry");
}

static void test_roundtrip(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/sub/dir/tune.txt", dir);
    setenv("DG_CUDA_GEMM_TUNE_FILE", path, 1);
    dg_gemm_tune_reset();
    dg_gemm_tune_entry_t a = mk("devA", 100, 3, 8), b = mk("devB", 100, 5, 8), got;
    CHECK(!dg_gemm_tune_lookup("devA", a.key, &got), "empty table: no hit");
    dg_gemm_tune_record(&a);
    dg_gemm_tune_record(&b);
    CHECK(dg_gemm_tune_lookup("devA", a.key, &got) && got.pick == 3, "hit in the process");
    dg_gemm_tune_reset(); /* a new process */
    CHECK(dg_gemm_tune_lookup("devA", a.key, &got) && got.pick == 3 && got.algo_hash == a.algo_hash,
          "read back from the file");
    CHECK(dg_gemm_tune_lookup("devB", b.key, &got) && got.pick == 5, "the other device's entry kept apart");
    CHECK(!dg_gemm_tune_lookup("devC", a.key, &got), "no hit for a third device");
    int k2[DG_GEMM_TUNE_KEY_N];
    memcpy(k2, a.key, sizeof k2);
    k2[DG_GEMM_TUNE_KEY_N - 1]++;
    CHECK(!dg_gemm_tune_lookup("devA", k2, &got), "no hit for another key");
    /* replace: a later record of the same key wins, in the process and in the file */
    dg_gemm_tune_entry_t a2 = mk("devA", 100, 6, 8);
    dg_gemm_tune_record(&a2);
    dg_gemm_tune_reset();
    CHECK(dg_gemm_tune_lookup("devA", a.key, &got) && got.pick == 6, "the newer entry of a key wins");
    int valid = 0;
    CHECK(count_lines(path, &valid) == 2 && valid == 2, "one line per key (%d valid)", valid);

    /* another process appends meanwhile (and a torn line): this process's rewrite keeps the other's entry
     * and drops the torn line */
    FILE *f = fopen(path, "a");
    CHECK(f != NULL, "append");
    if (f) {
        dg_gemm_tune_entry_t o = mk("devA", 200, 1, 2);
        fprintf(f, "v1 %s", o.tag);
        for (int i = 0; i < DG_GEMM_TUNE_KEY_N; i++)
            fprintf(f, " %d", o.key[i]);
        fprintf(f, " 1 2 %016llx 0.5 0.4\nv1 devA 300 1 2 3\n", (unsigned long long)o.algo_hash);
        fclose(f);
    }
    dg_gemm_tune_entry_t c = mk("devA", 400, 0, 3);
    dg_gemm_tune_record(&c); /* this table had read the file before the append */
    dg_gemm_tune_reset();
    dg_gemm_tune_entry_t o = mk("devA", 200, 1, 2);
    CHECK(dg_gemm_tune_lookup("devA", o.key, &got) && got.pick == 1, "the other process's entry survived");
    CHECK(dg_gemm_tune_lookup("devA", c.key, &got) && got.pick == 0, "this process's new entry");
    CHECK(count_lines(path, &valid) == 4 && valid == 4, "4 valid lines, the torn one gone (%d valid)", valid);
    char tmpname[1200];
    snprintf(tmpname, sizeof tmpname, "%s.tmp.%ld", path, (long)getpid());
    CHECK(access(tmpname, F_OK) != 0, "no temporary file left");
}

static void test_unwritable(const char *dir) {
    char blocker[1024], path[1200];
    snprintf(blocker, sizeof blocker, "%s/afile", dir);
    FILE *f = fopen(blocker, "w");
    if (f) fclose(f);
    snprintf(path, sizeof path, "%s/afile/tune.txt", dir); /* a file where a directory must be */
    setenv("DG_CUDA_GEMM_TUNE_FILE", path, 1);
    dg_gemm_tune_reset();
    dg_gemm_tune_entry_t a = mk("devA", 9, 2, 4), got;
    dg_gemm_tune_record(&a); /* warns once */
    dg_gemm_tune_record(&a);
    CHECK(dg_gemm_tune_lookup("devA", a.key, &got) && got.pick == 2, "the choice holds in the process");
    struct stat st;
    CHECK(stat(path, &st) != 0, "nothing was written");
}

static void test_concurrent(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/conc.txt", dir);
    setenv("DG_CUDA_GEMM_TUNE_FILE", path, 1);
    enum { NP = 6, PER = 40 };
    for (int p = 0; p < NP; p++) {
        pid_t pid = fork();
        if (pid == 0) {
            dg_gemm_tune_reset();
            for (int i = 0; i < PER; i++) {
                dg_gemm_tune_entry_t e = mk("devA", 1000 * (p + 1) + i, i % 4, 4);
                dg_gemm_tune_record(&e);
            }
            _exit(0);
        }
    }
    int ok = 1;
    for (int p = 0; p < NP; p++) {
        int stt = 0;
        wait(&stt);
        ok &= WIFEXITED(stt) && WEXITSTATUS(stt) == 0;
    }
    CHECK(ok, "writers exited cleanly");
    int valid = 0, n = count_lines(path, &valid);
    CHECK(n > 0 && n == valid, "every line of the file parses (%d of %d)", valid, n);
    CHECK(n >= PER, "at least one writer's entries are all there (%d lines)", n);
    dg_gemm_tune_reset();
    dg_gemm_tune_entry_t got;
    int mine = 0;
    for (int p = 0; p < NP; p++) {
        int k = 0;
        for (int i = 0; i < PER; i++) {
            dg_gemm_tune_entry_t e = mk("devA", 1000 * (p + 1) + i, i % 4, 4);
            k += dg_gemm_tune_lookup("devA", e.key, &got) && got.pick == i % 4;
        }
        if (k == PER) mine++;
    }
    CHECK(mine >= 1, "a complete writer's set reads back");
}

int main(void) {
    char dir[64];
    if (dg_test_mkdtemp(dir, sizeof dir, "dg_gemm_tune") != 0) return 1;
    test_parse();
    test_paths(dir);
    test_roundtrip(dir);
    test_unwritable(dir);
    test_concurrent(dir);
    dg_test_rmtree(dir);
    printf("test_gemm_tune: %d checks, %d failed\n", dg_checks, dg_fails);
    return dg_fails ? 1 : 0;
}
