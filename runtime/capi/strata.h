/* strata's C API: embed strata's ZeRO engine (partitioning, NVMe/CPU offload,
 * the optimizer) in a trainer written in any language that can call C.
 *
 * The trainer keeps its own model code and training loop. It tells strata
 * what its parameters are (name, dtype, shape, initial values) and which
 * parameters each operator (one kernel group of its forward) reads; around
 * each operator it asks strata for the parameters' full values (strata_fetch)
 * and gives them back (strata_release); in backward it adds the parameters'
 * gradients into buffers strata hands out; at an accumulation boundary
 * strata_step runs the optimizer on this rank's shard. strata decides where
 * each shard lives (accelerator memory, pinned CPU memory or NVMe swap files,
 * as the DeepSpeed-style config says) and when full values exist.
 *
 *     strata_engine* e;
 *     strata_engine_create("{\"zero_optimization\": {\"stage\": 3}}", &e);
 *     strata_register_param(e, "fc1.weight", STRATA_DTYPE_F32, 2, shape, values, NULL, NULL, &w1);
 *     strata_register_op(e, "fc1", 1, &w1, &fc1);
 *     strata_finalize(e);
 *     for each step:
 *       strata_fetch(e, fc1, STRATA_PHASE_FORWARD);  strata_param_ptr(e, w1, &p);
 *       ... forward with p ...;                      strata_release(e, fc1, STRATA_PHASE_FORWARD);
 *       strata_fetch(e, fc1, STRATA_PHASE_BACKWARD); strata_grad_ptr(e, w1, &g);
 *       ... add the gradient into g ...;             strata_release(e, fc1, STRATA_PHASE_BACKWARD);
 *       strata_step(e, lr, &result);
 *     strata_engine_destroy(e);
 *
 * Ranks. Each process is one data-parallel rank. strata_engine_create reads
 * the rank environment `strata run -n N` (or torchrun) sets: RANK,
 * WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (mpirun's OMPI_COMM_WORLD_*
 * too). Without them the process is rank 0 of 1. Functions marked COLLECTIVE
 * must be called by every rank, in the same order, with the same arguments
 * (except host buffers and gradients); a rank that does not join makes its
 * peers fail with STRATA_ERROR_COMMUNICATION after strata.collective_timeout_s.
 * Each rank trains on its own data; gradients are SUMMED over ranks (never
 * averaged): normalise the loss by a global count (strata_global_sum).
 *
 * Memory. Pointers from strata_param_ptr and strata_grad_ptr are accelerator
 * memory: host memory with the "cpu" accelerator (strata.accelerator in the
 * config), CUDA device memory with "cuda". strata_fetch returns once the
 * values are in place (the calling thread waits), so any stream or thread may
 * read them afterwards; before strata_release the caller must have finished
 * all of its own work on those pointers (e.g. synchronized its CUDA stream).
 * With a cuda accelerator the *_on_stream functions order the same steps on
 * the caller's CUDA stream by events instead, and the host waits for nothing
 * (strata_fetch_on_stream, strata_release_on_stream, strata_add_grad_device).
 * strata's accelerator memory comes from its own budget (the cuda backend's
 * stream-ordered pool, sized by the device's free memory at creation, or
 * strata.memory_budget): a process that also runs another allocator on the
 * same GPU (torch's caching allocator) shares the device between the two, so
 * create the engine after the other library has taken what it keeps, or cap
 * one of them (torch.cuda.set_per_process_memory_fraction).
 *
 * Errors. Every function returns a strata_status; STRATA_OK is 0. On failure
 * strata_last_error() gives a message naming the function and what was wrong;
 * successful calls leave it unchanged. No C++ exception crosses this API.
 *   - Bad input (a NULL pointer, an unknown id, a wrong dtype or shape, a bad
 *     config) is STRATA_ERROR_INVALID_ARGUMENT, and a call out of order (a
 *     fetch before strata_finalize, a registration after it, a step inside a
 *     hook window) is STRATA_ERROR_INVALID_STATE. Both are detected before
 *     anything changes: the engine stays usable.
 *   - Any other failure (I/O, memory, a dead peer, an init callback that
 *     failed, an internal error) may have happened half way through a
 *     collective or a transfer, so it leaves the engine unusable: every later
 *     call on it except strata_get_stats and strata_engine_destroy returns
 *     STRATA_ERROR_ENGINE_FAILED, repeating the first error. Destroy it.
 *
 * Thread-safety. An engine is driven by one thread at a time (the caller
 * serialises calls on one engine). strata_version*, strata_status_string and
 * strata_last_error may be called from any thread; strata_last_error is per
 * thread. A process may create several engines, one after another or side by
 * side; every rank must create them in the same order. They share the
 * process's connection to the other ranks, made by the first
 * strata_engine_create (with its config's collective timeout) and closed at
 * exit, where rank 0 waits for the others to finish.
 *
 * Ownership. strata owns everything behind a strata_engine* and every pointer
 * it hands out; the caller owns the buffers it passes, which strata only reads
 * or writes during the call (initial values are copied at registration).
 *
 * Checkpoints. strata_save_checkpoint / strata_load_checkpoint write and read
 * the directory format of `strata finetune --save` (crash-safe: a manifest
 * written last); strata_get_step_breakdown says where the last step's time
 * and bytes went, strata_get_op_stalls which operators compute waited for.
 *
 * Not yet: loading a checkpoint into another world size.
 *
 * Versioning: STRATA_VERSION_* below is the version this header belongs to;
 * strata_version() the library's. Structs and enum values change only with
 * STRATA_VERSION_MAJOR; a minor version only adds functions (and new structs
 * they fill). Since 0.2: strata_get_step_breakdown, strata_get_op_stalls,
 * strata_save_checkpoint, strata_load_checkpoint, strata_prepare_step.
 * Since 0.3: strata_freeze_param, strata_set_weight_decay,
 * strata_fetch_on_stream, strata_release_on_stream, strata_add_grad_device,
 * strata_clip_grad_norm, strata_begin_evaluation, strata_end_evaluation; and
 * strata_release closes windows in any order (0.2: the innermost only).
 * Since 0.4: strata_set_lr_scale, strata_read_optimizer_state,
 * strata_write_optimizer_state. */
