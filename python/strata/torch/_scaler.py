"""st.GradScaler: torch.amp.GradScaler's interface over strata's fp16 loss scaler (the config's "fp16" block).

    scaler = st.GradScaler(model)                   # the config has "fp16": {"enabled": true, ...}
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt); st.clip_grad_norm_(model, 1.0)   # optional: strata's norm is of the unscaled gradients
    scaler.step(opt)                                # strata divides the scale out, or skips the step on overflow
    scaler.update()                                 # strata has already moved the scale (DeepSpeed's rule)

strata keeps the scale and decides on every rank together: a gradient that is not finite on any rank skips the
step (nothing changes) and halves the scale (after fp16.hysteresis overflows), and after fp16.loss_scale_window
steps without one it doubles -- torch's GradScaler with backoff_factor 0.5, growth_factor 2 and growth_interval
= loss_scale_window + 1 (DeepSpeed's counting), hysteresis 1. The scale is saved by st.save_checkpoint.
"""

import torch

from ._wrap import StrataTorchError, wrapped_of


class GradScaler:
    """Scales the loss by strata's current fp16 loss scale; see the module's docstring."""

    def __init__(self, model):
        self._wrapped = wrapped_of(model)
        fp16 = self._wrapped.config.get("fp16", {})
        if not (isinstance(fp16, dict) and fp16.get("enabled") is True):
            raise StrataTorchError("strata.torch.GradScaler: the config's fp16.enabled is not true; strata scales "
                                   "the loss only with fp16 loss scaling on (add \"fp16\": {\"enabled\": true})")

    def _engine(self):
        if not self._wrapped.finalized:
            raise StrataTorchError("strata.torch.GradScaler: build st.Optimizer(model) first (the engine holds the "
                                   "scale)")
        return self._wrapped.engine

    def is_enabled(self):
        return True

    def get_scale(self):
        """The loss scale of the coming step."""
        return self._engine().loss_scale()

    def scale(self, outputs):
        """outputs (a tensor or nested tensors) times the loss scale."""
        scale = self.get_scale()
        return torch.utils._pytree.tree_map(lambda t: t * scale if isinstance(t, torch.Tensor) else t, outputs)

    def unscale_(self, optimizer):
        """Nothing to do: strata's gradient norm (st.clip_grad_norm_) and step take the scale out themselves."""
        _check_optimizer(self._wrapped, optimizer)

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(): strata's step, skipped on every rank when a gradient overflowed. Returns None
        then (as torch's GradScaler does), else the step's return value."""
        _check_optimizer(self._wrapped, optimizer)
        value = optimizer.step(*args, **kwargs)
        return value if optimizer.last_result is None or optimizer.last_result.applied else None

    def update(self, new_scale=None):
        """Nothing to do: strata's step has updated the scale. A new_scale is refused (strata owns it)."""
        if new_scale is not None:
            raise StrataTorchError("strata.torch.GradScaler.update: strata owns the loss scale (fp16.* in the "
                                   "config); new_scale is not supported")

    def state_dict(self):
        """Empty: the scale is part of strata's checkpoint (st.save_checkpoint)."""
        return {}

    def load_state_dict(self, state_dict):
        if state_dict:
            raise StrataTorchError("strata.torch.GradScaler.load_state_dict: the scale comes back with "
                                   "st.load_checkpoint, not from a torch GradScaler's state")


def _check_optimizer(wrapped, optimizer):
    if getattr(optimizer, "_wrapped", None) is not wrapped:
        raise StrataTorchError("strata.torch.GradScaler: the optimizer is not this model's st.Optimizer")
