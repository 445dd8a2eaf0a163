"""st.Optimizer: a torch.optim.Optimizer whose step is strata's (Adam/AdamW on the shards, CPU/NVMe/device)."""

import torch

from ._wrap import StrataTorchError, wrapped_of

# strata's defaults (docs/config.md, optimizer.params): torch.optim.AdamW's.
_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class Optimizer(torch.optim.Optimizer):
    """The optimizer of a model wrapped by st.wrap: Adam or AdamW as the config's optimizer.type says,
    run by strata on each rank's shard where the config puts the state (device, CPU memory or NVMe).

        opt = st.Optimizer(model)                                  # every parameter with requires_grad
        opt = st.Optimizer(model, [{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)

    param_groups are torch's: an lr scheduler changes group["lr"] and opt.step() passes it to strata (every
    group must have the same lr). A group's weight_decay applies to its parameters (strata keeps one optimizer
    group per decay); betas and eps are one for all. lr/betas/eps/weight_decay given here fill the config's
    optimizer.params where it says "auto" or nothing, and must agree with it otherwise. Parameters with
    requires_grad=False, or in no group, are frozen: partitioned and offloaded, never trained. Building it
    creates the engine: every rank together, once per model.

    state_dict() holds the param_groups (torch's format, for schedulers and the Trainer); the Adam moments and
    master weights live in strata: st.save_checkpoint / st.load_checkpoint carry them.
    """

    def __init__(self, model, params=None, *, lr=None, betas=None, eps=None, weight_decay=None):
        self._wrapped = w = wrapped_of(model)
        if w.finalized:
            raise StrataTorchError("strata.torch.Optimizer: this model has its optimizer already (one per model)")
        given = {key: value for key, value in (("lr", lr), ("betas", betas), ("eps", eps),
                                                ("weight_decay", weight_decay)) if value is not None}
        config = w.config.get("optimizer", {}).get("params", {})
        defaults = {}
        for key, fallback in _DEFAULTS.items():
            from_config = config.get(key, "auto")
            defaults[key] = given.get(key, fallback if from_config == "auto" else from_config)
        defaults["betas"] = tuple(defaults["betas"])
        if params is None:
            params = [p.tensor for p in w.params if p.tensor.requires_grad]
        super().__init__(params, defaults)
        ours = {id(p.tensor) for p in w.params}
        trained, decays = [], {}
        for index, group in enumerate(self.param_groups):
            for key in ("betas", "eps"):
                if _differs(group[key], defaults[key]):
                    raise StrataTorchError(
                        f"strata.torch.Optimizer: param group {index} has {key} {group[key]}, the others "
                        f"{defaults[key]}; strata runs one Adam per model (only lr and weight_decay may be set "
                        "per group, and lr must be the same in every group at each step)")
            for p in group["params"]:
                if id(p) not in ours:
                    raise StrataTorchError(f"strata.torch.Optimizer: param group {index} holds a parameter "
                                           f"(shape {tuple(p.shape)}) that is not the wrapped model's")
                if p.requires_grad:
                    trained.append(p)
                    if float(group["weight_decay"]) != float(defaults["weight_decay"]):
                        decays[p] = float(group["weight_decay"])
        self._decay_of = {id(p): float(g["weight_decay"]) for g in self.param_groups for p in g["params"]}
        w.finalize(trained=trained, weight_decay=decays, optimizer_params=given)
        w.optimizer = self
        self.last_result = None

    def current_lr(self):
        """The lr every group has now (None when they differ)."""
        lrs = {float(g["lr"]) for g in self.param_groups}
        return lrs.pop() if len(lrs) == 1 else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = self.current_lr()
        if lr is None:
            raise StrataTorchError("strata.torch.Optimizer.step: the param groups have different lr "
                                   f"({sorted({float(g['lr']) for g in self.param_groups})}); strata steps every "
                                   "parameter with one lr")
        for group in self.param_groups:
            for p in group["params"]:
                if float(group["weight_decay"]) != self._decay_of.get(id(p), float(group["weight_decay"])):
                    raise StrataTorchError("strata.torch.Optimizer.step: a group's weight_decay changed after the "
                                           "optimizer was built; strata fixes it then")
        self.last_result = self._wrapped.step(lr)
        return loss

    def zero_grad(self, set_to_none=True):
        """Drops the gradients accumulated since the last step (none after a step: strata zeroes them)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self._wrapped.zero_grad()


def _differs(a, b):
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(float(x) != float(y) for x, y in zip(a, b))
    return float(a) != float(b)