#ifndef STRATA_CAPI_STRATA_H_
#define STRATA_CAPI_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 4
#define STRATA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, like strata_version(). */
#define STRATA_VERSION (STRATA_VERSION_MAJOR * 10000 + STRATA_VERSION_MINOR * 100 + STRATA_VERSION_PATCH)

/* The most dimensions a parameter may have. */
#define STRATA_MAX_NDIM 8

typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_ERROR_INVALID_ARGUMENT = 1, /* NULL pointer, unknown id, bad dtype/shape/config; engine usable */
  STRATA_ERROR_INVALID_STATE = 2,    /* call out of order; engine usable */
  STRATA_ERROR_IO = 3,               /* file or NVMe I/O failed */
  STRATA_ERROR_OUT_OF_MEMORY = 4,    /* a memory budget or allocation failed */
  STRATA_ERROR_COMMUNICATION = 5,    /* a collective or the rendezvous failed or timed out */
  STRATA_ERROR_CUDA = 6,             /* CUDA, cuBLAS or NCCL reported an error */
  STRATA_ERROR_INTERNAL = 7,         /* a broken invariant inside strata (a bug) */
  STRATA_ERROR_ENGINE_FAILED = 8,    /* an earlier error left this engine unusable */
  STRATA_ERROR_CALLBACK = 9          /* an init callback returned non-zero */
} strata_status;

/* Storage dtype of a parameter. Gradients are always fp32. */
typedef enum strata_dtype {
  STRATA_DTYPE_F32 = 0,
  STRATA_DTYPE_F16 = 1, /* IEEE binary16 bits (uint16_t) */
  STRATA_DTYPE_BF16 = 2 /* bfloat16 bits (uint16_t) */
} strata_dtype;

/* Which pass a hook window belongs to. RECOMPUTE: the forward of a
 * checkpointed segment run again inside backward (fetched like FORWARD). */
typedef enum strata_phase {
  STRATA_PHASE_FORWARD = 0,
  STRATA_PHASE_BACKWARD = 1,
  STRATA_PHASE_RECOMPUTE = 2
} strata_phase;

/* Where shards live (strata_stats). */
typedef enum strata_tier { STRATA_TIER_DEVICE = 0, STRATA_TIER_CPU = 1, STRATA_TIER_NVME = 2 } strata_tier;

typedef struct strata_engine strata_engine; /* opaque */

/* What one strata_step did. */
typedef struct strata_step_result {
  int32_t applied;   /* 0: a gradient was not finite on some rank; nothing changed */
  float grad_scale;  /* factor applied to the stored gradients: 1 / loss scale x clipping */
  double grad_norm;  /* global L2 norm of the summed (unscaled) gradients, before clipping */
  double loss_scale; /* the fp16 loss scale this step's gradients carried; 1 without fp16 */
  int64_t step;      /* optimizer steps applied so far */
} strata_step_result;

