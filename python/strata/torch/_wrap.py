"""st.wrap: a torch.nn.Module's parameters handed to a strata engine (ZeRO-1/2/3, CPU/NVMe offload).

Every module that owns parameters (module._parameters, not its children's) is one strata operator;
each parameter is registered once, by identity (a tied weight is listed by every module owning it).
Between uses a parameter keeps its Parameter object with empty storage; around each use:

  forward:   a forward pre-hook fetches the module's operator (FORWARD, or RECOMPUTE when the
             forward runs inside backward: activation checkpointing) and points each parameter's
             .data at strata's gathered memory (torch.frombuffer over the pointer on the cpu
             accelerator, __cuda_array_interface__ on cuda: no copy); a forward hook
             (always_call) releases it and empties the parameters again.
  backward:  DeepSpeed's way. The forward hook puts an autograd Function on the module's outputs
             whose backward fetches the operator (BACKWARD) before any of the module's own
             backward runs; the pre-hook puts one on its inputs whose backward releases it once
             the module's backward is done. Windows of modules whose inputs need no gradient
             (embeddings) are released by a callback at the end of the backward pass. strata
             closes windows in any order (autograd finishes modules in no nested order).
  gradients: each trained parameter's register_post_accumulate_grad_hook hands its complete
             gradient to strata (strata_add_grad_device: added on strata's stream, widened from
             bf16/fp16 exactly) and drops torch's copy; averaged over ranks as DDP and DeepSpeed
             do (strata sums: the hook scales by 1 / world size first).
  saved tensors: a module's forward runs inside saved_tensors_hooks that replace any tensor
             saved for backward that is (a view of) a gathered parameter by a handle, rebuilt at
             backward from the parameter's memory of that moment (the BACKWARD fetch): the
             gathered memory of the forward is strata's and is reused after release. Every other
             tensor goes to the hooks outside (activation checkpointing's), unchanged.
  shared:    a module called more than once in a forward gets a FORWARD window per call; its
             BACKWARD window opens at the backward of its last call and closes after that of its
             first, so strata gets the summed gradient in one window.
  external:  until the first step a TorchFunctionMode refuses a torch function given a parameter
             outside every window listing it (a parent reading a child's weight), naming both;
             register_external_parameter lists it with the module that reads it. A module that
             did not run in a pass whose parameter's other operators did gets an empty BACKWARD
             window at its end (strata counts one per operator listing the parameter).

The engine is created, and the parameters registered and partitioned, when st.Optimizer is built
(or at the first forward): only then are the trained set, per-parameter weight decay and the
optimizer's hyper-parameters known. Every rank must wrap the same model and make the same calls.
"""

import atexit
import copy
import ctypes
import json
import os
import pathlib
import time
import weakref

import torch

import strata as _strata

from . import _safetensors

FORWARD, BACKWARD, RECOMPUTE = _strata.FORWARD, _strata.BACKWARD, _strata.RECOMPUTE
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_CUDA_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}

# Each wrapped model's state, by the model, and each registered Parameter's, by identity.
_BY_MODULE = weakref.WeakKeyDictionary()
_BY_PARAM = weakref.WeakKeyDictionary()


class StrataTorchError(RuntimeError):
    """A use of strata.torch that it cannot honour (the message says what and how to do instead)."""


