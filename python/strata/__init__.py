"""strata from Python: a ctypes binding over strata's C API (runtime/capi/strata.h).

No build step: the package loads libstrata_runtime.so, found (first match) at
  1. $STRATA_LIBRARY (the file),
  2. $STRATA_PREFIX/lib/libstrata_runtime.so (and lib64, lib/<multiarch>),
  3. the install this package belongs to (<prefix>/lib/strata/python/strata),
  4. a build directory of the source tree this package is in (build*/runtime),
  5. the dynamic linker's search path.

A Python trainer keeps its model code and loop; strata owns the parameters
(partitioned over ranks, offloaded to CPU memory or NVMe as the DeepSpeed-style
config says) and runs the optimizer:

    import numpy as np, strata
    eng = strata.Engine({"zero_optimization": {"stage": 3}, "strata": {"accelerator": "cpu"}})
    w = eng.register("w", np.zeros((1, 8), np.float32))
    lin = eng.op("linear", [w])
    eng.finalize()
    with eng.fetch(lin, "forward") as win:
        pred = x @ win.param(w).T          # a read-only copy of the full value
    with eng.fetch(lin, "backward") as win:
        win.add_grad(w, dw)                # or: win.grad(w)[...] += dw
    eng.step(lr=0.05)
    eng.step_breakdown()                   # where the step's time and bytes went
    eng.read("w")                          # the full value, on every rank (collective)
    eng.save_checkpoint("ckpt/")           # crash-safe; a fresh engine: eng.load_checkpoint("ckpt/")

    with strata.trace("run.json"):         # a Chrome/Perfetto timeline of what runs inside
        ...

Every failure of the C API raises strata.Error (InvalidArgument, InvalidState,
EngineFailed, ... by status) carrying strata's message. Collectives
(Engine(), finalize, fetch at stage 3, global_sum, step, read, write,
save_checkpoint, load_checkpoint) must be
called by every rank in the same order, as in the C API. Parameter values are
numpy arrays (float32, float16; bf16 as float32 values converted on the way in
and out) or torch tensors (through DLPack / their CPU copy) when torch is
importable; complex, object or string arrays are refused (InvalidArgument).
The arrays a Window hands out are copies that stay valid after the window is
released or the engine closed (read-only then), never views of memory that
strata reuses or frees; Engine.ptr / grad_ptr give the raw addresses.
"""

import ctypes
import ctypes.util
import json
import os
import pathlib
from collections import namedtuple

import numpy as np

__all__ = [
    "Engine", "Param", "Op", "Window", "StepResult", "StepBreakdown", "OpStall", "Error", "InvalidArgument",
    "InvalidState", "IoError", "OutOfMemory", "CommunicationError", "CudaError", "InternalError", "EngineFailed",
    "CallbackError", "FORWARD", "BACKWARD", "RECOMPUTE", "version", "library_path", "trace_start",
    "trace_stop", "trace",
]

FORWARD, BACKWARD, RECOMPUTE = 0, 1, 2
_PHASES = {"forward": FORWARD, "backward": BACKWARD, "recompute": RECOMPUTE}
_F32, _F16, _BF16 = 0, 1, 2
_DTYPE_NAMES = {"fp32": _F32, "float32": _F32, "fp16": _F16, "float16": _F16, "bf16": _BF16, "bfloat16": _BF16}
_MAJOR = 0  # the C API major version this binding is written for


# ---- errors -----------------------------------------------------------------------------


