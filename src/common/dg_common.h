/* dg_common.h — what every dgtrain module shares: status codes and error messages, logging,
 * always-on asserts, the per-library check macro pattern, dtypes, and small helpers.
 *
 * Error model (docs/design.md §4): a function that can fail for environmental reasons returns a
 * dg_status_t (0 = DG_OK) and leaves a message in a thread-local buffer (dg_last_error()).
 * The status value is the process exit-code class it would lead to (DG_ERR_USAGE = 1, ...), so the
 * CLI can return it directly after the ranks agree on it. Broken invariants use DG_ASSERT, which is
 * never compiled out. Library code never calls exit().
 */
#ifndef DG_COMMON_H
#define DG_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DG_VERSION_STRING "0.1.0"

/* ---- status codes: equal to the exit codes of docs/design.md §1 ---- */
typedef int dg_status_t;
enum {
    DG_OK = 0,
    DG_ERR_USAGE = 1,   /* usage or config error, bad input file */
    DG_ERR_RUNTIME = 2, /* I/O, divergence, internal */
    DG_ERR_PEER = 3,    /* a peer failed or the watchdog fired */
    DG_ERR_STORAGE = 4, /* checkpoints could not be saved checkpoint.max_failures times in a row (full or
                           failing storage): stop, and do not requeue into the same storage */
    DG_ERR_PAUSE = 5,   /* paused for an operator after a complete checkpoint (an SLA Level-2 pause, or
                           train.rollback_max rollbacks within train.rollback_window steps); not requeued */
    DG_ERR_SIGNAL = 75  /* stopped on a signal after a complete checkpoint */
};

/* Record an error (printf-style message) for this thread and return `code`. `src_file`/`src_line`
 * are the dgtrain source location; user-facing errors (DG_ERR_USAGE) print only the message,
 * others append "(at file:line)". Safe to call from any thread. */
