"""Block-scaled float8 checkpoints (DeepSeek-V3, Kimi K2: `quantization_config.quant_method: fp8`).

A quantized weight `W` [rows, cols] is stored as float8_e4m3fn next to `W_scale_inv` float32
[ceil(rows / br), ceil(cols / bc)] for `weight_block_size` [br, bc]; its value is W * scale_inv of its
block (edge blocks are partial). Weights are dequantized as each is read, to float32 and then to the
model's dtype by the caller, so no more than one tensor is ever held twice.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def attach_scales(model_dir: Path, tensors: dict, cfg: ModelConfig) -> dict:
    """The checkpoint's tensors without the `*_scale_inv` entries, each float8 weight carrying its scale
    (`TensorInfo.scale_inv`, with `block`); checks every pair against config.json's block size."""
    def refuse(name: str, why: str, fix: str):
        raise CheckpointError(f"{tensors[name].file}: tensor {name!r} {why}; {fix}")

    out = {name: info for name, info in tensors.items() if not name.endswith(SCALE_SUFFIX)}
    for name, info in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] not in tensors:
            refuse(name, "is a block scale of no tensor in the checkpoint", "the checkpoint is incomplete: download "
                   "it again")
        if info.dtype != FP8_DTYPE:
            continue
        if cfg.fp8_block is None:
            refuse(name, "is float8 but config.json has no quantization_config", "use the config.json the weights "
                   "were saved with (quant_method fp8, weight_block_size)")
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            refuse(name, f"is float8 without its block scales {name + SCALE_SUFFIX!r}", "the checkpoint is "
                   "incomplete: download it again")
        if len(info.shape) != 2:
            refuse(name, f"is float8 with shape {list(info.shape)}; block scales apply to 2-D weights",
                   "re-export the checkpoint")
        expected = scale_shape(info.shape, cfg.fp8_block)
        if scale.dtype != "F32" or scale.shape != expected:
            refuse(name + SCALE_SUFFIX, f"is {scale.dtype} {list(scale.shape)}, expected F32 {list(expected)} (weight "
                   f"{list(info.shape)} in blocks of {list(cfg.fp8_block)} from quantization_config)",
                   "the checkpoint and config.json disagree: use the config.json the weights were saved with")
        info.scale_inv, info.block = scale, cfg.fp8_block
    for name in tensors:
        if name.endswith(SCALE_SUFFIX) and tensors[name[:-len(SCALE_SUFFIX)]].dtype != FP8_DTYPE:
            refuse(name, f"scales {name[:-len(SCALE_SUFFIX)]!r}, which is not float8", "the checkpoint is "
                   "inconsistent: download or export it again")
    return out


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 weight * scale_inv per [br, bc] block, one block row at a time (no weight-sized scale array)."""
    rows, cols = weight.shape
    out = weight.astype(np.float32)
    for i in range(scale_inv.shape[0]):
        band = slice(i * block[0], min(rows, (i + 1) * block[0]))
        out[band] *= np.repeat(scale_inv[i].astype(np.float32), block[1])[:cols]
    return out