class Error(RuntimeError):
    """A strata C API call failed; str() is strata_last_error() ("<function>: <what>")."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class InvalidArgument(Error, ValueError):
    """Bad input (unknown id, wrong dtype or shape, bad config); the engine stays usable."""


class InvalidState(Error):
    """A call out of order (fetch before finalize, step inside a window); the engine stays usable."""


class IoError(Error):
    pass


class OutOfMemory(Error, MemoryError):
    pass


class CommunicationError(Error):
    pass


class CudaError(Error):
    pass


class InternalError(Error):
    pass


class EngineFailed(Error):
    """An earlier error left the engine unusable; close it."""


class CallbackError(Error):
    pass


_ERRORS = {1: InvalidArgument, 2: InvalidState, 3: IoError, 4: OutOfMemory, 5: CommunicationError,
           6: CudaError, 7: InternalError, 8: EngineFailed, 9: CallbackError}


# ---- the library --------------------------------------------------------------------------

_NAME = "libstrata_runtime.so"


def _candidates():
    env = os.environ.get("STRATA_LIBRARY")
    if env:
        yield pathlib.Path(env)
    prefix = os.environ.get("STRATA_PREFIX")
    if prefix:
        for lib in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
            yield pathlib.Path(prefix) / lib / _NAME
    here = pathlib.Path(__file__).resolve().parent
    # Installed: <prefix>/<libdir>/strata/python/strata/__init__.py
    yield here.parents[2] / _NAME
    # The source tree: <repo>/python/strata/__init__.py, built in <repo>/build*/ (newest first).
    repo = here.parents[1]
    builds = [p for p in repo.glob("build*/runtime/" + _NAME) if p.is_file()]
    yield from sorted(builds, key=lambda p: p.stat().st_mtime, reverse=True)


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            if hasattr(lib, "strata_engine_create"):  # a build from before the C API has none
                return lib, str(path)
    found = ctypes.util.find_library("strata_runtime")
    if found:
        return ctypes.CDLL(found), found
    raise ImportError("strata: libstrata_runtime.so not found; set STRATA_LIBRARY=/path/to/libstrata_runtime.so "
                      "or STRATA_PREFIX=<install prefix>. Tried: " + ", ".join(tried))


_lib, library_path = _load()

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_INIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, _vp, _i32, _i64, _i64, _vp)


class _StepResult(ctypes.Structure):
    _fields_ = [("applied", _i32), ("grad_scale", ctypes.c_float), ("grad_norm", ctypes.c_double),
                ("loss_scale", ctypes.c_double), ("step", _i64)]


class _Stats(ctypes.Structure):
    _fields_ = [("rank", _i32), ("world_size", _i32), ("zero_stage", _i32), ("param_tier", _i32),
                ("optimizer_tier", _i32), ("param_count", _i32), ("op_count", _i32), ("host_memory", _i32),
                ("finalized", _i32), ("failed", _i32), ("param_numel", _i64), ("steps", _i64),
                ("steps_skipped", _i64), ("gathered_bytes", ctypes.c_uint64),
                ("peak_gathered_bytes", ctypes.c_uint64), ("gathers", _i64)]


class _StepBreakdown(ctypes.Structure):
    _fields_ = [("step", _i64), ("applied", _i32), ("trace_followed", _i32), ("trace_dropped", _i32),
                ("stalled_windows", _i32), ("seconds", ctypes.c_double), ("compute_seconds", ctypes.c_double),
                ("param_stall_seconds", ctypes.c_double), ("grad_wait_seconds", ctypes.c_double),
                ("optimizer_seconds", ctypes.c_double), ("other_seconds", ctypes.c_double), ("windows", _i64),
                ("fetches", _i64), ("prefetched", _i64), ("gathers", _i64), ("gathered_bytes", ctypes.c_uint64),
                ("param_read_bytes", ctypes.c_uint64), ("nvme_read_bytes", ctypes.c_uint64),
                ("nvme_written_bytes", ctypes.c_uint64)]


class _OpStall(ctypes.Structure):
    _fields_ = [("op", _i32), ("phase", _i32), ("windows", _i64), ("seconds", ctypes.c_double)]


def _declare(name, argtypes, restype=ctypes.c_int):
    fn = getattr(_lib, name, None)
    if fn is None:  # a library older than this binding: the call says so when made
        def missing(*_args, name=name):
            raise Error(-1, f"strata: {name} is not in {library_path} (strata {_version_string().decode()}); "
                            "it needs a newer libstrata_runtime.so")
        return missing
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_EP = _vp  # strata_engine*
_version = _declare("strata_version", [], ctypes.c_int)
_version_string = _declare("strata_version_string", [], ctypes.c_char_p)
_last_error = _declare("strata_last_error", [], ctypes.c_char_p)
_create = _declare("strata_engine_create", [ctypes.c_char_p, ctypes.POINTER(_vp)])
_destroy = _declare("strata_engine_destroy", [_EP])
_register_param = _declare("strata_register_param", [_EP, ctypes.c_char_p, ctypes.c_int, _i32,
                                                      ctypes.POINTER(_i64), _vp, _INIT_FN, _vp,
                                                      ctypes.POINTER(_i32)])
_register_op = _declare("strata_register_op", [_EP, ctypes.c_char_p, _i32, ctypes.POINTER(_i32),
                                                ctypes.POINTER(_i32)])
_finalize = _declare("strata_finalize", [_EP])
_fetch = _declare("strata_fetch", [_EP, _i32, ctypes.c_int])
_release = _declare("strata_release", [_EP, _i32, ctypes.c_int])
_param_ptr = _declare("strata_param_ptr", [_EP, _i32, ctypes.POINTER(_vp)])
_grad_ptr = _declare("strata_grad_ptr", [_EP, _i32, ctypes.POINTER(_vp)])
_add_grad = _declare("strata_add_grad", [_EP, _i32, _vp])
_global_sum = _declare("strata_global_sum", [_EP, ctypes.c_double, ctypes.POINTER(ctypes.c_double)])
_step = _declare("strata_step", [_EP, ctypes.c_float, ctypes.POINTER(_StepResult)])
_prepare_step = _declare("strata_prepare_step", [_EP, ctypes.c_float])
_zero_grad = _declare("strata_zero_grad", [_EP])
_loss_scale = _declare("strata_loss_scale", [_EP, ctypes.POINTER(ctypes.c_double)])
_read_param = _declare("strata_read_param", [_EP, _i32, _vp])
_write_param = _declare("strata_write_param", [_EP, _i32, _vp])
_get_stats = _declare("strata_get_stats", [_EP, ctypes.POINTER(_Stats)])
_get_step_breakdown = _declare("strata_get_step_breakdown", [_EP, ctypes.POINTER(_StepBreakdown)])
_get_op_stalls = _declare("strata_get_op_stalls", [_EP, ctypes.POINTER(_OpStall), _i32, ctypes.POINTER(_i32)])
_save_checkpoint = _declare("strata_save_checkpoint", [_EP, ctypes.c_char_p])
_load_checkpoint = _declare("strata_load_checkpoint", [_EP, ctypes.c_char_p])
_freeze_param = _declare("strata_freeze_param", [_EP, _i32])
_set_weight_decay = _declare("strata_set_weight_decay", [_EP, _i32, ctypes.c_float])
_set_lr_scale = _declare("strata_set_lr_scale", [_EP, _i32, ctypes.c_float])
_FPP = ctypes.POINTER(ctypes.POINTER(ctypes.c_float))
_read_optimizer_state = _declare("strata_read_optimizer_state",
                                 [_EP, _i32, ctypes.POINTER(_i32), _FPP, _FPP, ctypes.POINTER(_i64)])
_write_optimizer_state = _declare("strata_write_optimizer_state", [_EP, _i32, ctypes.POINTER(_i32), _FPP, _FPP, _i64])
_fetch_on_stream = _declare("strata_fetch_on_stream", [_EP, _i32, ctypes.c_int, _vp])
_release_on_stream = _declare("strata_release_on_stream", [_EP, _i32, ctypes.c_int, _vp])
_add_grad_device = _declare("strata_add_grad_device", [_EP, _i32, _vp, ctypes.c_int, _vp])
_clip_grad_norm = _declare("strata_clip_grad_norm", [_EP, ctypes.c_double, ctypes.POINTER(ctypes.c_double)])
_begin_evaluation = _declare("strata_begin_evaluation", [_EP])
_end_evaluation = _declare("strata_end_evaluation", [_EP])
_trace_start = _declare("strata_trace_start", [ctypes.c_char_p])
_trace_stop = _declare("strata_trace_stop", [])

def _ids(params):
    return (_i32 * max(len(params), 1))(*[q.id for q in params])


def _pointers(arrays):
    arrays = list(arrays)
    return (ctypes.POINTER(ctypes.c_float) * max(len(arrays), 1))(
        *[a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for a in arrays])


if _version() // 10000 != _MAJOR:
    raise ImportError(f"strata: this binding is for C API {_MAJOR}.x; {library_path} is "
                      f"{_version_string().decode()}")


def version():
    """The loaded library's version string, e.g. "0.3.0"."""
    return _version_string().decode()


