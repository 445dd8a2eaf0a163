"""strata.torch: strata as the ZeRO-3 offload backend of a PyTorch model (docs: the README's "strata.torch").

    import strata.torch as st
    model = st.wrap(model, "ds_config.json")   # a path or a dict, before the optimizer is built
    opt = st.Optimizer(model)                   # a torch.optim.Optimizer: param_groups, lr schedulers, state_dict
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        st.clip_grad_norm_(model, 1.0)          # optional: strata's global norm
        opt.step()
        opt.zero_grad()
    st.save_checkpoint(model, "ckpt/")          # bit-identical resume: st.load_checkpoint(model, "ckpt/")

Parameters, gradients and optimizer state are partitioned over the ranks (`strata run -n N` or torchrun)
and offloaded as the config's zero_optimization says; a parameter exists whole only around its module's
use. strata.torch.hf has the Hugging Face Trainer (StrataTrainer).
"""

from strata import BACKWARD, FORWARD, RECOMPUTE

from ._optim import Optimizer
from ._scaler import GradScaler
from ._wrap import (StrataTorchError, Wrapped, clip_grad_norm_, load_checkpoint, register_external_parameter,
                    save_checkpoint, wrap, wrapped_of)

__all__ = ["wrap", "Optimizer", "GradScaler", "clip_grad_norm_", "save_checkpoint", "load_checkpoint", "register_external_parameter",
           "wrapped_of", "Wrapped",
           "StrataTorchError", "FORWARD", "BACKWARD", "RECOMPUTE"]