typedef struct strata_stats {
  int32_t rank, world_size;
  int32_t zero_stage;                       /* 1, 2 or 3 */
  int32_t param_tier, optimizer_tier;       /* strata_tier of the shards' homes */
  int32_t param_count, op_count;            /* registered so far */
  int32_t host_memory;                      /* 1: strata_param_ptr/grad_ptr give host memory (cpu accelerator) */
  int32_t finalized;                        /* 1 after strata_finalize succeeded */
  int32_t failed;                           /* 1 when an error left the engine unusable */
  int64_t param_numel;                      /* elements over every registered parameter */
  int64_t steps;                            /* optimizer steps applied */
  int64_t steps_skipped;                    /* strata_step calls skipped (gradient not finite) */
  uint64_t gathered_bytes;                  /* full parameters gathered now (stage 3) */
  uint64_t peak_gathered_bytes;             /* the most gathered at once since finalize */
  int64_t gathers;                          /* parameter allgathers issued (stage 3) */
} strata_stats;

/* Where the time and the bytes of one step went: the interval from the end
 * of the previous strata_step (or strata_finalize, or strata_load_checkpoint)
 * to the end of this one, on this rank. seconds = compute + param_stall +
 * grad_wait + optimizer + other (up to rounding). */
typedef struct strata_step_breakdown {
  int64_t step;                /* strata_step calls so far, skipped ones included; 0: no step yet (all else 0) */
  int32_t applied;             /* the step's strata_step_result.applied */
  int32_t trace_followed;      /* 1: every window matched the recorded operator trace, so strata prefetched (stage 3) */
  int32_t trace_dropped;       /* 1: a window differed from the trace; it is recorded again next step (stage 3) */
  int32_t stalled_windows;     /* windows whose parameters were not gathered yet at strata_fetch (timed) */
  double seconds;              /* wall time of the interval */
  double compute_seconds;      /* outside strata_step, minus param_stall: the caller's work, the windows' host work */
  double param_stall_seconds;  /* compute waiting in strata_fetch for parameters (timed on the compute stream) */
  double grad_wait_seconds;    /* strata_step waiting for the last gradient reductions to land */
  double optimizer_seconds;    /* strata_step's global norm, clipping, Adam, new values to their home */
  double other_seconds;        /* the rest of strata_step (stages 1/2: gathering the new values) */
  int64_t windows;             /* strata_fetch calls */
  int64_t fetches;             /* parameters a window needed that were not gathered already */
  int64_t prefetched;          /* of them, gathered ahead from the operator trace */
  int64_t gathers;             /* parameter allgathers issued (stage 3) */
  uint64_t gathered_bytes;     /* full parameters those allgathers produced (accelerator memory) */
  uint64_t param_read_bytes;   /* parameter shards read NVMe -> pinned CPU memory for them (offload_param nvme) */
  uint64_t nvme_read_bytes;    /* everything this rank read from NVMe: parameter shards, optimizer state, gradients */
  uint64_t nvme_written_bytes; /* everything this rank wrote to NVMe */
} strata_step_breakdown;

/* One operator's stall in a step (strata_get_op_stalls): how long compute
 * waited in strata_fetch for the parameters of operator `op`'s windows of
 * `phase` (stage 3; timed on the compute stream, like param_stall_seconds). */
typedef struct strata_op_stall {
  int32_t op;      /* the operator's id (strata_register_op) */
  int32_t phase;   /* a strata_phase */
  int64_t windows; /* its windows of that phase whose wait was timed */
  double seconds;  /* the time compute waited in them */
} strata_op_stall;

/* Fills `values` with elements [first, first + count) of parameter `param`'s
 * flattened tensor, in its storage dtype. Returns 0 on success; any other
 * value fails strata_finalize with STRATA_ERROR_CALLBACK (its message names
 * the parameter, the value and the range). Called on strata_finalize's thread. */
typedef int (*strata_init_fn)(void* user, int32_t param, int64_t first, int64_t count, void* values);

/* ---- library -------------------------------------------------------------- */

/* The library's version, MAJOR * 10000 + MINOR * 100 + PATCH. Compare
 * strata_version() / 10000 with STRATA_VERSION_MAJOR to detect a mismatch
 * between the header compiled against and the library loaded. */
int strata_version(void);
/* "MAJOR.MINOR.PATCH"; static storage. */
const char* strata_version_string(void);
/* "ok", "invalid argument", ...; static storage; "unknown status" for others. */
const char* strata_status_string(strata_status status);
/* The message of this thread's most recent failed call ("" before any):
 * "<function>: <what was wrong>". Valid until this thread's next failing call. */
const char* strata_last_error(void);

/* ---- engine --------------------------------------------------------------- */

/* Creates this rank's engine from a DeepSpeed-style config (JSON text; the
 * keys of `strata config docs`: zero_optimization.stage 1-3, offload_param /
 * offload_optimizer device none|cpu|nvme with nvme_path, optimizer Adam|AdamW,
 * gradient_clipping, aio, strata.accelerator cpu|cuda|auto, ...). Connects to
 * the other ranks (COLLECTIVE: every rank creates its engine). On success
 * *out owns the engine (free it with strata_engine_destroy); on failure *out
 * is NULL. Errors: INVALID_ARGUMENT for a NULL argument, invalid JSON (line
 * and column), every config problem found (one per line), a bad rank
 * environment; COMMUNICATION when the ranks cannot connect; CUDA when the
 * config asks for cuda and there is no device. */
