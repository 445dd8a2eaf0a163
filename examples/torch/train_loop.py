#!/usr/bin/env python3
"""A plain PyTorch loop with strata as the offload backend: a transformers GPT-2 (a model strata does not
implement natively) trained with ZeRO-3, its parameters and AdamW state in NVMe swap files, gathered into
torch's Parameter objects only around each module's use.

    PYTHONPATH=python <venv>/bin/python examples/torch/train_loop.py [--steps 40] [--nvme DIR]
    strata run -n 2 -- <venv>/bin/python examples/torch/train_loop.py   # or torchrun --nproc_per_node 2
    ... --model HF_DIR      # fine-tune a Hugging Face checkpoint (e.g. Phi-3, GPT-2) with its tokenizer

<venv>: scripts/torch-venv prints it (torch, transformers, peft, accelerate at the tested versions).
Without --model the model is a byte-level GPT-2 made from a config (4 layers, 128 wide) and the data is
examples/finetune's text; the loss falls from ~5.6 (ln 256) within a few dozen steps.
"""

import argparse
import math
import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import strata.torch as st  # noqa: E402
from data import Windows, tokens  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face directory (default: a byte-level GPT-2 from a config)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, over every rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nvme", help="swap directory (default: a temporary one)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (recompute)")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        ids = tokens(AutoTokenizer.from_pretrained(args.model))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=128, n_layer=4, n_head=4,
                                           use_cache=False))
        ids = tokens()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    nvme = args.nvme or os.path.join(tempfile.gettempdir(), f"strata-torch-example-{os.environ.get('MASTER_PORT', os.getpid())}")
    config = {
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "strata": {"log_level": "warn"},
    }
    model = st.wrap(model, config)
    # The Trainer's grouping: no weight decay for biases and norms.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = st.Optimizer(model, [{"params": [p for n, p in named if p.dim() >= 2]},
                               {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=args.lr)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    data = Windows(ids, args.seq)
    engine = st.wrapped_of(model).engine
    if rank == 0:
        n = sum(p.numel for p in st.wrapped_of(model).params)
        print(f"{type(model).__name__}: {n / 1e6:.2f} M parameters, {world} rank(s), ZeRO-3 with parameters and "
              f"optimizer state in {nvme}")
    per_rank = args.batch // world
    for step in range(args.steps):
        first = (step * args.batch) % (len(data) - args.batch)
        rows = [data[first + rank * per_rank + i] for i in range(per_rank)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch).loss
        loss.backward()
        norm = st.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        schedule.step()
        mean = engine.global_sum(loss.item()) / world
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            b = engine.step_breakdown()
            print(f"step {step + 1:4d}  loss {mean:.4f}  grad norm {float(norm):.3f}  lr {schedule.get_last_lr()[0]:.2e}"
                  f"  {b.seconds * 1e3:.0f} ms (stall on parameters {b.param_stall_seconds * 1e3:.0f} ms, "
                  f"NVMe read {b.nvme_read_bytes / 1e6:.1f} MB)")
    engine.close()


if __name__ == "__main__":
    main()