def _load_config(config):
    if isinstance(config, (str, os.PathLike)):
        path = pathlib.Path(config)
        try:
            text = path.read_text()
        except OSError as error:
            raise StrataTorchError(f"strata.torch: cannot read the config {path}: {error.strerror}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise StrataTorchError(f"strata.torch: {path}:{error.lineno}:{error.colno}: {error.msg}") from None
    if isinstance(config, dict):
        return copy.deepcopy(config)
    raise TypeError(f"strata.torch.wrap: config must be a path or a dict, not {type(config).__name__}")


def _autos(value, path=""):
    """Dotted paths of every "auto" in a config (a Hugging Face placeholder)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _autos(item, f"{path}.{key}" if path else key)
    elif value == "auto":
        yield path


def _cuda_tensor(ptr, shape, dtype, device):
    class _Array:  # __cuda_array_interface__ v2: torch wraps the pointer without a copy
        __cuda_array_interface__ = {"shape": tuple(shape), "typestr": _CUDA_TYPESTR[dtype], "data": (ptr, False),
                                    "version": 2, "strides": None}

    t = torch.as_tensor(_Array(), device=device)
    return t.view(dtype) if dtype == torch.bfloat16 else t


class _Param:
    __slots__ = ("index", "name", "tensor", "shape", "dtype", "numel", "nbytes", "ops", "open", "trained",
                 "weight_decay", "storage_ptr", "grads_seen", "hook", "view", "view_ptr", "source", "empty", "__weakref__")

    def __init__(self, index, name, tensor):
        self.index, self.name, self.tensor = index, name, tensor
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.numel = tensor.numel()
        self.nbytes = self.numel * tensor.element_size()
        self.ops = []          # operators listing it
        self.open = 0          # open windows listing it: materialized while > 0
        self.trained = True
        self.weight_decay = None
        self.storage_ptr = 0   # its gathered memory while materialized (saved-tensor handles match on it)
        self.grads_seen = 0    # gradients handed to strata since the last step
        self.hook = None
        self.view = None       # the last tensor over strata's gathered memory, and its address: a window that
        self.view_ptr = 0      # finds the parameter at the same address again reuses it
        self.source = None     # where its initial values are in st.wrap's weights= (None: the tensor's own)
        self.empty = None      # its storage between uses: an empty tensor of its dtype and device


class _Op:
    __slots__ = ("index", "name", "module", "params", "phase", "task", "calls", "forward_calls", "backward_uses",
                 "backward_left", "backward_done", "__weakref__")

    def __init__(self, index, name, module, params):
        self.index, self.name, self.module, self.params = index, name, module, params
        self.phase = None      # the open window's phase, or None
        self.task = -1         # the autograd graph task that opened a BACKWARD window
        self.calls = []        # per forward call in progress: (opened the window, saved-tensor hooks)
        self.forward_calls = 0  # training forwards since the last backward ended (a shared module: several)
        self.backward_uses = 0  # of them, the backward passes through the module so far in this backward
        self.backward_left = 0  # of those, the ones whose backward has not finished yet
        self.backward_done = False  # its BACKWARD window of this backward pass was released


class _SavedParam:
    """A tensor saved for backward that is (a view of) a gathered parameter: rebuilt from the parameter's
    memory when backward unpacks it."""
    __slots__ = ("param", "size", "stride", "offset", "dtype")

    def __init__(self, param, t):
        self.param, self.size, self.stride, self.offset, self.dtype = (param, t.size(), t.stride(),
                                                                       t.storage_offset(), t.dtype)


class _Outer:
    """A tensor packed by the saved-tensor hooks outside ours (activation checkpointing's)."""
    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


class _BackwardHook(torch.autograd.Function):
    """On a module's tensors: their backward calls the module's wrapper's `hook` (by name) for the module. On its
    outputs, "_pre_backward" fetches the module's parameters before the module's own backward; on its inputs,
    "_post_backward" releases them once the module's backward is done."""

    @staticmethod
    def forward(ctx, op_ref, hook, *tensors):
        ctx.op_ref, ctx.hook = op_ref, hook
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op_ref()
        if op is not None:
            w = _BY_MODULE[op.module]
            w._timed(getattr(w, ctx.hook), op)
        return (None, None) + grads


def _through_backward_hook(op, hook, tree):
    """`tree` with its tensors that need gradients passed through _BackwardHook(`hook`); None when it has none."""
    leaves, spec = _flatten(tree)
    wanted = _grad_tensors(leaves)
    if not wanted:
        return None
    detached = _BackwardHook.apply(weakref.ref(op), hook, *[leaves[i] for i in wanted])
    for i, t in zip(wanted, detached):
        leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


# Tensor attributes that an empty placeholder answers as the parameter would (its dtype, device, ...): reading
# them outside a window is harmless (transformers' model.dtype does, on its first parameter).
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda", "is_meta",
                       "is_sparse", "is_quantized", "is_floating_point", "is_complex", "element_size", "__hash__",
                       "__eq__", "grad", "_backward_hooks", "name", "__repr__", "__format__", "__reduce_ex__"})


def _metadata_only(func):
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name in _METADATA


class _UseCheck(torch.overrides.TorchFunctionMode):
    """Active during a wrapped model's forwards until its first step: Wrapped.check_use on every torch function,
    and the stack of the model's modules running (to name the one that uses a parameter it should not)."""

    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped
        self.stack = []
        self.handles = []

    def __enter__(self):
        names = self.wrapped._module_names

        def enter(module, args):
            if module in names:
                self.stack.append(names[module])

        def leave(module, args, output):  # returns None: the output stays
            if module in names and self.stack:
                self.stack.pop()
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                        torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return super().__exit__(*exc)

    def module_name(self):
        return f"module '{self.stack[-1]}'" if self.stack else "the model"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.wrapped.check_use(func, args, kwargs)
        return func(*args, **(kwargs or {}))


def _flatten(value):
    return torch.utils._pytree.tree_flatten(value)


def _grad_tensors(leaves):
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]