strata_status strata_engine_create(const char* config_json, strata_engine** out);

/* Frees the engine: its storage, swap files, streams and communicators (the
 * process's rendezvous stays for the next engine). NULL is a no-op. Never
 * fails on a valid engine, failed or not. Not collective, but a peer still
 * in a collective with this engine then fails with COMMUNICATION. */
strata_status strata_engine_destroy(strata_engine* engine);

/* ---- declaration (before strata_finalize) --------------------------------- */

/* Declares a parameter: a unique non-empty `name`, `dtype`, `ndim` in
 * [1, STRATA_MAX_NDIM] dimensions, each >= 1. Its initial value is one of:
 *   initial_values: the full tensor (numel x dtype size bytes, row-major),
 *     the same on every rank; copied now, so the buffer may be freed on
 *     return; each rank keeps only its own shard at strata_finalize;
 *   init (with `user`): called from strata_finalize for the ranges this rank
 *     owns, so the full tensor never has to exist (for large models);
 *   neither: zeros.
 * Giving both is INVALID_ARGUMENT. *id_out receives the parameter's id:
 * dense, from 0 in registration order, the same on every rank when every
 * rank registers the same parameters in the same order (they must).
 * Errors: INVALID_ARGUMENT (NULL, duplicate name, bad dtype, ndim or dim);
 * INVALID_STATE after strata_finalize. */
strata_status strata_register_param(strata_engine* engine, const char* name, strata_dtype dtype, int32_t ndim,
                                    const int64_t* shape, const void* initial_values, strata_init_fn init,
                                    void* user, int32_t* id_out);

/* Declares an operator: one hook window reading `n` distinct registered
 * parameters (`params` may be NULL when n is 0: a window that reads none).
 * A parameter may belong to several operators (a tied embedding); its
 * gradient is complete when every operator listing it has been released in
 * a backward pass. *op_out receives the operator's id (dense, from 0).
 * Errors: INVALID_ARGUMENT (NULL, empty name, n < 0, unknown or repeated
 * id); INVALID_STATE after strata_finalize. */
strata_status strata_register_op(strata_engine* engine, const char* name, int32_t n, const int32_t* params,
                                 int32_t* op_out);

/* Id of the parameter called `name`. Errors: INVALID_ARGUMENT (NULL, no such
 * parameter). */
strata_status strata_find_param(strata_engine* engine, const char* name, int32_t* id_out);

/* Marks parameter `id` frozen: not trained. It gets no gradient buffer
 * (strata_grad_ptr and strata_add_grad* refuse it, INVALID_STATE), is never
 * reduced, has no optimizer state and never changes, but is partitioned,
 * offloaded and fetched like any other (backward reads it to form the input
 * gradient). For adapters on a frozen base (LoRA) and frozen layers. Before
 * strata_finalize; every rank freezes the same parameters. Errors:
 * INVALID_ARGUMENT (unknown id); INVALID_STATE after strata_finalize.
 * Since 0.3. */
strata_status strata_freeze_param(strata_engine* engine, int32_t id);

/* Gives parameter `id` its own weight decay (finite, >= 0) in place of the
 * config's optimizer.params.weight_decay: AdamW's decoupled decay, Adam's L2
 * term, as the config's optimizer type says. A trainer's parameter groups
 * (e.g. no decay for biases and norms). Parameters of one decay are
 * partitioned and updated together; checkpoints record the grouping, so a
 * load needs the same decays. Before strata_finalize; every rank gives the
 * same decays. Errors: INVALID_ARGUMENT (unknown id, a negative or not finite
 * decay); INVALID_STATE after strata_finalize. Since 0.3. */
strata_status strata_set_weight_decay(strata_engine* engine, int32_t id, float weight_decay);

/* Gives parameter `id` a learning rate of `lr_scale` (finite, >= 0) times
 * the lr each strata_step (and strata_prepare_step) is given: a trainer's
 * parameter groups with lrs of their own (e.g. a head trained faster), whose
 * schedule scales every group alike. Parameters of one scale are partitioned
 * and updated together; checkpoints record the grouping, so a load needs the
 * same scales. Before strata_finalize; every rank gives the same scales.
 * Errors: INVALID_ARGUMENT (unknown id, a negative or not finite scale);
 * INVALID_STATE after strata_finalize. Since 0.4. */
strata_status strata_set_lr_scale(strata_engine* engine, int32_t id, float lr_scale);