def _check(status):
    if status != 0:
        raise _ERRORS.get(status, Error)(status, _last_error().decode(errors="replace"))


def _path_bytes(path):
    """A path (str, bytes or os.PathLike) as the C API's bytes."""
    return os.fsencode(os.fspath(path))


# ---- the timeline -----------------------------------------------------------------------------


def trace_start(path):
    """Starts recording this process's timeline (strata_trace_start): every engine's I/O workers,
    collectives and hook windows, to be written to `path` as Chrome/Perfetto trace JSON by
    trace_stop() (or at exit). "{rank}" in `path` becomes the rank; without it and with several
    ranks, ".rank<N>" goes before ".json". Not collective. Raises InvalidState when already
    recording, IoError when the file cannot be created."""
    _check(_trace_start(_path_bytes(path)))


def trace_stop():
    """Stops recording and writes the file trace_start named (strata_trace_stop)."""
    _check(_trace_stop())


class trace:
    """Records the timeline of the `with` block into `path` (trace_start ... trace_stop)."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        trace_start(self.path)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            trace_stop()
            return
        try:  # keep the block's exception; still write what was recorded
            trace_stop()
        except Error:
            pass


# ---- values: numpy, torch, bf16 -------------------------------------------------------------


def _f32_to_bf16_bits(a):
    """float32 -> bfloat16 bit patterns, round to nearest even, NaN kept a (quiet) NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _as_numpy(value):
    """A host numpy array for a numpy array, anything array-like, or a torch tensor (any device)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__") and hasattr(value, "detach"):  # a torch tensor
        import torch  # present: `value` is one of its tensors

        t = value.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return t.float().numpy()  # exact: bf16 widens to fp32 without rounding
        try:
            return np.from_dlpack(t)
        except (AttributeError, TypeError, RuntimeError, BufferError):
            return t.numpy()
    return np.asarray(value)


def _real(array, what):
    """`array` when it holds real numbers (floats, integers, booleans); else InvalidArgument: a complex value
    would lose its imaginary part, an object or string array has no numbers at all."""
    if array.dtype.kind not in "fiub":
        raise InvalidArgument(1, f"strata: {what} has dtype {array.dtype}, not real numbers (float or integer); "
                                 "strata stores fp32, fp16 or bf16")
    return array


def _dtype_code(dtype, array):
    if dtype is None:
        dtype = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16"}.get(array.dtype)
        if dtype is None:
            if array.dtype.kind in "iub":
                raise InvalidArgument(1, f"strata: values of dtype {array.dtype} need dtype='fp32', 'fp16' or "
                                         "'bf16' to say how strata stores them")
            dtype = "fp32"
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_NAMES:
        raise InvalidArgument(1, f"strata: dtype {dtype!r} is not fp32, fp16 or bf16")
    return _DTYPE_NAMES[key]


def _storage(array, code):
    """`array` in strata's storage layout for dtype `code`, C-contiguous."""
    if code == _F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if code == _F16:
        return np.ascontiguousarray(array, dtype=np.float16)
    return _f32_to_bf16_bits(np.asarray(array, dtype=np.float32))


