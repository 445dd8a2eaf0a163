#!/usr/bin/env python3
"""The Hugging Face Trainer with strata as its offload backend (strata.torch.hf.StrataTrainer): GPT-2 (or
--model HF_DIR, e.g. Phi-3) with ZeRO-3, parameters and optimizer state on NVMe, gradient accumulation and
activation checkpointing, checkpoints through the Trainer's own save and resume.

    PYTHONPATH=python <venv>/bin/python examples/torch/trainer.py --out run/ [--steps 30] [--resume]
    strata run -n 2 -- <venv>/bin/python examples/torch/trainer.py --out run/

The config (examples/torch/ds_config.json) leaves the Trainer's keys "auto": StrataTrainer fills them from
TrainingArguments, as DeepSpeed's integration does.
"""

import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from data import Windows, tokens  # noqa: E402
from strata.torch.hf import StrataTrainer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints, the final model)")
    parser.add_argument("--model", help="a Hugging Face directory (default: a byte-level GPT-2 from a config)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --out")
    args = parser.parse_args()
    from transformers import TrainingArguments
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
    config = pathlib.Path(__file__).with_name("ds_config.json").read_text()
    config = config.replace("NVME_PATH", os.path.join(args.out, "swap"))
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01,
                                 max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=5,
                                 save_steps=10, save_total_limit=2, gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], use_cpu=True,
                                 optim="adamw_torch", disable_tqdm=True)
    import json
    trainer = StrataTrainer(model=model, args=training, train_dataset=Windows(ids, args.seq),
                            strata_config=json.loads(config))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.out, "model"))  # every rank gathers; rank 0 writes


if __name__ == "__main__":
    main()
