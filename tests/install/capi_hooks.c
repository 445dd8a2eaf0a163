/* The C API's 0.3 additions for trainers that drive strata from an autograd
 * engine (strata.torch), built as a C99 program against an installed strata
 * (tests/install/embed_test.sh), alone and under `strata run -n 2`:
 *   - windows released in any order, a backward pass's gradients complete
 *     whichever window closes last;
 *   - strata_freeze_param and strata_set_weight_decay: a frozen parameter has
 *     no gradient and never changes, each decay is applied to its parameters
 *     (AdamW's first step, computed here);
 *   - strata_add_grad_device: fp32, bf16 and fp16 gradients added into the
 *     fp32 buffer (the widened sum, seen through the norm);
 *   - the *_on_stream forms with a NULL stream, and a stream refused on the
 *     cpu accelerator;
 *   - strata_clip_grad_norm: the norm before the step, the step's clipping to
 *     max_norm, no window until the step;
 *   - strata_begin_evaluation / strata_end_evaluation around forward windows;
 *   - 0.4: strata_set_lr_scale, strata_read/write_optimizer_state.
 * Every misuse a status naming the problem, the engine usable. Prints
 * "capi_hooks: ok". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/capi/strata.h"

static int failures = 0;

#define EXPECT(call, want, needle) expect_status((call), (want), (needle), #call, __LINE__)

static void expect_status(strata_status got, strata_status want, const char* needle, const char* text, int line) {
  if (got != want) {
    fprintf(stderr, "capi_hooks:%d: %s returned %d (%s), want %d (%s); last error: %s\n", line, text, (int)got,
            strata_status_string(got), (int)want, strata_status_string(want), strata_last_error());
    ++failures;
    return;
  }
  if (want != STRATA_OK && needle != NULL && strstr(strata_last_error(), needle) == NULL) {
    fprintf(stderr, "capi_hooks:%d: %s: message \"%s\" lacks \"%s\"\n", line, text, strata_last_error(), needle);
    ++failures;
  }
}

#define REQUIRE_OK(call)                                                                        \
  do {                                                                                          \
    strata_status s_ = (call);                                                                  \
    if (s_ != STRATA_OK) {                                                                      \
      fprintf(stderr, "capi_hooks:%d: %s failed: %s\n", __LINE__, #call, strata_last_error()); \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "capi_hooks:%d: %s: ", __LINE__, #cond);       \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, "\n");                                         \
      ++failures;                                                    \
    }                                                                \
  } while (0)

/* AdamW, lr 0.1, weight decay 0.5 unless a parameter has its own. */
static const char* kConfig =
    "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.1, \"weight_decay\": 0.5}},"
    " \"zero_optimization\": {\"stage\": 3, \"stage3_param_persistence_threshold\": 0},"
    " \"strata\": {\"accelerator\": \"cpu\", \"log_level\": \"error\", \"collective_timeout_s\": 60}}";

static strata_engine* create(int32_t* world) {
  strata_engine* e = NULL;
  strata_stats stats;
  REQUIRE_OK(strata_engine_create(kConfig, &e));
  REQUIRE_OK(strata_get_stats(e, &stats));
  *world = stats.world_size;
  return e;
}

static void add_all(strata_engine* e, int32_t p, int64_t n, float value) {
  float* g = NULL;
  int64_t i;
  REQUIRE_OK(strata_grad_ptr(e, p, &g));
  for (i = 0; i < n; ++i) g[i] += value;
}