class Wrapped:
    """The strata side of a wrapped model (model._strata_torch): the engine, parameters and operators."""

    def __init__(self, model, config, average_gradients=True, weights=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.torch.wrap: model must be a torch.nn.Module, not {type(model).__name__}")
        if model in _BY_MODULE or any(m in _BY_MODULE for m in model.modules()):
            raise StrataTorchError("strata.torch.wrap: this model (or a module in it) is wrapped already")
        self.model = model
        self.config = _load_config(config)
        self.average_gradients = average_gradients
        self.engine = None
        self.params = []
        self.ops = []
        self._by_storage = {}
        self._modules = {}
        self._handles = []
        self._task_callbacks = set()  # graph tasks whose end-of-backward callback is queued
        self._prepared = False
        self._evaluating = False
        self._grads_pending = False   # a gradient reached strata since the last step
        self._micro_steps = 0         # backward passes since the last step
        self.last_grad_norm = None
        self.windows = {FORWARD: 0, BACKWARD: 0, RECOMPUTE: 0}  # windows opened, by phase (for tests, benches)
        # For benches: host seconds spent in the hooks (strata's calls included) and in the gradient hooks,
        # and the bytes of parameters materialized in torch now and at most (reset_peak()).
        self.hook_seconds = 0.0
        self.grad_seconds = 0.0
        self.strata_seconds = 0.0  # of them, inside strata's fetch, release and gradient-add calls
        self.materialized_bytes = 0
        self.peak_materialized_bytes = 0
        self.device = None
        names = {}
        for name, p in model.named_parameters(remove_duplicate=True):
            names[id(p)] = name
        self._param_of = {}  # id(Parameter) -> _Param
        self._module_names = {m: n or "<root>" for n, m in model.named_modules(remove_duplicate=True)}
        meta = []
        for module_name, module in model.named_modules(remove_duplicate=True):
            own = [p for p in module._parameters.values() if p is not None]
            if not own:
                continue
            listed = []
            for p in own:
                name = names.get(id(p), f"{module_name}.?")
                if p.dtype not in _DTYPES:
                    raise StrataTorchError(f"strata.torch.wrap: parameter '{name}' is {p.dtype}; strata stores "
                                           "float32, float16 or bfloat16")
                if p.device.type == "meta":
                    meta.append(name)
                elif self.device is None:
                    self.device = p.device
                elif p.device != self.device:
                    raise StrataTorchError(f"strata.torch.wrap: parameters on {self.device} and {p.device} "
                                           f"('{name}'); move the model to one device first")
                param = self._param_of.get(id(p))
                if param is None:
                    param = _Param(len(self.params), name, p)
                    self._param_of[id(p)] = param
                    self.params.append(param)
                if param not in listed:
                    listed.append(param)
            self._add_op(module, listed)
        if not self.params:
            raise StrataTorchError("strata.torch.wrap: the model has no parameters")
        accelerator = self.config.setdefault("strata", {}).get("accelerator", "auto")
        self.weights = None
        if meta:
            if weights is None:
                raise StrataTorchError(
                    f"strata.torch.wrap: parameter '{meta[0]}' is on the meta device ({len(meta)} parameter(s) "
                    "are); give its values: st.wrap(model, config, weights=\"model.safetensors\" or a Hugging Face "
                    "directory), or build the model with them")
        if weights is not None:
            try:
                self.weights = _safetensors.Weights(weights)
                for param in self.params:
                    param.source = self.weights.find(param.name, self._aliases(param), param.shape,
                                                     required=param.tensor.device.type == "meta")
            except _safetensors.WeightsError as error:
                raise StrataTorchError(f"strata.torch.wrap: {error}") from None
            self._load_meta_buffers()
        if self.device is None:  # every parameter on meta: strata's accelerator decides
            cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
            self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda
                           else torch.device("cpu"))
        self._cuda = self.device.type == "cuda"
        self._replace_meta_parameters()
        wanted = "cuda" if self._cuda else "cpu"
        if accelerator not in ("auto", wanted):
            raise StrataTorchError(
                f"strata.torch.wrap: the config's strata.accelerator is {accelerator!r} but the model is on "
                f"{self.device}; move the model or set strata.accelerator to {wanted!r}")
        self.config["strata"]["accelerator"] = wanted
        # A forward of the whole model without gradients is an evaluation; one with them a training pass,
        # even where parts of it run without (reentrant activation checkpointing's first forward).
        self._evaluation_pass = False
        # Until the first step, every forward checks that no parameter is used outside a window listing it
        # (a parent reading a child's weight): refused naming both, before torch fails on an empty tensor.
        self._check_uses = True
        self._use_check = None
        self._hook_depth = 0
        self._handles.append(model.register_forward_pre_hook(lambda m, args: self._root_forward(), prepend=True))
        self._handles.append(model.register_forward_hook(lambda m, args, out: self._root_forward_done(),
                                                         always_call=True))
        _BY_MODULE[model] = self
        for param in self.params:
            _BY_PARAM[param.tensor] = self

    def _replace_meta_parameters(self):
        """A Parameter on meta cannot take real storage (torch refuses set_data across those devices): each is
        replaced, in every module holding it, by an empty one of its dtype on the model's device (the same
        object wherever it was tied). The only Parameters st.wrap replaces: build the optimizer after it."""
        new = {}
        for param in self.params:
            old = param.tensor
            if old.device.type != "meta":
                continue
            param.tensor = torch.nn.Parameter(torch.empty(0, dtype=param.dtype, device=self.device),
                                              requires_grad=old.requires_grad)
            new[id(old)] = param.tensor
            del self._param_of[id(old)]
            self._param_of[id(param.tensor)] = param
        if not new:
            return
        for module in self._module_names:
            for key, value in module._parameters.items():
                if value is not None and id(value) in new:
                    module._parameters[key] = new[id(value)]

    def _aliases(self, param):
        """Every name the model has for a parameter (a tied weight has several)."""
        return [n for n, p in self.model.named_parameters(remove_duplicate=False) if p is param.tensor]

    def _load_meta_buffers(self):
        for name, buffer in self.model.named_buffers():
            if buffer.device.type != "meta":
                continue
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            value = self.weights.read_whole(name, tuple(buffer.shape), buffer.dtype)
            if value is None:
                raise StrataTorchError(
                    f"strata.torch.wrap: buffer '{name}' is on the meta device and not in {self.weights.where}; "
                    "build the model with its buffers materialized (accelerate's init_empty_weights() keeps them "
                    "off meta), or set it before wrapping")
            module._buffers[attr] = value

    def _add_op(self, module, params):
        """Makes `module` an operator listing `params` and hooks it."""
        op = _Op(len(self.ops), self._module_names[module], module, params)
        for param in params:
            param.ops.append(op)
        self.ops.append(op)
        self._modules[module] = op
        _BY_MODULE[module] = self
        ref = weakref.ref(op)
        self._handles.append(module.register_forward_pre_hook(
            lambda m, args, kwargs, ref=ref: self._timed(self._pre_forward, ref(), args, kwargs),
            with_kwargs=True))
        self._handles.append(module.register_forward_hook(
            lambda m, args, kwargs, out, ref=ref: self._timed(self._post_forward, ref(), out), with_kwargs=True,
            always_call=True))
        self._handles.append(module._register_state_dict_hook(
            lambda m, state, prefix, meta, ref=ref: self._gather_state(ref(), state, prefix)))
        return op

    def register_external_parameter(self, module, parameter):
        """Lists `parameter` in `module`'s operator: gathered around module's forward and backward too."""
        if self.finalized:
            raise StrataTorchError("strata.torch.register_external_parameter: call it before st.Optimizer (the "
                                   "operators are fixed when the engine is created)")
        param = self._param_of.get(id(parameter))
        if param is None:
            raise StrataTorchError("strata.torch.register_external_parameter: the parameter is not one of the "
                                   "wrapped model's")
        if module not in self._module_names:
            raise StrataTorchError("strata.torch.register_external_parameter: the module is not part of the "
                                   "wrapped model")
        op = self._modules.get(module)
        if op is None:
            self._add_op(module, [param])
        elif param not in op.params:
            op.params.append(param)
            param.ops.append(op)

    # ---- creation (st.Optimizer, or the first forward) ------------------------------------------

    @property
    def finalized(self):
        return self.engine is not None

    def finalize(self, trained=None, weight_decay=None, optimizer_params=None, lr_scale=None):
        """Creates the engine (collective), registers and partitions every parameter, and empties them.
        trained: the Parameters to train (default: requires_grad); weight_decay: {Parameter: decay};
        lr_scale: {Parameter: its lr over each step's};
        optimizer_params: lr, betas, eps, weight_decay from st.Optimizer, filling the config's "auto"s
        (or absent keys) and refused when they contradict it."""
        if self.finalized:
            raise StrataTorchError("strata.torch: the model's engine exists already (st.Optimizer once per model)")
        config = self.config
        if optimizer_params:
            section = config.setdefault("optimizer", {}).setdefault("params", {})
            for key, value in optimizer_params.items():
                value = list(value) if isinstance(value, tuple) else value
                given = section.get(key, "auto")
                if given == "auto":
                    section[key] = value
                elif not _same(given, value):
                    raise StrataTorchError(
                        f"strata.torch.Optimizer: {key}={value!r} contradicts the config's optimizer.params.{key} "
                        f"= {given!r}; give one of them (or \"auto\" in the config)")
        autos = list(_autos(config))
        if autos:
            raise StrataTorchError("strata.torch: the config still holds \"auto\" at " + ", ".join(autos) +
                                   "; give values (st.Optimizer fills optimizer.params; StrataTrainer fills the "
                                   "Trainer's keys)")
        trained_ids = {id(p) for p in trained} if trained is not None else None
        decays = {id(p): float(v) for p, v in (weight_decay or {}).items()}
        scales = {id(p): float(v) for p, v in (lr_scale or {}).items()}
        self.engine = _strata.Engine(config)
        try:
            self._world = self.engine.world_size
            for param in self.params:
                param.trained = (param.tensor.requires_grad if trained_ids is None
                                 else id(param.tensor) in trained_ids)
                self.engine.register(param.name, shape=param.shape, dtype=_DTYPES[param.dtype],
                                     init_into=self._initializer(param))
            for param in self.params:
                if not param.trained:
                    self.engine.freeze(param.index)
                    continue
                if id(param.tensor) in decays:
                    param.weight_decay = decays[id(param.tensor)]
                    self.engine.set_weight_decay(param.index, param.weight_decay)
                if id(param.tensor) in scales:
                    self.engine.set_lr_scale(param.index, scales[id(param.tensor)])
            for op in self.ops:
                self.engine.op(op.name, [p.index for p in op.params])
            self.engine.finalize()
        except BaseException:
            self.engine.close()
            self.engine = None
            raise
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())  # swap files and locks go at exit
        for param in self.params:
            param.empty = self._empty(param)
            param.tensor.data = param.empty
            if param.trained:
                param.hook = param.tensor.register_post_accumulate_grad_hook(
                    lambda t, param=param: self._timed_grad(param))
        self._accumulation = int(config.get("gradient_accumulation_steps", 1))
        return self

    def _initializer(self, param):
        if param.source is not None:  # each rank reads its own ranges from the file, into strata's memory
            return lambda first, count, address: self.weights.read_into(param.source, first, count, address,
                                                                      param.dtype)
        source = param.tensor.detach()
        itemsize = source.element_size()

        def into(first, count, address):
            flat = source.reshape(-1)[first:first + count]
            if source.device.type == "cpu":
                flat = flat.contiguous()
                ctypes.memmove(address, flat.data_ptr(), count * itemsize)
            else:  # one range of a device tensor into strata's host view of it
                buffer = (ctypes.c_byte * (count * itemsize)).from_address(address)
                torch.frombuffer(buffer, dtype=source.dtype, count=count).copy_(flat)
        return into

    def _empty(self, param):
        return torch.empty(0, dtype=param.dtype, device=self.device)

    # ---- materialized parameters ------------------------------------------------------------------

    def _materialize(self, op):
        for param in op.params:
            param.open += 1
            if param.open > 1:
                continue  # another open window gathered it: the same memory
            ptr = self.engine.ptr(param.index)
            if ptr != param.view_ptr:  # gathered elsewhere than last time: a new view (else the last one again)
                if self._cuda:
                    param.view = _cuda_tensor(ptr, param.shape, param.dtype, self.device)
                else:
                    buffer = (ctypes.c_byte * param.nbytes).from_address(ptr)
                    param.view = torch.frombuffer(buffer, dtype=param.dtype, count=param.numel).view(param.shape)
                param.view_ptr = ptr
            param.tensor.data = param.view
            param.storage_ptr = ptr
            self._by_storage[ptr] = param
            self.materialized_bytes += param.nbytes
            self.peak_materialized_bytes = max(self.peak_materialized_bytes, self.materialized_bytes)

    def _dematerialize(self, op):
        for param in op.params:
            param.open -= 1
            if param.open > 0:
                continue
            self._by_storage.pop(param.storage_ptr, None)
            param.storage_ptr = 0
            self.materialized_bytes -= param.nbytes
            param.tensor.data = param.empty

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self._cuda else None

    def _open(self, op, phase):
        if phase == FORWARD and self._evaluation_pass:
            self._maybe_begin_evaluation()
        elif self._evaluating:
            self._end_evaluation()
        start = time.perf_counter()
        self.engine.fetch_window(op.index, phase, self._stream())
        self.strata_seconds += time.perf_counter() - start
        self.windows[phase] += 1
        op.phase = phase
        self._materialize(op)

    def _close(self, op):
        phase, op.phase, op.task = op.phase, None, -1
        self._dematerialize(op)
        start = time.perf_counter()
        self.engine.release_window(op.index, phase, self._stream())
        self.strata_seconds += time.perf_counter() - start

    # ---- evaluation and the prepared step ------------------------------------------------------

    def _maybe_begin_evaluation(self):
        # A forward without gradients between steps: the training step's operator trace is kept.
        if self._evaluating or self._prepared or self._grads_pending or any(o.phase is not None for o in self.ops):
            return
        self.engine.begin_evaluation()
        self._evaluating = True

    def _end_evaluation(self):
        if self._evaluating:
            self.engine.end_evaluation()
            self._evaluating = False

    def _maybe_prepare(self):
        # The last micro-step's forward: the optimizer may update sub-groups during its backward
        # (exactly rolled back if the step turns out otherwise).
        if self._prepared or self._accumulation < 1 or (self._micro_steps + 1) % self._accumulation != 0:
            return
        if any(o.phase is not None for o in self.ops):
            return
        optimizer = getattr(self, "optimizer", None)
        lr = optimizer.current_lr() if optimizer is not None else None
        if lr is None:
            return
        self.engine.prepare_step(lr)
        self._prepared = True

    # ---- hooks -----------------------------------------------------------------------------------

    def _timed(self, hook, *args):
        start = time.perf_counter()
        self._hook_depth += 1
        try:
            return hook(*args)
        finally:
            self._hook_depth -= 1
            self.hook_seconds += time.perf_counter() - start

    def reset_peak(self):
        self.peak_materialized_bytes = self.materialized_bytes

    def _root_forward(self):
        if torch._C._current_graph_task_id() == -1:
            self._evaluation_pass = not torch.is_grad_enabled()
            if self._check_uses and self._use_check is None:
                self._use_check = _UseCheck(self)
                self._use_check.__enter__()

    def _root_forward_done(self):
        check, self._use_check = self._use_check, None
        if check is not None:
            check.__exit__(None, None, None)

    def check_use(self, func, args, kwargs):
        """Refuses a torch function given a parameter that is not gathered: one read outside every window that
        lists it (a parent using a child's weight), which would otherwise meet torch with an empty tensor."""
        if self._hook_depth or not self.finalized or _metadata_only(func):
            return
        for value in (*args, *(kwargs or {}).values()):
            for item in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(item, torch.nn.Parameter):
                    continue
                param = self._param_of.get(id(item))
                if param is None or param.open > 0:
                    continue
                user = self._use_check.module_name() if self._use_check is not None else "the model"
                owners = ", ".join(f"'{o.name}'" for o in param.ops)
                raise StrataTorchError(
                    f"strata.torch: {user} uses parameter '{param.name}' outside the forward of {owners}, the "
                    "module(s) strata gathers it for (there it has no values); list it with the module that uses "
                    f"it before st.Optimizer: st.register_external_parameter(<{user}>, <'{param.name}'>)")

    def _pre_forward(self, op, args, kwargs):
        if not self.finalized:
            self.finalize()
        in_backward = torch._C._current_graph_task_id() != -1
        phase = RECOMPUTE if in_backward else FORWARD
        training = torch.is_grad_enabled()
        if phase == FORWARD and training:
            self._end_evaluation()
            op.forward_calls += 1  # a module called twice (shared) gets a window per call
            self._maybe_prepare()
        opened = op.phase is None
        if opened:
            self._open(op, phase)
        else:  # its BACKWARD window is open (activation checkpointing recomputes inside it): use that one
            self._materialize(op)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t, outer=outer: self._pack(t, outer), self._unpack)
        hooks.__enter__()
        op.calls.append((opened, hooks))
        if not training:
            return None
        return _through_backward_hook(op, "_post_backward", (args, kwargs))

    def _post_forward(self, op, output):
        if not op.calls:  # the pre-hook failed before recording the call
            return None
        opened, hooks = op.calls.pop()
        hooks.__exit__(None, None, None)
        if opened:
            self._close(op)
        else:
            self._dematerialize(op)
        if not torch.is_grad_enabled():
            return None
        return _through_backward_hook(op, "_pre_backward", output)

    def _pre_backward(self, op):
        task = torch._C._current_graph_task_id()
        if task not in self._task_callbacks:
            self._task_callbacks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda task=task: self._end_backward(task))
        if op.phase == BACKWARD:
            # A module called more than once in the forward: its backward window, opened by the backward of a
            # later call, stays open for the earlier ones, so that strata gets its gradient in one window.
            op.backward_uses += 1
            op.backward_left += 1
            return
        if op.phase is not None:
            raise StrataTorchError(
                f"strata.torch: backward reached module '{op.name}' while its {_PHASE_NAMES[op.phase]} window is "
                "still open")
        if op.backward_done:
            raise StrataTorchError(
                f"strata.torch: backward reached module '{op.name}' again after its backward window closed in this "
                f"pass ({op.forward_calls} training call(s) counted in forward): a module called more than once "
                "where the forward's calls were not counted (inside reentrant activation checkpointing; use "
                "use_reentrant=False)")
        op.backward_uses, op.backward_left = 1, 1
        self._open(op, BACKWARD)
        op.task = task

    def _post_backward(self, op):
        if op.phase != BACKWARD:
            return
        op.backward_left -= 1
        if op.backward_left <= 0 and op.backward_uses >= max(op.forward_calls, 1):
            self._close(op)
            op.backward_done = True

    def _end_backward(self, task):
        self._task_callbacks.discard(task)
        for op in self.ops:
            if op.phase == BACKWARD and op.task == task:
                self._close(op)
                op.backward_done = True
        if not self._task_callbacks:
            # A module that did not run (its parent read its parameters: register_external_parameter) shares
            # a parameter with one whose backward did: strata counts a backward window per operator listing
            # it, so this one gets an empty window (no gradient added) to complete the parameter's backward.
            for op in self.ops:
                if not op.backward_done and op.phase is None and any(
                        o.backward_done for p in op.params if p.trained for o in p.ops if o is not op):
                    self._open(op, BACKWARD)
                    self._close(op)
            self._micro_steps += 1
            for op in self.ops:
                op.forward_calls = op.backward_uses = op.backward_left = 0
                op.backward_done = False

    def _timed_grad(self, param):
        start = time.perf_counter()
        try:
            self._on_grad(param)
        finally:
            self.grad_seconds += time.perf_counter() - start

    def _on_grad(self, param):
        grad = param.tensor.grad
        param.tensor.grad = None
        if grad is None:
            return
        if grad.is_sparse or grad.layout != torch.strided:
            raise StrataTorchError(f"strata.torch: the gradient of '{param.name}' is sparse; strata takes dense ones")
        grad = grad.contiguous()
        if self.average_gradients and self._world > 1:
            grad = grad.mul_(1.0 / self._world) if grad.dtype == torch.float32 else grad.float().mul_(1.0 / self._world)
        start = time.perf_counter()
        self.engine.add_grad_device(param.index, grad.data_ptr(), _DTYPES[grad.dtype], self._stream())
        self.strata_seconds += time.perf_counter() - start
        param.grads_seen += 1
        self._grads_pending = True

    # ---- saved tensors ---------------------------------------------------------------------------

    def _pack(self, t, outer):
        if self._by_storage:
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
                ptr = 0
            param = self._by_storage.get(ptr) if ptr else None
            if param is not None:
                return _SavedParam(param, t)
        if outer is not None:
            pack, unpack = outer
            return _Outer(pack(t), unpack)
        return t

    @staticmethod
    def _unpack(saved):
        if isinstance(saved, _SavedParam):
            param = saved.param
            if param.open == 0:
                raise StrataTorchError(
                    f"strata.torch: backward needs parameter '{param.name}' outside a window of a module listing it "
                    "(used outside its module's forward: list it with the module using it, "
                    "st.register_external_parameter, before st.Optimizer)")
            storage = param.tensor.detach().untyped_storage()
            return torch.empty(0, dtype=saved.dtype, device=param.tensor.device).set_(
                storage, saved.offset, saved.size, saved.stride)
        if isinstance(saved, _Outer):
            return saved.unpack(saved.packed)
        return saved

    # ---- steps -------------------------------------------------------------------------------

    def _require_between_steps(self, what):
        open_ops = [o.name for o in self.ops if o.phase is not None]
        if open_ops:
            raise StrataTorchError(f"strata.torch: {what} with module(s) {', '.join(open_ops)} still in a forward or "
                                   "backward pass")
        self._end_evaluation()

    def step(self, lr):
        self._require_between_steps("optimizer step")
        missing = [p.name for p in self.params if p.trained and p.grads_seen == 0]
        if missing and self._grads_pending:
            raise StrataTorchError(
                "strata.torch: no gradient reached parameter(s) " + ", ".join(missing[:8]) +
                (f" and {len(missing) - 8} more" if len(missing) > 8 else "") +
                " since the last step; torch's AdamW would leave them alone, strata updates every trained "
                "parameter: freeze them (requires_grad_(False)) before st.Optimizer")
        result = self.engine.step(lr)
        self._after_step()
        self.last_grad_norm = result.grad_norm
        return result

    def _after_step(self):
        self._check_uses = False  # a step went through: the forward's uses were checked
        self._prepared = False
        self._grads_pending = False
        self._micro_steps = 0
        for param in self.params:
            param.grads_seen = 0
        for op in self.ops:
            op.forward_calls = 0

    def zero_grad(self):
        if not self.finalized or not (self._grads_pending or self._prepared):
            return
        self._require_between_steps("zero_grad")
        self.engine.zero_grad()
        self._after_step()

    def clip_grad_norm(self, max_norm):
        self._require_between_steps("clip_grad_norm_")
        norm = self.engine.clip_grad_norm(max_norm)
        self.last_grad_norm = norm
        return norm

    # ---- state -------------------------------------------------------------------------------

    def _gather_state(self, op, state, prefix):
        if op is None or not self.finalized:
            return
        for name, p in op.module._parameters.items():
            if p is None or prefix + name not in state:
                continue
            param = next(q for q in op.params if q.tensor is p)
            if param.open > 0:  # inside a window: its memory is there
                state[prefix + name] = p.detach().clone()
                continue
            self._require_between_steps("state_dict()")
            full = torch.empty(param.shape, dtype=param.dtype)
            self.engine.read_into(param.index, full.data_ptr())
            state[prefix + name] = full.to(self.device) if self._cuda else full

    def close(self):
        """Destroys the engine (its swap files, its lock on nvme_path); the model's parameters are gone with it."""
        if self.engine is not None:
            self.engine.close()

    def save_checkpoint(self, directory):
        self._require_between_steps("save_checkpoint")
        self.engine.save_checkpoint(directory)

    def load_checkpoint(self, directory):
        self._require_between_steps("load_checkpoint")
        self.engine.load_checkpoint(directory)


