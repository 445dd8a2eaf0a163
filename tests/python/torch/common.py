"""Shared pieces of strata.torch's tests: the GPT-2 fixture, configs, the plain torch reference."""

import copy
import os
import pathlib
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "python"))

import torch  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def log(*args):
    if RANK == 0:
        print(*args, flush=True)


def gpt2(seed=0, layers=2, tie=True):
    """A GPT-2 strata does not implement natively, initialised with std 0.2 (a missing piece of math moves
    the loss visibly), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                        initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=tie, use_cache=False)
    return GPT2LMHeadModel(config)


def batch(step, n=4, seq=16, vocab=256):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def mine(b):
    """This rank's share of a batch (rows rank, rank + world, ...)."""
    return {k: v[RANK::WORLD] for k, v in b.items()}


def shared_dir(name):
    """A directory every rank names alike (under `strata run` they share STRATA_MASTER_PORT)."""
    tag = os.environ.get("STRATA_MASTER_PORT", os.environ.get("MASTER_PORT", str(os.getpid())))
    path = pathlib.Path(tempfile.gettempdir()) / f"strata-torch-{name}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def config(nvme_dir=None, stage=3, lr=1e-3, weight_decay=0.01, clipping=0.0, **extra):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if nvme_dir is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_dir)}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_dir)}
    c = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
         "zero_optimization": zero, "gradient_clipping": clipping,
         "strata": {"log_level": "warn", "collective_timeout_s": 120}}
    c.update(extra)
    return c


def reference_losses(model, steps, lr=1e-3, weight_decay=0.01, batches=batch, clip=None, groups=None):
    """Plain torch: AdamW on the whole batch; the loss of each step."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups(model) if groups else model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for step in range(steps):
        loss = model(**batches(step)).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def check_losses(name, got, want, tol=1e-5):
    worst = max(relative(a, b) for a, b in zip(got, want))
    log(f"{name}: losses {['%.6f' % x for x in got]}")
    log(f"{name}: torch   {['%.6f' % x for x in want]}  worst relative difference {worst:.2e}")
    if len(got) != len(want) or worst > tol:
        raise AssertionError(f"{name}: losses differ from torch AdamW's by {worst:.2e} (> {tol})")
