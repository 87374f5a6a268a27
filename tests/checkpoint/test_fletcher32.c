/* test_fletcher32.c — the checkpoint library's H5_checksum_fletcher32 (src/checkpoint_hdf5/fletcher32.c)
 * against HDF5's own, and proof that HDF5's Fletcher32 filter really calls it.
 *   1. ours == HDF5's (dlsym RTLD_NEXT) == the portable path, for every length 0..3000 at 3 alignments,
 *      around every multiple of the 360-word block up to 8 blocks, for large odd lengths, and for
 *      all-0x00 / all-0xff / random contents (all-0xff drives the 32-bit sums to wrap);
 *   2. an HDF5 file written and read back through the Fletcher32 filter in this process makes calls
 *      to ours (dg_ckpt_fletcher32_calls), and a flipped byte in a chunk is still caught on read;
 *   3. throughput of both on 64 MiB (printed, not judged: bench/checkpoint measures the save).
 * h5py and h5dump read files written this way in tests/checkpoint/cases.sh (case h5py) with an
 * unmodified HDF5, which checks every chunk's checksum. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <hdf5.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "dg_check.h"

uint32_t H5_checksum_fletcher32(const void *data, size_t len);
typedef uint32_t (*lib_fn)(const void *, size_t);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void fill(uint8_t *b, size_t n, int kind, uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b[i] = kind == 0 ? 0 : kind == 1 ? 0xff : (uint8_t)(x >> 32);
    }
}

static int compare(lib_fn lib, const uint8_t *b, size_t n, const char *what) {
    uint32_t want = lib(b, n), got = H5_checksum_fletcher32(b, n), port = dg_ckpt_fletcher32_portable(b, n);
    CHECK(got == want && port == want, "%s, %zu bytes: ours %08x, portable %08x, HDF5's %08x", what, n, got,
          port, want);
    return got == want && port == want;
}

static void test_values(lib_fn lib) {
    size_t cap = (16u << 20) + 64;
    uint8_t *buf = malloc(cap);
    int ok = 1;
    for (int kind = 0; kind < 3 && ok; kind++) {
        fill(buf, cap, kind, 7 + (uint64_t)kind);
        const char *what = kind == 0 ? "zeros" : kind == 1 ? "0xff" : "random";
        for (size_t off = 0; off < 3 && ok; off++)
            for (size_t n = 0; n <= 3000 && ok; n++)
                ok = compare(lib, buf + off, n, what);
        for (size_t blk = 1; blk <= 8 && ok; blk++)
            for (int d = -3; d <= 3 && ok; d++)
                ok = compare(lib, buf + 1, blk * 720 + (size_t)(long)d, what);
        const size_t big[] = {(1u << 20) + 1, (4u << 20) - 3, 16u << 20, (16u << 20) + 63};
        for (size_t k = 0; k < 4 && ok; k++)
            ok = compare(lib, buf + (k & 1), big[k], what);
    }
    if (ok) printf("ok: checksums equal HDF5's for 0..3000 bytes at 3 offsets, block edges, 1-16 MiB\n");
    free(buf);
}

static void test_filter(void) {
    char path[] = "/tmp/dg-fletcher32-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0) return;
    close(fd);
    const hsize_t n = 1 << 20, chunk = 1 << 16;
    float *w = malloc(n * sizeof *w), *r = malloc(n * sizeof *r);
    for (hsize_t i = 0; i < n; i++)
        w[i] = (float)i * 0.25f - 1000.0f;
    uint64_t before = dg_ckpt_fletcher32_calls();
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t sp = H5Screate_simple(1, &n, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, 1, &chunk);
    H5Pset_fletcher32(dcpl);
    hid_t d = H5Dcreate2(f, "x", H5T_NATIVE_FLOAT, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    CHECK(d >= 0 && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w) >= 0, "write");
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
    H5Fclose(f);
    uint64_t written = dg_ckpt_fletcher32_calls() - before;
    CHECK(written >= n / chunk, "HDF5's filter made %llu calls to our checksum writing %llu chunks",
          (unsigned long long)written, (unsigned long long)(n / chunk));
    f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    d = H5Dopen2(f, "x", H5P_DEFAULT);
    CHECK(d >= 0 && H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, r) >= 0, "read");
    CHECK(memcmp(w, r, n * sizeof *w) == 0, "data read back differs");
    H5Dclose(d);
    H5Fclose(f);
    CHECK(dg_ckpt_fletcher32_calls() - before >= 2 * (n / chunk), "reading did not verify through ours");
    /* flip one byte of the raw data: find the float 5000.0 (element 24000, chunk 0) in the file */
    FILE *fp = fopen(path, "r+b");
    size_t len = 0, at = (size_t)-1;
    uint8_t *img = NULL;
    if (fp) {
        fseek(fp, 0, SEEK_END);
        len = (size_t)ftell(fp);
        img = malloc(len);
        rewind(fp);
        len = fread(img, 1, len, fp);
        float probe = w[24000];
        for (size_t i = 0; i + 4 <= len; i++)
            if (memcmp(img + i, &probe, 4) == 0) {
                at = i;
                break;
            }
    }
    CHECK(at != (size_t)-1, "could not find the probe value in the file");
    if (at != (size_t)-1) {
        img[at] ^= 0x10;
        fseek(fp, (long)at, SEEK_SET);
        fwrite(img + at, 1, 1, fp);
        fclose(fp);
        fp = NULL;
        H5E_BEGIN_TRY {
            f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
            d = H5Dopen2(f, "x", H5P_DEFAULT);
            herr_t rc = H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, r);
            CHECK(rc < 0, "a flipped byte in a chunk was not caught by the checksum on read");
            H5Dclose(d);
            H5Fclose(f);
        }
        H5E_END_TRY;
    }
    if (fp) fclose(fp);
    free(img);
    unlink(path);
    free(w);
    free(r);
    printf("ok: HDF5's Fletcher32 filter computed %llu checksums through ours; a flipped byte is caught\n",
           (unsigned long long)(dg_ckpt_fletcher32_calls() - before));
}

static void test_speed(lib_fn lib) {
    size_t n = 64u << 20;
    uint8_t *b = malloc(n);
    fill(b, n, 2, 3);
    double best[2] = {1e9, 1e9};
    uint32_t sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        sink ^= lib(b, n);
        double t1 = now();
        sink ^= H5_checksum_fletcher32(b, n);
        double t2 = now();
        if (t1 - t0 < best[0]) best[0] = t1 - t0;
        if (t2 - t1 < best[1]) best[1] = t2 - t1;
    }
    printf("throughput on 64 MiB (best of 3): HDF5's %.2f GB/s, ours %.2f GB/s (%.1fx) [%08x]\n",
           n / best[0] / 1e9, n / best[1] / 1e9, best[0] / best[1], sink);
    free(b);
}

int main(void) {
    lib_fn lib = (lib_fn)dlsym(RTLD_NEXT, "H5_checksum_fletcher32");
    CHECK(lib != NULL && (void *)lib != (void *)H5_checksum_fletcher32,
          "HDF5's own H5_checksum_fletcher32 not found behind ours");
    CHECK(dg_ckpt_fletcher32_interposed(), "HDF5's calls do not reach the checkpoint library's checksum");
    if (lib && (void *)lib != (void *)H5_checksum_fletcher32) {
        test_values(lib);
        test_filter();
        test_speed(lib);
    }
    if (dg_fails) fprintf(stderr, "test_fletcher32: %d check(s) FAILED\n", dg_fails);
    return dg_fails ? 1 : 0;
}