_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", RECOMPUTE: "recompute"}


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def wrap(model, config, *, weights=None, average_gradients=True):
    """Hands `model`'s parameters to strata, configured by `config` (a ds_config path or dict); returns the
    same model, hooked. Build st.Optimizer(model) next: the engine is created then (every rank together).

    weights: initial values from safetensors instead of the tensors -- a .safetensors file, or a directory
    holding model.safetensors or a sharded model.safetensors.index.json (a Hugging Face save_pretrained
    directory). Each rank reads only the ranges of the shard it owns, straight into strata's memory, so a
    model built on the meta device (`with torch.device("meta"): model = ...`) is never materialized whole.
    Parameters on meta need it; a parameter missing from the files is refused by name (one not on meta then
    keeps its own values), and meta buffers are read from the files whole."""
    Wrapped(model, config, average_gradients=average_gradients, weights=weights)
    return model


def register_external_parameter(module, parameter):
    """Gathers `parameter` around `module`'s forward and backward as well as its own module's: for a module
    that reads a parameter of another module directly (a parent using a child's weight), which strata would
    otherwise have gathered only inside that other module's forward (DeepSpeed ZeRO-3 has the same call).
    Before st.Optimizer. Without it such a use is refused at the first forward, naming both."""
    wrapped_of(module).register_external_parameter(module, parameter)