/* COLLECTIVE. Partitions every parameter, creates each shard's storage where
 * the config says (device, pinned CPU, NVMe) and writes the initial values of
 * this rank's shard (calling init callbacks on this thread). A config
 * without zero_optimization.sub_group_size or reduce_bucket_size gets them
 * here, chosen from the registered parameters' decoder layers (the names up to
 * their first all-digit component, "model.layers.3.*"; one layer per
 * sub-group and per bucket; names without one make the whole model one
 * piece), logged once by rank 0. Once; needs at
 * least one parameter. With several ranks it first checks that every rank
 * registered the same parameters and operators. Errors: INVALID_STATE
 * (twice, no parameter); INVALID_ARGUMENT (the ranks' registrations differ);
 * CALLBACK (an init callback returned non-zero), OUT_OF_MEMORY, IO,
 * COMMUNICATION -- each of these last four leaves the engine unusable. */
strata_status strata_finalize(strata_engine* engine);

/* ---- hook windows (after strata_finalize) -------------------------------- */

/* COLLECTIVE at stage 3 (gathers shards). Opens operator `op`'s window for
 * `phase`: on return every parameter of `op` has its full value at
 * strata_param_ptr (the calling thread waited for it). Windows may nest or
 * overlap and be released in any order; an operator cannot be open twice.
 * Every rank opens the same windows in the same order (the prefetcher
 * follows the order of the first step: keep it the same every step).
 * Errors: INVALID_ARGUMENT (unknown op, bad phase); INVALID_STATE (before
 * finalize, op already open); IO/COMMUNICATION/OUT_OF_MEMORY (unusable). */
strata_status strata_fetch(strata_engine* engine, int32_t op, strata_phase phase);

/* Closes the open window (op, phase) -- any open window, not only the last
 * opened (since 0.3: an autograd engine finishes a module's backward when its
 * inputs' gradients are done, which need not be the reverse of the order the
 * windows opened in) -- once the caller has finished every use of its
 * pointers. Pointers from strata_param_ptr and strata_grad_ptr for this
 * window are invalid afterwards (strata may free or reuse them; those of a
 * parameter another open window lists stay valid until that one closes too).
 * After a BACKWARD release, a parameter whose every operator has now been
 * released in this backward pass has a complete gradient, which strata
 * reduces over ranks and accumulates into this rank's shard (stages 2/3;
 * stage 1 at strata_step). Errors: INVALID_ARGUMENT (unknown op, bad phase);
 * INVALID_STATE ((op, phase) is not open). */
strata_status strata_release(strata_engine* engine, int32_t op, strata_phase phase);

/* strata_fetch without the host wait: on return the parameters are being
 * gathered, and work the caller enqueues on `stream` (a cudaStream_t, e.g.
 * torch.cuda.current_stream().cuda_stream) after this call runs after they
 * are in place (the stream waits on an event). A NULL stream is strata_fetch.
 * The cpu accelerator has no streams: a non-NULL stream is INVALID_ARGUMENT
 * there. Same errors otherwise. Since 0.3. */
strata_status strata_fetch_on_stream(strata_engine* engine, int32_t op, strata_phase phase, void* stream);

/* strata_release for work on `stream`: the window's memory is freed, and its
 * gradients reduced, only after the work enqueued on `stream` before this call
 * (strata's streams wait on an event; the host does not). The caller may
 * release as soon as it has enqueued its last use. A NULL stream is
 * strata_release (the caller has finished its work). Same errors, and
 * INVALID_ARGUMENT for a stream on the cpu accelerator. Since 0.3. */
strata_status strata_release_on_stream(strata_engine* engine, int32_t op, strata_phase phase, void* stream);

/* *ptr receives parameter `id`'s full value (row-major, its storage dtype,
 * accelerator memory), which the caller may read but not write, valid until
 * the release of the window that made it available. Errors: INVALID_ARGUMENT
 * (NULL, unknown id); INVALID_STATE (no open window lists `id`). */
strata_status strata_param_ptr(strata_engine* engine, int32_t id, void** ptr);

/* *ptr receives parameter `id`'s fp32 gradient buffer for this backward pass
 * (its full shape, accelerator memory), zero at the pass's first use: ADD
 * the operator's gradient contribution into it (never overwrite: a tied
 * parameter receives several). Valid until the window's release. Errors:
 * INVALID_ARGUMENT (NULL, unknown id); INVALID_STATE (no open BACKWARD
 * window lists `id`). */
strata_status strata_grad_ptr(strata_engine* engine, int32_t id, float** ptr);

/* Adds `host_grad` (numel fp32 values in host memory, the parameter's full
 * gradient contribution) into the gradient buffer strata_grad_ptr gives; for
 * trainers whose gradients are on the host (with a cuda accelerator it goes
 * through host memory: slower than adding on the device). Same window rules
 * and errors as strata_grad_ptr. */