/* Windows close in any order; a gradient is complete when its last operator closes. */
static void release_in_any_order(void) {
  int32_t world, a, b, op_a, op_b, op_ab, both[2];
  const int64_t shape[1] = {4};
  double norm = 0;
  strata_engine* e = create(&world);
  REQUIRE_OK(strata_register_param(e, "a", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &a));
  REQUIRE_OK(strata_register_param(e, "b", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &b));
  REQUIRE_OK(strata_register_op(e, "A", 1, &a, &op_a));
  REQUIRE_OK(strata_register_op(e, "B", 1, &b, &op_b));
  both[0] = a, both[1] = b;
  REQUIRE_OK(strata_register_op(e, "AB", 2, both, &op_ab)); /* a and b are each used twice */
  REQUIRE_OK(strata_finalize(e));
  /* Forward: A, B and AB open together, closed first-opened first. */
  REQUIRE_OK(strata_fetch(e, op_a, STRATA_PHASE_FORWARD));
  REQUIRE_OK(strata_fetch(e, op_b, STRATA_PHASE_FORWARD));
  REQUIRE_OK(strata_fetch(e, op_ab, STRATA_PHASE_FORWARD));
  REQUIRE_OK(strata_release(e, op_a, STRATA_PHASE_FORWARD));
  {
    void* p = NULL;
    REQUIRE_OK(strata_param_ptr(e, a, &p)); /* still listed by the open AB */
  }
  REQUIRE_OK(strata_release(e, op_b, STRATA_PHASE_FORWARD));
  EXPECT(strata_release(e, op_b, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE,
         "releasing operator 'B' (forward), which is not open (open: 'AB' (forward))");
  REQUIRE_OK(strata_release(e, op_ab, STRATA_PHASE_FORWARD));
  /* Backward: AB first (its own window), then A and B overlapping, A closed first. */
  REQUIRE_OK(strata_fetch(e, op_ab, STRATA_PHASE_BACKWARD));
  add_all(e, a, 4, 1.0f);
  REQUIRE_OK(strata_release(e, op_ab, STRATA_PHASE_BACKWARD));
  EXPECT(strata_step(e, 0.1f, NULL), STRATA_ERROR_INVALID_STATE, "has had 1 of its 2 operators released");
  REQUIRE_OK(strata_fetch(e, op_a, STRATA_PHASE_BACKWARD));
  add_all(e, a, 4, 1.0f);
  REQUIRE_OK(strata_fetch(e, op_b, STRATA_PHASE_BACKWARD));
  add_all(e, b, 4, 3.0f);
  REQUIRE_OK(strata_release(e, op_a, STRATA_PHASE_BACKWARD));
  EXPECT(strata_step(e, 0.1f, NULL), STRATA_ERROR_INVALID_STATE, "'B' (backward) still fetched");
  REQUIRE_OK(strata_release(e, op_b, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_clip_grad_norm(e, 0.0, &norm));
  /* Each rank added 2 per element of a and 3 per element of b; gradients are summed over ranks. */
  CHECK(fabs(norm - world * sqrt(4 * 4.0 + 4 * 9.0)) < 1e-9 * norm, "norm %f", norm);
  REQUIRE_OK(strata_step(e, 0.1f, NULL));
  REQUIRE_OK(strata_engine_destroy(e));
}

static int init_ones(void* user, int32_t param, int64_t first, int64_t count, void* values) {
  int64_t i;
  (void)user, (void)param, (void)first;
  for (i = 0; i < count; ++i) ((float*)values)[i] = 1.0f;
  return 0;
}

/* Frozen and per-parameter decay: AdamW's first step is p (1 - lr wd) - lr sign(g). */
static void freeze_and_decay(void) {
  enum { N = 8 };
  int32_t world, w, nd, fz, op, all[3];
  const int64_t shape[1] = {N};
  float got[N];
  float* g = NULL;
  int i;
  strata_step_result result;
  strata_engine* e = create(&world);
  REQUIRE_OK(strata_register_param(e, "decayed", STRATA_DTYPE_F32, 1, shape, NULL, init_ones, NULL, &w));
  REQUIRE_OK(strata_register_param(e, "bias", STRATA_DTYPE_F32, 1, shape, NULL, init_ones, NULL, &nd));
  REQUIRE_OK(strata_register_param(e, "frozen", STRATA_DTYPE_F32, 1, shape, NULL, init_ones, NULL, &fz));
  EXPECT(strata_set_weight_decay(e, nd, -1.0f), STRATA_ERROR_INVALID_ARGUMENT, "'bias': weight decay -1");
  EXPECT(strata_set_weight_decay(e, nd, NAN), STRATA_ERROR_INVALID_ARGUMENT, "must be finite and >= 0");
  EXPECT(strata_set_weight_decay(e, 7, 0.0f), STRATA_ERROR_INVALID_ARGUMENT, "parameter id 7 is not registered");
  EXPECT(strata_freeze_param(e, -1), STRATA_ERROR_INVALID_ARGUMENT, "parameter id -1 is not registered");
  REQUIRE_OK(strata_set_weight_decay(e, nd, 0.0f));
  REQUIRE_OK(strata_freeze_param(e, fz));
  all[0] = w, all[1] = nd, all[2] = fz;
  REQUIRE_OK(strata_register_op(e, "layer", 3, all, &op));
  REQUIRE_OK(strata_finalize(e));
  EXPECT(strata_freeze_param(e, w), STRATA_ERROR_INVALID_STATE, "'decayed' frozen after strata_finalize");
  EXPECT(strata_set_weight_decay(e, w, 0.1f), STRATA_ERROR_INVALID_STATE, "after strata_finalize");
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  EXPECT(strata_grad_ptr(e, fz, &g), STRATA_ERROR_INVALID_STATE, "'frozen' is frozen");
  EXPECT(strata_add_grad_device(e, fz, got, STRATA_DTYPE_F32, NULL), STRATA_ERROR_INVALID_STATE, "is frozen");
  add_all(e, w, N, 0.25f);
  add_all(e, nd, N, -0.25f);
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.1f, &result));
  CHECK(result.applied == 1, "step not applied");
  REQUIRE_OK(strata_read_param(e, w, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - (1.0f * (1 - 0.1f * 0.5f) - 0.1f)) < 1e-5f, "decayed[%d] = %f", i, got[i]);
  REQUIRE_OK(strata_read_param(e, nd, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - 1.1f) < 1e-5f, "bias[%d] = %f (no decay)", i, got[i]);
  REQUIRE_OK(strata_read_param(e, fz, got));
  for (i = 0; i < N; ++i) CHECK(got[i] == 1.0f, "frozen[%d] = %f", i, got[i]);
  REQUIRE_OK(strata_engine_destroy(e));
}

