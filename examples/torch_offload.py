#!/usr/bin/env python3
"""Offload a PyTorch model's optimizer state (and strata's copy of its weights) to NVMe.

PyTorch keeps the model and runs forward and backward as usual; strata replaces
the optimizer. Each step copies the gradients into strata, runs strata's AdamW
(ZeRO stage 3: the fp32 master weights and both Adam moments live in NVMe swap
files, as do strata's parameter shards), and copies the new parameters back
into the torch model. The same model trained with torch.optim.AdamW runs
beside it as the reference: the two should agree to float rounding.

Half way, strata saves a checkpoint (Engine.save_checkpoint: every rank's
shards and Adam moments, crash-safe). At the end a fresh engine loads it into
a fresh torch model and replays the second half: it must end where the first
engine did, bit for bit -- the optimizer state came back whole. The last
step's breakdown (where its time and bytes went) is printed.

    PYTHONPATH=python python3 examples/torch_offload.py [--steps 30] [--nvme DIR]
    strata run -n 2 -- python3 examples/torch_offload.py     # each rank half the batch

Needs torch and numpy, and libstrata_runtime.so (see python/strata: a build
directory of this tree, STRATA_LIBRARY, or STRATA_PREFIX). CPU only.
"""

import argparse
import os
import pathlib
import shutil
import sys
import tempfile

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
import strata  # noqa: E402


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.GELU(), torch.nn.Linear(128, 4))


def batch(step, n=64):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(n, 32, generator=g)
    y = torch.stack([x[:, :8].sum(1), x[:, 8:16].prod(1).tanh(), (x[:, 16:24] ** 2).mean(1), x[:, 24:].max(1).values], 1)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nvme", help="directory for the swap files (default: a temporary one)")
    parser.add_argument("--checkpoint", help="directory for the checkpoint, the same for every rank "
                                             "(default: a temporary one, removed at the end)")
    args = parser.parse_args()
    # Every rank names the same directory: under `strata run` they share MASTER_PORT.
    ckpt = pathlib.Path(args.checkpoint or pathlib.Path(tempfile.gettempdir()) /
                        f"strata-torch-ckpt-{os.environ.get('MASTER_PORT', os.getpid())}")
    half = args.steps // 2
    swap = pathlib.Path(args.nvme or tempfile.mkdtemp(prefix="strata-torch-"))
    swap.mkdir(parents=True, exist_ok=True)

    model, reference = make_model(0), make_model(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
        },
        "strata": {"accelerator": "cpu", "log_level": "warn"},
    }
    eng = strata.Engine(config)
    # One strata parameter per torch parameter (registered from the tensor),
    # one operator each: its window is where its gradient is handed over.
    names = [name for name, _ in model.named_parameters()]
    params = {name: eng.register(name, p) for name, p in model.named_parameters()}
    ops = {name: eng.op(name, [params[name]]) for name in names}
    eng.finalize()
    rank0 = eng.rank == 0
    if rank0:
        n = sum(p.numel() for p in model.parameters())
        print(f"torch {torch.__version__}, strata {strata.version()}: {n} parameters, {eng.world_size} rank(s), "
              f"ZeRO-3 with parameters and AdamW state in {swap}")

    def train_step(eng, model, params, ops, step):
        x, y = batch(step)
        mine = slice(eng.rank, len(x), eng.world_size)
        # torch: forward and backward on this rank's part of the batch, the loss
        # normalised by the global batch so the ranks' gradients sum to the whole's.
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine], reduction="sum") / len(x)
        loss.backward()
        # strata: the gradients in, AdamW on the NVMe-resident state, the weights out.
        for name, p in model.named_parameters():
            with eng.fetch(ops[name], "backward") as win:
                win.add_grad(params[name], p.grad)
        result = eng.step(args.lr)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(eng.read(params[name])))
        return result, eng.global_sum(loss.item())

    for step in range(args.steps):
        if step == half:
            eng.save_checkpoint(ckpt)  # collective: every rank's shards and Adam state, manifest last
        result, global_loss = train_step(eng, model, params, ops, step)
        x, y = batch(step)

        # The reference: the whole batch, torch's own AdamW.
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = torch.nn.functional.mse_loss(reference(x), y, reduction="sum") / len(x)
        ref_loss.backward()
        ref_opt.step()
        if rank0 and (step % 5 == 0 or step == args.steps - 1):
            diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
            print(f"step {step + 1:3d}  loss {global_loss:.5f}  (torch AdamW {ref_loss.item():.5f})  "
                  f"grad norm {result.grad_norm:.4f}  max |w - w_torch| {diff:.2e}")

    stats = eng.stats()
    b = eng.step_breakdown()
    swap_files = ", ".join(f"{f.relative_to(swap)} ({f.stat().st_size / 1e3:.0f} KB)" for f in sorted(swap.rglob("*"))
                           if f.is_file())
    eng.close()
    if rank0:
        print(f"strata: {stats['steps']} steps, {stats['gathers']} parameter gathers; swap files while "
              f"training: {swap_files or 'none'}")
        print(f"last step: {b.seconds * 1e3:.1f} ms = outside strata_step (torch, the reference) "
              f"{b.compute_seconds * 1e3:.1f} + stall "
              f"{b.param_stall_seconds * 1e3:.1f} + gradient wait {b.grad_wait_seconds * 1e3:.1f} + AdamW "
              f"{b.optimizer_seconds * 1e3:.1f} + other {b.other_seconds * 1e3:.1f}; NVMe "
              f"{b.nvme_read_bytes / 1e3:.0f} KB read, {b.nvme_written_bytes / 1e3:.0f} KB written")

    # Resume: a fresh engine and a fresh torch model (other initial values) from the checkpoint,
    # the second half replayed: the result must be the first run's, bit for bit.
    resumed = make_model(1)
    eng2 = strata.Engine(config)
    params2 = {name: eng2.register(name, p) for name, p in resumed.named_parameters()}
    ops2 = {name: eng2.op(name, [params2[name]]) for name in names}
    eng2.finalize()
    eng2.load_checkpoint(ckpt)
    assert eng2.stats()["steps"] == half, eng2.stats()["steps"]
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.copy_(torch.from_numpy(eng2.read(params2[name])))
    for step in range(half, args.steps):
        train_step(eng2, resumed, params2, ops2, step)
    eng2.global_sum(0)  # every rank is done with the checkpoint
    eng2.close()
    if not args.checkpoint and rank0:
        shutil.rmtree(ckpt, ignore_errors=True)
    resume_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), resumed.parameters()))
    if rank0:
        print(f"resumed from the checkpoint of step {half} in a fresh engine: after step {args.steps}, "
              f"max |w - w_uninterrupted| = {resume_diff:.1e}")

    if not args.nvme:
        shutil.rmtree(swap, ignore_errors=True)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    if diff > 1e-3:
        print(f"torch_offload: strata's AdamW and torch's differ by {diff:.2e}", file=sys.stderr)
        return 1
    if resume_diff != 0:
        print(f"torch_offload: the resumed run differs from the uninterrupted one by {resume_diff:.2e}",
              file=sys.stderr)
        return 1
    if rank0:
        print("torch_offload: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
