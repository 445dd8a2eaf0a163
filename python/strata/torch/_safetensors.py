"""Initial values from safetensors files, by range: st.wrap(model, config, weights=...).

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range in the data that follows, and the data (row-major, little-endian). Each rank reads only the
element ranges strata gives it (the shard it owns) with pread, straight into strata's memory when the file's
dtype is the parameter's, so no rank ever holds a whole tensor of the model.
"""

import ctypes
import json
import os
import pathlib

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class WeightsError(RuntimeError):
    pass


class Entry:
    """One tensor of a file: its file, dtype, shape and where its data begins."""
    __slots__ = ("key", "path", "dtype", "shape", "offset", "nbytes")

    def __init__(self, key, path, dtype, shape, offset, nbytes):
        self.key, self.path, self.dtype, self.shape, self.offset, self.nbytes = key, path, dtype, shape, offset, nbytes


def _header(path):
    """The tensors of one safetensors file (name -> Entry), from its header only."""
    try:
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            size = int.from_bytes(size_bytes, "little")
            file_size = os.fstat(f.fileno()).st_size
            if size > file_size - 8:
                raise WeightsError(f"{path}: not a safetensors file (a header of {size} bytes in {file_size})")
            header = json.loads(f.read(size))
    except OSError as error:
        raise WeightsError(f"cannot read {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WeightsError(f"{path}: the safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object")
    entries = {}
    data_start = 8 + size
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: tensor '{key}' has no dtype, shape and data_offsets") from None
        if dtype not in _DTYPES:
            entries[key] = Entry(key, path, dtype, shape, data_start + begin, end - begin)
            continue
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty(0, dtype=_DTYPES[dtype]).element_size()
        if end - begin != numel * itemsize or data_start + end > file_size:
            raise WeightsError(f"{path}: tensor '{key}' ({dtype}, shape {list(shape)}) has bytes {begin}..{end} "
                               f"of a file of {file_size}: truncated or corrupt")
        entries[key] = Entry(key, path, dtype, shape, data_start + begin, end - begin)
    return entries


class Weights:
    """The tensors of a .safetensors file, or of a directory's model.safetensors or sharded index."""

    def __init__(self, where):
        path = pathlib.Path(where)
        self.where = str(path)
        if path.is_dir():
            if (path / _INDEX).is_file():
                try:
                    weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
                except (OSError, ValueError, KeyError, TypeError):
                    raise WeightsError(f"{path / _INDEX}: not a safetensors index (no weight_map)") from None
                files = sorted({path / name for name in weight_map.values()})
            elif (path / _SINGLE).is_file():
                files = [path / _SINGLE]
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise WeightsError(f"{path}: no {_SINGLE}, {_INDEX} or *.safetensors in the directory")
        elif path.is_file():
            files = [path]
        else:
            raise WeightsError(f"{path}: no such file or directory")
        self.entries = {}
        for f in files:
            self.entries.update(_header(f))
        self._fds = {}

    def find(self, name, aliases, shape, required):
        """The entry of parameter `name` (or one of its aliases, or either without a leading prefix such as
        a task model's "model."), checked against `shape`; None when absent and not required."""
        candidates = list(dict.fromkeys([name] + list(aliases)))
        for candidate in list(candidates):
            if "." in candidate:
                candidates.append(candidate.split(".", 1)[1])
        for candidate in candidates:
            entry = self.entries.get(candidate)
            if entry is None:
                continue
            if entry.dtype not in _DTYPES:
                raise WeightsError(f"{entry.path}: tensor '{entry.key}' is {entry.dtype}; parameter '{name}' "
                                   "needs float values (F32, F16, BF16 or F64)")
            if tuple(entry.shape) != tuple(shape):
                raise WeightsError(f"{entry.path}: tensor '{entry.key}' has shape {list(entry.shape)}, parameter "
                                   f"'{name}' {list(shape)}")
            return entry
        if required:
            raise WeightsError(f"{self.where}: no tensor for parameter '{name}' (tried {', '.join(candidates)}); "
                               "it is on the meta device, so its values must come from the files")
        return None

    def _fd(self, path):
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread_into(self, entry, offset, nbytes, address):
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd(entry.path), [view[done:]], entry.offset + offset + done)
            if got <= 0:
                raise WeightsError(f"{entry.path}: tensor '{entry.key}' ends early (read {done} of {nbytes} bytes)")
            done += got

    def read_into(self, entry, first, count, address, dtype):
        """Elements [first, first + count) of `entry`, flattened, as `dtype` into host memory at `address`."""
        source = _DTYPES[entry.dtype]
        itemsize = torch.empty(0, dtype=source).element_size()
        if source == dtype:
            self._pread_into(entry, first * itemsize, count * itemsize, address)
            return
        values = torch.empty(count, dtype=source)  # another dtype in the file: read, convert as torch converts
        self._pread_into(entry, first * itemsize, count * itemsize, values.data_ptr())
        out_nbytes = count * torch.empty(0, dtype=dtype).element_size()
        out = torch.frombuffer((ctypes.c_char * out_nbytes).from_address(address), dtype=dtype, count=count)
        out.copy_(values)

    def read_whole(self, name, shape, dtype):
        """A whole tensor (a buffer) as a new CPU tensor of `dtype`; None when the files do not have it."""
        entry = self.entries.get(name)
        if entry is None or entry.dtype not in _DTYPES or tuple(entry.shape) != tuple(shape):
            return None
        numel = 1
        for d in shape:
            numel *= d
        out = torch.empty(shape, dtype=dtype)
        if numel:
            self.read_into(entry, 0, numel, out.data_ptr(), dtype)
        return out

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass
