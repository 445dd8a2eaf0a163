#!/usr/bin/env python3
"""One rank of DeepSpeed's side of bench/strata-vs-deepspeed/run (started by
it, once per rank, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set):
the same model directory, ds_config, token file, windows and steps that
`strata finetune` is given, trained with deepspeed.initialize on DeepSpeed's
cpu accelerator (DS_ACCELERATOR=cpu, Gloo).

    deepspeed_side.py --model DIR --config DS_JSON --data TOKENS_U16 --seq N
                      --steps N --seed S --json OUT

The windows are strata's for a raw u16 token file (runtime/data/token_file.cc,
sample_order.h): window w is tokens [w*seq, w*seq + seq] (ids and the next
token), and the g-th sample of training reads window_of_sample(g) of a keyed
permutation; rank r's micro-batch of step s holds samples
(s-1)*mb*world + r*mb + [0, mb). The loss is the mean over the rank's targets
(cross entropy of every position, as strata trains a token file); ranks hold
equal token counts, so DeepSpeed's average of the ranks' gradients is strata's
mean over the global batch.

Per step: forward+backward (engine(...) and engine.backward) and the optimizer
phase (engine.step(): the norm and clipping, the sub-groups' state swapped in
from NVMe, CPU Adam, swapped out, the parameters written back), each timed on
this rank. NVMe is required, not assumed: the offload devices the engine ended
up with and the swap files under nvme_path are written to OUT, and the run
fails if DeepSpeed's async_io op cannot be loaded (no CPU fallback here).
"""
import argparse
import json
import os
import sys
import time

M64 = (1 << 64) - 1


def mix(x):  # splitmix64's finaliser, as runtime/data/sample_order.h
    x ^= x >> 30
    x = (x * 0xbf58476d1ce4e5b9) & M64
    x ^= x >> 27
    x = (x * 0x94d049bb133111eb) & M64
    return x ^ (x >> 31)


def permute(i, n, key):
    if n <= 1:
        return 0
    bits = (n - 1).bit_length()
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for rnd in range(4):
            f = mix(right ^ key ^ ((rnd * 0x9e3779b97f4a7c15) & M64)) & mask
            left, right = right, left ^ f
        x = (left << half) | right
        if x < n:
            return x


def window_of_sample(sample, windows, seed):
    epoch = sample // windows
    return permute(sample % windows, windows, mix(seed ^ mix(epoch + 1)))


def swap_files(root):
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            found.append((os.path.relpath(p, root), os.path.getsize(p)))
    return found


def main():
    p = argparse.ArgumentParser()
    for flag in ("--model", "--config", "--data", "--json"):
        p.add_argument(flag, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["LOCAL_RANK"] = str(rank)
    t_start = time.perf_counter()

    import numpy
    import torch
    import transformers
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers.integrations import HfDeepSpeedConfig

    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        sys.exit(f"deepspeed_side.py: DeepSpeed chose the {accel.device_name()} accelerator; set DS_ACCELERATOR=cpu")
    aio = accel.create_op_builder("AsyncIOBuilder")
    if not aio.is_compatible():
        sys.exit("deepspeed_side.py: DeepSpeed's async_io op is not compatible here (libaio-dev missing?): "
                 "NVMe offload impossible, and this bench does not fall back to CPU offload")
    aio.load()

    ds_config = json.load(open(a.config))
    zero = ds_config["zero_optimization"]
    for part in ("offload_param", "offload_optimizer"):
        if zero.get(part, {}).get("device") != "nvme":
            sys.exit(f"deepspeed_side.py: {a.config}: zero_optimization.{part}.device is not nvme")
    mb = ds_config["train_micro_batch_size_per_gpu"]
    if ds_config.get("gradient_accumulation_steps", 1) != 1:
        sys.exit("deepspeed_side.py: gradient_accumulation_steps must be 1 here")

    deepspeed.init_distributed(dist_backend="gloo")
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - from_pretrained builds under zero.Init while it lives
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    t_ready = time.perf_counter()

    tokens = numpy.fromfile(a.data, dtype="<u2").astype(numpy.int64)
    windows = (len(tokens) - 1) // a.seq
    vocab = model.config.vocab_size
    steps, used = [], []
    for s in range(1, a.steps + 1):
        first = (s - 1) * mb * world + rank * mb
        ws = [window_of_sample(first + i, windows, a.seed) for i in range(mb)]
        used.append(ws)
        rows = torch.from_numpy(numpy.stack([tokens[w * a.seq: w * a.seq + a.seq + 1] for w in ws]))
        ids, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        t0 = time.perf_counter()
        logits = engine(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        norm = engine.get_global_grad_norm()
        steps.append({"step": s, "loss": mean.item() / world, "grad_norm": float(norm) if norm is not None else None,
                      "step_s": t2 - t0, "forward_backward_s": t1 - t0, "optimizer_s": t2 - t1})
        if rank == 0:
            print(f"[deepspeed] step {s} loss {steps[-1]['loss']:.4f} norm {steps[-1]['grad_norm']} "
                  f"step {t2 - t0:.3f} s (forward+backward {t1 - t0:.3f}, optimizer {t2 - t1:.3f})", flush=True)

    # What really holds the state: the optimizer's flags and swapper, and this
    # rank's swap files under nvme_path (zero_stage_3/optimizer/rankR: master
    # weights, exp_avg, exp_avg_sq, gradients; zero_stage_3/<dtype>params/rankR).
    opt = engine.optimizer
    swap = {}
    for part in ("offload_optimizer", "offload_param"):
        root = os.path.join(zero[part]["nvme_path"], "zero_stage_3")
        for d in (os.listdir(root) if os.path.isdir(root) else []):
            files = swap_files(os.path.join(root, d, f"rank{rank}"))
            swap[d] = {"files": len(files), "bytes": sum(n for _, n in files)}
    offload = {"offload_optimizer": bool(getattr(opt, "offload_optimizer", False)),
               "offload_param": bool(getattr(opt, "offload_param", False)),
               "params_in_nvme_and_cpu": bool(getattr(opt, "params_in_nvme_and_cpu", False)),
               "optimizer_swapper": type(getattr(opt, "optimizer_swapper", None)).__name__,
               "swap": swap}
    nvme = (offload["params_in_nvme_and_cpu"] and offload["optimizer_swapper"] != "NoneType"
            and swap.get("optimizer", {}).get("bytes", 0) > 0
            and any(k.endswith("params") and v["bytes"] > 0 for k, v in swap.items()))
    result = {"rank": rank, "world": world, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "startup_s": t_ready - t_start, "steps": steps, "windows": used, "offload": offload,
              "nvme": nvme, "threads": torch.get_num_threads()}
    with open(a.json, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