_NP_STORAGE = {_F32: np.float32, _F16: np.float16, _BF16: np.uint16}


# ---- the engine --------------------------------------------------------------------------------


class Param(namedtuple("Param", "id name shape dtype")):
    """A registered parameter: its id, name, shape and storage dtype ("fp32", "fp16", "bf16")."""

    @property
    def numel(self):
        return int(np.prod(self.shape, dtype=np.int64))


class Op(namedtuple("Op", "id name params")):
    """A registered operator: its id, name and the Params its window makes available."""


StepResult = namedtuple("StepResult", "applied grad_norm grad_scale loss_scale step")
StepBreakdown = namedtuple("StepBreakdown", [name for name, _ in _StepBreakdown._fields_])
StepBreakdown.__doc__ = """The last step's breakdown (strata_step_breakdown in strata.h): seconds = compute_seconds +
param_stall_seconds + grad_wait_seconds + optimizer_seconds + other_seconds; bytes per tier
(gathered_bytes: full parameters in accelerator memory; param_read_bytes, nvme_read_bytes,
nvme_written_bytes: NVMe traffic); operator-trace flags and fetch counts."""
_DTYPE_OF_CODE = {_F32: "fp32", _F16: "fp16", _BF16: "bf16"}
OpStall = namedtuple("OpStall", "op phase windows seconds")
OpStall.__doc__ = """How long compute waited in fetch for one operator's parameters in the last step: its Op,
the phase ("forward", "backward", "recompute"), the windows timed and the seconds (strata_op_stall)."""
_PHASE_NAMES = {code: name for name, code in _PHASES.items()}