strata_status strata_add_grad(strata_engine* engine, int32_t id, const float* host_grad);

/* Adds `grad` (numel values of `dtype`, F32, F16 or BF16, in accelerator
 * memory -- host memory with the cpu accelerator -- the parameter's full
 * gradient contribution) into parameter `id`'s fp32 gradient buffer, widening
 * 16-bit values exactly, on strata's compute stream: no host copy. With a
 * NULL `stream` the add has finished on return, so `grad` may be reused at
 * once. With a stream (cuda) the add runs after the work enqueued on `stream`
 * so far (which may still be writing `grad`), and work enqueued on `stream`
 * afterwards runs after the add (so `grad` may be freed in stream order).
 * Same window rules as strata_grad_ptr. Errors: INVALID_ARGUMENT (NULL grad,
 * unknown id, bad dtype, a stream on the cpu accelerator); INVALID_STATE (no
 * open BACKWARD window lists `id`, or it is frozen); OUT_OF_MEMORY (the
 * widening's scratch), CUDA (unusable). Since 0.3. */
strata_status strata_add_grad_device(strata_engine* engine, int32_t id, const void* grad, strata_dtype dtype,
                                     void* stream);

/* ---- steps (after strata_finalize, no window open) ------------------------ */

/* COLLECTIVE. *sum receives the sum of `value` over ranks (exact fp64 sum),
 * e.g. the global number of samples or tokens to normalise the loss by.
 * Errors: INVALID_ARGUMENT (NULL); INVALID_STATE (before finalize);
 * COMMUNICATION (unusable). */
strata_status strata_global_sum(strata_engine* engine, double value, double* sum);

/* COLLECTIVE. The optimizer at an accumulation boundary: the global gradient
 * norm, clipping (gradient_clipping), Adam/AdamW on this rank's shard with
 * learning rate `lr` (finite, >= 0; a schedule's value), the new values
 * written to the shards' homes; then every gradient is zero. When a gradient
 * is not finite on any rank the step is skipped on every rank (applied = 0,
 * nothing changes but the gradients, which are dropped). `result` may be
 * NULL. Errors: INVALID_ARGUMENT (bad lr); INVALID_STATE (before finalize, a
 * window open, a backward pass half done: some operator listing a parameter
 * not yet released in BACKWARD); IO/COMMUNICATION/OUT_OF_MEMORY (unusable). */
strata_status strata_step(strata_engine* engine, float lr, strata_step_result* result);

/* COLLECTIVE, optional. Says that the next backward pass is the last before
 * strata_step(engine, lr, ...): with ZeRO stage 2 or 3 the optimizer may then
 * update each sub-group of this rank's shard during that backward, as soon as
 * its gradient is final, instead of after it (strata.overlap_optimizer,
 * zero_optimization.sub_group_size and reduce_bucket_size set how much
 * overlaps). It speculates that the step applies unclipped; when clipping or
 * an overflow fires, or strata_step gets another lr, the speculative updates
 * are rolled back exactly and the step is taken as without this call: results
 * never depend on it. Call it after the previous micro-step's backward and
 * before the last one's (before its forward is simplest). Until strata_step
 * or strata_zero_grad (which abandons the step and rolls back),
 * strata_read_param, strata_write_param and strata_save_checkpoint fail with
 * INVALID_STATE. Errors: INVALID_ARGUMENT (bad lr); INVALID_STATE (before
 * finalize, a window open, a backward pass half done, already prepared);
 * COMMUNICATION (unusable). Since 0.2. */
strata_status strata_prepare_step(strata_engine* engine, float lr);

/* COLLECTIVE, optional, torch.nn.utils.clip_grad_norm_'s place in a loop:
 * after the last backward pass before strata_step (every pass finished, no
 * window open), *norm receives the global L2 norm of the summed (unscaled)
 * gradients -- the grad_norm strata_step reports -- and the coming
 * strata_step clips to `max_norm` (> 0; 0 or less: no clipping) instead of
 * the config's gradient_clipping. The step's result is the same bits as with
 * gradient_clipping = max_norm. Only for that step: the next one clips by the
 * config again unless this is called again. It waits for the gradients'
 * reductions and reads the gradient shard once (the step reads it again).
 * After strata_prepare_step the norm is still exact, but speculative updates
 * taken with the config's clipping may be redone. `norm` may be NULL.
 * Errors: INVALID_ARGUMENT (max_norm not a number); INVALID_STATE (before
 * finalize, a window open, a backward pass half done); IO/COMMUNICATION
 * (unusable). Since 0.3. */
strata_status strata_clip_grad_norm(strata_engine* engine, double max_norm, double* norm);

