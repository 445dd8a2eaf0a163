#!/usr/bin/env python3
"""One rank of bench/strata-torch/run's Trainer sides: the Hugging Face Trainer on a Llama directory with
ZeRO-3, parameters and optimizer state on NVMe, either through strata (StrataTrainer, st.wrap) or through
DeepSpeed (Trainer(deepspeed=...), DS_ACCELERATOR=cpu). The same TrainingArguments, data and config keys;
per step the time between optimizer steps, the loss; at the end peak RSS, and for strata the hook time,
windows and the bytes of parameters materialized in torch at most. Writes --json (rank 0)."""

import argparse
import json
import os
import pathlib
import resource
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("strata", "deepspeed"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="u16 tokens")
    p.add_argument("--config", required=True)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    import numpy as np
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    ids = torch.from_numpy(np.fromfile(a.data, dtype="<u2").astype("int64"))

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return (len(ids) - 1) // a.seq

        def __getitem__(self, i):
            w = ids[i * a.seq:(i + 1) * a.seq]
            return {"input_ids": w, "labels": w.clone()}

    times, losses, hooks = [], [], []
    holder = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())
            w = holder.get("wrapped")
            if w is not None:  # this step's hook time, compute's stall on parameters inside it, its windows
                b = w.engine.step_breakdown()
                total = w.hook_seconds + w.grad_seconds
                hooks.append({"hook_s": total - holder.get("hook_s", 0.0), "stall_s": b.param_stall_seconds,
                              "strata_s": w.strata_seconds - holder.get("strata_s", 0.0), "windows": b.windows,
                              "step_s": b.seconds})
                holder["hook_s"], holder["strata_s"] = total, w.strata_seconds

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = json.loads(pathlib.Path(a.config).read_text())
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=1,
                             gradient_accumulation_steps=1, learning_rate=1e-5, weight_decay=0.0, max_grad_norm=1.0,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=a.backend == "strata", disable_tqdm=True, optim="adamw_torch", seed=7,
                             deepspeed=config if a.backend == "deepspeed" else None, dataloader_drop_last=True)
    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    if a.backend == "strata":
        sys.path.insert(0, str(ROOT / "python"))
        from strata.torch.hf import StrataTrainer
        trainer = StrataTrainer(model=model, args=args, train_dataset=Windows(), strata_config=config,
                                callbacks=[Clock()])
        holder["wrapped"] = trainer._strata
    else:
        trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    steps = [b - a_ for a_, b in zip([t0] + times[:-1], times)]
    result = {"backend": a.backend, "steps_s": steps, "losses": losses, "startup_s": t0 - start,
              "tokens_per_step": a.seq * int(os.environ.get("WORLD_SIZE", "1")),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if a.backend == "strata":
        w = trainer._strata
        stats = w.engine.stats()
        result.update({"hook_seconds": w.hook_seconds, "grad_hook_seconds": w.grad_seconds, "per_step": hooks,
                       "windows": {"forward": w.windows[0], "backward": w.windows[1], "recompute": w.windows[2]},
                       "peak_materialized_bytes": w.peak_materialized_bytes,
                       "param_bytes": sum(q.nbytes for q in w.params),
                       "peak_gathered_bytes": stats["peak_gathered_bytes"]})
    else:
        swap = pathlib.Path(config["zero_optimization"]["offload_param"]["nvme_path"])
        result["nvme_files"] = sum(1 for f in swap.rglob("*") if f.is_file())
    if int(os.environ.get("RANK", "0")) == 0:
        pathlib.Path(a.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
