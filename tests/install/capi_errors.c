/* The C API's contract for bad input, built as a C99 program against an
 * installed strata (tests/install/embed_test.sh): every misuse returns the
 * status strata.h documents with a message naming the function and the
 * problem, never crashes, and leaves the engine usable unless the header says
 * otherwise. Also values through the API: a tied parameter, a bf16 tensor
 * read back bit for bit on any number of ranks, write/read, and (two ranks) a
 * finalize whose ranks registered different things; checkpoints saved and
 * loaded bit for bit, and refused with a message naming the problem (a
 * missing directory, a truncated file, other parameters, a step already
 * saved) without changing the engine; the step breakdown.
 * Runs alone or under `strata run -n 2`; prints "capi_errors: ok". */
#define _XOPEN_SOURCE 700

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/capi/strata.h"

static int failures = 0;

/* `call` must return `want` and, unless OK, leave a message containing `needle`. */
#define EXPECT(call, want, needle) expect_status((call), (want), (needle), #call, __LINE__)

static void expect_status(strata_status got, strata_status want, const char* needle, const char* text, int line) {
  if (got != want) {
    fprintf(stderr, "capi_errors:%d: %s returned %d (%s), want %d (%s); last error: %s\n", line, text, (int)got,
            strata_status_string(got), (int)want, strata_status_string(want), strata_last_error());
    ++failures;
    return;
  }
  if (want != STRATA_OK && needle != NULL && strstr(strata_last_error(), needle) == NULL) {
    fprintf(stderr, "capi_errors:%d: %s: message \"%s\" lacks \"%s\"\n", line, text, strata_last_error(), needle);
    ++failures;
  }
}