class Engine:
    """This rank's strata engine (strata_engine_create); `config` is a dict or JSON text.

    Use as a context manager, or call close(); the rank environment comes from
    `strata run` / torchrun (alone: rank 0 of 1).
    """

    def __init__(self, config):
        text = config if isinstance(config, str) else json.dumps(config)
        handle = _vp()
        _check(_create(text.encode(), ctypes.byref(handle)))
        self._handle = handle
        self._params = []
        self._by_name = {}
        self._ops = []
        self._keep = []  # init callbacks, alive until finalize
        self._windows = set()  # open Windows: their arrays are detached when they close
        stats = self.stats()
        self.rank, self.world_size = stats["rank"], stats["world_size"]
        self.host_memory = bool(stats["host_memory"])

    # -- lifetime --
    def close(self):
        """Destroys the engine (strata_engine_destroy); collective like every rank's exit."""
        handle, self._handle = getattr(self, "_handle", None), None
        for window in list(getattr(self, "_windows", ())):
            window._detach(write_back=False)  # their arrays stay readable copies; the memory goes now
            window._open = False
        if handle:
            _destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def _h(self):
        if not self._handle:
            raise InvalidState(2, "strata: the engine is closed")
        return self._handle

    # -- declaration --
    def register(self, name, values=None, *, shape=None, dtype=None, init=None, init_into=None):
        """Registers a parameter; returns its Param.

        values: its full initial value (numpy array, torch tensor or array-like), the same on
                every rank; or `shape` (+ dtype) with `init(first, count) -> values` (called at
                finalize for this rank's ranges only) or neither (zeros).
        init_into: instead of `init`, `init_into(first, count, address)` writes the `count`
                elements from `first` on (storage dtype: fp32, fp16, or bf16 bits) into host
                memory at `address` itself -- no array in between (strata.torch copies each
                rank's ranges straight from the tensor's memory).
        dtype:  "fp32", "fp16" or "bf16"; default from the values (float32/float16), else fp32.
        """
        if init_into is not None and (values is not None or init is not None):
            raise InvalidArgument(1, f"strata: parameter '{name}': give one of values, init or init_into")
        array = None
        if values is not None:
            if dtype is None and str(getattr(values, "dtype", "")) == "torch.bfloat16":
                dtype = "bf16"  # keep a torch tensor's storage dtype (numpy has no bf16)
            array = _real(_as_numpy(values), f"the values of '{name}'")
            if shape is not None and tuple(shape) != tuple(array.shape):
                raise InvalidArgument(1, f"strata: shape {tuple(shape)} given for values of shape {array.shape}")
            shape = array.shape
        if shape is None:
            raise InvalidArgument(1, f"strata: parameter '{name}': give values or a shape")
        shape = tuple(int(d) for d in shape)
        code = _dtype_code(dtype, array if array is not None else np.zeros(0, np.float32))
        data = None
        if array is not None:
            data = _storage(array, code)
        callback = _INIT_FN()
        if init_into is not None:
            def fill_into(_user, _param, first, count, out, into=init_into):
                try:
                    into(int(first), int(count), int(out))
                    return 0
                except Exception:  # an exception must not cross into C; strata names the parameter
                    import traceback
                    traceback.print_exc()
                    return 1

            callback = _INIT_FN(fill_into)
            self._keep.append(callback)
        elif init is not None:
            storage = _NP_STORAGE[code]

            def fill(_user, _param, first, count, out, init=init, code=code, storage=storage):
                try:
                    chunk = _storage(_real(np.asarray(init(int(first), int(count))), "init's values").reshape(-1),
                                     code)
                    if chunk.size != count:
                        return 2
                    ctypes.memmove(out, chunk.ctypes.data, chunk.nbytes)
                    return 0
                except Exception:  # an exception must not cross into C
                    return 1

            callback = _INIT_FN(fill)
            self._keep.append(callback)
        dims = (_i64 * max(len(shape), 1))(*shape)
        out = _i32()
        _check(_register_param(self._h(), name.encode(), code, len(shape), dims,
                               data.ctypes.data if data is not None else None, callback, None, ctypes.byref(out)))
        param = Param(out.value, name, shape, _DTYPE_OF_CODE[code])
        self._params.append(param)
        self._by_name[name] = param
        return param

    def _param(self, p):
        if isinstance(p, Param):
            return p
        if isinstance(p, str):
            if p not in self._by_name:
                raise InvalidArgument(1, f"strata: no parameter is called '{p}'")
            return self._by_name[p]
        if isinstance(p, (int, np.integer)) and 0 <= int(p) < len(self._params):
            return self._params[int(p)]
        return Param(int(p), f"#{int(p)}", (), "fp32")  # strata says what is wrong with it

    def op(self, name, params):
        """Registers an operator reading `params` (Params, names or ids); returns its Op."""
        resolved = [self._param(p) for p in params]
        ids = (_i32 * max(len(resolved), 1))(*[p.id for p in resolved])
        out = _i32()
        _check(_register_op(self._h(), name.encode(), len(resolved), ids, ctypes.byref(out)))
        op = Op(out.value, name, tuple(resolved))
        self._ops.append(op)
        return op

    def freeze(self, p):
        """Marks p frozen before finalize (strata_freeze_param): no gradient, no optimizer state."""
        _check(_freeze_param(self._h(), self._param(p).id))

    def set_weight_decay(self, p, weight_decay):
        """Gives p its own weight decay before finalize (strata_set_weight_decay)."""
        _check(_set_weight_decay(self._h(), self._param(p).id, float(weight_decay)))

    def set_lr_scale(self, p, lr_scale):
        """Gives p an lr of lr_scale times each step's, before finalize (strata_set_lr_scale)."""
        _check(_set_lr_scale(self._h(), self._param(p).id, float(lr_scale)))

    def finalize(self):
        """Partitions and stores every parameter (collective)."""
        try:
            _check(_finalize(self._h()))
        finally:
            self._keep.clear()

    # -- hook windows --
    def fetch(self, op, phase="forward"):
        """Opens `op`'s window (strata_fetch); a context manager that releases it on exit."""
        code = _PHASES.get(phase, phase) if isinstance(phase, str) else phase
        if isinstance(phase, str) and phase not in _PHASES:
            raise InvalidArgument(1, f"strata: phase {phase!r} is not forward, backward or recompute")
        op_id = op.id if isinstance(op, Op) else int(op)
        _check(_fetch(self._h(), op_id, int(code)))
        window = Window(self, op_id, int(code))
        self._windows.add(window)
        return window

    def fetch_window(self, op, phase, stream=None):
        """strata_fetch (stream None) or strata_fetch_on_stream: opens op's window without a Window object;
        pair it with release_window. `phase` is FORWARD, BACKWARD or RECOMPUTE; `stream` a cudaStream_t."""
        if stream is None:
            _check(_fetch(self._h(), int(op), int(phase)))
        else:
            _check(_fetch_on_stream(self._h(), int(op), int(phase), stream))

    def release_window(self, op, phase, stream=None):
        """strata_release (stream None) or strata_release_on_stream: windows close in any order."""
        if stream is None:
            _check(_release(self._h(), int(op), int(phase)))
        else:
            _check(_release_on_stream(self._h(), int(op), int(phase), stream))

    def add_grad_device(self, p, address, dtype, stream=None):
        """Adds the gradient at `address` (accelerator memory: host memory on the cpu accelerator; p's numel
        values of `dtype`: "fp32", "fp16" or "bf16") into p's fp32 gradient, on strata's compute stream
        (strata_add_grad_device): no copy through the host."""
        _check(_add_grad_device(self._h(), self._param(p).id, address, _DTYPE_NAMES[str(dtype)], stream))

    def clip_grad_norm(self, max_norm):
        """The global gradient norm now (collective, after the last backward), and the coming step clips to
        max_norm (<= 0: no clipping) instead of the config's gradient_clipping (strata_clip_grad_norm)."""
        out = ctypes.c_double()
        _check(_clip_grad_norm(self._h(), float(max_norm), ctypes.byref(out)))
        return out.value

    def begin_evaluation(self):
        """Forward windows that are not training follow (strata_begin_evaluation)."""
        _check(_begin_evaluation(self._h()))

    def end_evaluation(self):
        _check(_end_evaluation(self._h()))

    def read_into(self, p, address):
        """p's full value into host memory at `address` (storage dtype; collective): read() without an array."""
        _check(_read_param(self._h(), self._param(p).id, address))

    def write_from(self, p, address):
        """Sets p from host memory at `address` (its full value, storage dtype, the same on every rank;
        collective): write() without an array."""
        _check(_write_param(self._h(), self._param(p).id, address))

    def _copy(self, param, ptr, dtype):
        """A numpy copy of p's memory at `ptr` (host memory only)."""
        if not self.host_memory:
            raise InvalidState(2, "strata: the accelerator's memory is not host memory; use ptr() / grad_ptr()")
        count = param.numel
        buffer = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr)
        return np.frombuffer(buffer, dtype=dtype).reshape(param.shape).copy()

    def ptr(self, p):
        """The address of p's full value (accelerator memory) in an open window: raw, valid until the window
        is released (Window.param and Window.grad hand out arrays that stay safe after it)."""
        out = _vp()
        _check(_param_ptr(self._h(), self._param(p).id, ctypes.byref(out)))
        return out.value

    def grad_ptr(self, p):
        """The address of p's fp32 gradient buffer in an open backward window."""
        out = _vp()
        _check(_grad_ptr(self._h(), self._param(p).id, ctypes.byref(out)))
        return out.value

    def add_grad(self, p, grad):
        """Adds `grad` (p's shape; numpy, torch or array-like; converted to fp32) into p's gradient."""
        param = self._param(p)
        array = np.ascontiguousarray(_real(_as_numpy(grad), f"the gradient for '{param.name}'"), dtype=np.float32)
        if param.shape and array.size != param.numel:
            raise InvalidArgument(1, f"strata: gradient for '{param.name}' has {array.size} elements, the "
                                     f"parameter {param.numel} (shape {param.shape})")
        for window in self._windows:  # a grad() array of an open window holds p's gradient until release
            held = window._grads.get(param.id)
            if held is not None:
                held[0].reshape(-1)[...] += array.reshape(-1)
                return
        _check(_add_grad(self._h(), param.id, array.ctypes.data))

    # -- steps --
    def global_sum(self, value):
        """Sum of `value` over ranks (collective)."""
        out = ctypes.c_double()
        _check(_global_sum(self._h(), float(value), ctypes.byref(out)))
        return out.value

    def step(self, lr):
        """The optimizer step (collective); returns StepResult(applied, grad_norm, grad_scale, loss_scale, step)."""
        result = _StepResult()
        _check(_step(self._h(), float(lr), ctypes.byref(result)))
        return StepResult(bool(result.applied), result.grad_norm, result.grad_scale, result.loss_scale, result.step)

    def prepare_step(self, lr):
        """Optional, collective: the next backward is the last before step(lr), so the optimizer may update each
        sub-group during it (ZeRO-2/3), rolled back exactly when clipping or an overflow fires."""
        _check(_prepare_step(self._h(), float(lr)))

    def loss_scale(self):
        """The fp16 loss scale of the coming step (1 without fp16): multiply the loss by it."""
        out = ctypes.c_double()
        _check(_loss_scale(self._h(), ctypes.byref(out)))
        return out.value

    def zero_grad(self):
        _check(_zero_grad(self._h()))

    def read(self, p):
        """p's full current value as a new numpy array (collective); bf16 comes back as float32."""
        param = self._param(p)
        code = _DTYPE_NAMES[param.dtype]
        out = np.empty(param.shape, dtype=_NP_STORAGE[code])
        _check(_read_param(self._h(), param.id, out.ctypes.data))
        return _bf16_bits_to_f32(out) if code == _BF16 else out

    def write(self, p, values):
        """Sets p to `values` (its full value, the same on every rank; collective)."""
        param = self._param(p)
        data = _storage(_real(_as_numpy(values), f"the values for '{param.name}'"), _DTYPE_NAMES[param.dtype])
        if data.size != param.numel:
            raise InvalidArgument(1, f"strata: values for '{param.name}' have {data.size} elements, the "
                                     f"parameter {param.numel}")
        _check(_write_param(self._h(), param.id, data.ctypes.data))

    def read_optimizer_state(self, params):
        """The Adam moments of the trained parameters `params` (collective, every rank the same list):
        ({p: (exp_avg, exp_avg_sq)} as float32 numpy arrays of each one's shape, Adam's step count)."""
        resolved = [self._param(p) for p in params]
        moments = [(np.empty(q.shape, dtype=np.float32), np.empty(q.shape, dtype=np.float32)) for q in resolved]
        step = _i64()
        _check(_read_optimizer_state(self._h(), len(resolved), _ids(resolved), _pointers(m[0] for m in moments),
                                     _pointers(m[1] for m in moments), ctypes.byref(step)))
        return {q.name: m for q, m in zip(resolved, moments)}, step.value

    def write_optimizer_state(self, moments, step):
        """Sets every trained parameter's Adam moments, {p: (exp_avg, exp_avg_sq)} (each its full value, the same
        on every rank), and Adam's step count (collective); the master weights stay."""
        resolved, arrays = [], []
        for p, (m, v) in moments.items():
            q = self._param(p)
            pair = tuple(np.ascontiguousarray(_real(_as_numpy(x), f"a moment of '{q.name}'"), dtype=np.float32)
                         for x in (m, v))
            for x in pair:
                if x.size != q.numel:
                    raise InvalidArgument(1, f"strata: a moment of '{q.name}' has {x.size} elements, the "
                                             f"parameter {q.numel}")
            resolved.append(q)
            arrays.append(pair)
        _check(_write_optimizer_state(self._h(), len(resolved), _ids(resolved), _pointers(a[0] for a in arrays),
                                      _pointers(a[1] for a in arrays), int(step)))

    def stats(self):
        out = _Stats()
        _check(_get_stats(self._h(), ctypes.byref(out)))
        return {name: getattr(out, name) for name, _ in _Stats._fields_}

    def step_breakdown(self):
        """The last step's StepBreakdown on this rank: seconds and bytes (all 0 before the first step)."""
        out = _StepBreakdown()
        _check(_get_step_breakdown(self._h(), ctypes.byref(out)))
        return StepBreakdown(*[getattr(out, name) for name in StepBreakdown._fields])

    def op_stalls(self):
        """The last step's OpStalls, most seconds first (stage 3; they sum to param_stall_seconds)."""
        count = _i32()
        _check(_get_op_stalls(self._h(), None, 0, ctypes.byref(count)))
        out = (_OpStall * max(count.value, 1))()
        _check(_get_op_stalls(self._h(), out, count.value, ctypes.byref(count)))
        ops = {op.id: op for op in self._ops}
        return [OpStall(ops.get(s.op, s.op), _PHASE_NAMES.get(s.phase, s.phase), s.windows, s.seconds)
                for s in out[:count.value]]

    # -- checkpoints --
    def save_checkpoint(self, directory):
        """Saves the engine's state as `directory`/step_<N> (collective; strata_save_checkpoint):
        crash-safe, the manifest written last; `directory` keeps the newest checkpoint only."""
        _check(_save_checkpoint(self._h(), _path_bytes(directory)))

    def load_checkpoint(self, directory):
        """Loads the newest complete checkpoint in `directory` into this finalized engine
        (collective; strata_load_checkpoint). Same world size and parameters as the saver's.
        A missing, truncated or corrupt checkpoint raises InvalidArgument naming the file, and
        the engine stays usable."""
        _check(_load_checkpoint(self._h(), _path_bytes(directory)))

    @property
    def params(self):
        return list(self._params)


