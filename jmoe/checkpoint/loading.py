"""Build a MoETransformer from a Hugging Face safetensors directory, checking every tensor.

Parameters are assembled one at a time on the host (NumPy) and put straight where the placement
wants them (device or pinned host), so the accelerator never holds more than its share.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jmoe.checkpoint.fp8 import attach_scales
from jmoe.checkpoint.mxfp4 import attach_mxfp4
from jmoe.checkpoint.hf_layout import TensorTarget, expected_tensors, is_ignorable
from jmoe.model.params import ParamPath, abstract_model, abstract_params, flat_params, nest_params, param_key
from jmoe.checkpoint.safetensors_files import TensorInfo, index_tensors, read_tensor
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError
from jmoe.kernels import FORMATS, quantize
from jmoe.model import MoETransformer

Placer = Callable[[ParamPath, np.ndarray], jax.Array]


def _name_list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors dtypes a weight may have


def check_tensor_names(model_dir: Path, tensors: dict[str, TensorInfo], expected: dict[str, TensorTarget],
                       cfg: ModelConfig) -> None:
    """Every expected tensor is present with its expected shape; nothing unexpected is present."""
    missing = sorted(n for n in expected if n not in tensors)
    unexpected = sorted(n for n in tensors if n not in expected and not is_ignorable(cfg, n))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_name_list(unexpected)}")
    if problems:
        raise CheckpointError(f"{model_dir}: the checkpoint does not match config.json "
                              f"(model_type {cfg.family!r}): " + "; ".join(problems))
    for name, target in expected.items():
        found = tensors[name].shape
        if found != target.hf_shape:
            raise CheckpointError(f"{tensors[name].file}: tensor {name!r} has shape {list(found)}, expected "
                                  f"{list(target.hf_shape)} from config.json; the checkpoint and config disagree")
        if tensors[name].dtype not in FLOAT_DTYPES and tensors[name].scale_inv is None:
            raise CheckpointError(f"{tensors[name].file}: tensor {name!r} has dtype {tensors[name].dtype}, expected "
                                  f"a floating-point weight ({', '.join(FLOAT_DTYPES)}); casting it would give wrong "
                                  f"numbers: re-export the checkpoint in a float dtype")


def oriented(target: TensorTarget, data: np.ndarray) -> np.ndarray:
    """An HF tensor in jmoe's orientation: transposed, and (gate, up) pairs split into halves."""
    data = data.T if target.transpose else data
    return np.concatenate([data[..., 0::2], data[..., 1::2]], axis=-1) if target.deinterleave else data


# Rows and columns of one block of a blocked transpose: NumPy's plain transposed copy walks the source with a
# stride of a whole row and ran at a third less speed (a 2048 x 7168 bfloat16 tensor: 50 ms plain, 34 blocked).
TRANSPOSE_BLOCK = 64


def put_oriented(out: np.ndarray, target: TensorTarget, data: np.ndarray) -> None:
    """out[...] = oriented(target, data), cast to out's dtype; a 2-D transpose copied block by block."""
    if not (target.transpose and data.ndim == 2 and not target.deinterleave):
        out[...] = oriented(target, data)
        return
    rows, cols = data.shape
    for i in range(0, rows, TRANSPOSE_BLOCK):
        for j in range(0, cols, TRANSPOSE_BLOCK):
            out[j:j + TRANSPOSE_BLOCK, i:i + TRANSPOSE_BLOCK] = data[i:i + TRANSPOSE_BLOCK, j:j + TRANSPOSE_BLOCK].T


def assemble_param(shape, dtype, pieces: list[tuple[TensorTarget, TensorInfo]]) -> np.ndarray:
    """One jmoe parameter on the host, from its HF tensors (oriented and sliced into place)."""
    out = np.empty(shape, dtype)
    for target, info in pieces:
        put_oriented(out[target.index], target, read_tensor(info))
    return out


def device_placer(path: ParamPath, host: np.ndarray) -> jax.Array:
    return jnp.asarray(host)