/* Brackets forward passes that are not training (an evaluation between
 * steps, forward windows only): stage 3 gathers their parameters on demand
 * and leaves the training step's operator trace alone, so the next step still
 * prefetches. Between steps only (no window open, no backward pass half done,
 * not after strata_prepare_step); strata_end_evaluation before the next
 * training window. In between, BACKWARD windows are INVALID_STATE. Errors:
 * INVALID_STATE (misplaced, or already begun / not begun). Since 0.3. */
strata_status strata_begin_evaluation(strata_engine* engine);
strata_status strata_end_evaluation(strata_engine* engine);

/* *scale receives the loss scale of the coming step: with fp16.enabled in the
 * config (dynamic loss scaling, DeepSpeed's fp16.* keys), multiply the loss --
 * so every gradient added -- by it; strata_step divides it out, skips a step
 * whose gradients overflow (applied = 0) and adjusts it. 1 for fp32/bf16.
 * Errors: INVALID_ARGUMENT (NULL). */
strata_status strata_loss_scale(strata_engine* engine, double* scale);

/* Drops the gradients accumulated since the last step (e.g. to abandon
 * micro-batches). Needs every backward pass finished, like strata_step. */
strata_status strata_zero_grad(strata_engine* engine);

/* COLLECTIVE. Copies parameter `id`'s full current value (its storage dtype,
 * numel elements) into `host_full` (host memory) on every rank. For tests,
 * exports and handing values back to another framework; not for the hot
 * path (it moves the whole tensor). Errors: INVALID_ARGUMENT (NULL, unknown
 * id); INVALID_STATE (before finalize, a window open). */
strata_status strata_read_param(strata_engine* engine, int32_t id, void* host_full);

/* COLLECTIVE. Sets parameter `id` to `host_full` (the full tensor, its
 * storage dtype, the same on every rank); each rank stores its shard. The
 * optimizer's fp32 master copy restarts from the new values. Same errors as
 * strata_read_param. */
strata_status strata_write_param(strata_engine* engine, int32_t id, const void* host_full);

/* COLLECTIVE. The Adam moments of the trained parameters ids[0..count), in
 * torch.optim.Adam(W)'s terms: exp_avg[i] and exp_avg_sq[i] (host memory,
 * numel fp32 each, either may be NULL) receive parameter ids[i]'s full first
 * and second moments on every rank, and *step (may be NULL) the optimizer
 * steps applied so far (the step skipped on overflow not counted: Adam's t).
 * One pass over the optimizer state (NVMe read once). For a trainer's
 * optimizer state_dict; not for the hot path. Every rank passes the same ids.
 * Errors: INVALID_ARGUMENT (NULL ids with count > 0, count < 0, an unknown,
 * repeated or frozen id); INVALID_STATE (before finalize, a window open, a
 * backward pass half done, after strata_prepare_step); IO/COMMUNICATION
 * (unusable). Since 0.4. */
strata_status strata_read_optimizer_state(strata_engine* engine, int32_t count, const int32_t* ids,
                                          float* const* exp_avg, float* const* exp_avg_sq, int64_t* step);

/* COLLECTIVE. Sets the Adam moments of every trained parameter -- each one
 * listed in ids[0..count) exactly once, exp_avg[i] and exp_avg_sq[i] its full
 * moments (host memory, numel fp32 each, the same on every rank; each rank
 * keeps its share) -- and the optimizer step count to `step` (>= 0), as
 * strata_read_optimizer_state gives them (a torch optimizer's state_dict
 * loaded). The fp32 master weights are kept (strata_write_param sets them).
 * Errors, nothing changed: INVALID_ARGUMENT (NULL pointers, an unknown,
 * repeated or frozen id, a trained parameter missing, step < 0);
 * INVALID_STATE as strata_read_optimizer_state. IO/COMMUNICATION (unusable).
 * Since 0.4. */
strata_status strata_write_optimizer_state(strata_engine* engine, int32_t count, const int32_t* ids,
                                           const float* const* exp_avg, const float* const* exp_avg_sq,
                                           int64_t step);

/* Fills *stats. Works on a failed engine too (stats->failed = 1). Errors:
 * INVALID_ARGUMENT (NULL). */
strata_status strata_get_stats(strata_engine* engine, strata_stats* stats);

/* Fills *breakdown with the last strata_step's breakdown (this rank's; all
 * zero before the first step and after strata_load_checkpoint). Not
 * collective; works on a failed engine too. For the whole run, sum them.
 * Errors: INVALID_ARGUMENT (NULL). Since 0.2. */
strata_status strata_get_step_breakdown(strata_engine* engine, strata_step_breakdown* breakdown);

