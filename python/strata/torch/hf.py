"""StrataTrainer: the Hugging Face Trainer with strata as its ZeRO-3 offload backend.

    from strata.torch.hf import StrataTrainer
    trainer = StrataTrainer(model=model, args=TrainingArguments(...), train_dataset=..., strata_config="ds.json")
    trainer.train()                       # resume: trainer.train(resume_from_checkpoint=True)

The model is wrapped (st.wrap) when the Trainer is built; the Trainer's optimizer is st.Optimizer with its own
parameter groups (weight decay, none for biases and norms) and hyper-parameters (learning_rate, adam_beta1/2,
adam_epsilon, weight_decay), its lr scheduler steps the groups' lr, gradient accumulation is strata's
micro-steps (gradients accumulate in strata's shards between optimizer steps), max_grad_norm is strata's
clipping (the logged grad_norm is strata's global norm). The config's "auto" values are filled from the
TrainingArguments as DeepSpeed's integration fills them; an explicit value that contradicts them is refused.
Checkpoints go through the Trainer's own save and resume: each checkpoint-<step>/ holds, beside the Trainer's
files, strata/ (every rank's shards and optimizer state, st.save_checkpoint); save_model gathers the weights
on every rank (collective) and rank 0 writes them. No DDP: strata reduces the gradients itself. fp16=True is
strata's loss scaler (the config's fp16 block, DeepSpeed's dynamic rule) in place of torch's GradScaler: the
loss is multiplied by strata's scale before backward, and a step strata skips on overflow leaves the lr
schedule where it was.
"""

import os
import shutil

import torch
import transformers

from . import _wrap
from ._optim import Optimizer

_STRATA_DIR = "strata"
_ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf"}


def _fill(config, path, value, why):
    """Sets config[path] to value where it is "auto" or absent; refuses a different explicit value."""
    node = config
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    given = node.get(keys[-1], "auto")
    if given == "auto":
        node[keys[-1]] = value
    elif not _wrap._same(given, value):
        raise _wrap.StrataTorchError(f"StrataTrainer: the config's {path} is {given!r} but {why} is {value!r}; "
                                     "make them agree (or write \"auto\" in the config)")


def trainer_config(strata_config, args, world_size):
    """The ds_config with the Trainer's values in place of "auto" (DeepSpeed's HF integration's mapping)."""
    config = _wrap._load_config(strata_config)
    if args.optim not in _ADAMW:
        raise _wrap.StrataTorchError(f"StrataTrainer: TrainingArguments.optim is {args.optim!r}; strata runs AdamW "
                                     f"(optim one of {sorted(_ADAMW)}; the config's optimizer.type says Adam or AdamW)")
    if args.fp16:
        # strata's loss scaler in place of torch's GradScaler: the config's fp16 block (DeepSpeed's keys).
        section = config.setdefault("fp16", {})
        if section.get("enabled", "auto") not in ("auto", True):
            raise _wrap.StrataTorchError("StrataTrainer: fp16=True but the config's fp16.enabled is "
                                         f"{section['enabled']!r}; make them agree (or write \"auto\")")
        section["enabled"] = True
    if config.get("scheduler") not in (None, "auto"):
        raise _wrap.StrataTorchError("StrataTrainer: the config has a scheduler section; the Trainer's "
                                     "lr_scheduler_type sets the schedule (remove the section)")
    config.pop("scheduler", None)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _fill(config, "train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    _fill(config, "gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    _fill(config, "train_batch_size", micro * accumulation * world_size,
          "per_device_train_batch_size x gradient_accumulation_steps x world size")
    _fill(config, "gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    _fill(config, "optimizer.params.lr", args.learning_rate, "learning_rate")
    _fill(config, "optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "(adam_beta1, adam_beta2)")
    _fill(config, "optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    _fill(config, "optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    for key, flag in (("bf16", args.bf16), ("fp16", args.fp16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = bool(flag)
    return config


class StrataTrainer(transformers.Trainer):
    """transformers.Trainer with `strata_config=` (a ds_config path or dict): see the module's docstring."""

    def __init__(self, *args, strata_config=None, **kwargs):
        if strata_config is None:
            raise TypeError("StrataTrainer needs strata_config= (a ds_config path or dict)")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise _wrap.StrataTorchError("StrataTrainer: TrainingArguments also asks for DeepSpeed or FSDP; strata "
                                         "is the offload backend here (leave deepspeed/fsdp out)")
        config = trainer_config(strata_config, self.args, self.args.world_size)
        _wrap.wrap(self.model, config)
        self._strata = _wrap.wrapped_of(self.model)
        # strata decides whether a step was skipped (a gradient not finite on some rank; fp16 overflow): the
        # Trainer then leaves the lr schedule alone, as it does for torch's GradScaler.
        trainer = self
        self.accelerator.__class__ = type("StrataAccelerator", (type(self.accelerator),), {
            "optimizer_step_was_skipped": property(lambda _: trainer._strata_step_skipped())})
        if self.args.fp16:
            # The loss times strata's scale, in place of accelerate's GradScaler (none left to unscale).
            self.accelerator.scaler = None
            backward = self.accelerator.backward
            self.accelerator.backward = lambda loss, **kw: backward(loss * self._strata.engine.loss_scale(), **kw)

    def _strata_step_skipped(self):
        result = getattr(self.optimizer, "last_result", None)
        return result is not None and not result.applied

    # ---- the optimizer: st.Optimizer, with the Trainer's groups; no DDP around the model ----------

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            model = self.model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            self.optimizer = Optimizer(model, groups, lr=self.args.learning_rate,
                                       betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon,
                                       weight_decay=self.args.weight_decay)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        # strata partitions the parameters and reduces the gradients: the model is not put in DDP.
        model = self.model
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _wrap_model(self, model, training=True, dataloader=None):
        return model

    # ---- clipping: strata's global norm ------------------------------------------------------------

    def _clip_grad_norm(self, model):
        return _wrap.clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        # Without clipping the norm is strata's step's; taking it here would read the gradients once more.
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # ---- checkpoints through the Trainer's save and resume --------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        target = os.path.join(output_dir, _STRATA_DIR)
        # The Trainer writes over a checkpoint-<step> that exists (a run resumed in its own output_dir):
        # so does strata, once every rank has seen it (strata refuses to save over a newer checkpoint).
        engine = self._strata.engine
        if engine.global_sum(1.0 if os.path.isdir(target) else 0.0) > 0:
            if self.args.should_save:
                shutil.rmtree(target, ignore_errors=True)
            engine.global_sum(0)
        _wrap.save_checkpoint(self.model, target)  # collective: every rank writes its shards
        with self.optimizer.groups_only():  # the moments are in strata/; the Trainer's file has the groups
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        with self.optimizer.groups_only():
            super()._load_optimizer_and_scheduler(checkpoint)
        _wrap.load_checkpoint(self.model, os.path.join(checkpoint, _STRATA_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The weights come back with the optimizer state, from the checkpoint's strata/ (after the engine exists).
        if not os.path.isdir(os.path.join(resume_from_checkpoint, _STRATA_DIR)):
            raise _wrap.StrataTorchError(f"StrataTrainer: {resume_from_checkpoint} has no {_STRATA_DIR}/ (it was not "
                                         "written by StrataTrainer)")

    def save_model(self, output_dir=None, _internal_call=False):
        if output_dir is None:
            output_dir = self.args.output_dir
        state_dict = self.model.state_dict()  # gathered: every rank takes part
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
