#!/usr/bin/env python3
"""The ZeRO-3 NVMe fine-tune of scripts/gpu-check under DeepSpeed, for the
tokens/s ratio strata / DeepSpeed on the same model, batch, sequence and steps.

    deepspeed_zero3.py --init CONFIG_JSON --data TEXT --seq N --micro-batch N --steps N
                       --lr LR --nvme DIR [--json OUT]

transformers' LlamaForCausalLM built from CONFIG_JSON (the Hugging Face
config.json strata's --init takes) inside deepspeed.zero.Init, trained with
deepspeed.initialize: ZeRO stage 3, bf16, AdamW, parameters and optimizer state
offloaded to NVMe under DIR (DeepSpeed's async_io op, built on the spot by the
machine's ninja and compiler, against the libaio that gpu-check points CPATH
and LIBRARY_PATH at). If that op cannot be built or used here, both
are offloaded to CPU memory instead and the output says so: the ratio is then
against DeepSpeed's CPU offload, not its NVMe offload. The data are random
windows of TEXT's bytes (vocab 256), as `strata finetune --data-format text`
trains. Prints one line: median tokens/s over the steps after the first two,
the loss from first to last step and the offload device; --json writes them.
"""
import argparse
import json
import os
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--nvme", required=True)
    p.add_argument("--json")
    a = p.parse_args()

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    import torch
    import transformers
    import deepspeed

    device = "nvme"
    note = ""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible():
            raise RuntimeError("AsyncIOBuilder is not compatible (libaio missing?)")
        AsyncIOBuilder().load()
    except Exception as e:  # noqa: BLE001 - any failure means: no NVMe offload here
        import traceback
        traceback.print_exc()  # into gpu-check's log: why the op did not build
        device, note = "cpu", f" (DeepSpeed's async_io op unusable here: {str(e).splitlines()[0][:160]}; CPU offload instead)"
    offload = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload["nvme_path"] = a.nvme
    ds_config = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000_000, "reduce_bucket_size": 50_000_000,
                              "stage3_param_persistence_threshold": 1000,
                              "offload_param": dict(offload), "offload_optimizer": dict(offload)},
        "aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 1},
        "steps_per_print": 1_000_000,
    }
    deepspeed.init_distributed()
    keys = json.load(open(a.init))
    keys.pop("model_type", None)  # the class says it
    config = transformers.LlamaConfig(**keys)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.LlamaForCausalLM(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    data = torch.tensor(list(open(a.data, "rb").read()), dtype=torch.long)
    generator = torch.Generator().manual_seed(1234)
    times, losses = [], []
    for _ in range(a.steps):
        starts = torch.randint(0, len(data) - a.seq - 1, (a.micro_batch,), generator=generator)
        ids = torch.stack([data[s:s + a.seq] for s in starts]).to(engine.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[2:] if len(times) > 3 else times
    rate = a.micro_batch * a.seq / statistics.median(timed)
    result = {"tokens_per_s": rate, "first_loss": losses[0], "last_loss": losses[-1], "offload": device,
              "deepspeed": deepspeed.__version__, "steps": a.steps}
    if a.json:
        json.dump(result, open(a.json, "w"))
    print(f"DeepSpeed {deepspeed.__version__} ZeRO-3, {device} offload: median {rate:.0f} tokens/s, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
