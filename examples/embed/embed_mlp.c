/* embed_mlp: a trainer written in plain C99 that embeds strata through its C
 * API. The program owns the model code and the training loop (a two-layer
 * MLP, 64 -> 128 -> 10, ReLU, softmax cross-entropy, forward and backward by
 * hand on the CPU); strata owns the parameters: it partitions them over the
 * ranks (ZeRO stage 3), keeps each rank's shard and the Adam state in NVMe
 * swap files under a temporary directory, gathers the full values around each
 * layer, reduces the gradients and runs the optimizer.
 *
 *     embed_mlp [STEPS [CHECKPOINT_DIR]]                      one rank
 *     strata run -n 2 -- embed_mlp [STEPS [CHECKPOINT_DIR]]   two ranks, each with half of every batch
 *
 * With CHECKPOINT_DIR, a run resumes from the checkpoint there when the
 * directory exists (strata_load_checkpoint: parameters, Adam state, step
 * count) and saves one there at the end (strata_save_checkpoint, crash-safe):
 * `embed_mlp 30 ck && embed_mlp 40 ck` ends where `embed_mlp 40` does, bit for bit.
 * The printed lines carry the step breakdown (strata_get_step_breakdown).
 *
 * The task is synthetic: 10 classes, the label of x is the argmax of T x for a
 * fixed random "teacher" T. Every rank generates the same data and takes
 * every world_size-th sample of each batch, so the result does not depend on
 * the number of ranks. Exits 0 when the loss fell to under half its first
 * value (a resumed run: when it trained), 1 otherwise, 2 on a strata error
 * (printing strata_last_error()). */
#define _XOPEN_SOURCE 700 /* mkdtemp, nftw */

#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/capi/strata.h"

enum { IN = 64, HIDDEN = 128, CLASSES = 10, BATCH = 64 };
#define LR 0.01f /* AdamW's learning rate, constant (strata_step takes each step's) */

#define CHECK(call)                                                                              \
  do {                                                                                           \
    strata_status status_ = (call);                                                              \
    if (status_ != STRATA_OK) {                                                                  \
      fprintf(stderr, "embed_mlp: %s failed (%s): %s\n", #call, strata_status_string(status_), \
              strata_last_error());                                                              \
      exit(2);                                                                                   \
    }                                                                                            \
  } while (0)

/* Counter-based uniform in [-1, 1) from (stream, index): the same values on
 * every rank and for any partition of the index range. */
static float uniform(uint64_t stream, uint64_t index) {
  uint64_t z = stream * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)((double)(z >> 11) / 4503599627370496.0 - 1.0); /* 2^52 */
}

/* strata_init_fn for the weights: He-style uniform, fills just the range strata
 * asks for (this rank's shard). `user` points to the fan-in. */
static int init_weight(void* user, int32_t param, int64_t first, int64_t count, void* values) {
  const float scale = sqrtf(6.0f / (float)*(const int*)user);
  float* out = (float*)values;
  int64_t i;
  for (i = 0; i < count; ++i) out[i] = scale * uniform(100 + (uint64_t)param, (uint64_t)(first + i));
  return 0;
}

/* Sample `n` of the data set: x in [-1, 1)^IN and its teacher label. */
static int sample(uint64_t n, float* x) {
  int best = 0, c, i;
  float best_score = -1e30f;
  for (i = 0; i < IN; ++i) x[i] = uniform(1, n * IN + (uint64_t)i);
  for (c = 0; c < CLASSES; ++c) {
    float score = 0;
    for (i = 0; i < IN; ++i) score += uniform(2, (uint64_t)(c * IN + i)) * x[i];
    if (score > best_score) best_score = score, best = c;
  }
  return best;
}

/* Parameter `id`'s full value while a window listing it is open. */
static const float* param(strata_engine* engine, int32_t id) {
  void* p = NULL;
  CHECK(strata_param_ptr(engine, id, &p));
  return (const float*)p;
}

