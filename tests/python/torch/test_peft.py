#!/usr/bin/env python3
"""PEFT LoRA on a wrapped GPT-2: only the adapters train (the base is frozen in strata: no gradient, no
optimizer state, bit-unchanged), every step's loss within 1e-5 relative of PEFT trained by torch AdamW, and
the adapter that save_pretrained writes (every rank gathers, rank 0 writes) loads in PEFT onto a fresh base
with the run's loss."""

import copy
import shutil

from common import RANK, WORLD, batch, check_losses, config, gpt2, log, mine, relative, shared_dir  # noqa: I100

import torch
from peft import LoraConfig, PeftModel, get_peft_model

import strata.torch as st

STEPS = 5


def lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                                            fan_in_fan_out=True, init_lora_weights="gaussian"))


def main():
    torch.set_num_threads(1)
    model = lora(gpt2())
    reference = copy.deepcopy(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    want = []
    for step in range(STEPS):
        loss = reference(**batch(step)).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    nvme = shared_dir("peft-nvme")
    st.wrap(model, config(nvme))
    opt = st.Optimizer(model)
    w = st.wrapped_of(model)
    trained = [p.name for p in w.params if p.trained]
    assert trained and all("lora_" in n for n in trained), trained
    got = []
    for step in range(STEPS):
        loss = model(**mine(batch(step))).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(w.engine.global_sum(loss.item()) / WORLD)
    check_losses(f"PEFT LoRA (r 4 on c_attn, c_fc), {WORLD} rank(s)", got, want)
    log(f"trained {len(trained)} adapter tensors, {sum(1 for p in w.params if not p.trained)} frozen base tensors")
    state = model.state_dict()  # collective
    for name, before in base_before.items():
        assert torch.equal(state[name], before), f"the frozen {name} changed"
    out = shared_dir("peft-adapter")
    model.save_pretrained(str(out), is_main_process=RANK == 0)  # gathers on every rank
    held = batch(42)
    model.eval()
    with torch.no_grad():
        run_loss = model(**held).loss.item()
    w.engine.global_sum(0)  # rank 0 has written the adapter
    loaded = PeftModel.from_pretrained(gpt2(), str(out))  # a fresh base: the same seed's values
    with torch.no_grad():
        peft_loss = loaded(**held).loss.item()
    log(f"save_pretrained: PEFT loads the adapter with loss {peft_loss:.6f} (the run's {run_loss:.6f})")
    assert relative(peft_loss, run_loss) < 1e-6, (peft_loss, run_loss)
    w.engine.global_sum(0)
    w.engine.close()
    if RANK == 0:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(nvme, ignore_errors=True)
    log("test_peft: ok")


if __name__ == "__main__":
    main()