/* Gradients in accelerator memory (host memory on cpu), three dtypes; the norm and clipping. */
static void device_grads_and_clipping(void) {
  enum { N = 6 };
  int32_t world, p, op;
  const int64_t shape[1] = {N};
  float f32[N];
  uint16_t bf16[N], f16[N];
  double norm = 0, want = 0;
  int i;
  strata_step_result result;
  strata_engine* e = create(&world);
  for (i = 0; i < N; ++i) {
    f32[i] = (float)(i + 1);
    bf16[i] = 0x3F00; /* 0.5 */
    f16[i] = 0x3400;  /* 0.25 */
    want += (i + 1.75) * (i + 1.75);
  }
  want = world * sqrt(want);
  REQUIRE_OK(strata_register_param(e, "p", STRATA_DTYPE_BF16, 1, shape, NULL, NULL, NULL, &p));
  REQUIRE_OK(strata_register_op(e, "op", 1, &p, &op));
  REQUIRE_OK(strata_finalize(e));
  EXPECT(strata_fetch_on_stream(e, op, STRATA_PHASE_FORWARD, (void*)f32), STRATA_ERROR_INVALID_ARGUMENT,
         "the cpu accelerator has no streams");
  REQUIRE_OK(strata_fetch_on_stream(e, op, STRATA_PHASE_FORWARD, NULL));
  REQUIRE_OK(strata_release_on_stream(e, op, STRATA_PHASE_FORWARD, NULL));
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  EXPECT(strata_add_grad_device(e, p, NULL, STRATA_DTYPE_F32, NULL), STRATA_ERROR_INVALID_ARGUMENT, "grad is NULL");
  EXPECT(strata_add_grad_device(e, p, f32, (strata_dtype)9, NULL), STRATA_ERROR_INVALID_ARGUMENT, "dtype 9");
  EXPECT(strata_add_grad_device(e, p, f32, STRATA_DTYPE_F32, (void*)f32), STRATA_ERROR_INVALID_ARGUMENT,
         "no streams");
  EXPECT(strata_release_on_stream(e, op, STRATA_PHASE_BACKWARD, (void*)f32), STRATA_ERROR_INVALID_ARGUMENT,
         "no streams");
  REQUIRE_OK(strata_add_grad_device(e, p, f32, STRATA_DTYPE_F32, NULL));
  REQUIRE_OK(strata_add_grad_device(e, p, bf16, STRATA_DTYPE_BF16, NULL));
  REQUIRE_OK(strata_add_grad_device(e, p, f16, STRATA_DTYPE_F16, NULL));
  EXPECT(strata_clip_grad_norm(e, 1.0, &norm), STRATA_ERROR_INVALID_STATE, "still fetched");
  REQUIRE_OK(strata_release_on_stream(e, op, STRATA_PHASE_BACKWARD, NULL));
  EXPECT(strata_clip_grad_norm(e, NAN, &norm), STRATA_ERROR_INVALID_ARGUMENT, "max_norm is NaN");
  REQUIRE_OK(strata_clip_grad_norm(e, want / 4, &norm));
  CHECK(fabs(norm - want) < 1e-9 * want, "norm %f, want %f", norm, want);
  EXPECT(strata_fetch(e, op, STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE,
         "between strata_clip_grad_norm and strata_step");
  EXPECT(strata_begin_evaluation(e), STRATA_ERROR_INVALID_STATE, "between strata_clip_grad_norm and strata_step");
  REQUIRE_OK(strata_clip_grad_norm(e, want / 4, NULL)); /* again: the same boundary */
  REQUIRE_OK(strata_step(e, 0.1f, &result));
  CHECK(fabs(result.grad_norm - want) < 1e-9 * want, "step's norm %f, want %f", result.grad_norm, want);
  CHECK(fabsf(result.grad_scale - 0.25f) < 1e-5f, "grad_scale %f, want 0.25 (clipped to a quarter)",
        result.grad_scale);
  /* The next step clips by the config again (gradient_clipping 0: not at all). */
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_add_grad_device(e, p, f32, STRATA_DTYPE_F32, NULL));
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.1f, &result));
  CHECK(result.grad_scale == 1.0f, "grad_scale %f after the clipped step, want 1", result.grad_scale);
  REQUIRE_OK(strata_engine_destroy(e));
}