class Window:
    """An open hook window (Engine.fetch); release() or leave the `with` block to close it.

    The arrays it hands out are numpy arrays of their own, never views of the engine's memory, so no
    array outlives the memory it shows (the window's buffers are reused after release and freed at
    close): param() copies the value; grad() copies the gradient and writes it back at release. After
    release (or close) they are read-only: writing one raises ValueError instead of writing freed memory.
    """

    def __init__(self, engine, op, phase):
        self._engine, self.op, self.phase, self._open = engine, op, phase, True
        self._params = {}  # param id -> its read-only copy
        self._grads = {}   # param id -> (the array handed out, the gradient when it was copied)

    def _require_open(self):
        if not self._open:
            raise InvalidState(2, "strata: the window is released; fetch it again")

    def param(self, p):
        """A read-only numpy array of p's full value (cpu accelerator), the same array for every call in this
        window. Its storage dtype: float32, float16, or for bf16 the raw bit patterns as uint16."""
        self._require_open()
        param = self._engine._param(p)
        if param.id not in self._params:
            value = self._engine._copy(param, self._engine.ptr(param), _NP_STORAGE[_DTYPE_NAMES[param.dtype]])
            value.flags.writeable = False
            self._params[param.id] = value
        return self._params[param.id]

    def grad(self, p):
        """A writable fp32 numpy array of p's gradient (backward, cpu accelerator): add into it; what it holds
        becomes p's gradient at release. The same array for every call in this window."""
        self._require_open()
        param = self._engine._param(p)
        if param.id not in self._grads:
            snapshot = self._engine._copy(param, self._engine.grad_ptr(param), np.float32)
            self._grads[param.id] = (snapshot.copy(), snapshot)
        return self._grads[param.id][0]

    def add_grad(self, p, grad):
        self._require_open()
        self._engine.add_grad(p, grad)

    def _detach(self, write_back):
        """Ends the arrays' tie to the engine: writes grad() arrays back (while the window is still open), then
        makes every array read-only."""
        try:
            if write_back:
                for pid, (array, snapshot) in self._grads.items():
                    param = self._engine._param(pid)
                    ptr = self._engine.grad_ptr(param)
                    current = self._engine._copy(param, ptr, np.float32)
                    if np.array_equal(current.view(np.uint32), snapshot.view(np.uint32)):
                        ctypes.memmove(ptr, np.ascontiguousarray(array, dtype=np.float32).ctypes.data,
                                       array.size * 4)
                    else:  # also changed through strata's own calls meanwhile: add what this array added
                        delta = np.ascontiguousarray(array - snapshot, dtype=np.float32)
                        _check(_add_grad(self._engine._h(), pid, delta.ctypes.data))
        finally:
            for array, _ in self._grads.values():
                array.flags.writeable = False
            self._engine._windows.discard(self)

    def release(self):
        if self._open:
            try:
                self._detach(write_back=True)
            finally:
                self._open = False
                _check(_release(self._engine._h(), self.op, self.phase))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.release()
            return
        try:  # keep the original exception; a failed engine would only repeat it
            self.release()
        except Error:
            pass