def param_pieces(model_dir: Path, cfg: ModelConfig, abstract: dict[ParamPath, object],
                 check_data: bool = True) -> dict[ParamPath, list[tuple[TensorTarget, TensorInfo]]]:
    """Check the checkpoint against the config; then, per parameter path, the HF tensors that fill it.
    `check_data=False` reads the file headers alone (see index_tensors)."""
    tensors = attach_mxfp4(model_dir, attach_scales(model_dir, index_tensors(model_dir, check_data), cfg),
                           cfg.mxfp4_experts)
    expected = expected_tensors(cfg)
    check_tensor_names(model_dir, tensors, expected, cfg)
    pieces: dict[ParamPath, list] = defaultdict(list)
    for name, target in expected.items():
        pieces[target.param].append((target, tensors[name]))
    uncovered = sorted(param_key(p) for p in abstract if p not in pieces)
    if uncovered:  # the layout table and the model disagree: a bug in jmoe, not in the checkpoint
        raise AssertionError(f"jmoe layout table leaves parameters unfilled: {uncovered}")
    return pieces


def check_finite_param(source: Path, path: ParamPath, host: np.ndarray) -> None:
    """Refuse a parameter holding NaN or inf (a check over data already in memory)."""
    if not np.isfinite(host).all():
        bad = int(np.size(host) - np.count_nonzero(np.isfinite(host)))
        raise CheckpointError(f"{source}: parameter {param_key(path)} holds {bad} NaN or infinite values; the "
                              f"weights are broken: download or export the checkpoint again")


def params_as_read(cfg: ModelConfig, dtype) -> dict[ParamPath, object]:
    """{path: shape struct} of the parameters a Hugging Face checkpoint fills, before experts are quantized:
    float experts (in `cfg.expert_dtype` when that is a float dtype)."""
    if cfg.expert_dtype in FORMATS:
        cfg = cfg.replace(expert_dtype=None, expert_group=0)
    return abstract_params(cfg, dtype)


def stored_params(model_dir: Path, cfg: ModelConfig, as_read: dict[ParamPath, object], pieces, path: ParamPath,
                  check_finite: bool) -> dict[ParamPath, np.ndarray]:
    """Parameter `path` of `as_read` (params_as_read) assembled from its tensors, as the model stores it:
    itself, or, for an expert weight to be quantized, its values (same path) and scales (`..._scale`)."""
    host = assemble_param(as_read[path].shape, as_read[path].dtype, pieces[path])
    if check_finite:
        check_finite_param(model_dir, path, host)
    if cfg.expert_dtype not in FORMATS or "experts" not in path or path[-1] not in ("w_gate_up", "w_down"):
        return {path: host}
    stored = quantize(host, cfg.expert_dtype, cfg.expert_group)
    return {path: stored.values, path[:-1] + (f"{path[-1]}_scale",): stored.scales}


def load_model(model_dir: Path, cfg: ModelConfig, *, dtype=None, place: Placer = device_placer,
               progress: bool = True, check_finite: bool = False, unread=None) -> MoETransformer:
    """Read, check and place every parameter; return the merged NNX model. `check_finite`: refuse NaN or
    inf weights (one pass over data already read). Quantized experts (`cfg.expert_dtype`) are quantized
    one layer's weight at a time, as they are read. `unread(path)` True: that parameter is not read, and holds
    no expert (leading axis 0: experts the disk tier reads itself, jmoe.offload.host_tier)."""
    dtype = np.dtype(jnp.dtype(dtype or cfg.dtype))
    graphdef, state = abstract_model(cfg, dtype)
    abstract = flat_params(nnx.to_pure_dict(state))
    as_read = abstract if cfg.expert_dtype not in FORMATS else params_as_read(cfg, dtype)
    pieces = param_pieces(model_dir, cfg, as_read)
    loaded = {path: place(path, np.zeros((0, *abstract[path].shape[1:]), abstract[path].dtype))
              for path in abstract if unread is not None and unread(path)}
    for path in tqdm(as_read, desc="loading weights", unit="param", disable=not progress, leave=False):
        if path in loaded:
            continue
        for stored_path, host in stored_params(model_dir, cfg, as_read, pieces, path, check_finite).items():
            loaded[stored_path] = place(stored_path, host)
    nnx.replace_by_pure_dict(state, nest_params(loaded))
    return nnx.merge(graphdef, state)