#define REQUIRE_OK(call)                                                                          \
  do {                                                                                            \
    strata_status s_ = (call);                                                                    \
    if (s_ != STRATA_OK) {                                                                        \
      fprintf(stderr, "capi_errors:%d: %s failed: %s\n", __LINE__, #call, strata_last_error()); \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

static const char* kConfig =
    "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.1, \"weight_decay\": 0.0}},"
    " \"zero_optimization\": {\"stage\": 3, \"stage3_param_persistence_threshold\": 0},"
    " \"strata\": {\"accelerator\": \"cpu\", \"log_level\": \"error\", \"collective_timeout_s\": 60}}";

static int failing_init(void* user, int32_t param, int64_t first, int64_t count, void* values) {
  (void)user, (void)param, (void)first, (void)count, (void)values;
  return 42;
}

static strata_engine* create(void) {
  strata_engine* e = NULL;
  REQUIRE_OK(strata_engine_create(kConfig, &e));
  return e;
}

static void no_engine(void) {
  strata_engine* e = (strata_engine*)0x1;
  int32_t id = 0;
  strata_stats stats;
  EXPECT(strata_engine_create(NULL, &e), STRATA_ERROR_INVALID_ARGUMENT, "strata_engine_create: config_json is NULL");
  if (e != NULL) fprintf(stderr, "capi_errors: *out not NULL after a failed create\n"), ++failures;
  EXPECT(strata_engine_create(kConfig, NULL), STRATA_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(strata_engine_create("{\"zero_optimization\": ", &e), STRATA_ERROR_INVALID_ARGUMENT, "strata_engine_create");
  EXPECT(strata_engine_create("{\"zero_optimization\": {\"stage\": 0}}", &e), STRATA_ERROR_INVALID_ARGUMENT,
         "stage is 0");
  EXPECT(strata_engine_create("{\"zero_optimization\": {\"stage\": 3, \"bogus_key\": 1}}", &e),
         STRATA_ERROR_INVALID_ARGUMENT, "bogus_key");
  EXPECT(strata_register_param(NULL, "w", STRATA_DTYPE_F32, 1, NULL, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "strata_register_param: engine is NULL");
  EXPECT(strata_fetch(NULL, 0, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_ARGUMENT, "engine is NULL");
  EXPECT(strata_step(NULL, 0.1f, NULL), STRATA_ERROR_INVALID_ARGUMENT, "engine is NULL");
  EXPECT(strata_get_stats(NULL, &stats), STRATA_ERROR_INVALID_ARGUMENT, "engine is NULL");
  EXPECT(strata_engine_destroy(NULL), STRATA_OK, NULL);
  if (strcmp(strata_status_string(STRATA_ERROR_IO), "I/O error") != 0) ++failures;
  if (strata_version() != STRATA_VERSION) {
    fprintf(stderr, "capi_errors: library %d, header %d\n", strata_version(), STRATA_VERSION);
    ++failures;
  }
}

static void declarations_and_windows(void) {
  strata_engine* e = create();
  const int64_t shape[2] = {3, 4}, bad_shape[2] = {3, 0};
  float values[12];
  int32_t w, b, tied, op, op2, op_b, none, id = -1, list[2];
  void* p = NULL;
  float* g = NULL;
  strata_stats stats;
  strata_step_result result;
  int i;
  for (i = 0; i < 12; ++i) values[i] = (float)i;

  /* Registration: each problem a status, nothing registered. */
  EXPECT(strata_register_param(e, NULL, STRATA_DTYPE_F32, 2, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "name is NULL");
  EXPECT(strata_register_param(e, "", STRATA_DTYPE_F32, 2, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "name is empty");
  EXPECT(strata_register_param(e, "w", (strata_dtype)7, 2, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "dtype 7 is not a strata_dtype");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 0, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "ndim 0");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 9, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "ndim 9");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, NULL, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "shape is NULL");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, bad_shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "shape[1] is 0");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, shape, values, failing_init, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "not both");
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, shape, values, NULL, NULL, NULL),
         STRATA_ERROR_INVALID_ARGUMENT, "id_out is NULL");
  REQUIRE_OK(strata_get_stats(e, &stats));
  if (stats.param_count != 0) fprintf(stderr, "capi_errors: a failed registration registered\n"), ++failures;

  REQUIRE_OK(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, shape, values, NULL, NULL, &w));
  REQUIRE_OK(strata_register_param(e, "b", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &b));
  REQUIRE_OK(strata_register_param(e, "tied", STRATA_DTYPE_F32, 1, shape + 1, NULL, NULL, NULL, &tied));
  if (w != 0 || b != 1 || tied != 2) fprintf(stderr, "capi_errors: ids not dense\n"), ++failures;
  EXPECT(strata_register_param(e, "w", STRATA_DTYPE_F32, 2, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_ARGUMENT, "'w' is already registered");
  EXPECT(strata_find_param(e, "nope", &id), STRATA_ERROR_INVALID_ARGUMENT, "no parameter is called 'nope'");
  REQUIRE_OK(strata_find_param(e, "b", &id));
  if (id != b) ++failures;

  list[0] = w, list[1] = 7;
  EXPECT(strata_register_op(e, "op", 2, list, &op), STRATA_ERROR_INVALID_ARGUMENT,
         "params[1] = 7 is not a registered parameter id");
  list[1] = w;
  EXPECT(strata_register_op(e, "op", 2, list, &op), STRATA_ERROR_INVALID_ARGUMENT, "listed twice");
  EXPECT(strata_register_op(e, "op", -1, list, &op), STRATA_ERROR_INVALID_ARGUMENT, "n is -1");
  EXPECT(strata_register_op(e, "op", 1, NULL, &op), STRATA_ERROR_INVALID_ARGUMENT, "params is NULL");
  list[0] = w, list[1] = tied;
  REQUIRE_OK(strata_register_op(e, "op", 2, list, &op));
  REQUIRE_OK(strata_register_op(e, "op2", 1, &tied, &op2)); /* `tied` is used twice */
  REQUIRE_OK(strata_register_op(e, "op_b", 1, &b, &op_b));
  REQUIRE_OK(strata_register_op(e, "marker", 0, NULL, &none));

  /* Out of order before finalize. */
  EXPECT(strata_fetch(e, op, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE, "strata_fetch: called before strata_finalize");
  EXPECT(strata_param_ptr(e, w, &p), STRATA_ERROR_INVALID_STATE, "before strata_finalize");
  EXPECT(strata_step(e, 0.1f, &result), STRATA_ERROR_INVALID_STATE, "before strata_finalize");
  EXPECT(strata_read_param(e, w, values), STRATA_ERROR_INVALID_STATE, "before strata_finalize");
  REQUIRE_OK(strata_finalize(e));
  EXPECT(strata_finalize(e), STRATA_ERROR_INVALID_STATE, "called twice");
  EXPECT(strata_register_param(e, "late", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &id),
         STRATA_ERROR_INVALID_STATE, "after strata_finalize");
  EXPECT(strata_register_op(e, "late", 0, NULL, &id), STRATA_ERROR_INVALID_STATE, "after strata_finalize");

  /* Windows. */
  EXPECT(strata_fetch(e, 99, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_ARGUMENT, "operator id 99 is not registered");
  EXPECT(strata_fetch(e, op, (strata_phase)5), STRATA_ERROR_INVALID_ARGUMENT, "phase 5");
  EXPECT(strata_param_ptr(e, w, &p), STRATA_ERROR_INVALID_STATE, "no fetched operator lists it");
  EXPECT(strata_release(e, op, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE, "no window is open");
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_FORWARD));
  EXPECT(strata_fetch(e, op, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE, "already fetched");
  EXPECT(strata_param_ptr(e, w, NULL), STRATA_ERROR_INVALID_ARGUMENT, "ptr is NULL");
  EXPECT(strata_param_ptr(e, -1, &p), STRATA_ERROR_INVALID_ARGUMENT, "parameter id -1 is not registered");
  EXPECT(strata_param_ptr(e, b, &p), STRATA_ERROR_INVALID_STATE, "'b' is not available");
  REQUIRE_OK(strata_param_ptr(e, w, &p));
  if (((const float*)p)[11] != 11.0f) fprintf(stderr, "capi_errors: w[11] != 11\n"), ++failures;
  EXPECT(strata_grad_ptr(e, w, &g), STRATA_ERROR_INVALID_STATE, "no operator fetched for backward");
  EXPECT(strata_add_grad(e, w, values), STRATA_ERROR_INVALID_STATE, "strata_add_grad");
  EXPECT(strata_step(e, 0.1f, &result), STRATA_ERROR_INVALID_STATE, "'op' (forward) still fetched");
  EXPECT(strata_read_param(e, w, values), STRATA_ERROR_INVALID_STATE, "still fetched");
  REQUIRE_OK(strata_fetch(e, none, STRATA_PHASE_FORWARD)); /* windows overlap */
  EXPECT(strata_release(e, op, STRATA_PHASE_BACKWARD), STRATA_ERROR_INVALID_STATE,
         "releasing operator 'op' (backward), which is not open (open: 'op' (forward), 'marker' (forward))");
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_FORWARD)); /* in any order (0.3) */
  EXPECT(strata_param_ptr(e, w, &p), STRATA_ERROR_INVALID_STATE, "no fetched operator lists it");
  REQUIRE_OK(strata_release(e, none, STRATA_PHASE_FORWARD));

  /* Backward: a half-done pass blocks the step; finishing it unblocks it. */
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  EXPECT(strata_add_grad(e, w, NULL), STRATA_ERROR_INVALID_ARGUMENT, "host_grad is NULL");
  EXPECT(strata_grad_ptr(e, w, NULL), STRATA_ERROR_INVALID_ARGUMENT, "ptr is NULL");
  REQUIRE_OK(strata_grad_ptr(e, tied, &g));
  for (i = 0; i < 4; ++i) g[i] += 1.0f;
  for (i = 0; i < 12; ++i) values[i] = 0.5f;
  REQUIRE_OK(strata_add_grad(e, w, values));
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  EXPECT(strata_step(e, 0.1f, &result), STRATA_ERROR_INVALID_STATE, "'tied' has had 1 of its 2 operators");
  EXPECT(strata_zero_grad(e), STRATA_ERROR_INVALID_STATE, "half done");
  REQUIRE_OK(strata_fetch(e, op2, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_grad_ptr(e, tied, &g));
  for (i = 0; i < 4; ++i) g[i] += 2.0f;
  REQUIRE_OK(strata_release(e, op2, STRATA_PHASE_BACKWARD));
  EXPECT(strata_step(e, NAN, &result), STRATA_ERROR_INVALID_ARGUMENT, "lr is nan");
  EXPECT(strata_step(e, -1.0f, &result), STRATA_ERROR_INVALID_ARGUMENT, "lr is -1");
  REQUIRE_OK(strata_step(e, 0.1f, &result));
  REQUIRE_OK(strata_get_stats(e, &stats));
  /* Every rank added 3 per element of `tied` and 0.5 per element of `w`; AdamW's
   * first step moves each element with a gradient by lr, `b` (none) not at all. */
  {
    float t[4], bv[12];
    const float expect_norm = sqrtf((float)stats.world_size * (float)stats.world_size * (4 * 9.0f + 12 * 0.25f));
    REQUIRE_OK(strata_read_param(e, tied, t));
    REQUIRE_OK(strata_read_param(e, b, bv));
    REQUIRE_OK(strata_read_param(e, w, values));
    if (!result.applied || result.step != 1 || fabs(result.grad_norm - expect_norm) > 1e-3 * expect_norm ||
        fabsf(t[0] + 0.1f) > 1e-4f || bv[0] != 0.0f || fabsf(values[11] - 10.9f) > 1e-4f) {
      fprintf(stderr, "capi_errors: step: applied %d step %lld norm %f (want %f) tied[0] %f b[0] %f w[11] %f\n",
              result.applied, (long long)result.step, result.grad_norm, expect_norm, t[0], bv[0], values[11]);
      ++failures;
    }
  }
  if (stats.steps != 1 || stats.failed || !stats.finalized || stats.param_count != 3 || stats.op_count != 4 ||
      stats.param_numel != 19 || stats.zero_stage != 3 || !stats.host_memory) {
    fprintf(stderr, "capi_errors: stats wrong\n");
    ++failures;
  }
  EXPECT(strata_read_param(e, w, NULL), STRATA_ERROR_INVALID_ARGUMENT, "host_full is NULL");
  EXPECT(strata_read_param(e, 3, values), STRATA_ERROR_INVALID_ARGUMENT, "parameter id 3 is not registered");
  EXPECT(strata_global_sum(e, 1.0, NULL), STRATA_ERROR_INVALID_ARGUMENT, "sum is NULL");
  EXPECT(strata_get_stats(e, NULL), STRATA_ERROR_INVALID_ARGUMENT, "stats is NULL");
  REQUIRE_OK(strata_engine_destroy(e));
}

/* bf16 values read back bit for bit on any number of ranks (3001 elements:
 * with two ranks each owns part, the second a ragged end). */
static void values_roundtrip(void) {
  enum { N = 3001 };
  strata_engine* e = create();
  const int64_t shape[1] = {N};
  static uint16_t bits[N], back[N], other[N];
  int32_t p;
  int i;
  for (i = 0; i < N; ++i) {
    bits[i] = (uint16_t)(((uint32_t)i * 2654435761u) >> 16); /* every pattern kind, NaNs included */
    other[i] = (uint16_t)(i + 1);
  }
  REQUIRE_OK(strata_register_param(e, "bits", STRATA_DTYPE_BF16, 1, shape, bits, NULL, NULL, &p));
  REQUIRE_OK(strata_finalize(e));
  REQUIRE_OK(strata_read_param(e, p, back));
  if (memcmp(back, bits, sizeof bits) != 0) fprintf(stderr, "capi_errors: bf16 values differ\n"), ++failures;
  REQUIRE_OK(strata_write_param(e, p, other));
  REQUIRE_OK(strata_read_param(e, p, back));
  if (memcmp(back, other, sizeof other) != 0) fprintf(stderr, "capi_errors: write/read differ\n"), ++failures;
  REQUIRE_OK(strata_engine_destroy(e));
}

/* An init callback's failure leaves the engine unusable, every later call says
 * so. One rank only: a rank whose shard holds none of the parameter's
 * elements never calls the callback, and its peers would wait for the failed
 * rank's collectives until the timeout. */
static void sticky_failure(void) {
  strata_engine* e = create();
  const int64_t shape[1] = {16};
  int32_t p, op;
  double sum;
  strata_stats stats;
  REQUIRE_OK(strata_register_param(e, "p", STRATA_DTYPE_F32, 1, shape, NULL, failing_init, NULL, &p));
  REQUIRE_OK(strata_register_op(e, "op", 1, &p, &op));
  EXPECT(strata_finalize(e), STRATA_ERROR_CALLBACK, "the init callback of parameter 'p' returned 42");
  EXPECT(strata_global_sum(e, 1.0, &sum), STRATA_ERROR_ENGINE_FAILED, "returned 42");
  EXPECT(strata_fetch(e, op, STRATA_PHASE_FORWARD), STRATA_ERROR_ENGINE_FAILED, "strata_fetch: the engine is unusable");
  REQUIRE_OK(strata_get_stats(e, &stats));
  if (!stats.failed) fprintf(stderr, "capi_errors: stats.failed not set\n"), ++failures;
  REQUIRE_OK(strata_engine_destroy(e));
}

/* Ranks that registered different shapes are told so at finalize. */
static void ranks_disagree(void) {
  strata_engine* e = create();
  strata_stats stats;
  int64_t shape[1] = {8};
  int32_t p;
  REQUIRE_OK(strata_get_stats(e, &stats));
  shape[0] += stats.rank;
  REQUIRE_OK(strata_register_param(e, "p", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &p));
  EXPECT(strata_finalize(e), STRATA_ERROR_INVALID_ARGUMENT, "registered different parameters");
  REQUIRE_OK(strata_get_stats(e, &stats));
  if (stats.failed) fprintf(stderr, "capi_errors: a mismatch should leave the engine usable\n"), ++failures;
  REQUIRE_OK(strata_engine_destroy(e));
}

/* A directory every rank names alike (under `strata run` the ranks share
 * MASTER_PORT), removed by the caller's rank 0 at the end. */
static void shared_dir(char* out, size_t size, const char* name) {
  const char* world = getenv("WORLD_SIZE");
  const char* port = getenv("MASTER_PORT");
  if (world != NULL && atoi(world) > 1 && port != NULL) {
    snprintf(out, size, "/tmp/strata-capi-errors-%s-%s", port, name);
  } else {
    snprintf(out, size, "/tmp/strata-capi-errors-%ld-%s", (long)getpid(), name);
  }
}

static int remove_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

static void barrier(strata_engine* e) {
  double sum;
  REQUIRE_OK(strata_global_sum(e, 0.0, &sum));
}

/* One step adding `value` to every gradient element of `p` (op lists only p). */
static void one_step(strata_engine* e, int32_t op, int32_t p, int64_t numel, float value) {
  float* g = NULL;
  int64_t i;
  strata_step_result result;
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_grad_ptr(e, p, &g));
  for (i = 0; i < numel; ++i) g[i] += value * (float)(i % 7 - 3);
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.05f, &result));
}