/* Forward windows outside training, bracketed. */
static void evaluation(void) {
  int32_t world, p, op;
  const int64_t shape[1] = {3};
  strata_engine* e = create(&world);
  REQUIRE_OK(strata_register_param(e, "p", STRATA_DTYPE_F32, 1, shape, NULL, NULL, NULL, &p));
  REQUIRE_OK(strata_register_op(e, "op", 1, &p, &op));
  EXPECT(strata_begin_evaluation(e), STRATA_ERROR_INVALID_STATE, "before strata_finalize");
  REQUIRE_OK(strata_finalize(e));
  EXPECT(strata_end_evaluation(e), STRATA_ERROR_INVALID_STATE, "no evaluation has begun");
  REQUIRE_OK(strata_begin_evaluation(e));
  EXPECT(strata_begin_evaluation(e), STRATA_ERROR_INVALID_STATE, "begun already");
  EXPECT(strata_fetch(e, op, STRATA_PHASE_BACKWARD), STRATA_ERROR_INVALID_STATE, "forward windows only");
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_FORWARD));
  EXPECT(strata_end_evaluation(e), STRATA_ERROR_INVALID_STATE, "still fetched");
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_FORWARD));
  REQUIRE_OK(strata_end_evaluation(e));
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.1f, NULL));
  REQUIRE_OK(strata_engine_destroy(e));
}

/* 0.4: an lr scale per parameter (AdamW's first step moves it lr x scale), and the Adam moments read by
 * parameter (after one step: (1 - beta1) g and (1 - beta2) g^2, g summed over ranks) and written back
 * (zero and step 0: the next step is a first step again). */
