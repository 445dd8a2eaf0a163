#!/usr/bin/env python3
"""strata beside torch.distributed under `torchrun --nproc_per_node 2`: the process group is initialised
first (gloo, env://: torchrun's agent store holds MASTER_PORT), then strata starts its own store on
MASTER_PORT + 1 and trains GPT-2 with ZeRO-3 on NVMe against torch AdamW on the whole batch (test_wrap's
case), resumes a checkpoint bit for bit, and torch's process group still works afterwards. Also run
under `strata run -n 2` (STRATA_MASTER_PORT beside MASTER_PORT)."""

import os

import common  # noqa: F401  (sys.path)

import torch
import torch.distributed as dist

import strata.torch as st
import test_wrap


def main():
    assert "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) == 2, "run me with 2 ranks"
    dist.init_process_group("gloo")
    test_wrap.gpt2_nvme()
    test_wrap.resume()
    model = common.gpt2()
    st.wrap(model, common.config())
    st.Optimizer(model)
    engine = st.wrapped_of(model).engine
    assert (engine.rank, engine.world_size) == (dist.get_rank(), dist.get_world_size())
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)  # torch's own group, beside strata's
    assert total.item() == 3.0, total
    assert engine.global_sum(dist.get_rank() + 1) == 3.0
    engine.close()
    dist.destroy_process_group()
    common.log(f"test_torchrun: ok (torch.distributed on MASTER_PORT {os.environ['MASTER_PORT']}, strata beside it)")


if __name__ == "__main__":
    main()