/* The last strata_step's stall per (operator, phase), most seconds first:
 * *count receives how many there are; the first min(count, capacity) are
 * written to `stalls` (which may be NULL when capacity is 0: ask the count
 * first). Their seconds sum to the breakdown's param_stall_seconds. Not
 * collective; works on a failed engine too. Errors: INVALID_ARGUMENT (NULL
 * engine or count, capacity < 0, NULL stalls with capacity > 0). Since 0.2. */
strata_status strata_get_op_stalls(strata_engine* engine, strata_op_stall* stalls, int32_t capacity,
                                   int32_t* count);

/* ---- checkpoints (after strata_finalize, between steps) -------------------- */

/* COLLECTIVE. Saves the engine's state -- every rank's parameter shards, the
 * optimizer's fp32 master weights and Adam moments, the step count and the
 * fp16 loss scaler -- as the checkpoint `dir`/step_<N>, N being the number of
 * strata_step calls so far (skipped ones included). The format is `strata
 * finetune --save`'s: each rank writes and fsyncs its files under
 * step_<N>/rank<r>/, then rank 0 writes manifest.json (the world size, the
 * parameters' names, dtypes and shapes, each file's size and CRC-32) under a
 * temporary name, fsyncs it and renames it into place. The checkpoint exists
 * from that rename on: a process killed at any instant leaves the previous
 * checkpoint in `dir` loadable (a step_<N> without a manifest is ignored, and
 * removed by the next save). After the rename, older checkpoints in `dir` are
 * removed: `dir` keeps one. Gradients accumulated since the last strata_step
 * are not saved. `dir` is created if missing and must be the same directory
 * for every rank (one machine, or a shared filesystem). `dir` is the
 * caller's; strata only reads it during the call.
 * Errors, the engine usable: INVALID_ARGUMENT (NULL or empty dir; `dir`
 * cannot be created or written; it already holds a checkpoint of step N or
 * later -- save after the next strata_step, or elsewhere); INVALID_STATE
 * (before finalize, a window open, a backward pass half done). Unusable: IO
 * (a write failed, a full disk included; the partial checkpoint has no
 * manifest and never counts), COMMUNICATION. Since 0.2. */
strata_status strata_save_checkpoint(strata_engine* engine, const char* dir);

/* COLLECTIVE. Loads the newest complete checkpoint in `dir` (or `dir` itself
 * when it is a step_<N> directory) written by strata_save_checkpoint into
 * this finalized engine: parameters, optimizer state, step count, loss
 * scale; gradients accumulated since the last strata_step are dropped. The
 * checkpoint must come from the same number of ranks and the same parameters
 * (names, dtypes, shapes, registration order); the ZeRO stage and the
 * offload tiers may differ. Every file is checked against the manifest (size
 * and CRC-32) on every rank before anything is loaded. Then
 * strata_get_stats's steps is the checkpoint's.
 * Errors, nothing loaded, the engine usable: INVALID_ARGUMENT (NULL or empty
 * dir; `dir` does not exist or holds no complete checkpoint; a manifest that
 * does not parse; a checkpoint of another world size or other parameters; a
 * file missing, truncated or corrupt -- each message names the file);
 * INVALID_STATE (before finalize, a window open, a backward pass half done).
 * Unusable: IO (a read failed while loading), COMMUNICATION. Since 0.2. */
strata_status strata_load_checkpoint(strata_engine* engine, const char* dir);

/* ---- timeline (any time; process-wide, not per engine) -------------------- */

/* Starts recording a timeline of this process -- every engine's I/O workers,
 * collectives and hook windows (strata_fetch, strata_release, strata_step),
 * one track per thread, with bytes and GB/s -- to be written as
 * Chrome/Perfetto trace JSON (open it in ui.perfetto.dev) by
 * strata_trace_stop, or at exit if the process ends first. One file per
 * rank (ranks from the environment, as strata_engine_create reads them):
 * "{rank}" in `path` is replaced by the rank; without it and with several
 * ranks, ".rank<N>" goes before a ".json" extension (or at the end). The file
 * is created now, under a temporary name beside `path`, so a bad path fails
 * here rather than at the end of a run. Recording costs a fraction of a
 * microsecond per event and, when off, nothing measurable. Not collective.
 * Errors: INVALID_ARGUMENT (NULL or empty path, a bad rank environment);
 * INVALID_STATE (already recording); IO (the file cannot be created: the
 * message names it and the reason). */
strata_status strata_trace_start(const char* path);

/* Stops recording and writes the file started by strata_trace_start
 * (complete, then renamed into place). Events beyond the per-thread bound
 * (262144 per thread) are dropped and counted in the file's
 * otherData.dropped_events. Errors: INVALID_STATE (not recording); IO
 * (writing or renaming failed; recording is off either way). */
strata_status strata_trace_stop(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_CAPI_STRATA_H_ */
