#!/usr/bin/env python3
"""The README's Accelerate recipe: Accelerator() (torch.distributed beside strata), the model and optimizer
kept out of accelerator.prepare (strata reduces the gradients), the dataloader prepared (each rank its share
of the batches); GPT-2 with ZeRO-3 against torch AdamW on one rank with the combined batch, 4 steps."""

from common import WORLD, check_losses, config, gpt2, log  # noqa: I100

import torch
from accelerate import Accelerator

import strata.torch as st

STEPS, BATCH = 4, 2


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 256, (STEPS * BATCH * WORLD, 16), generator=torch.Generator().manual_seed(9))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    data = Tokens()
    reference = gpt2()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for batch in torch.utils.data.DataLoader(data, batch_size=BATCH * WORLD):  # one rank, the combined batch
        loss = reference(**batch).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    model = st.wrap(gpt2(), config())
    opt = st.Optimizer(model)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=BATCH))
    got = []
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(accelerator.gather(loss.detach()).mean().item())
    check_losses(f"Accelerate recipe, {accelerator.num_processes} process(es)", got, want)
    st.wrapped_of(model).close()
    log("test_accelerate: ok")


if __name__ == "__main__":
    main()