dg_status_t dg_error_at(dg_status_t code, const char *src_file, int src_line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define DG_ERR(code, ...) dg_error_at((code), __FILE__, __LINE__, __VA_ARGS__)

/* The last error message of this thread ("" if none) and its source location. */
const char *dg_last_error(void);
const char *dg_last_error_where(void); /* "file.c:123" or "" */
dg_status_t dg_last_error_code(void);
void dg_clear_error(void);

/* Propagate a failing status unchanged. */
#define DG_TRY(expr)                                                                                         \
    do {                                                                                                     \
        dg_status_t dg_try_s_ = (expr);                                                                      \
        if (dg_try_s_ != DG_OK) return dg_try_s_;                                                            \
    } while (0)

/* Always-on assert for broken invariants (never for bad input): prints and aborts. */
void dg_assert_fail(const char *cond, const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 4, 5)));
#define DG_ASSERT(cond)                                                                                      \
    do {                                                                                                     \
        if (!(cond)) dg_assert_fail(#cond, __FILE__, __LINE__, " ");                                         \
    } while (0)
#define DG_ASSERTF(cond, ...)                                                                                \
    do {                                                                                                     \
        if (!(cond)) dg_assert_fail(#cond, __FILE__, __LINE__, __VA_ARGS__);                                 \
    } while (0)

/* Pattern for the one-check-macro-per-library rule. Each library's macro lives beside its users:
 *   DG_MPI_CHECK    src/common/dg_mpi.h
 *   DG_HWLOC_CHECK  src/mpi_boot/
 *   DG_H5_CHECK     src/checkpoint_hdf5/
 *   DG_CUDA_CHECK, DG_NCCL_CHECK  src/backend/cuda/
 * Each expands to: evaluate the call once; on failure return DG_ERR(code, "<lib> call `<call>`
 * failed: <library message>; hint: <hint>"). */

/* ---- logging: levels, "[rank R host] " prefix on stderr, and one file per rank ---- */
typedef enum { DG_LOG_ERROR = 0, DG_LOG_WARN = 1, DG_LOG_INFO = 2, DG_LOG_DEBUG = 3 } dg_log_level_t;

/* Configure the process-wide logger. `log_dir` may be NULL (stderr only); otherwise
 * log_dir/rank-<rank>.log is opened for append. Returns DG_ERR_RUNTIME if the file cannot be opened. */
dg_status_t dg_log_init(int rank, const char *host, dg_log_level_t level, const char *log_dir);
void dg_log_set_level(dg_log_level_t level);
/* Stderr echo: by default only rank 0 echoes INFO to stderr; every rank echoes WARN and ERROR. */
void dg_log_set_stderr_all_ranks(int on);
/* The run context of every later line of the log file: "[CTX step S]" after the rank and host (the stderr
 * echo stays as it is, for people). CTX is e.g. "run 9f3c... attempt 2 job 4711" (NULL or "": none). */
void dg_log_set_context(const char *ctx);
void dg_log_set_step(long long step); /* the step those lines name (optimizer steps completed) */
void dg_log_close(void);
void dg_log(dg_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define DG_LOG_ERROR(...) dg_log(DG_LOG_ERROR, __VA_ARGS__)
#define DG_LOG_WARN(...) dg_log(DG_LOG_WARN, __VA_ARGS__)
#define DG_LOG_INFO(...) dg_log(DG_LOG_INFO, __VA_ARGS__)
#define DG_LOG_DEBUG(...) dg_log(DG_LOG_DEBUG, __VA_ARGS__)

/* ---- dtypes ---- */
typedef enum { DG_F32 = 0, DG_BF16 = 1, DG_F16 = 2, DG_I32 = 3, DG_U16 = 4, DG_F64 = 5 } dg_dtype_t;
size_t dg_dtype_size(dg_dtype_t t);
const char *dg_dtype_name(dg_dtype_t t);
/* One 16-bit float to f32, exactly (bf16: the top half of an f32; else IEEE fp16, subnormals, inf and NaN
 * included) */
float dg_half_to_f32(uint16_t h, int bf16);

/* ---- small helpers ---- */
double dg_now_s(void); /* monotonic seconds */
/* mkdir -p (mode 0775 at most, dg_fs.h); returns DG_ERR_RUNTIME with a message naming the path on failure. */
dg_status_t dg_mkdir_p(const char *path);
/* Write `len` bytes to `path` atomically: path.tmp.PID (O_EXCL|O_NOFOLLOW under a handle of the
 * directory), fsync, rename over path (a link there is replaced, never followed), fsync the directory. */
dg_status_t dg_write_file_atomic(const char *path, const void *data, size_t len);
/* Read the rest of stream f into a new buffer (*out, free() it) of *len bytes and a NUL after them; f stays
 * open. Returns 0, EFBIG when the stream holds more than max_bytes, or a read error's errno (EIO when
 * the C library names none); *out is untouched on failure. Callers word the messages. */
int dg_read_stream(FILE *f, size_t max_bytes, char **out, size_t *len);
/* The items of a comma-separated list, cut in place like strtok_r: the first call passes the list, the
 * later ones NULL; each item without the spaces around it (empty items between ",," are skipped, a
 * blank one is ""); NULL after the last. */
char *dg_list_next(char *list, char **save);
/* The line of text[0, len) that starts at *pos (call only while *pos < len): *line and the returned
 * length without the spaces and tabs around it (nor a '\r' before its '\n'); *pos moves past its '\n'. */
size_t dg_text_line(const char *text, size_t len, size_t *pos, const char **line);
/* Malloc that never returns NULL for n > 0 (asserts on OOM: not an environmental error we recover from). */
void *dg_xmalloc(size_t n);
void *dg_xcalloc(size_t n, size_t size);
char *dg_xstrdup(const char *s);
/* free() of each of the n pointers (NULL ones are fine); DG_FREE_ALL(a, b, ...): of each argument, in order
 * (a teardown's owned arrays and the struct last) */
void dg_free_n(void *const *ptrs, size_t n);
#define DG_FREE_ALL(...)                                                                                     \
    dg_free_n((void *const[]){__VA_ARGS__}, sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))
/* snprintf into a fixed buffer; asserts on truncation. */
void dg_fmt(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "Did you mean": the optimal-string-alignment distance (Levenshtein plus adjacent transpositions, ASCII
 * case ignored) between a and b; 1000 when either is longer than 64 bytes. */
int dg_edit_distance(const char *a, const char *b);
/* Index of the candidate closest to word (the first of equals), or -1 when n is 0; *dist: its distance. */
int dg_closest(const char *word, const char *const *cands, int n, int *dist);
/* The name of enum value v in `names`, a table indexed by the enum (designated initializers): `fallback`
 * when v lies outside the table or has no entry. DG_ENUM_NAME takes the table's length from its type. */
const char *dg_enum_name(const char *const *names, size_t n, int v, const char *fallback);
#define DG_ENUM_NAME(names, v, fallback)                                                                     \
    dg_enum_name((names), sizeof(names) / sizeof *(names), (int)(v), (fallback))

#ifdef __cplusplus
}
#endif
#endif /* DG_COMMON_H */
