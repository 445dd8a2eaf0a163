#!/usr/bin/env python3
"""strata.torch.hf.StrataTrainer against the plain transformers.Trainer (AdamW, the same arguments) on GPT-2:
gradient accumulation 2 (strata's micro-steps), gradient checkpointing on, clipping at 1.0, a linear schedule,
ZeRO-3 with parameters and optimizer on NVMe: every logged loss within 1e-5 relative and every grad_norm
within 1e-5 -- alone, or on 2 ranks (strata run, torchrun) against one rank on the combined batch; then the Trainer's own checkpoint of step 3 resumed in a fresh Trainer (another init): steps
4-5 equal the uninterrupted run's bit for bit; save_model writes weights transformers loads with the run's
loss; fp16=True with strata's loss scaler skips an overflowing step as torch's GradScaler does."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from common import RANK, WORLD, config, gpt2, log, relative, shared_dir  # noqa: I100

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

from strata.torch.hf import StrataTrainer

STEPS = 5


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=40, seq=16):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 256, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False}, seed=3, disable_tqdm=True,
                optim="adamw_torch")
    base.update(kw)
    return TrainingArguments(**base)


def logged(trainer, key, after=0):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h and h["step"] > after]


def reference(out):
    """The plain Trainer on one rank, on the combined batch of every rank (per-device batch x world size): its
    logged losses and grad norms. Under several ranks it runs in a process of its own without the rank
    environment (accelerate would make this process's Trainer a DDP one)."""
    if WORLD == 1:
        trainer = Trainer(model=gpt2(), args=arguments(out / "ref"), train_dataset=Tokens())
        trainer.train()
        return logged(trainer, "loss"), logged(trainer, "grad_norm")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                           "MASTER_ADDR", "MASTER_PORT", "STRATA_MASTER_PORT")}
    result = out / f"reference-{RANK}.json"
    subprocess.run([sys.executable, __file__, "--reference", str(2 * WORLD), str(result)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


class _Overflowing(StrataTrainer):
    """Its second optimizer step's loss is infinite (every gradient overflows)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step != 1:
            return out
        return (out[0] * float("inf"),) + tuple(out[1:]) if isinstance(out, tuple) else out * float("inf")


def fp16(out, strata_config, want, want_norms):
    """fp16=True: strata's loss scaler in place of torch's GradScaler. The first step's loss and (unscaled) norm
    are the fp32 run's; the overflowing second step is skipped on every rank, the scale halves and the Trainer's
    lr schedule stays where it was (as with torch's GradScaler); the third step trains again."""
    cfg = dict(strata_config, fp16={"enabled": "auto", "loss_scale_window": 1000, "hysteresis": 1})
    args = arguments(out / "fp16", fp16=True, max_steps=3, logging_nan_inf_filter=False)
    trainer = _Overflowing(model=gpt2(), args=args, train_dataset=Tokens(), strata_config=cfg)
    trainer.train()
    losses, norms, lrs = logged(trainer, "loss"), logged(trainer, "grad_norm"), logged(trainer, "learning_rate")
    log(f"fp16 with an overflow at step 2: losses {losses}, grad_norm {norms}, lr {lrs}, loss scale "
        f"{trainer._strata.engine.loss_scale()}")
    assert relative(losses[0], want[0]) < 1e-5 and relative(norms[0], want_norms[0]) < 1e-5, (losses, want)
    # (The Trainer's logged loss of step 3 is nan: its running sum kept step 2's inf. Step 3's norm is finite.)
    assert losses[1] == float("inf") and norms[2] < 100 and trainer.optimizer.last_result.applied
    assert lrs[1] < lrs[0] and lrs[2] == lrs[1], lrs  # each step's lr: the skipped one did not advance it
    assert trainer._strata.engine.loss_scale() == 2.0 ** 15
    assert trainer._strata.engine.stats()["steps_skipped"] == 1
    trainer._strata.engine.close()


def main():
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--reference"]:  # the one-rank Trainer of reference()
        trainer = Trainer(model=gpt2(), train_dataset=Tokens(),
                          args=arguments(pathlib.Path(sys.argv[3]).parent / "ref", per_device_train_batch_size=int(sys.argv[2])))
        trainer.train()
        pathlib.Path(sys.argv[3]).write_text(json.dumps([logged(trainer, "loss"), logged(trainer, "grad_norm")]))
        return
    out = shared_dir("trainer")
    nvme = shared_dir("trainer-nvme")
    want, want_norms = reference(out)
    model = gpt2()
    strata_config = config(nvme, lr="auto", weight_decay="auto", clipping="auto",
                           train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    trainer = StrataTrainer(model=model, args=arguments(out / "run", save_strategy="steps", save_steps=3),
                            train_dataset=Tokens(), strata_config=strata_config)
    trainer.train()
    got = logged(trainer, "loss")
    worst = max(relative(a, b) for a, b in zip(got, want))
    log(f"StrataTrainer losses {got} ({WORLD} rank(s))\nTrainer       losses {want} (1 rank, the combined batch)"
        f"  worst relative difference {worst:.2e}")
    assert len(got) == len(want) == STEPS and worst < 1e-5, (got, want)
    norms = logged(trainer, "grad_norm")
    log(f"grad_norm {norms} (Trainer {want_norms})")
    assert all(relative(a, b) < 1e-5 for a, b in zip(norms, want_norms)) and len(norms) == STEPS
    # Resume from the Trainer's checkpoint of step 3 in a fresh model: steps 4 and 5 bit for bit.
    checkpoint = out / "run" / "checkpoint-3"
    assert (checkpoint / "strata").is_dir(), sorted(os.listdir(checkpoint))
    resumed = StrataTrainer(model=gpt2(seed=11), args=arguments(out / "run", save_strategy="steps", save_steps=3),
                            train_dataset=Tokens(), strata_config=strata_config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    tail = logged(resumed, "loss", after=3)
    log(f"resumed at step 3: losses {tail} (uninterrupted {got[3:]})")
    assert tail == got[3:], (tail, got[3:])
    # save_model: every rank gathers, rank 0 writes; transformers loads it with the run's loss.
    resumed.save_model(str(out / "model"))
    if RANK == 0:
        loaded = GPT2LMHeadModel.from_pretrained(str(out / "model"))
        batch = Tokens()[0:4]
        with torch.no_grad():
            want_loss = loaded(**batch).loss.item()
            resumed.model.eval()
            got_loss = resumed.model(**batch).loss.item()
        log(f"save_model: loaded by transformers, loss {want_loss:.6f} (the run's model {got_loss:.6f})")
        assert relative(got_loss, want_loss) < 1e-6
    else:
        resumed.model.eval()
        with torch.no_grad():
            resumed.model(**Tokens()[0:4])  # the forward's gathers are collective
    resumed._strata.engine.global_sum(0)
    resumed._strata.engine.close()
    fp16(out, strata_config, want, want_norms)
    if RANK == 0:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(nvme, ignore_errors=True)
    log("test_trainer: ok")


if __name__ == "__main__":
    main()