static void lr_scale_and_moments(void) {
  enum { N = 8 };
  int32_t world, w, h, op, both[2], twice[2];
  const int64_t shape[1] = {N};
  float got[N], m_w[N], v_w[N], m_h[N], v_h[N], zeros[N] = {0};
  float* m[2] = {m_w, m_h};
  float* v[2] = {v_w, v_h};
  const float* z[2] = {zeros, zeros};
  int64_t step = -1;
  int i;
  double g;
  strata_engine* e = create(&world);
  g = 0.25 * world;
  REQUIRE_OK(strata_register_param(e, "w", STRATA_DTYPE_F32, 1, shape, NULL, init_ones, NULL, &w));
  REQUIRE_OK(strata_register_param(e, "head", STRATA_DTYPE_F32, 1, shape, NULL, init_ones, NULL, &h));
  EXPECT(strata_set_lr_scale(e, h, -1.0f), STRATA_ERROR_INVALID_ARGUMENT, "'head': lr scale -1");
  EXPECT(strata_set_lr_scale(e, h, INFINITY), STRATA_ERROR_INVALID_ARGUMENT, "must be finite and >= 0");
  EXPECT(strata_set_lr_scale(e, 9, 1.0f), STRATA_ERROR_INVALID_ARGUMENT, "parameter id 9 is not registered");
  REQUIRE_OK(strata_set_lr_scale(e, h, 3.0f));
  REQUIRE_OK(strata_set_weight_decay(e, w, 0.0f));
  REQUIRE_OK(strata_set_weight_decay(e, h, 0.0f));
  both[0] = w, both[1] = h;
  twice[0] = w, twice[1] = w;
  REQUIRE_OK(strata_register_op(e, "layer", 2, both, &op));
  EXPECT(strata_read_optimizer_state(e, 2, both, m, v, &step), STRATA_ERROR_INVALID_STATE, "before strata_finalize");
  REQUIRE_OK(strata_finalize(e));
  EXPECT(strata_set_lr_scale(e, w, 2.0f), STRATA_ERROR_INVALID_STATE, "after strata_finalize");
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  add_all(e, w, N, 0.25f);
  add_all(e, h, N, 0.25f);
  EXPECT(strata_read_optimizer_state(e, 2, both, m, v, &step), STRATA_ERROR_INVALID_STATE, "still fetched");
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.1f, NULL));
  REQUIRE_OK(strata_read_param(e, w, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - 0.9f) < 1e-5f, "w[%d] = %f, want 0.9", i, got[i]);
  REQUIRE_OK(strata_read_param(e, h, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - 0.7f) < 1e-5f, "head[%d] = %f, want 0.7 (lr x 3)", i, got[i]);
  EXPECT(strata_read_optimizer_state(e, 2, twice, m, v, &step), STRATA_ERROR_INVALID_ARGUMENT, "'w' is listed twice");
  EXPECT(strata_read_optimizer_state(e, -1, both, m, v, &step), STRATA_ERROR_INVALID_ARGUMENT, "count -1");
  REQUIRE_OK(strata_read_optimizer_state(e, 2, both, m, v, &step));
  CHECK(step == 1, "step %lld, want 1", (long long)step);
  for (i = 0; i < N; ++i) {
    CHECK(fabs(m_w[i] - 0.1 * g) < 1e-6 && fabs(m_h[i] - 0.1 * g) < 1e-6, "exp_avg[%d] %f %f", i, m_w[i], m_h[i]);
    CHECK(fabs(v_w[i] - 0.001 * g * g) < 1e-8, "exp_avg_sq[%d] %g", i, v_w[i]);
  }
  EXPECT(strata_write_optimizer_state(e, 1, both, z, z, 0), STRATA_ERROR_INVALID_ARGUMENT,
         "trained parameter 'head' is not listed");
  EXPECT(strata_write_optimizer_state(e, 2, both, z, z, -3), STRATA_ERROR_INVALID_ARGUMENT, "step -3");
  REQUIRE_OK(strata_write_optimizer_state(e, 2, both, z, z, 0));
  REQUIRE_OK(strata_fetch(e, op, STRATA_PHASE_BACKWARD));
  add_all(e, w, N, 0.25f);
  add_all(e, h, N, 0.25f);
  REQUIRE_OK(strata_release(e, op, STRATA_PHASE_BACKWARD));
  REQUIRE_OK(strata_step(e, 0.1f, NULL));
  REQUIRE_OK(strata_read_param(e, w, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - 0.8f) < 1e-5f, "w[%d] = %f, want 0.8 (a first step again)", i, got[i]);
  REQUIRE_OK(strata_read_param(e, h, got));
  for (i = 0; i < N; ++i) CHECK(fabsf(got[i] - 0.4f) < 1e-5f, "head[%d] = %f, want 0.4", i, got[i]);
  REQUIRE_OK(strata_engine_destroy(e));
}

int main(void) {
  release_in_any_order();
  lr_scale_and_moments();
  freeze_and_decay();
  device_grads_and_clipping();
  evaluation();
  if (failures != 0) {
    fprintf(stderr, "capi_hooks: %d failure(s)\n", failures);
    return 1;
  }
  printf("capi_hooks: ok\n");
  return 0;
}
