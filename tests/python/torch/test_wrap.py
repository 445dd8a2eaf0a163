#!/usr/bin/env python3
"""strata.torch on a transformers GPT-2 (a model strata does not implement natively) from a plain loop,
against plain torch.optim.AdamW on the whole batch, every step's loss within 1e-5 relative: ZeRO-3 with
parameters and optimizer state on NVMe; activation checkpointing (reentrant and not: recompute fetched as
RECOMPUTE); parameter groups with their own weight decay and a frozen parameter; st.clip_grad_norm_ (strata's
norm against torch's) with an lr schedule; gradient accumulation; an evaluation between steps; a checkpoint
resumed bit for bit in a fresh model; model.state_dict() gathered. Alone, and under `strata run -n 2` or
torchrun (each rank half the batch, gradients averaged as DDP does) against one rank on the whole batch.
Also: parameters stay the same objects, empty between uses, and inside a module they are strata's memory."""

import shutil

from common import (RANK, WORLD, batch, check_losses, config, gpt2, log, mine, relative,  # noqa: I100
                    shared_dir)

import copy

import torch

import strata.torch as st

STEPS = 5


def loop(model, opt, steps, *, clip=None, schedule=None, accumulation=1, evaluate_at=None, strata=False,
         first=0):
    """The same loop for both: accumulation micro-batches per step (the loss divided by their number), an
    optional clip, an optional lr schedule, an optional evaluation. Returns the losses (the whole batch's mean:
    under several ranks the ranks' means averaged) and the gradient norms."""
    sched = schedule(opt) if schedule else None
    losses, norms, evals = [], [], []
    for step in range(first, first + steps):
        whole = batch(step, n=4 * accumulation)
        total = 0.0
        for micro in range(accumulation):
            part = {k: v[4 * micro:4 * (micro + 1)] for k, v in whole.items()}
            loss = model(**(mine(part) if strata else part)).loss / accumulation
            loss.backward()
            total += loss.item()
        if clip is not None:
            norm = (st.clip_grad_norm_(model, clip) if strata else
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        if strata:
            total = st.wrapped_of(model).engine.global_sum(total) / WORLD
        losses.append(total)
        if evaluate_at == step:
            model.eval()
            with torch.no_grad():
                held = batch(99)
                evals.append(model(**held).loss.item())
            model.train()
    return losses, norms, evals


def compare(name, make, cfg, *, groups=None, freeze=None, checkpointing=None, after_wrap=None, wrap=None, **kw):
    """Trains `make()` with strata (config `cfg`) and with torch AdamW, the same loop; returns the models.
    wrap: makes the wrapped model instead of st.wrap(make(), cfg) (the reference is still make()'s)."""
    model = make()
    if freeze:
        freeze(model)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(groups(reference) if groups else
                                [p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    want, want_norms, want_evals = loop(reference, ref_opt, STEPS, **kw)
    model = st.wrap(model, cfg) if wrap is None else wrap()
    if after_wrap:
        after_wrap(model)
    opt = st.Optimizer(model, groups(model) if groups else None)
    got, norms, evals = loop(model, opt, STEPS, strata=True, **kw)
    check_losses(name, got, want)
    for a, b in zip(norms, want_norms):
        assert relative(a, b) < 1e-5, f"{name}: strata's norm {a} against torch's {b}"
    for a, b in zip(evals, want_evals):
        assert relative(a, b) < 1e-5, f"{name}: evaluation loss {a} against torch's {b}"
    if norms:
        log(f"{name}: norms {['%.6f' % x for x in norms]} (torch {['%.6f' % x for x in want_norms]})")
    return model, reference, opt


def close(model):
    st.wrapped_of(model).engine.close()


def gpt2_nvme():
    nvme = shared_dir("nvme")
    model = gpt2()
    params_before = list(model.parameters())
    w_probe = {}

    def probe(module, args):  # inside a module's forward, its parameters are strata's gathered memory
        w = st.wrapped_of(module)
        for name, p in module._parameters.items():
            w_probe[name] = (p.data_ptr(), w.engine.ptr(next(q.index for q in w.params if q.tensor is p)),
                             tuple(p.shape))
    model, reference, _ = compare(f"gpt2 ZeRO-3 NVMe, {WORLD} rank(s)", lambda: model, config(nvme),
                                  after_wrap=lambda m: m.transformer.h[0].mlp.c_fc.register_forward_pre_hook(probe))
    w = st.wrapped_of(model)
    assert len(w.params) == len(params_before), "a tied parameter registered twice"
    assert all(a is b for a, b in zip(model.parameters(), params_before)), "parameters replaced"
    assert all(p.numel() == 0 for p in model.parameters()), "parameters keep their storage between uses"
    assert w_probe and all(a == b for a, b, _ in w_probe.values()), f"not strata's memory: {w_probe}"
    assert w_probe["weight"][2] == (64, 256)
    stats = w.engine.stats()
    last = w.engine.step_breakdown()  # the trace of the first step was followed, the gathers prefetched
    assert last.trace_followed and last.prefetched > 0 and last.nvme_read_bytes > 0, last
    assert stats["zero_stage"] == 3 and stats["param_tier"] == 2 and stats["optimizer_tier"] == 2, stats
    # model.state_dict() gathers every parameter (collective), under the model's own names: strata's values
    # exactly, and torch's within 1e-5 -- except the key bias of attention (c_attn.bias[64:128]), whose
    # gradient is zero up to rounding (softmax ignores a constant added to every key), which Adam's
    # normalised update turns into +-lr steps of noise in either run.
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for p in w.params:
        assert torch.equal(got[p.name], torch.from_numpy(w.engine.read(p.index)).reshape(p.shape)), p.name
    worst = 0.0
    for key in want:
        diff = (got[key] - want[key]).abs()
        if key.endswith("attn.c_attn.bias"):
            diff[64:128] = 0
        worst = max(worst, diff.max().item())
    assert worst < 1e-5, f"state_dict differs from torch's by {worst}"
    log(f"state_dict: {len(got)} tensors gathered, max |strata - torch| {worst:.1e}")
    close(model)
    if RANK == 0:
        shutil.rmtree(nvme, ignore_errors=True)


def checkpointing():
    for reentrant in (False, True):
        model, _, _ = compare(f"gpt2 gradient checkpointing (use_reentrant={reentrant})", gpt2, config(),
                              checkpointing=reentrant)
        windows = st.wrapped_of(model).windows
        # Each step, each block's 6 modules are recomputed inside backward: in their own RECOMPUTE windows,
        # but for the one whose backward window is open when the non-reentrant recompute begins.
        assert windows[st.RECOMPUTE] == STEPS * 2 * (6 if reentrant else 5), windows
        log(f"  windows opened: {windows[st.FORWARD]} forward, {windows[st.RECOMPUTE]} recompute, "
            f"{windows[st.BACKWARD]} backward")
        assert st.wrapped_of(model).engine.step_breakdown().trace_followed, "the prefetcher lost the trace"
        close(model)


def groups_frozen_clip_schedule():
    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    def freeze(model):
        model.transformer.wpe.weight.requires_grad_(False)
        model.transformer.h[1].ln_2.bias.requires_grad_(False)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    model, _, opt = compare("decay groups, frozen, clip 0.5, lr schedule", gpt2, config(stage=2), groups=groups,
                            freeze=freeze, clip=0.5, schedule=schedule)
    assert abs(opt.param_groups[0]["lr"] - 1e-3 * 0.5) < 1e-12, opt.param_groups[0]["lr"]
    close(model)


def accumulation_and_evaluation():
    model, _, _ = compare("gradient accumulation 2, an evaluation", gpt2, config(stage=3), accumulation=2,
                          evaluate_at=2)
    # The evaluation's windows were kept out of the operator trace: the steps after it still prefetched.
    assert st.wrapped_of(model).engine.step_breakdown().trace_followed, "the evaluation broke the trace"
    close(model)


def no_decay_for_biases(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() >= 2]},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def resume():
    """A checkpoint after 3 steps (two decay groups), loaded into a fresh model (another init): the next 2 steps
    are the uninterrupted run's, bit for bit."""
    ckpt = shared_dir("ckpt")
    model = gpt2()
    st.wrap(model, config())
    opt = st.Optimizer(model, no_decay_for_biases(model))
    loop(model, opt, 3, strata=True)
    st.save_checkpoint(model, ckpt)
    want, _, _ = loop(model, opt, 2, strata=True, first=3)
    want_state = model.state_dict()
    close(model)
    fresh = gpt2(seed=7)
    st.wrap(fresh, config())
    opt = st.Optimizer(fresh, no_decay_for_biases(fresh))
    st.load_checkpoint(fresh, ckpt)
    got, _, _ = loop(fresh, opt, 2, strata=True, first=3)
    got_state = fresh.state_dict()
    assert got == want, f"resumed losses {got} differ from the uninterrupted run's {want}"
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state), "resumed weights differ"
    log(f"resume: steps 4-5 after loading step 3's checkpoint {['%.6f' % x for x in got]}: bit for bit")
    st.wrapped_of(fresh).engine.global_sum(0)  # every rank is done with the checkpoint
    close(fresh)
    if RANK == 0:
        shutil.rmtree(ckpt, ignore_errors=True)


def main():
    torch.set_num_threads(1)
    log(f"torch {torch.__version__}, {WORLD} rank(s)")
    gpt2_nvme()
    checkpointing()
    groups_frozen_clip_schedule()
    accumulation_and_evaluation()
    resume()
    log("test_wrap: ok")


if __name__ == "__main__":
    main()