/* Checkpoints: a round trip bit for bit, and every bad input a status with a
 * message naming the problem (the file, for a damaged one), the engine
 * usable afterwards; the step breakdown after a step. */
static void checkpoints(void) {
  enum { N = 1000 };
  char dir[256], bad[512], path[640], rank_file[768];
  static float values[N], saved[N], back[N];
  const int64_t shape[1] = {N};
  strata_engine* e = create();
  strata_engine* fresh;
  strata_stats stats;
  strata_step_breakdown b;
  int32_t p, op;
  int i;
  struct stat st;
  for (i = 0; i < N; ++i) values[i] = (float)i / N;
  shared_dir(dir, sizeof dir, "ckpt");

  REQUIRE_OK(strata_register_param(e, "p", STRATA_DTYPE_F32, 1, shape, values, NULL, NULL, &p));
  REQUIRE_OK(strata_register_op(e, "op", 1, &p, &op));
  EXPECT(strata_save_checkpoint(e, dir), STRATA_ERROR_INVALID_STATE,
         "strata_save_checkpoint: called before strata_finalize");
  EXPECT(strata_get_step_breakdown(e, NULL), STRATA_ERROR_INVALID_ARGUMENT, "breakdown is NULL");
  EXPECT(strata_get_step_breakdown(NULL, &b), STRATA_ERROR_INVALID_ARGUMENT, "engine is NULL");
  REQUIRE_OK(strata_finalize(e));
  REQUIRE_OK(strata_get_step_breakdown(e, &b));
  if (b.step != 0 || b.seconds != 0) fprintf(stderr, "capi_errors: a breakdown before any step\n"), ++failures;
  one_step(e, op, p, N, 1.0f);
  one_step(e, op, p, N, 2.0f);
  REQUIRE_OK(strata_get_step_breakdown(e, &b));
  {
    const double parts = b.compute_seconds + b.param_stall_seconds + b.grad_wait_seconds + b.optimizer_seconds +
                         b.other_seconds;
    if (b.step != 2 || !b.applied || b.windows != 1 || b.gathers < 1 || b.gathered_bytes < N * 4 ||
        !(b.seconds > 0) || fabs(parts - b.seconds) > 1e-6 + 1e-3 * b.seconds) {
      fprintf(stderr, "capi_errors: breakdown: step %lld windows %lld gathers %lld bytes %llu seconds %g parts %g\n",
              (long long)b.step, (long long)b.windows, (long long)b.gathers, (unsigned long long)b.gathered_bytes,
              b.seconds, parts);
      ++failures;
    }
  }

  {
    strata_op_stall stall[4];
    int32_t count = -1, k;
    double seconds = 0;
    EXPECT(strata_get_op_stalls(e, NULL, 0, NULL), STRATA_ERROR_INVALID_ARGUMENT, "count is NULL");
    EXPECT(strata_get_op_stalls(e, NULL, 2, &count), STRATA_ERROR_INVALID_ARGUMENT, "stalls is NULL with capacity 2");
    EXPECT(strata_get_op_stalls(e, stall, -1, &count), STRATA_ERROR_INVALID_ARGUMENT, "capacity is -1");
    REQUIRE_OK(strata_get_op_stalls(e, NULL, 0, &count));
    if (count < 0 || count > 1 || count != b.stalled_windows) {
      fprintf(stderr, "capi_errors: %d operator stalls, %d stalled windows\n", (int)count, (int)b.stalled_windows);
      ++failures;
    }
    REQUIRE_OK(strata_get_op_stalls(e, stall, 4, &count));
    for (k = 0; k < count && k < 4; ++k) {
      seconds += stall[k].seconds;
      if (stall[k].op != op || stall[k].phase != STRATA_PHASE_BACKWARD || stall[k].windows != 1) ++failures;
    }
    if (fabs(seconds - b.param_stall_seconds) > 1e-9 + 1e-6 * b.param_stall_seconds) {
      fprintf(stderr, "capi_errors: op stalls sum to %g, the breakdown says %g\n", seconds, b.param_stall_seconds);
      ++failures;
    }
  }

  /* Bad arguments and states. */
  EXPECT(strata_save_checkpoint(NULL, dir), STRATA_ERROR_INVALID_ARGUMENT, "engine is NULL");
  EXPECT(strata_save_checkpoint(e, NULL), STRATA_ERROR_INVALID_ARGUMENT, "dir is NULL");
  EXPECT(strata_load_checkpoint(e, ""), STRATA_ERROR_INVALID_ARGUMENT, "dir is empty");
  EXPECT(strata_save_checkpoint(e, "/proc/strata-no-such/ckpt"), STRATA_ERROR_INVALID_ARGUMENT,
         "cannot create the checkpoint directory /proc/strata-no-such/ckpt");
  snprintf(bad, sizeof bad, "%s-missing", dir);
  EXPECT(strata_load_checkpoint(e, bad), STRATA_ERROR_INVALID_ARGUMENT, "does not exist");
  if (strstr(strata_last_error(), bad) == NULL) fprintf(stderr, "capi_errors: %s unnamed\n", bad), ++failures;
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_FORWARD));
  EXPECT(strata_save_checkpoint(e, dir), STRATA_ERROR_INVALID_STATE, "still fetched");
  EXPECT(strata_load_checkpoint(e, dir), STRATA_ERROR_INVALID_STATE, "still fetched");
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_FORWARD));

  /* Save, train on, load: the saved values bit for bit, the step count back. */
  REQUIRE_OK(strata_save_checkpoint(e, dir));
  EXPECT(strata_save_checkpoint(e, dir), STRATA_ERROR_INVALID_ARGUMENT, "already holds a checkpoint of step 2");
  REQUIRE_OK(strata_read_param(e, p, saved));
  one_step(e, op, p, N, 3.0f);
  REQUIRE_OK(strata_read_param(e, p, back));
  if (memcmp(back, saved, sizeof saved) == 0) fprintf(stderr, "capi_errors: a step changed nothing\n"), ++failures;
  REQUIRE_OK(strata_load_checkpoint(e, dir));
  REQUIRE_OK(strata_read_param(e, p, back));
  REQUIRE_OK(strata_get_stats(e, &stats));
  if (memcmp(back, saved, sizeof saved) != 0 || stats.steps != 2) {
    fprintf(stderr, "capi_errors: load gave other values or step %lld (want 2)\n", (long long)stats.steps);
    ++failures;
  }

  /* A fresh engine loads it too; one with another shape refuses, naming the parameter. */
  fresh = create();
  REQUIRE_OK(strata_register_param(fresh, "p", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &i));
  REQUIRE_OK(strata_finalize(fresh));
  REQUIRE_OK(strata_load_checkpoint(fresh, dir));
  REQUIRE_OK(strata_read_param(fresh, 0, back));
  if (memcmp(back, saved, sizeof saved) != 0) fprintf(stderr, "capi_errors: a fresh load differs\n"), ++failures;
  REQUIRE_OK(strata_engine_destroy(fresh));
  fresh = create();
  {
    const int64_t other[1] = {N + 1};
    REQUIRE_OK(strata_register_param(fresh, "p", STRATA_DTYPE_F32, 1, other, NULL, NULL, NULL, &i));
  }
  REQUIRE_OK(strata_finalize(fresh));
  EXPECT(strata_load_checkpoint(fresh, dir), STRATA_ERROR_INVALID_ARGUMENT,
         "parameter 0 is 'p' fp32 [1000] there, 'p' fp32 [1001] in this engine");
  REQUIRE_OK(strata_engine_destroy(fresh));

  /* A truncated file: each rank cuts its own, the load names it, nothing changes. */
  snprintf(path, sizeof path, "%s/step_00000002", dir);
  if (stat(path, &st) != 0) fprintf(stderr, "capi_errors: %s missing\n", path), ++failures;
  one_step(e, op, p, N, 4.0f);
  REQUIRE_OK(strata_read_param(e, p, saved));
  {
    strata_stats mine;
    REQUIRE_OK(strata_get_stats(e, &mine));
    snprintf(rank_file, sizeof rank_file, "%s/rank%d/params_fp32.bin", path, (int)mine.rank);
  }
  barrier(e); /* every rank checked the file above before any truncates */
  if (stat(rank_file, &st) != 0 || truncate(rank_file, st.st_size / 2) != 0) {
    fprintf(stderr, "capi_errors: cannot truncate %s\n", rank_file);
    ++failures;
  }
  barrier(e);
  EXPECT(strata_load_checkpoint(e, dir), STRATA_ERROR_INVALID_ARGUMENT, "bytes, the manifest says");
  if (strstr(strata_last_error(), rank_file) == NULL) {
    fprintf(stderr, "capi_errors: the truncated file is not named: %s\n", strata_last_error());
    ++failures;
  }
  REQUIRE_OK(strata_read_param(e, p, back));
  REQUIRE_OK(strata_get_stats(e, &stats));
  if (memcmp(back, saved, sizeof saved) != 0 || stats.failed || stats.steps != 3) {
    fprintf(stderr, "capi_errors: a refused load changed the engine\n");
    ++failures;
  }
  one_step(e, op, p, N, 5.0f); /* still usable */
  REQUIRE_OK(strata_save_checkpoint(e, dir)); /* step 4 replaces the damaged step 2 */
  snprintf(path, sizeof path, "%s/step_00000002", dir);
  barrier(e);
  if (stat(path, &st) == 0) fprintf(stderr, "capi_errors: the old checkpoint was kept\n"), ++failures;
  REQUIRE_OK(strata_get_stats(e, &stats));
  REQUIRE_OK(strata_engine_destroy(e));
  if (stats.rank == 0) nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
}

int main(void) {
  const char* world = getenv("WORLD_SIZE");
  no_engine();
  declarations_and_windows();
  values_roundtrip();
  checkpoints();
  if (world != NULL && atoi(world) > 1) {
    ranks_disagree();
  } else {
    sticky_failure();
  }
  if (failures != 0) {
    fprintf(stderr, "capi_errors: %d failure(s)\n", failures);
    return 1;
  }
  printf("capi_errors: ok\n");
  return 0;
}
