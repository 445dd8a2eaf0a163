"""st.Optimizer: a torch.optim.Optimizer whose step is strata's (Adam/AdamW on the shards, CPU/NVMe/device)."""

import contextlib

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

    param_groups are torch's: an lr scheduler changes group["lr"] and opt.step() passes it to strata. Groups may
have lrs of their own (e.g. a head trained faster): strata fixes each group's ratio to the optimizer's lr (the
config's optimizer.params.lr, or lr= here) when this is built, so a schedule must scale every group alike (any of
torch's LRScheduler classes with one lambda does); a step whose groups' ratios changed is refused. A group's
weight_decay applies to its parameters (strata keeps one optimizer group per decay and lr); betas and eps are one
for all. lr/betas/eps/weight_decay given here fill the config's optimizer.params where it says "auto" or
nothing, and must agree with it otherwise. Parameters with requires_grad=False, or in no group, are frozen:
partitioned and offloaded, never trained. Building it creates the engine: every rank together, once per model.

state_dict() is torch's format with the Adam moments gathered (state[i] = {"step", "exp_avg", "exp_avg_sq"},
full tensors on every rank: collective), so a torch.optim.AdamW over the same parameters can continue from it,
and load_state_dict() takes one of those back (every trained parameter's moments, or none: zero). The fp32
master weights are strata's own (the model's values, gathered by model.state_dict()); st.save_checkpoint /
st.load_checkpoint carry everything bit for bit and read each rank's shard only.
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
        trained, decays, scales = [], {}, {}
        self._base_lr = float(defaults["lr"])
        self._scale_of_group = []
        for index, group in enumerate(self.param_groups):
            for key in ("betas", "eps"):
                if _differs(group[key], defaults[key]):
                    raise StrataTorchError(
                        f"strata.torch.Optimizer: param group {index} has {key} {group[key]}, the others "
                        f"{defaults[key]}; strata runs one Adam per model (only lr and weight_decay may be set "
                        "per group, and lr must be the same in every group at each step)")
            scale = self._lr_scale(index, group)
            self._scale_of_group.append(scale)
            for p in group["params"]:
                if id(p) not in ours:
                    raise StrataTorchError(f"strata.torch.Optimizer: param group {index} holds a parameter "
                                           f"(shape {tuple(p.shape)}) that is not the wrapped model's")
                if p.requires_grad:
                    trained.append(p)
                    if float(group["weight_decay"]) != float(defaults["weight_decay"]):
                        decays[p] = float(group["weight_decay"])
                    if scale != 1.0:
                        scales[p] = scale
        self._decay_of = {id(p): float(g["weight_decay"]) for g in self.param_groups for p in g["params"]}
        w.finalize(trained=trained, weight_decay=decays, lr_scale=scales, optimizer_params=given)
        w.optimizer = self
        self.last_result = None
        self._groups_only = False

    def _lr_scale(self, index, group):
        lr = float(group["lr"])
        if lr == self._base_lr:
            return 1.0
        if self._base_lr == 0:
            raise StrataTorchError(f"strata.torch.Optimizer: param group {index} has lr {lr} and the optimizer's lr "
                                   "is 0; strata keeps each group's lr as a multiple of the optimizer's")
        return lr / self._base_lr

    def current_lr(self):
        """The optimizer's lr now, each group's lr over its fixed ratio (None when the groups disagree: a
        schedule that scaled them differently)."""
        lrs = []
        for group, scale in zip(self.param_groups, self._scale_of_group):
            lr = float(group["lr"])
            if scale == 0:
                if lr != 0:
                    return None
                continue
            lrs.append(lr / scale)
        if not lrs:
            return 0.0
        if any(abs(x - lrs[0]) > 1e-6 * max(abs(lrs[0]), 1e-30) for x in lrs):
            return None
        return lrs[0]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != len(self._scale_of_group):
            raise StrataTorchError("strata.torch.Optimizer.step: param groups were added after the optimizer was "
                                   "built (add_param_group); strata fixes the groups then")
        lr = self.current_lr()
        if lr is None:
            raise StrataTorchError(
                "strata.torch.Optimizer.step: the param groups' lrs "
                f"{[float(g['lr']) for g in self.param_groups]} are no longer the ratios they had when the optimizer "
                f"was built ({[s * self._base_lr for s in self._scale_of_group]}); strata fixes each group's ratio "
                "then: scale every group alike (one schedule for all)")
        for group in self.param_groups:
            for p in group["params"]:
                if float(group["weight_decay"]) != self._decay_of.get(id(p), float(group["weight_decay"])):
                    raise StrataTorchError("strata.torch.Optimizer.step: a group's weight_decay changed after the "
                                           "optimizer was built; strata fixes it then")
        self.last_result = self._wrapped.step(lr)
        return loss

    def add_param_group(self, param_group):
        if getattr(self, "_scale_of_group", None) is not None and self._wrapped.finalized:
            raise StrataTorchError("strata.torch.Optimizer.add_param_group: strata fixes the parameter groups when "
                                   "the optimizer is built; give every group to st.Optimizer(model, groups)")
        super().add_param_group(param_group)

    # ---- state_dict: torch's format, the moments gathered ----------------------------------------------------

    def _indexed(self):
        """(index in torch's state_dict, the wrapped parameter) of each trained parameter, torch's numbering."""
        w, index, out = self._wrapped, 0, []
        by_tensor = {id(p.tensor): p for p in w.params}
        for group in self.param_groups:
            for p in group["params"]:
                param = by_tensor[id(p)]
                if param.trained:
                    out.append((index, param))
                index += 1
        return out

    @torch.no_grad()
    def state_dict(self):
        """torch's optimizer state_dict with strata's Adam moments (collective: every rank calls it)."""
        packed = super().state_dict()  # the param_groups, numbered as torch numbers them
        if self._groups_only:
            return packed
        w = self._wrapped
        w._require_between_steps("Optimizer.state_dict()")
        indexed = self._indexed()
        moments, step = w.engine.read_optimizer_state([param.index for _, param in indexed])
        state = {}
        if step > 0:
            for index, param in indexed:
                m, v = moments[param.name]
                state[index] = {"step": torch.tensor(float(step)),
                                "exp_avg": _to(torch.from_numpy(m), param, w),
                                "exp_avg_sq": _to(torch.from_numpy(v), param, w)}
        packed["state"] = state
        return packed

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Takes torch's format back: param_groups' hyperparameters (lr, ...) and every trained parameter's
        moments (collective); an empty state means none (zero, step 0)."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise StrataTorchError("strata.torch.Optimizer.load_state_dict: the state_dict's param groups do not "
                                   "match this optimizer's (group count or sizes differ)")
        state = state_dict.get("state", {})
        super().load_state_dict({"state": {}, "param_groups": groups})
        if self._groups_only:
            return
        w = self._wrapped
        w._require_between_steps("Optimizer.load_state_dict()")
        moments, steps = {}, set()
        for index, param in self._indexed():
            entry = state.get(index, state.get(str(index)))
            if entry is None:
                if state:
                    raise StrataTorchError(f"strata.torch.Optimizer.load_state_dict: no state for parameter "
                                           f"'{param.name}' (index {index}); strata sets every trained "
                                           "parameter's moments together")
                m = v = torch.zeros(param.shape)
                steps.add(0)
            else:
                try:
                    m, v, step = entry["exp_avg"], entry["exp_avg_sq"], entry["step"]
                except KeyError as error:
                    raise StrataTorchError(f"strata.torch.Optimizer.load_state_dict: parameter '{param.name}' "
                                           f"(index {index}) has no {error.args[0]!r}: not Adam's state") from None
                for what, t in (("exp_avg", m), ("exp_avg_sq", v)):
                    if tuple(t.shape) != tuple(param.shape):
                        raise StrataTorchError(f"strata.torch.Optimizer.load_state_dict: {what} of '{param.name}' "
                                               f"has shape {list(t.shape)}, the parameter {list(param.shape)}")
                steps.add(int(float(step)))
            moments[param.index] = (m.detach().float().cpu().numpy(), v.detach().float().cpu().numpy())
        if len(steps) > 1:
            raise StrataTorchError(f"strata.torch.Optimizer.load_state_dict: the parameters have different step "
                                   f"counts {sorted(steps)}; strata takes one step for all")
        w.engine.write_optimizer_state(moments, steps.pop() if steps else 0)

    @contextlib.contextmanager
    def groups_only(self):
        """Within it, state_dict() / load_state_dict() carry the param_groups alone (not collective): for a
        trainer whose checkpoint has strata's own optimizer files (StrataTrainer)."""
        self._groups_only = True
        try:
            yield
        finally:
            self._groups_only = False

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


def _to(tensor, param, wrapped):
    return tensor.to(wrapped.device) if wrapped._cuda else tensor