static int remove_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : 60;
  const char* checkpoint_dir = argc > 2 ? argv[2] : NULL;
  int first_step = 0;
  char swap_dir[] = "/tmp/strata-embed-XXXXXX";
  char config[1024];
  strata_engine* engine = NULL;
  strata_stats stats;
  int32_t w1, b1, w2, b2, fc1, fc2;
  const int64_t w1_shape[2] = {HIDDEN, IN}, b1_shape[1] = {HIDDEN};
  const int64_t w2_shape[2] = {CLASSES, HIDDEN}, b2_shape[1] = {CLASSES};
  static const float zeros[HIDDEN]; /* the biases start at zero */
  int fan_in1 = IN, fan_in2 = HIDDEN;
  static float x[BATCH][IN], h[BATCH][HIDDEN], dlogits[BATCH][CLASSES], dh[BATCH][HIDDEN];
  static int label[BATCH];
  double first_loss = 0, last_losses = 0;
  int step, rank, world, n_local, i, j, k;

  if (steps < 10) {
    fprintf(stderr, "embed_mlp: STEPS must be >= 10 (usage: embed_mlp [STEPS [CHECKPOINT_DIR]])\n");
    return 2;
  }
  if (strata_version() / 10000 != STRATA_VERSION_MAJOR) {
    fprintf(stderr, "embed_mlp: built against strata %d.x, loaded %s\n", STRATA_VERSION_MAJOR,
            strata_version_string());
    return 2;
  }
  /* Each rank its own swap directory (strata names its files per rank anyway). */
  if (mkdtemp(swap_dir) == NULL) {
    perror("embed_mlp: mkdtemp");
    return 2;
  }
  snprintf(config, sizeof config,
           "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": %g, \"weight_decay\": 0.0}},"
           " \"gradient_clipping\": 1.0,"
           " \"zero_optimization\": {\"stage\": 3,"
           "   \"stage3_param_persistence_threshold\": 0,"
           "   \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"},"
           "   \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
           " \"strata\": {\"accelerator\": \"cpu\", \"log_level\": \"warn\"}}",
           (double)LR, swap_dir, swap_dir);

  CHECK(strata_engine_create(config, &engine));
  CHECK(strata_register_param(engine, "fc1.weight", STRATA_DTYPE_F32, 2, w1_shape, NULL, init_weight,
                              &fan_in1, &w1));
  CHECK(strata_register_param(engine, "fc1.bias", STRATA_DTYPE_F32, 1, b1_shape, zeros, NULL, NULL, &b1));
  CHECK(strata_register_param(engine, "fc2.weight", STRATA_DTYPE_F32, 2, w2_shape, NULL, init_weight,
                              &fan_in2, &w2));
  CHECK(strata_register_param(engine, "fc2.bias", STRATA_DTYPE_F32, 1, b2_shape, zeros, NULL, NULL, &b2));
  {
    const int32_t fc1_params[2] = {w1, b1}, fc2_params[2] = {w2, b2};
    CHECK(strata_register_op(engine, "fc1", 2, fc1_params, &fc1));
    CHECK(strata_register_op(engine, "fc2", 2, fc2_params, &fc2));
  }
  CHECK(strata_finalize(engine));
  CHECK(strata_get_stats(engine, &stats));
  rank = stats.rank;
  world = stats.world_size;
  if (rank == 0) {
    printf("embed_mlp: strata %s, %d rank(s), ZeRO stage %d, %lld parameters, shards and Adam state in %s\n",
           strata_version_string(), world, stats.zero_stage, (long long)stats.param_numel, swap_dir);
  }
  if (checkpoint_dir != NULL) {
    struct stat st;
    if (stat(checkpoint_dir, &st) == 0) { /* resume: a damaged checkpoint is an error, not a fresh start */
      CHECK(strata_load_checkpoint(engine, checkpoint_dir));
      CHECK(strata_get_stats(engine, &stats));
      first_step = (int)stats.steps; /* every step applied: gradient clipping keeps them finite */
      if (rank == 0) printf("embed_mlp: resumed from %s at step %d\n", checkpoint_dir, first_step);
    }
  }

  for (step = first_step; step < steps; ++step) {
    double local_loss = 0, global_count = 0, loss = 0;
    strata_step_result result;
    const float* W1;
    const float* B1;
    const float* W2;
    const float* B2;
    float *dW1, *dB1, *dW2, *dB2;

    /* This rank's samples of the global batch: every world-th one. */
    n_local = 0;
    for (i = rank; i < BATCH; i += world) {
      label[n_local] = sample((uint64_t)step * BATCH + (uint64_t)i, x[n_local]);
      ++n_local;
    }
    /* Normalise by the global batch, so N ranks sum to the one-rank gradient. */
    CHECK(strata_global_sum(engine, (double)n_local, &global_count));

    /* ---- forward: fc1 + ReLU ---- */
    CHECK(strata_fetch(engine, fc1, STRATA_PHASE_FORWARD));
    W1 = param(engine, w1);
    B1 = param(engine, b1);
    for (i = 0; i < n_local; ++i) {
      for (j = 0; j < HIDDEN; ++j) {
        float s = B1[j];
        for (k = 0; k < IN; ++k) s += W1[j * IN + k] * x[i][k];
        h[i][j] = s > 0 ? s : 0;
      }
    }
    CHECK(strata_release(engine, fc1, STRATA_PHASE_FORWARD));

    /* ---- forward: fc2 + softmax cross-entropy (and its gradient) ---- */
    CHECK(strata_fetch(engine, fc2, STRATA_PHASE_FORWARD));
    W2 = param(engine, w2);
    B2 = param(engine, b2);
    for (i = 0; i < n_local; ++i) {
      float logits[CLASSES], max = -1e30f;
      double sum = 0;
      for (j = 0; j < CLASSES; ++j) {
        float s = B2[j];
        for (k = 0; k < HIDDEN; ++k) s += W2[j * HIDDEN + k] * h[i][k];
        logits[j] = s;
        if (s > max) max = s;
      }
      for (j = 0; j < CLASSES; ++j) sum += exp((double)(logits[j] - max));
      local_loss += log(sum) - (double)(logits[label[i]] - max);
      for (j = 0; j < CLASSES; ++j) {
        const double p = exp((double)(logits[j] - max)) / sum;
        dlogits[i][j] = (float)((p - (j == label[i])) / global_count);
      }
    }
    CHECK(strata_release(engine, fc2, STRATA_PHASE_FORWARD));

    /* ---- backward: fc2 (gradients are ADDED into strata's buffers) ---- */
    CHECK(strata_fetch(engine, fc2, STRATA_PHASE_BACKWARD));
    W2 = param(engine, w2);
    CHECK(strata_grad_ptr(engine, w2, &dW2));
    CHECK(strata_grad_ptr(engine, b2, &dB2));
    for (i = 0; i < n_local; ++i) {
      for (j = 0; j < CLASSES; ++j) {
        dB2[j] += dlogits[i][j];
        for (k = 0; k < HIDDEN; ++k) dW2[j * HIDDEN + k] += dlogits[i][j] * h[i][k];
      }
      for (k = 0; k < HIDDEN; ++k) {
        float s = 0;
        for (j = 0; j < CLASSES; ++j) s += W2[j * HIDDEN + k] * dlogits[i][j];
        dh[i][k] = h[i][k] > 0 ? s : 0;
      }
    }
    CHECK(strata_release(engine, fc2, STRATA_PHASE_BACKWARD));

    /* ---- backward: fc1 ---- */
    CHECK(strata_fetch(engine, fc1, STRATA_PHASE_BACKWARD));
    CHECK(strata_grad_ptr(engine, w1, &dW1));
    CHECK(strata_grad_ptr(engine, b1, &dB1));
    for (i = 0; i < n_local; ++i) {
      for (j = 0; j < HIDDEN; ++j) {
        dB1[j] += dh[i][j];
        for (k = 0; k < IN; ++k) dW1[j * IN + k] += dh[i][j] * x[i][k];
      }
    }
    CHECK(strata_release(engine, fc1, STRATA_PHASE_BACKWARD));

    /* ---- optimizer (strata: reduce, clip, AdamW on the NVMe-resident state) ---- */
    CHECK(strata_global_sum(engine, local_loss, &loss));
    loss /= global_count;
    CHECK(strata_step(engine, LR, &result));
    if (step == first_step) first_loss = loss;
    if (step >= steps - 5) last_losses += loss / 5;
    if (rank == 0 && (step % 10 == 0 || step == steps - 1)) {
      /* Where this step's time went (this rank): compute is the C code above,
       * stall the wait in strata_fetch for parameters read from NVMe and
       * gathered, optim strata_step's reduction wait and AdamW. */
      strata_step_breakdown b;
      CHECK(strata_get_step_breakdown(engine, &b));
      printf("step %3d  loss %.4f  grad norm %.4f%s  [%.1f ms: compute %.1f, stall %.1f, optim %.1f; NVMe %.0f KB "
             "read, %.0f KB written]\n",
             step + 1, loss, result.grad_norm, result.applied ? "" : "  (skipped: not finite)", b.seconds * 1e3,
             b.compute_seconds * 1e3, b.param_stall_seconds * 1e3,
             (b.grad_wait_seconds + b.optimizer_seconds) * 1e3, (double)b.nvme_read_bytes / 1e3,
             (double)b.nvme_written_bytes / 1e3);
    }
  }
  if (checkpoint_dir != NULL && first_step < steps) {
    CHECK(strata_save_checkpoint(engine, checkpoint_dir));
    if (rank == 0) printf("embed_mlp: saved step %d to %s\n", steps, checkpoint_dir);
  }

  CHECK(strata_get_stats(engine, &stats));
  {
    /* The trained model, whole, on every rank (a collective read). */
    static float final_b2[CLASSES];
    CHECK(strata_read_param(engine, b2, final_b2));
    if (rank == 0) {
      printf("embed_mlp: %lld optimizer steps, %lld parameter gathers (peak %.1f KB gathered), "
             "fc2.bias[0] = %.9g\n",
             (long long)stats.steps, (long long)stats.gathers, (double)stats.peak_gathered_bytes / 1e3,
             final_b2[0]);
    }
  }
  CHECK(strata_engine_destroy(engine));
  nftw(swap_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);

  if (first_step >= steps) {
    if (rank == 0) printf("embed_mlp: ok, the checkpoint is at step %d already\n", first_step);
    return 0;
  }
  if (first_step == 0 ? !(last_losses < 0.5 * first_loss) : !(last_losses < first_loss)) {
    fprintf(stderr, "embed_mlp: the loss did not fall enough: first %.4f, last 5 steps %.4f\n", first_loss,
            last_losses);
    return 1;
  }
  if (rank == 0) printf("embed_mlp: ok, loss %.4f -> %.4f\n", first_loss, last_losses);
  return 0;
}
