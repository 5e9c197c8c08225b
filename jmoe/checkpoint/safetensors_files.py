"""Read Hugging Face safetensors checkpoints (single file or sharded) tensor by tensor.

The `safetensors` library validates each file's header (so truncated or corrupted files fail with a
clear message); the data is then read through a NumPy memory map so that any dtype, bfloat16
included, comes back as a host array without touching an accelerator. Planning (jmoe.plan) reads the
headers alone (`check_data=False`): it works on files whose tensor data is missing or cut off.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jmoe.checkpoint import mxfp4
from jmoe.checkpoint.fp8 import dequantize
from jmoe.errors import CheckpointError
from jmoe.jsonfile import read_json

STORED_DTYPES = {  # safetensors dtype name -> NumPy dtype
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class TensorInfo:
    __slots__ = ("file", "dtype", "shape", "start", "end", "scale_inv", "block", "mx_blocks", "mx_scales")

    def __init__(self, file: Path, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end
        self.scale_inv: TensorInfo | None = None  # a float8 weight's block scales (jmoe.checkpoint.fp8)
        self.block: tuple[int, int] | None = None
        # An MXFP4 weight's codes and scales (jmoe.checkpoint.mxfp4): this entry reads as their dequantization.
        self.mx_blocks: TensorInfo | None = None
        self.mx_scales: TensorInfo | None = None


def tensor_stored_bytes(info: TensorInfo) -> int:
    """Bytes the checkpoint holds for a tensor: its data, or its quantized parts."""
    parts = [info.mx_blocks, info.mx_scales] if info.mx_blocks is not None else [info, info.scale_inv]
    return sum(part.end - part.start for part in parts if part is not None)


def _read_header(path: Path, check_data: bool = True) -> tuple[dict, int]:
    """(header, offset of the data section). With `check_data` the safetensors library validates the whole
    file first; without, only the header is read and checked, and the tensor data may be absent."""
    if check_data:
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError, OverflowError, ValueError) as e:
            raise CheckpointError(f"{path}: not a valid safetensors file ({e}); the file is truncated or "
                                  f"corrupted: download or export it again") from e
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(MAX_HEADER_BYTES, path.stat().st_size - 8):
                raise ValueError(f"the header length field says {header_len} bytes, more than the file holds or "
                                 f"the format allows ({MAX_HEADER_BYTES})")
            raw = f.read(header_len)
        if len(raw) != header_len:
            raise ValueError(f"the header says {header_len} bytes, the file has {len(raw)} after it")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    except (OSError, struct.error, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a valid safetensors file (its header: {e}); the file is truncated or "
                              f"corrupted: download or export it again") from e
    header.pop("__metadata__", None)
    return header, 8 + header_len


def _index_entry(index: Path, name) -> Path:
    """A shard file the index names: a file name inside the model directory, never a path that leaves it
    (the file itself may be a symlink, as in the Hugging Face cache)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{index}: weight_map entry {name!r} is not a file name inside the model directory "
                              f"(absolute paths and '..' are refused); fix the index")
    return index.parent / name


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(path: Path, name: str, meta) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, data begin, data end) of one header entry, each checked: a known dtype, a shape of
    whole numbers, offsets that hold exactly that many bytes (where they lie in the file is checked when the
    data is read)."""
    def malformed(why: str):
        return CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({why}); the file is "
                               f"corrupted: download or export it again")

    if not isinstance(meta, dict):
        raise malformed(f"expected an object, found {meta!r}")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise malformed(f"dtype {dtype!r}")
    if dtype not in STORED_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; supported: {', '.join(STORED_DTYPES)}")
    if not isinstance(shape, list) or not all(_whole(v) for v in shape):
        raise malformed(f"shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(v) for v in offsets):
        raise malformed(f"data_offsets {offsets!r}")
    size = int(np.prod(shape, dtype=object)) * np.dtype(STORED_DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != size:
        raise malformed(f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, the shape {shape} of "
                        f"{dtype} needs {size}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory; refuses pickle checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        advice = "re-export the checkpoint or fix the index"
        weight_map = read_json(index, "sharded-checkpoint index", CheckpointError, advice).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: expected a 'weight_map' object (tensor name -> shard file), found "
                                  f"{type(weight_map).__name__}; {advice}")
        files = list(dict.fromkeys(_index_entry(index, name) for name in weight_map.values()))
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir}: found only pickle checkpoint files ({', '.join(pickles)}); jmoe refuses them "
            f"because unpickling can run arbitrary code. Convert them to safetensors first, e.g. "
            f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` "
            f"in a trusted environment")
    raise CheckpointError(f"{model_dir}: no *.safetensors files found; expected model.safetensors or shards "
                          f"listed in model.safetensors.index.json")


def index_tensors(model_dir: Path, check_data: bool = True) -> dict[str, TensorInfo]:
    """Name -> where and what each tensor is, across all shards (no tensor data read). `check_data`: validate
    each whole file with the safetensors library (loading); without, read the headers alone (planning)."""
    tensors: dict[str, TensorInfo] = {}
    for path in checkpoint_files(model_dir):
        header, data_start = _read_header(path, check_data)
        for name, meta in header.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file} and {path}")
            dtype, shape, begin, end = _tensor_entry(path, name, meta)
            tensors[name] = TensorInfo(path, dtype, shape, data_start + begin, data_start + end)
    return tensors


def stored_values(model_dir: Path) -> int:
    """How many values the checkpoint's tensors hold, from the headers alone."""
    return sum(int(np.prod(info.shape, dtype=np.int64)) for info in index_tensors(model_dir, check_data=False).values())


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's data as a NumPy array (a read-only view of the memory-mapped file); a float8 weight with
    block scales, or an MXFP4 weight, comes back dequantized, in float32."""
    if info.scale_inv is not None:
        return dequantize(_read(info), _read(info.scale_inv), info.block)
    if info.mx_blocks is not None:
        return mxfp4.dequantize(_read(info.mx_blocks), _read(info.mx_scales))
    return _read(info)


def _read(info: TensorInfo) -> np.ndarray:
    dtype = np.dtype(STORED_DTYPES[info.dtype])
    count = int(np.prod(info.shape, dtype=np.int64))
    data = np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=(count,))
    return data.reshape(info.shape)