def wrapped_of(obj):
    """The Wrapped state of a wrapped model, one of its modules or parameters."""
    if isinstance(obj, Wrapped):
        return obj
    found = _BY_MODULE.get(obj) if isinstance(obj, torch.nn.Module) else None
    if found is None and isinstance(obj, torch.nn.Module):
        for module in obj.modules():  # a wrapper around a wrapped model (a PeftModel, a Trainer's model)
            found = _BY_MODULE.get(module)
            if found is not None:
                break
    if found is None and isinstance(obj, torch.Tensor):
        found = _BY_PARAM.get(obj)
    if found is None:
        raise StrataTorchError("strata.torch: this model was not wrapped (st.wrap(model, config) first)")
    return found


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ for a wrapped model: the global L2 norm of every trained parameter's
    gradient (summed over ranks, as strata steps on it), and the coming opt.step() clips to max_norm. Give the
    model or all of its trained parameters: strata clips them together. Returns the norm as a tensor."""
    if float(norm_type) != 2.0:
        raise StrataTorchError(f"strata.torch.clip_grad_norm_: norm_type {norm_type} (strata computes the L2 norm)")
    if isinstance(parameters, torch.nn.Module):
        w = wrapped_of(parameters)
    else:
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not given:
            return torch.tensor(0.0)
        w = wrapped_of(given[0])
        trained = {id(p.tensor) for p in w.params if p.trained}
        if {id(p) for p in given if p.requires_grad} - trained or trained - {id(p) for p in given}:
            raise StrataTorchError("strata.torch.clip_grad_norm_: give the model or every trained parameter of it "
                                   "(strata clips all of them together)")
    norm = w.clip_grad_norm(max_norm)
    if error_if_nonfinite and not (norm == norm and norm != float("inf")):
        raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({norm})")
    return torch.tensor(norm)


def save_checkpoint(model, directory):
    """Saves the engine's state (parameters, optimizer state, step count) as `directory`/step_<N>; collective."""
    wrapped_of(model).save_checkpoint(directory)


def load_checkpoint(model, directory):
    """Loads the newest checkpoint in `directory` into the model's engine (after st.Optimizer); collective."""
    wrapped_of(model).load_checkpoint(directory)
